"""The training plan: stages of a token length, a data mix, a sequence length and an LR phase; the WSD learning rate
over them; an on-demand decay (a copy of the plan's own) cut into them; the split of a micro-step's rows among a
mix's corpora. Pure functions of the plan list (a list of dicts, stored in every checkpoint's state.json): train.py
runs it, tests call them."""
import math


class PlanError(ValueError):
    """A config whose stages do not make a plan (train.py reports it as one line, exit 2)."""



def decay_length(decay_frac, n):
    """floor(decay_frac x n), past float error: int(0.35 * 180) is 62 (0.35 * 180 = 62.99999999999999)."""
    return int(decay_frac * n + 1e-9)


def no_decay_note(cfg):
    """A one-line note when decay_frac x max_iters rounds to no decay step (a short run: silently never decayed), or
    None."""
    if cfg["stages"] or cfg["decay_frac"] <= 0 or decay_length(cfg["decay_frac"], cfg["max_iters"]) > 0:
        return None
    return (f"note: decay_frac={cfg['decay_frac']} x max_iters={cfg['max_iters']} rounds to no decay step: the LR "
            f"never decays to min_lr; raise --max_iters (at least {math.ceil(1 / cfg['decay_frac'] - 1e-9)}) for one")


def build_plan(cfg, tokens_per_step, refuse_short=True):
    """Normalise the config's stages into [{name, mix, tokens, seq_len, lr_phase}] with token lengths. A stage given
    in tokens is rounded to whole steps of its seq_len: a step trains its first stage's mix for all its tokens, so a
    stage that began mid-step lost that part to its neighbour, and one shorter than a step was never trained."""
    if not cfg["stages"] and cfg["warmup_iters"] + decay_length(cfg["decay_frac"], cfg["max_iters"]) > cfg["max_iters"]:
        raise PlanError(f"max_iters={cfg['max_iters']} is shorter than warmup_iters={cfg['warmup_iters']} plus the "
                         f"decay ({cfg['decay_frac']} x max_iters); lower --warmup_iters or raise --max_iters")
    raw = cfg["stages"] or [
        dict(name="warmup", steps=cfg["warmup_iters"], lr_phase="warmup"),
        dict(name="stable", steps=cfg["max_iters"] - cfg["warmup_iters"] - decay_length(cfg["decay_frac"], cfg["max_iters"]),
             lr_phase="stable"),
        dict(name="decay", steps=decay_length(cfg["decay_frac"], cfg["max_iters"]), lr_phase="decay"),
    ]
    plan = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict):
            raise PlanError(f"stages[{i}] must be a dict, got {s!r}")
        bad = set(s) - {"name", "mix", "tokens", "steps", "seq_len", "lr_phase"}
        if bad:
            raise PlanError(f"stages[{i}]: unknown keys {sorted(bad)} (allowed: name, mix, tokens, steps, seq_len, lr_phase)")
        for key in ("tokens", "steps", "seq_len"):  # 2e9 is a float in Python: whole numbers of either type
            v = s.get(key)
            if key in s and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v)):
                raise PlanError(f"stages[{i}]: {key} must be a whole number, got {v!r}")
            if key != "seq_len" and key in s and v < 0:  # skipped as a 0 is, the stage silently never trained
                raise PlanError(f"stages[{i}]: {key} must be >= 0 (0 skips the stage), got {v!r}")
        if "mix" in s and not (isinstance(s["mix"], dict) and s["mix"] and all(
                isinstance(c, str) and isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                for c, w in s["mix"].items())):
            raise PlanError(f"stages[{i}]: mix must be a dict of corpus name -> weight (finite numbers), got {s['mix']!r}")
        if not isinstance(s.get("name", ""), str):
            raise PlanError(f"stages[{i}]: name must be a string, got {s['name']!r}")
        phase = s.get("lr_phase", "stable")
        if phase not in ("warmup", "stable", "decay"):
            raise PlanError(f"stages[{i}]: lr_phase must be warmup, stable or decay, got {phase!r}")
        T = int(s.get("seq_len", cfg["seq_len"]))
        if T < 1:
            raise PlanError(f"stages[{i}]: seq_len must be at least 1, got {T}" if "seq_len" in s
                             else f"--seq_len={T}: must be at least 1")
        if ("tokens" in s) == ("steps" in s):
            raise PlanError(f"stages[{i}]: give exactly one of tokens or steps")
        step_tokens = tokens_per_step(T)
        if "tokens" in s and int(s["tokens"]) > 0:
            steps = (int(s["tokens"]) + step_tokens // 2) // step_tokens  # the nearest whole number of steps
            if steps == 0 and not refuse_short:  # a resume keeps its stored plan: this one is only compared
                steps = 1
            if steps == 0:
                raise PlanError(f"stages[{i}] ({s.get('name', f'stage{i}')}): tokens={int(s['tokens']):,} is less than "
                                f"half a step ({step_tokens:,} tokens at seq_len {T}): it would never be trained; give "
                                f"at least {step_tokens:,} tokens, or steps=1")
            tokens = steps * step_tokens
        else:
            tokens = int(s["tokens"]) if "tokens" in s else int(s["steps"]) * step_tokens
        if tokens <= 0:
            continue  # e.g. warmup_iters = 0
        mix = s["mix"] if "mix" in s else {cfg["dataset"]: 1.0}
        if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
            raise PlanError(f"stages[{i}]: mix weights must be >= 0 with a positive sum, got {mix}")
        plan.append(dict(name=s.get("name", f"stage{i}"), mix=dict(mix), tokens=tokens, seq_len=T, lr_phase=phase,
                         seq_len_from_config="seq_len" not in s))
    if not plan:
        raise PlanError("the plan is empty: set stages or max_iters > 0")
    return plan


def stage_at(plan, tokens_seen):
    """(index, stage, tokens into the stage) for the stage that trains token number tokens_seen."""
    start = 0
    for i, s in enumerate(plan):
        if tokens_seen < start + s["tokens"]:
            return i, s, tokens_seen - start
        start += s["tokens"]
    return len(plan), None, 0


def plan_tokens(plan):
    return sum(s["tokens"] for s in plan)


def align_plan(plan, tokens_seen, tokens_per_step):
    """The plan with what is left of it from tokens_seen in whole steps of tokens_per_step(seq_len): each stage ends
    at the whole step nearest its planned end (one not begun keeps at least a step), the last at the first one at or
    past the plan's end. A resume with another step size (batch_size, grad_accum, world size, seq_len) had a step
    straddle a stage boundary, training the next stage's planned tokens on the earlier one's mix, seq_len and LR, and
    skip a stage shorter than a step altogether, while the stored plan said otherwise. A stage ends early enough to
    leave a step to each one after it: short stages at the end (a decay split in stages, each now under a step) take
    their steps from the stage before (each pushed the plan's end out by up to a step). A no-op on whole steps."""
    out, start, pos = [dict(s) for s in plan], 0, tokens_seen  # start: the planned stage's, pos: the aligned one's
    total = plan_tokens(plan)
    room = [sum(tokens_per_step(t["seq_len"]) for t in plan[i + 1:]) for i in range(len(plan))]  # a step each after i
    for i, s in enumerate(plan):
        end = start + s["tokens"]
        if end > tokens_seen:  # a stage not finished: its end to the whole step nearest the planned one
            tps, began = tokens_per_step(s["seq_len"]), start < tokens_seen
            target = min(end, total - room[i])
            # half a step rounds down: a tie pushed every later stage, and the plan's end, a step further
            n = -(-(end - pos) // tps) if i == len(plan) - 1 else (target - pos + (tps - 1) // 2) // tps
            n = max(n, 0) if began else max(n, 1)  # (one under half a step: a step, as build_plan keeps it on resume)
            out[i]["tokens"] = pos + n * tps - (start if began else pos)
            pos += n * tps
        start = end
    return out


def lr_at(plan, tokens_seen, lr, lr_min, step_tokens=0):
    """WSD (MiniCPM arXiv 2404.06395; Hagele et al. 2024): linear warmup (from 0; a warmup after a decay, a replan
    climbing back, from min_lr), constant, then a (1 - sqrt) decay.
    step_tokens (tokens of the step about to run) makes warmup reach the full LR on its last step, and the decay
    reach lr_min on its last (counted from the step's start, the last decay step ran above lr_min: 3.2e-4 for tiny's
    3e-4, and an 8-step on-demand decay ended at 4.7e-4)."""
    i, s, _ = stage_at(plan, tokens_seen)
    if s is None:  # past the end: where the last stage left it (a plan with no decay never reached lr_min)
        return lr_min if plan and plan[-1]["lr_phase"] == "decay" else lr
    if s["lr_phase"] in ("warmup", "decay"):  # over its run of stages: a decay split in two went back up to the peak
        lo, hi = phase_span(plan, i)
        start, end = plan_tokens(plan[:lo]), plan_tokens(plan[:hi + 1])
        frac = min(1.0, (tokens_seen - start + step_tokens) / (end - start))
        if s["lr_phase"] == "warmup":  # from 0, or from min_lr after a decay (a re-warm dipped to lr/n, under min_lr)
            base = lr_min if lo > 0 and plan[lo - 1]["lr_phase"] == "decay" else 0.0
            return base + (lr - base) * frac
        return lr_min + (lr - lr_min) * (1 - math.sqrt(frac))
    return lr


def phase_span(plan, i):
    """(first, last) index of the consecutive stages around stage i that share its lr_phase: one warmup or decay ramp,
    whatever mixes or seq_lens it is split into. An on-demand decay is a ramp of its own: one asked just as a planned
    decay ended (before the stable stage after it) joined that one's ramp, its LR back up from min_lr mid-ramp."""
    same = lambda j: (plan[j]["lr_phase"] == plan[i]["lr_phase"]  # noqa: E731
                      and is_on_demand(plan[j]) == is_on_demand(plan[i]))
    lo = hi = i
    while lo > 0 and same(lo - 1):
        lo -= 1
    while hi + 1 < len(plan) and same(hi + 1):
        hi += 1
    return lo, hi


ON_DEMAND = "decay-on-demand"  # the name of an on-demand decay's stage ("decay-on-demand:<planned name>" for each of
# several: the on-demand copies of a decay planned over several stages)


def is_on_demand(stage):
    """Whether a plan stage is (one of the stages of) an on-demand decay that decay_now appended."""
    name = stage.get("name")
    return isinstance(name, str) and (name == ON_DEMAND or name.startswith(ON_DEMAND + ":"))


def decay_ramp(plan, tokens_seen=0):
    """(first, last) index of the planned decay an on-demand decay asked at tokens_seen stands in for: the first
    decay ramp not over by then, else the plan's last; None for a plan without a decay stage."""
    ramps, i = [], 0
    while i < len(plan):
        lo, hi = phase_span(plan, i)
        if plan[i]["lr_phase"] == "decay":
            ramps.append((lo, hi))
        i = hi + 1
    return next((r for r in ramps if plan_tokens(plan[:r[1] + 1]) > tokens_seen), ramps[-1] if ramps else None)


def on_demand_decay_tokens(plan, decay_tokens, decay_frac, tokens_seen=0):
    """Length of an on-demand decay: decay_tokens if set, else the plan's own decay (all of its stages: the first
    alone made a split decay's on-demand copy short), else decay_frac of the plan."""
    ramp = decay_ramp(plan, tokens_seen)
    if decay_tokens or ramp is None:
        return decay_tokens or decay_length(decay_frac, plan_tokens(plan))
    return plan_tokens(plan[ramp[0]:ramp[1] + 1])


def _cut(plan, tokens):
    """The plan's stages up to token `tokens` (the one it falls in shortened to end there)."""
    out, start = [], 0
    for s in plan:
        if start >= tokens:
            break
        out.append(dict(s, tokens=min(s["tokens"], tokens - start)))
        start += s["tokens"]
    return out


def decay_now(plan, tokens_seen, length, tokens_per_step=None):
    """The plan cut at tokens_seen with an on-demand decay of about `length` tokens appended. It trains as the plan's
    own decay would: its stages' mixes and seq_lens in order, each scaled by length / the planned decay's tokens
    (it trained the stable stage's mix, losing a decay planned on an annealing mix or another seq_len); only a plan
    without a decay stage decays on the mix and seq_len of the stage the cut falls in (at a stage boundary it took
    the one before). tokens_per_step(seq_len): each appended stage ends at the whole step nearest its scaled end,
    at least one step in all. During a decay the plan ends with that decay (all its stages) instead, and a finished
    plan stays as it is: a second decay would start from the peak LR again."""
    i, cur, _ = stage_at(plan, tokens_seen)
    if cur is None:
        return [dict(s) for s in plan]
    if cur["lr_phase"] == "decay":  # the rest of its ramp too (cut at this stage, the LR dropped at once)
        return [dict(s) for s in plan[:phase_span(plan, i)[1] + 1]]
    if cur["lr_phase"] == "warmup":  # the decay starts from the peak LR: after the warmup, never an unwarmed jump to it
        tokens_seen = plan_tokens(plan[:phase_span(plan, i)[1] + 1])  # all of it, when split in stages
    out = _cut(plan, tokens_seen)
    ramp = decay_ramp(plan, tokens_seen)
    if ramp is None:  # the stage the decay replaces (the one after the warmup, when asked during it)
        model = [stage_at(plan, tokens_seen)[1] or (out[-1] if out else plan[-1])]
    else:
        model = [s for s in plan[ramp[0]:ramp[1] + 1] if s["tokens"] > 0] or [plan[ramp[1]]]
    planned, done, pos, tail = sum(max(s["tokens"], 0) for s in model), 0, 0, []
    for s in model:
        done += max(s["tokens"], 0)
        end = int(length) * done // planned if planned > 0 else int(length)  # the scaled end of this stage
        n = end - pos
        if tokens_per_step is not None:
            tps = tokens_per_step(s["seq_len"])
            n = (n + tps // 2) // tps * tps
        if n > 0:  # (a stage scaled under half a step: none, its neighbours train on)
            tail.append((s, n))
            pos += n
    if not tail:  # at least one step, of the decay's first stage
        tail = [(model[0], tokens_per_step(model[0]["seq_len"]) if tokens_per_step is not None else max(1, int(length)))]
    # seq_len_from_config as the stage it copies: a resume with another --seq_len moves both (it kept the old one)
    out += [dict(name=ON_DEMAND if len(model) == 1 else f"{ON_DEMAND}:{s['name']}", mix=dict(s["mix"]), tokens=n,
                 seq_len=s["seq_len"], lr_phase="decay", seq_len_from_config=bool(s.get("seq_len_from_config")))
            for s, n in tail]
    return out


def keep_on_demand_decay(plan, stored):
    """A new plan (--replan) with the on-demand decay the stored plan started kept as it was (a started decay is
    history, trained on its mixes and seq_lens so far): the new plan cut where that decay began, then the decay's
    stages as stored (all of them, when it copies a decay planned over several). A new plan that ends before it
    began has its last stage stretched up to there (those tokens were trained)."""
    k = next((j for j, s in enumerate(stored) if is_on_demand(s)), None)
    if k is None:
        return [dict(s) for s in plan]
    at = plan_tokens(stored[:k])
    out = _cut(plan, at)
    if out and plan_tokens(out) < at:
        out[-1]["tokens"] += at - plan_tokens(out)
    return out + [dict(s, mix=dict(s["mix"])) for s in stored[k:]]


def rows_per_stream(mix, rows, micro_index):
    """Deterministic split of `rows` sequences among the mix's corpora for micro-step number micro_index: global row
    g goes to the first corpus (sorted by name) when floor((g+1)*share) steps, else on to the rest, whose own rows are
    split the same way (Bresenham's line, nested). Among the first n rows a corpus gets floor(n*share) of the rows
    its predecessors left: never a negative count (the last corpus once took what rounding left, -1 at times), none
    for a weight of 0, and resume reproduces it from micro_index alone."""
    names = sorted(n for n in mix if mix[n] > 0)
    lo, hi = micro_index * rows, (micro_index + 1) * rows  # this micro-step's rows, counted among the rows still unsplit
    out = dict.fromkeys(sorted(mix), 0)
    for i, n in enumerate(names[:-1]):
        share = min(1.0, mix[n] / sum(mix[m] for m in names[i:]))
        a, b = math.floor(lo * share), math.floor(hi * share)
        out[n] = b - a
        lo, hi = lo - a, hi - b
    out[names[-1]] = hi - lo
    return out


PLAN_SOURCE_KEYS = ("max_iters", "warmup_iters", "decay_frac", "dataset")  # what a plan without stages is built from


def unused_with_stages(cfg):
    """The plan keys a config's stages leave unread: max_iters and warmup_iters, and decay_frac unless it sizes an
    on-demand decay (no decay stage, no decay_tokens)."""
    if not cfg.get("stages"):  # (.get: relay reads it from a checkpoint's stored config)
        return ()
    if cfg.get("decay_tokens") or any(isinstance(s, dict) and s.get("lr_phase") == "decay" for s in cfg["stages"]):
        return "max_iters", "warmup_iters", "decay_frac"
    return "max_iters", "warmup_iters"


def stored_plan_source(state):
    """What a checkpoint's plan was built from (plan_source); one saved before the dataset was recorded there
    (2026-12-03) takes it from its saved config, which built that plan: a --dataset resuming it trained on unsaid."""
    src = state.get("plan_source") or {}
    if isinstance(src, dict) and "dataset" not in src and isinstance(state.get("config"), dict) and \
            "dataset" in state["config"]:
        src = dict(src, dataset=state["config"]["dataset"])
    return src


def stored_plan_differs(state, cfg):
    """Whether the config builds another plan than the stored one from the same stages: other lengths without stages,
    another --dataset for stages without a mix."""
    src = stored_plan_source(state)
    if cfg["stages"] and all("mix" in s for s in cfg["stages"] if isinstance(s, dict)):
        src = {}
    return any(src[k] != cfg[k] for k in PLAN_SOURCE_KEYS if k in src)


def plan_changes(state, cfg):
    """What makes the config's plan another than the one stored in a checkpoint's state, each as 'what: stored X,
    config Y' (empty: the same plan), so a refused resume names what to put back or --replan."""
    stored_stages, stages = state.get("config_stages"), cfg["stages"]
    changes = []
    if stored_stages != stages:
        if not isinstance(stored_stages, list) or len(stored_stages) != len(stages):
            count = lambda x: (f"{len(x)} stage{'s' * (len(x) != 1)}" if isinstance(x, list) and x  # noqa: E731
                               else "none (from max_iters)")
            changes.append(f"stages: stored {count(stored_stages)}, config {count(stages)}")
        else:
            i = next(i for i, (a, b) in enumerate(zip(stored_stages, stages)) if a != b)
            changes.append(f"stage {i}: stored {stored_stages[i]}, config {stages[i]}")
    if stored_plan_differs(state, cfg):
        src = stored_plan_source(state)
        changes += [f"{k}: stored {src[k]!r}, config {cfg[k]!r}" for k in PLAN_SOURCE_KEYS  # (not those stages ignore)
                    if k in src and src[k] != cfg[k] and k not in unused_with_stages(cfg)]
    return changes
