"""Expert-load collapse: train.py's judgement of its logged per-layer expert load (model.load_stats: the fraction of
each MoE layer's experts under 10% of the mean load over a log window), said once when a layer starves most of its
experts window after window, and once when it clears; and the line `train.py --status` gives from a run dir.

DeepSeek-V3's selection bias (bias += gamma * sign(mean_load - load), DESIGN.md) balances the load without an
auxiliary loss; a forker who set bias_update_rate=0, or a routing bug, starves experts silently for hours otherwise.
Pure functions on a row's figures and a small JSON state (kept in state.json, so a resume goes on counting).
"""
import math

# expert-load collapse: a MoE layer whose full log windows each starve (load_stats: under 10% of the mean load) more
# than COLLAPSE_FRAC of its experts, COLLAPSE_WINDOWS windows in a row (a healthy config/tiny.py run starves up to 56%
# in one window, 38% for three in a row past step 100; bias_update_rate=0 starves 44-88% from step 20: see README)
COLLAPSE_FRAC, COLLAPSE_WINDOWS, COLLAPSE_LIST = 0.5, 3, 8  # (COLLAPSE_LIST: layers named on the line at most)


def collapse_grace_steps(log_interval, bias_update_rate):
    """Steps at a run's start whose windows are not judged: three windows, and 1/bias_update_rate (at most 1000) when
    it balances: the bias moves an expert's selection score by ~rate a step, so in 1/rate steps by the whole (0, 1)
    range of the sigmoid affinities; an expert starved past that is not waiting on it. Without balancing
    (rate 0) there is nothing to wait for."""
    return max(3 * log_interval, min(math.ceil(1 / bias_update_rate), 1000) if bias_update_rate > 0 else 0)


def load_collapse_line(state, step, dead_frac_layers, n_experts, log_interval, bias_update_rate, first_moe_layer=0):
    """Judge a full log window's per-MoE-layer dead-expert fractions (a metrics row's dead_frac_layers, ending at
    step); state (a dict, JSON, kept in state.json) carries the streaks. Returns the WARNING line at onset (a layer
    over COLLAPSE_FRAC COLLAPSE_WINDOWS windows in a row), the line saying it cleared (every layer at or under it
    for as many windows), or None: one line each way, so a layer flickering around the threshold is said at most
    once every COLLAPSE_WINDOWS windows."""
    if step <= collapse_grace_steps(log_interval, bias_update_rate) or not dead_frac_layers:
        return None
    n = len(dead_frac_layers)
    streak, since = state.get("streak"), state.get("since")
    if not (isinstance(streak, list) and isinstance(since, list) and len(streak) == len(since) == n
            and all(isinstance(v, int) for v in streak + since)):  # (another model's, grown or hand-edited: recounted)
        streak, since = [0] * n, [0] * n
    for i, d in enumerate(dead_frac_layers):
        if d > COLLAPSE_FRAC:
            since[i] = since[i] if streak[i] else step - log_interval + 1
            streak[i] += 1
        else:
            streak[i] = 0
    state["streak"], state["since"] = streak, since
    if state.get("warned") is None:
        worst = sorted((i for i in range(n) if streak[i] >= COLLAPSE_WINDOWS), key=lambda i: -dead_frac_layers[i])
        if not worst:
            return None
        state["warned"], state["calm"] = step, 0
        named = ", ".join(f"layer {first_moe_layer + i}: {round(dead_frac_layers[i] * n_experts)} of {n_experts} "
                          f"experts starved" for i in worst[:COLLAPSE_LIST])
        more = f" (and {len(worst) - COLLAPSE_LIST} more layers)" if len(worst) > COLLAPSE_LIST else ""
        steps = min(step - since[i] + 1 for i in worst)
        why = (f"bias_update_rate is {bias_update_rate:g}: " + (
            "nothing balances the experts (config/nano.py has 1e-3; set it and resume)" if bias_update_rate <= 0
            else "the router bias is not keeping up (raise it?) or the routing broke"))
        return (f"WARNING: expert load collapsed at step {step}: {named}{more} (under 10% of the mean load) for the "
                f"last {steps} steps; {why}; per-layer figures: dead_frac_layers in metrics.jsonl")
    calm = state.get("calm") if isinstance(state.get("calm"), int) else 0
    state["calm"] = 0 if max(dead_frac_layers) > COLLAPSE_FRAC else calm + 1
    if state["calm"] < COLLAPSE_WINDOWS:
        return None
    warned, state["warned"] = state["warned"], None
    return (f"expert load recovered at step {step}: no MoE layer has starved over {COLLAPSE_FRAC:.0%} of its experts "
            f"for {COLLAPSE_WINDOWS} log windows (collapsed since the warning at step {warned})")


def collapsed_since(state):
    """The step a state.json (or relay's training_state.json) warned of a collapse not cleared since, or None."""
    lc = state.get("load_collapse")
    warned = lc.get("warned") if isinstance(lc, dict) else None
    return warned if isinstance(warned, int) and not isinstance(warned, bool) else None


def load_collapse_status(st, row):
    """--status's line on an expert-load collapse (said once, in the trainer's log only), or None: the checkpoint's
    state.json warned of one and it has not cleared, or metrics.jsonl's newest row (row), past the checkpoint, says
    one is on; the layers that row's dead_frac_layers starve over COLLAPSE_FRAC (MoE layers: after the dense ones)."""
    warned = collapsed_since(st)
    row = row if isinstance(row, dict) and isinstance(row.get("step"), int) else {}
    newer = row.get("step", -1) > st["step"]
    if newer and row.get("load_collapsed") is False and warned is not None:
        return (f"expert load collapsed at step {warned} (the checkpoint's state); recovered by the newest logged step "
                f"{row['step']}")
    if warned is None and not (newer and row.get("load_collapsed") is True):
        return None
    since = f"since step {warned}" if warned is not None else f"after the checkpoint's step {st['step']}"
    mc = st.get("model_config") if isinstance(st.get("model_config"), dict) else {}
    first = mc.get("n_dense_layers") if isinstance(mc.get("n_dense_layers"), int) else 0
    dead = row.get("dead_frac_layers")
    layers = ([first + i for i, d in enumerate(dead) if isinstance(d, (int, float)) and d > COLLAPSE_FRAC]
              if row.get("load_collapsed") is True and isinstance(dead, list) else [])
    named = ", ".join(map(str, layers[:COLLAPSE_LIST])) + (
        f" (and {len(layers) - COLLAPSE_LIST} more)" if len(layers) > COLLAPSE_LIST else "")
    which = (f"; at logged step {row['step']} " + (f"layers {named} starve over {COLLAPSE_FRAC:.0%} of their experts"
             if len(layers) > 1 else f"layer {named} starves over {COLLAPSE_FRAC:.0%} of its experts")
             if layers else "")
    rate = mc.get("bias_update_rate")
    rate = f"; bias_update_rate {rate:g}" if isinstance(rate, (int, float)) and not isinstance(rate, bool) else ""
    return (f"WARNING: expert load collapsed {since} (said once, in the trainer's log){which}{rate}; per-layer "
            f"figures: dead_frac_layers in metrics.jsonl")
