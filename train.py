"""
Train a picaflor MoE model. One process:            python train.py config/tiny.py
                            torchrun DDP:           torchrun --standalone --nproc_per_node=8 train.py config/nano.py
                            (torchrun SIGKILLs its workers 30 s after passing a SIGTERM on: a big checkpoint's save
                            needs more, --shutdown_timeout=900)
                            progress of a run:      python train.py --status out/nano   (run_status.py)
                            supervised (guardian):  python train.py config/nano.py --supervise   (guardian.py)
Any config global can be overridden: --key=value (configurator.py). Formats: checkpoint.py (run and step dirs), shards.py (corpora), container.py (int4).

The run's plan is data: `stages`, a list of dicts {name, mix {corpus: weight}, tokens | steps, seq_len,
lr_phase in warmup|stable|decay}; tokens are rounded to whole steps (a step trains one stage's mix, so a stage under
half a step is refused, not skipped). Progress through the plan is counted in tokens, so changing batch_size or
seq_len on resume keeps both the schedule and the data position (per corpus: shard, token offset). The plan is
stored in state.json at the first start; a resume whose config plans differently is refused unless --replan.
Any other key a resume changes is said in one line at its start (both values, what it does from that step), or
refused when nothing would read it (decay_tokens once the decay began, a seq_len that every stage left sets).
A run is finished only when the last planned token is trained. `control.json` in out_dir ({"start_decay":
true}, set by relay.py or by hand) starts the WSD decay now: the plan is cut at the current token and a copy of its
own decay appended (its stages' mixes and seq_lens, scaled to --decay_tokens when set; without a decay stage, one
stage on the current stage's mix and seq_len).

Checkpoints (checkpoint.py): permanent every ckpt_interval steps and at each stage end, a temporary one every
checkpoint_minutes (replaced by the next), one on SIGTERM (preemption: save, exit 0; an evaluation it cut short is
done by the resume, first, and recorded as the uninterrupted run did), the best by val loss
(pointer file BEST; another val set, from batch_size, eval_iters, a stage's seq_len or the val shards read,
restarts the best).
Retention keeps the last keep_last permanent ones, every stage final, the best, and the newest; it never deletes the
only valid checkpoint. An out_dir that holds checkpoints is continued only by
--init_from=resume (any other start is refused: its saves would overwrite them). A rollback, --init_from=resume
--resume_from=OUT/step_N with later steps in OUT, moves those later ones to OUT/abandoned/ first, so neither a later
resume nor retention mistakes the old timeline for the new one.

Exit codes (one line on stderr each, and a crash-<ms>.json report in out_dir; under torchrun, once the loop is set
up, every rank its own, crash-<ms>-rank<r>.json for ranks other than 0): 0 done / leg done / preempted
(SIGTERM: checkpoint, then exit), 1 error (bad config, bad checkpoint, missing data; an out_dir that this refused
start made is removed again, not left holding a lock file and a crash report), 2 bad config syntax or key
(before out_dir is read: no crash report), 3 corrupt data (shard, offset, what), 4 storage denied (HTTP 401/403: credentials or billing; a run dir it may not write), 5 storage
unreachable (a mount that dropped; an I/O error), 6 out of disk (previous checkpoint intact), 7 non-finite loss or gradient norm (the step is not applied and never
reaches a checkpoint), 8 hang (no step progress for hang_timeout s; all thread stacks in hang-*.txt), 9 stuck
(--supervise only: the guardian gave up, guardian.py), 10 an unforeseen error (its traceback on stderr and in the crash
report; the guardian restarts on it), 130 a second Ctrl-C (quits at once, no checkpoint).
Logs (metrics.jsonl, guardian.json, crash reports) live in out_dir, flushed each log step (a resume moves rows past
its step to metrics.abandoned.jsonl, so each step is logged once). A row's loss and expert load average the steps
since the last multiple of log_interval; the rows between (a start's first step, an evaluation's, and every
checkpoint's step, a stop's included) show that window so far, and a checkpoint carries it, so a resumed run logs the
rows the run never stopped would (tok/s and MFU: this start's steps since its previous row). mirror_dir copies them
and the newest checkpoint elsewhere (keep_last applies there too; a failed copy warns, training goes on; a mirror
that cannot be written, or that another run mirrors into (DIR/MIRROR_OF.json), is refused at the start). Documents
are never cut (shards pack them whole), so no token is dropped.
"""

import os
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep instead of spinning (2x wall on shared CPUs)
import base64
import json
import math
import pickle
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields

from checkpoint import DISK_ERRNOS, fmt_size  # a write refused for lack of space; MiB / GiB
from checkpoint import detach_from_lost_terminal, print_or_detach  # output that a lost terminal cannot end the run on
from expert_load import load_collapse_line  # the collapse warning
import rundir
from run_status import last_metrics_row, print_status, step_line  # --status; the log line
from rundir import RunDirError, RunLocked, hold_run_lock, mirror, prepare_run_dir, retain
from schedule import (PLAN_SOURCE_KEYS, PlanError, align_plan, build_plan, decay_now, is_on_demand, keep_on_demand_decay,
                      lr_at, no_decay_note, on_demand_decay_tokens, plan_changes, plan_tokens, rows_per_stream,
                      stage_at, unused_with_stages)

# -----------------------------------------------------------------------------------------------------------
# config (globals; config files and --key=value override them)
out_dir = "out"
dataset = "local"            # a corpus folder under data_root; the default plan trains on it alone
data_root = "data"
init_from = "scratch"        # scratch | resume | grow | finetune
resume_from = ""             # with init_from=resume: a specific step_* dir (default: newest valid in out_dir)
grow_from = ""               # with init_from=grow: the checkpoint (dir) to grow
grow_layers = 0              # new layers added by growth
finetune_from = ""           # with init_from=finetune: start from these weights (fresh optimizer, plan and data)
grow_where = "interleave"    # interleave (LLaMA Pro: new blocks evenly spaced, the last after the top block) | top
# (grow_* and finetune_from set for another start than theirs are refused; a resume keeps them, but refuses another
# grow_layers or grow_where than its run grew with: it grows nothing)
# model (ModelConfig fields)
vocab_size = 32768
n_layer = 24
n_dense_layers = 1
d_model = 1024
n_head = 16
n_kv_head = 4
dense_ffn = 4096
n_experts = 64
expert_ffn = 512
n_shared = 4
top_k = 2                    # >= 2 for a new run (top-1: the router learns nothing); serve top-1: --experts-per-token 1
route_scale = 1.0
bias_update_rate = 1e-3
rope_theta = 10000.0
max_seq_len = 2048
norm_eps = 1e-5
tie_embeddings = False
# plan: `stages` as above; when empty, warmup/stable/decay built from max_iters, warmup_iters, decay_frac
stages = []
max_iters = 1000
warmup_iters = 100
decay_frac = 0.2
decay_tokens = 0             # length of an on-demand decay (0: the plan's decay stages, else decay_frac of the plan)
batch_size = 16              # sequences per micro-step per process
seq_len = 1024               # default for stages that do not set one
grad_accum = 1
doc_mask = True              # loss-masked (SFT) data: each packed conversation attends only to itself
learning_rate = 3e-4
min_lr = 3e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
lr_mult = {"embedding": 1.0, "old": 1.0, "new": 1.0}   # differential LR by parameter origin
# evaluation, logging, checkpoints
eval_interval = 500
eval_iters = 20              # val loss over the val split's first eval_iters x batch_size rows, shared among ranks
log_interval = 10
ckpt_interval = 1000
checkpoint_minutes = 0.0     # >0: also a temporary checkpoint this often (wall clock)
keep_last = 3
mirror_dir = ""              # also copy logs and the newest checkpoint here (another disk, a bucket mount)
hang_timeout = 1800.0        # seconds without step progress -> dump all thread stacks, exit 8 (0: off)
quarantine_shards = []       # "corpus/file" shards to skip (the guardian adds to it; kept in state.json)
release_shards = []          # "corpus/file" quarantined shards to read again (fixed by hand; checkpoints untouched)
on_stuck = ""                # guardian: shell command run when max_stuck_starts starts made no new checkpoint
max_stuck_starts = 3
unreachable_backoff_s = 5.0  # guardian: storage unreachable -> wait 2x, 4x, 8x ... this (<= 60 s) between retries
unreachable_give_up_s = 1800.0  # guardian: ... until one outage's waits would pass this, then stop with exit 5
stop_grace_s = 3600.0        # guardian: a trainer not out this long after a stop signal is SIGKILLed (past hang_timeout:
                             # a save or mirror copy of a big checkpoint, ticking the watchdog, takes minutes)
max_restarts = 20           # guardian: restarts after starts that made no new checkpoint, per invocation
lock_wait_s = 600.0         # a second trainer on this out_dir waits this long for the first to exit, then errors
sample_tokens = 64           # sample printed at the end (0: none)
# this invocation
stop_after_steps = -1        # >=0: stop after this many optimizer steps (a relay leg; 0 writes a checkpoint)
stop_after_hours = -1.0     # stop (checkpointed) this many hours after the trainer started, start-up included (-1: off)
# system
device = "cuda"
dtype = "bfloat16"           # autocast dtype on CUDA; a CPU run computes in float32 (said at the start)
compile = False
seed = 1337
gpu_hourly_usd = 0.0         # $ per GPU-hour: usd_spent adds each start's hours at its own price and world size
CONTROL_KEYS = ("start_decay", "start_decay_taken_at_step")  # what control.json may hold (the second is written here)
_CONFIG_KEYS = sorted(k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool, list, dict)))
# -----------------------------------------------------------------------------------------------------------

# exit codes per fault cause (faults.py; imported below _CONFIG_KEYS: ints and dicts above it are config keys)
from faults import (CAUSES, EXIT_CRASH, EXIT_DATA, EXIT_DENIED, EXIT_DISK, EXIT_ERROR, EXIT_NONFINITE, EXIT_UNREACHABLE,
                    RUN_INFO as _RUN_INFO, TrainError, Watchdog, die, write_crash_report)
# dense bf16 peaks (vendor datasheets; H100/H200 SXM 989e12 per REFERENCES.md) by the words of the card's name, the
# entry naming most of them winning whatever the order: "A10" in "A10G" gave an A10G the A10's 125e12, "L4" in
# "L40" an L40 the L4's. A10G (AWS G5, not an A10): 70e12 FP16/BF16 tensor, NVIDIA's A10G datasheet for AWS
# (d1.awsstatic.com/product-marketing/ec2/NVIDIA_AWS_A10G_DataSheet_FINAL_02_17_2022.pdf, as tabled by
# full-stack-deep-learning's cloud GPU page). GH200: its H100's peak
PEAK_BF16_FLOPS = [("H200 NVL", 835e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H200", 989e12),
                   ("GH200", 989e12), ("H100", 989e12), ("A100", 312e12), ("4090", 165e12), ("L40S", 362e12),
                   ("L40", 181e12), ("A10", 125e12), ("A10G", 70e12), ("L4", 121e12)]


# -----------------------------------------------------------------------------------------------------------
# model helpers

RESUME_CONFIG_WINS = ("max_seq_len", "bias_update_rate")  # model fields no weight depends on


def model_config_from(cfg):
    from model import ModelConfig
    try:
        return ModelConfig.from_dict({f.name: cfg[f.name] for f in fields(ModelConfig)})
    except ValueError as e:  # a config error (exit 1), not a crash to restart
        raise TrainError(f"{e}; fix the config (or its --key=value overrides)")


def stored_model_config(ck, state):
    """A checkpoint's model_config, which must name every field the weights depend on: a missing one (rope_theta) took
    the config's or the default's value and trained another model without a word (RESUME_CONFIG_WINS may be absent)."""
    from model import ModelConfig
    stored = state["model_config"]
    missing = [k for k in ModelConfig.missing_keys(stored) if k not in RESUME_CONFIG_WINS]
    if missing:
        raise TrainError(f"{ck}/state.json: its model_config lacks {missing}; use the picaflor that wrote it")
    try:  # the checkpoint's own fault, said so (n_layer "3": a TypeError traceback, exit 10, restarted)
        ModelConfig.from_dict({f.name: stored[f.name] for f in fields(ModelConfig) if f.name in stored})
    except (ValueError, TypeError) as e:
        raise TrainError(f"{ck}/state.json: no model config this picaflor can build ({type(e).__name__}: "
                         f"{str(e)[:160]}); use the picaflor that wrote it, or another checkpoint")
    return stored


def check_resume_state(ck, state, n_layer):
    """The state.json fields a resume reads, each of the kind train.py writes them: a hand-edited or foreign one (no
    "tokens", a layer_origin of another length, a data_position or rng of another shape) was a KeyError / TypeError
    traceback, exit 10, which the guardian restarted into the same crash."""
    def whole(v):
        return type(v) is int and v >= 0

    def number(v):
        return type(v) in (int, float) and math.isfinite(v) and v >= 0

    def stage(s):
        return (isinstance(s, dict) and isinstance(s.get("name"), str) and whole(s.get("tokens")) and
                whole(s.get("seq_len")) and s["seq_len"] > 0 and s.get("lr_phase") in ("warmup", "stable", "decay")
                and isinstance(s.get("mix"), dict) and bool(s["mix"]) and all(isinstance(c, str) and number(w)
                                                                              for c, w in s["mix"].items()))

    def position(p):
        return isinstance(p, dict) and "shard" in p and "offset" in p and all(whole(p.get(k, 0))
                                                                                for k in ("shard", "offset", "epoch"))
    get = state.get
    checks = {"step": whole(get("step")), "tokens": whole(get("tokens")),
              "elapsed_seconds": number(get("elapsed_seconds")), "usd_spent": number(get("usd_spent", 0)),
              "save_seconds": number(get("save_seconds", 0)),
              "best_val_loss": get("best_val_loss") is None or type(get("best_val_loss")) in (int, float),
              "seq_len_history": isinstance(get("seq_len_history"), list) and all(
                  isinstance(h, dict) and whole(h.get("seq_len")) for h in get("seq_len_history")),
              "plan": isinstance(get("plan"), list) and bool(get("plan")) and all(stage(s) for s in get("plan")),
              "layer_origin": isinstance(get("layer_origin"), list) and len(get("layer_origin")) == n_layer and all(
                  isinstance(o, str) for o in get("layer_origin")),
              "data_position": isinstance(get("data_position", {}), dict) and all(
                  isinstance(c, str) and position(p) for c, p in get("data_position", {}).items()),
              "plan_source": isinstance(get("plan_source") or {}, dict),
              "data_split_sha": isinstance(get("data_split_sha") or {}, dict) and all(
                  isinstance(h, str) for h in (get("data_split_sha") or {}).values()),
              "rng": "rng" not in state or isinstance(get("rng"), dict) and isinstance(get("rng").get("torch"), str),
              "quarantined_shards": isinstance(get("quarantined_shards", []), list) and all(
                  isinstance(f, str) for f in get("quarantined_shards", [])),
              "decay_started_at_tokens": get("decay_started_at_tokens") is None or whole(
                  get("decay_started_at_tokens"))}
    bad = next((k for k, ok in checks.items() if not ok), None)
    if bad:
        said = repr(state[bad])[:80] if bad in state else "missing"
        raise TrainError(f"{ck}/state.json: its {bad} is not what train.py writes ({said}); resume another checkpoint "
                         f"(--resume_from=STEP_DIR), or the run's own copy of this one")


# keys a resume does not compare with the checkpoint's config: this invocation's (where and how long it runs, the
# guardian's), the start's (grow_*, finetune_from: a resume keeps them; relay's init passes grow_from resolved;
# grow_layers and grow_where where set: resume_changes), and those said elsewhere (the model's by config_wins, the
# plan's by plan_changes, the optimizer groups' on load, the quarantine with its fix)
RESUME_UNCOMPARED = {"out_dir", "init_from", "resume_from", "grow_from", "grow_layers", "grow_where", "finetune_from",
                     "stop_after_steps", "stop_after_hours", "mirror_dir", "lock_wait_s", "hang_timeout", "on_stuck",
                     "max_stuck_starts", "unreachable_backoff_s", "unreachable_give_up_s", "stop_grace_s",
                     "max_restarts", "stages", "max_iters", "warmup_iters", "lr_mult", "weight_decay", "beta1",
                     "beta2", "quarantine_shards", "release_shards"}


def resume_changes(ck, state, cfg, plan, tokens_per_step, given=()):
    """One line per config key whose value differs from the checkpoint's (state.json's config), saying what it does
    from this step: a changed learning_rate, batch_size or keep_last trained on without a word, and a changed
    decay_tokens after the on-demand decay began was used nowhere while the run went on. A change a resume cannot
    honour is a TrainError naming the key, both values and the fix."""
    from model import ModelConfig
    was = state.get("config")
    if not isinstance(was, dict):  # (a checkpoint written by hand or by another tool: nothing to compare with)
        return []
    skip = RESUME_UNCOMPARED | {f.name for f in fields(ModelConfig)}
    sized_by_frac = cfg["stages"] and not cfg["decay_tokens"] and not any(s["lr_phase"] == "decay" for s in plan
                                                                           if not is_on_demand(s))
    if not cfg["stages"]:
        skip |= {"dataset", "decay_frac"}  # (they build the plan: plan_changes)
    elif not sized_by_frac:
        skip.add("decay_frac")  # (unread: configurator refuses it when set beside such stages)
    if not cfg["stages"] or not all("mix" in s for s in cfg["stages"]):
        skip.add("dataset")  # (a stage without a mix trains on it: plan_changes)
    changed = [k for k in sorted(cfg) if k in was and k not in skip and was[k] != cfg[k]]
    # set otherwise than the start that made the run (config/grow.py reused to resume: the same): a resume grows
    # nothing (relay's config.py may leave them out, its init resolves grow_from: compared only where set, paths not)
    regrow = [k for k in ("grow_layers", "grow_where") if k in given and k in was and was[k] != cfg[k]]
    if regrow:
        k = regrow[0]
        raise TrainError(f"{k} {was[k]!r} -> {cfg[k]!r}: a resume grows nothing (it goes on with the checkpoint's "
                         f"{len(state['layer_origin'])} layers); put back --{k}={was[k]!r}, or grow a checkpoint into "
                         f"a new run (--init_from=grow --grow_from=STEP_DIR --out_dir=NEW)")
    step, tokens = state["step"], state["tokens"]
    decayed = state.get("decay_started_at_tokens")
    for k in ("decay_tokens", "decay_frac"):
        if k in changed and decayed is not None:
            raise TrainError(f"{k} {was[k]!r} -> {cfg[k]!r}: the decay started at {decayed:,} tokens is planned as "
                             f"stored in {ck}/state.json and a resume cannot resize it; put back --{k}={was[k]!r}, or "
                             f"resume a checkpoint from before the decay (--resume_from=STEP_DIR)")
    if "dataset" in changed:  # (as on a first start, no stage reads it: the run trained on as before)
        raise TrainError(f"dataset {was['dataset']!r} -> {cfg['dataset']!r}: no stage reads it (each stage's mix names "
                         f"its corpora); put back --dataset={was['dataset']!r}, or change the stages' mix and pass "
                         f"--replan")
    ends = [plan_tokens(plan[:i + 1]) for i in range(len(plan))]
    if "seq_len" in changed and not any(s.get("seq_len_from_config") for s, e in zip(plan, ends) if e > tokens):
        raise TrainError(f"seq_len {was['seq_len']!r} -> {cfg['seq_len']!r}: no stage left reads it (each sets its own "
                         f"seq_len); put back --seq_len={was['seq_len']!r}, or change the stages' seq_len and pass "
                         f"--replan")
    lines = []
    for k in changed:
        why = ""
        if k in ("learning_rate", "min_lr"):
            stage = stage_at(plan, tokens)[1]
            lr = lr_at(plan, tokens, cfg["learning_rate"], cfg["min_lr"],
                       tokens_per_step(stage["seq_len"]) if stage else 0)
            why = f" (the next step trains at lr {lr:.2e})"
        elif k in ("batch_size", "grad_accum", "seq_len"):
            left = sum(-(-(e - max(tokens, e - s["tokens"])) // tokens_per_step(s["seq_len"]))  # each at its seq_len
                       for s, e in zip(plan, ends) if e > tokens)
            why = (f" (the plan and the data position are counted in tokens: {plan_tokens(plan) - tokens:,} tokens "
                   f"left, {left} steps now)")
        elif k in ("decay_tokens", "decay_frac"):
            why = " (the length of an on-demand decay, when control.json starts one)"
        elif k == "seed":
            why = " (a resume goes on with the checkpoint's RNG state; the seed seeds the end-of-run sample only)"
        elif k == "keep_last":
            why = f" (from the next save, retention keeps the last {cfg[k]} permanent checkpoints)"
        lines.append(f"resume: {k} {was[k]!r} -> {cfg[k]!r} from step {step}{why}")
    # a key added since the picaflor that wrote the checkpoint (doc_mask): it trained without it; that changed unsaid
    for k in sorted(k for k in cfg if k not in was and k not in skip):
        lines.append(f"resume: {k} {cfg[k]!r} from step {step}, a key the picaflor that wrote {ck} did not have (it "
                     f"trained without it)")
    return lines


def load_weights(ck, mcfg):
    """A checkpoint's model.safetensors; one that its manifest verifies but safetensors cannot read (damaged before
    the manifest was written, or written by another tool) was a SafetensorError traceback, exit 10, restarted. Its
    shapes are checked against its config mcfg before a model is built (a state.json's vocab_size of 2^31: a 274 GB
    allocation, its MemoryError exit 10)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from model import weights_misfit
    try:
        sd = load_file(os.path.join(ck, "model.safetensors"))
    except SafetensorError as e:
        raise TrainError(f"{ck}/model.safetensors: not a readable safetensors file "
                         f"({(str(e).splitlines() or [''])[0]}); re-copy the checkpoint from where it was saved, or "
                         f"start from another (an earlier step_* dir)")
    why = weights_misfit(mcfg, {k: t.shape for k, t in sd.items()})
    if why:
        raise TrainError(f"{ck}/model.safetensors: does not fit its state.json model_config ({why}); use the "
                         f"checkpoint as train.py wrote it, or another one")
    return sd


def chat_padding(x, bos):
    """(B, T) bool: the <|bos|> padding that fills the end of a packed chat row (data/smoltalk/prepare.py): a <|bos|>
    followed by another or last in the window (a conversation's own <|bos|> is followed by its text)."""
    import torch
    nxt = torch.cat([x[:, 1:], torch.full_like(x[:, :1], bos)], dim=1)
    return (x == bos) & (nxt == bos)


def origin_of(name, layer_origin):
    """Origin tag of a parameter: embedding (embeddings, lm_head, final norm), or its layer's old/new."""
    if name.startswith("layers."):
        return layer_origin[int(name.split(".")[1])]
    return "embedding"


def param_groups(model, layer_origin, cfg):
    """AdamW groups by (origin, decay): weight decay on matrices only; LR multiplier per origin."""
    groups = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        tag = origin_of(name, layer_origin)
        decay = p.dim() >= 2 and not name.startswith("embed_tokens")
        key = (tag, decay)
        if key not in groups:
            groups[key] = dict(params=[], names=[], origin=tag, lr_mult=float(cfg["lr_mult"].get(tag, 1.0)),
                               weight_decay=cfg["weight_decay"] if decay else 0.0)
        groups[key]["params"].append(p)
        groups[key]["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def router_bias_load(load, model, layer_origin, lr_mult):
    """The load the router bias update steers by: a frozen layer's row zeroed (lr_mult 0 for its origin means "do not
    change this layer"; a row of zeros moves its bias by sign(0) = 0), so its routing stays as it was."""
    moe = [i for i, b in enumerate(model.layers) if b.is_moe]
    keep = load.new_tensor([float(lr_mult.get(layer_origin[i], 1.0) != 0) for i in moe])
    return load * keep[:, None] if load.numel() else load


def open_val_stream(corpus_dir, vocab_size, skip):
    """(the val split's TokenStream, None), or (None, the line that says why no val loss is logged): a corpus prepared
    without a val split (--val-percent 0), or one whose val shards are all quarantined (named, with the fix; this was
    said as "has no val split", and prepare.py, the fix that says, leaves the quarantine in place)."""
    import shards
    try:  # quarantine holds for val shards too (the guardian names them as it names train ones)
        return shards.TokenStream(corpus_dir, "val", vocab_size=vocab_size, skip_shards=skip), None
    except shards.DataError as e:
        if e.kind != "index":  # a missing or truncated val shard: the guardian's repair, not "no val split", silently
            raise
        entries = shards.load_index(corpus_dir)["splits"].get("val") or []
        if set(skip) & {v["file"] for v in entries}:
            return None, f"WARNING: no val loss will be logged: {e}"
        name = os.path.basename(os.path.normpath(corpus_dir))
        return None, (f"note: corpus {name} has no val split (prepared with no val share, e.g. --val-percent 0); no "
                      f"val loss will be logged and no checkpoint is kept as the best by val loss")


def source_checkpoint(cfg):
    """The checkpoint dir a grow / finetune starts from, verified (None otherwise). Rank 0 picks it for every rank:
    a source run still training could otherwise hand ranks different steps (a new LATEST between their reads)."""
    import checkpoint
    if cfg["init_from"] == "grow":
        if not cfg["grow_from"] or cfg["grow_layers"] <= 0:
            raise TrainError("init_from=grow needs grow_from=CHECKPOINT and grow_layers > 0")
        path = cfg["grow_from"]
    elif cfg["init_from"] == "finetune":
        if not cfg["finetune_from"]:
            raise TrainError("init_from=finetune needs finetune_from=CHECKPOINT (a run dir or step_* dir)")
        path = cfg["finetune_from"]
    else:
        return None
    flag = "grow_from" if cfg["init_from"] == "grow" else "finetune_from"
    try:
        ck = checkpoint.resolve(path)
        checkpoint.verify(ck)
    except checkpoint.CheckpointUnreachable:
        raise
    except checkpoint.CheckpointError as e:  # (config/sft.py's default out/tiny, not trained yet: say which key)
        raise TrainError(f"--{flag}: {e}") from None
    return ck


def grow_state_dict(sd, old_cfg, n_new, where):
    """Insert n_new identity blocks into a state dict (LLaMA Pro, arXiv 2401.02415): each copies the block
    before it, with the attention output and every FFN down projection zeroed so the block adds nothing.
    Returns (new state dict, layer_origin list)."""
    import torch
    L, nd = old_cfg.n_layer, old_cfg.n_dense_layers
    if nd >= L:
        raise TrainError("growth copies MoE blocks, and this model has none (n_dense_layers == n_layer); grow a "
                         "checkpoint with MoE layers (--grow_from=STEP_DIR), or train a deeper model from scratch")
    if where == "top":
        after = [L - 1] * n_new
    elif where == "interleave":  # evenly over the MoE layers, the last one after the top block (LLaMA Pro)
        after = [nd - 1 - (-(i + 1) * (L - nd) // n_new) for i in range(n_new)]  # ceil: never after a dense layer
    else:
        raise TrainError(f"grow_where must be interleave or top, got {where!r}")
    order, origin = [], []
    for i in range(L):
        order.append(i)
        origin.append("old")
        for a in after:
            if a == i:
                order.append(("new", i))
                origin.append("new")
    out = {k: v for k, v in sd.items() if not k.startswith("layers.")}
    for new_i, o in enumerate(order):
        src = o if isinstance(o, int) else o[1]
        for k, v in sd.items():
            if k.startswith(f"layers.{src}."):
                rest = k[len(f"layers.{src}."):]
                t = v.clone()
                if isinstance(o, tuple) and (rest.endswith("o_proj.weight") or "down_proj" in rest):
                    t = torch.zeros_like(t)
                out[f"layers.{new_i}.{rest}"] = t
    return out, origin


# -----------------------------------------------------------------------------------------------------------
# state helpers

def rng_state(device_type):
    import torch
    st = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device_type == "cuda":
        st["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return st


def set_rng_state(st, device_type):
    import numpy as np
    import torch
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(st["torch"]), dtype=np.uint8).copy()))
    if device_type == "cuda" and "cuda" in st:
        torch.cuda.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(st["cuda"]), dtype=np.uint8).copy()))


def read_json(path, default=None):
    return rundir.read_json(path, default, error=TrainError)


def gpu_peak_flops(device_type, dtype="bfloat16"):
    """(card name, dense peak FLOP/s for the dtype the matmuls run in): bf16 autocast, or with --dtype=float32 TF32
    (enabled below), half the bf16 rate on every card listed (a float32 run's MFU was against the bf16 peak: half)."""
    import torch
    if os.environ.get("PICAFLOR_INJECT_PEAK_FLOPS"):  # a peak on any device: the MFU test on a CPU
        return "injected", float(os.environ["PICAFLOR_INJECT_PEAK_FLOPS"])
    if device_type != "cuda":
        return None, None
    name = torch.cuda.get_device_name()
    peak = card_peak(name)
    return name, (peak / 2 if dtype == "float32" else peak) if peak else None


def card_peak(name):
    """PEAK_BF16_FLOPS of the entry whose words are all words of the card's name ("NVIDIA A100-SXM4-80GB": A100), the
    one naming most of them (an H100 PCIe is no H100 SXM), or None."""
    words = set(re.findall(r"[A-Z0-9]+", name.upper()))
    found = [(len(key.split()), peak) for key, peak in PEAK_BF16_FLOPS if set(key.upper().split()) <= words]
    return max(found)[1] if found else None


def process_age_s():
    """Seconds since this process started (Linux's /proc/self/stat: the interpreter's start and imports before main
    are rented seconds too), or 0 where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def spent(before, leg_s, gpu_hourly_usd, world):
    """(elapsed_seconds, usd_spent) of a run whose earlier starts left before = (elapsed, usd), after leg_s seconds of
    this start (its start-up included) at its own price and world size."""
    return before[0] + leg_s, before[1] + gpu_hourly_usd * world * leg_s / 3600


def eta_seconds(tokens_left, pace):
    """Seconds to train tokens_left at pace = (tokens, seconds) this start trained them in (its evaluations and saves
    included: they recur), or None. The run's whole history (tokens / elapsed_seconds) lagged: a leg on a faster GPU
    took the earlier legs' slower rate, and their start-ups."""
    tokens, seconds = pace
    return tokens_left * seconds / tokens if tokens > 0 and seconds > 0 else None


def memory_plan(cfg, mcfg, n_params, world, device_type):
    """Bytes per process: fp32 params + grads + AdamW moments, plus an activation estimate for the largest
    stage (bf16 under autocast on GPU, else fp32; attention via SDPA so no T^2 term). Returns (total, parts dict)."""
    T = max([s.get("seq_len", cfg["seq_len"]) for s in cfg["stages"]] + [cfg["seq_len"]])
    B = cfg["batch_size"]
    act_bytes = 2 if device_type == "cuda" and cfg["dtype"] != "float32" else 4  # (--dtype=float32: no autocast)
    d, k, F, Fs = mcfg.d_model, mcfg.top_k, mcfg.expert_ffn, mcfg.n_shared * mcfg.expert_ffn
    kv = mcfg.n_kv_head * mcfg.head_dim
    attn = 6 * d + 2 * kv + 2 * d                     # norms, q/k/v/o inputs and outputs, residual
    dense = 3 * mcfg.dense_ffn + 2 * d
    moe = k * (2 * d + 4 * F) + 4 * Fs + 3 * d        # gathered tokens, gate/up/act per slot, shared expert
    per_token = mcfg.n_dense_layers * (attn + dense) + (mcfg.n_layer - mcfg.n_dense_layers) * (attn + moe)
    parts = {"params": 4 * n_params, "grads": 4 * n_params, "adamw": 8 * n_params,
             "activations": B * T * per_token * act_bytes + B * T * mcfg.vocab_size * 4 * 3}
    return sum(parts.values()), parts


def device_memory(device_type):
    import torch
    if device_type == "cuda":
        return torch.cuda.mem_get_info()[1]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -----------------------------------------------------------------------------------------------------------
# durability: metrics file, what a crash says to do next (the hang watchdog and crash reports: faults.py)

def source_state(ck, flag):
    """A grow / finetune source's state.json, which must say its model_config (without one: a TypeError traceback,
    exit 10, which the guardian restarted)."""
    st = read_json(os.path.join(ck, "state.json"), None)
    if not isinstance(st, dict) or not isinstance(st.get("model_config"), dict):
        raise TrainError(f"{ck}: no state.json with a model_config (not a checkpoint train.py wrote); pass another "
                         f"--{flag}")
    return st


def metrics_cut(f, size, resumed_step):
    """The offset in metrics.jsonl (open as f, of size bytes) where its rows past resumed_step begin: after its last
    row at or before that step, found reading back from the end (rows are in step order: each start moves those past
    its step away before it appends; reading all 1M rows of a long run took a minute and 800 MB at every start)."""
    pos, first = size, b""  # first: the start of a line that a later block's first line continued
    while pos > 0:
        n = min(1 << 16, pos)
        pos -= n
        f.seek(pos)
        block = f.read(n) + first
        lines = block.split(b"\n")
        first, end = (lines.pop(0) if pos > 0 else b""), pos + len(block)
        for line in reversed(lines):
            try:
                row_step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                row_step = None  # a line cut by a kill
            if isinstance(row_step, int) and row_step <= resumed_step:
                return min(end + 1, size)  # (its newline kept)
            end -= len(line) + 1
    return 0


def open_metrics(path, resumed_step):
    """Append mode. Rows past the step this start resumes (logged after the last checkpoint by a start that crashed,
    or by a timeline a rollback left) move to metrics.abandoned.jsonl: the steps are logged again, once each."""
    if os.path.isfile(path):
        with open(path, "r+b") as r:
            size = os.fstat(r.fileno()).st_size
            cut = metrics_cut(r, size, resumed_step)
            if cut < size:
                r.seek(cut)
                gone = [g for g in r.read().split(b"\n") if g.strip()]
                if gone:  # (on disk before they leave metrics.jsonl: a kill between left them in both, none lost)
                    with open(os.path.join(os.path.dirname(path), "metrics.abandoned.jsonl"), "ab") as a:
                        a.write(b"".join(g + b"\n" for g in gone))
                        a.flush()
                        os.fsync(a.fileno())
                r.truncate(cut)
                r.flush()
                os.fsync(r.fileno())
    return open(path, "a")


def add_to_metrics_row(path, step, fields, row=None):
    """Adds fields to the step's row of metrics.jsonl (its last one), or appends row with them when the file has none
    (a run dir without the earlier start's log); written as checkpoint.write_atomic writes (temp, fsync, rename). Rows
    before the step's are copied as they are (all 1M rows of a long run parsed took a minute)."""
    head, lines = b"", []
    if os.path.isfile(path):
        with open(path, "rb") as f:
            cut = metrics_cut(f, os.fstat(f.fileno()).st_size, step - 1)
            f.seek(0)
            head = f.read(cut)
            lines = f.read().splitlines()
    if head and not head.endswith(b"\n"):
        head += b"\n"
    at = None
    for i, line in enumerate(lines):
        try:
            d = json.loads(line)
        except ValueError:
            continue  # (a line cut by a kill)
        if isinstance(d, dict) and d.get("step") == step:
            at, row = i, d
    if row is None:
        row = {"step": step}
    row = {**row, **fields}
    if at is None:
        lines.append(json.dumps(row).encode())
    else:
        lines[at] = json.dumps(row).encode()
    import checkpoint
    checkpoint.write_atomic(path, head + b"".join(x + b"\n" for x in lines if x.strip()))


def relay_store_of(out_dir):
    """The store of the relay run a dir relay.py made trains for: a leg's LEG.json names it; "" for init's dir (only
    relay_config.py: its step 0 is committed, then the dir deleted); None: not relay.py's dir."""
    try:
        return str(json.load(open(os.path.join(out_dir, "LEG.json")))["store"])
    except (OSError, ValueError, KeyError, TypeError):
        return "" if os.path.isfile(os.path.join(out_dir, "relay_config.py")) else None


def resume_command(argv):
    """The command that resumes this run: this start's config files and overrides (an --out_dir=... left out resumed
    another run, or none), without how it began (--init_from, a rollback's --resume_from: it would roll back again)."""
    import shlex
    kept = [a for a in argv if not a.startswith(("--init_from=", "--resume_from="))]
    launcher = "python train.py" if int(os.environ.get("WORLD_SIZE") or 1) <= 1 else "torchrun ... train.py"
    supervised = bool(os.environ.get(rundir.LOCKED_OUT_ENV))  # the guardian started this one
    if supervised:  # its restarts append what is left of the stops, and its quarantine, after the user's own
        appended, first = ("--stop_after_steps", "--stop_after_hours", "--quarantine_shards", "--release_shards"), []
        for a in kept:
            key = a.split("=")[0]
            if key not in appended or key not in {b.split("=")[0] for b in first}:
                first.append(a)
        kept = first
    return f"{launcher} {shlex.join(kept + ['--init_from=resume'] + (['--supervise'] if supervised else []))}"


def reread_warning(corpus, corpus_dir, planned, total):
    """A plan longer than its corpus: said, with the script that makes more (index.json's: data/<corpus>/ holds none
    for a corpus prepared under another name)."""
    import shards
    made_by = shards.corpus_made_by(corpus_dir) or f"data/{corpus}/prepare.py"
    times = planned / total  # (1.03 said "read ~1.0 times", as if it were not read again)
    return (f"WARNING: the plan trains ~{planned:,.0f} tokens of {corpus}, which holds {total:,} train tokens: it is "
            f"read ~{times:.{1 if times >= 1.1 else 2}f} times; prepare more (python {made_by} --help) or plan fewer "
            f"tokens if that is not meant")


def reread_warnings(plan, tokens_seen, streams, data_root, before=None):
    """reread_warning of each corpus that the plan reads past its train tokens by its end: what its stream gave so far
    (its position: a --replan's stages need not say what trained before) plus its share of the plan from tokens_seen
    on. before: the plan an on-demand decay replaced (whose reads were said at the start): only a corpus read more."""
    def reads(p):
        out, start = {c: float(s.tokens_read) for c, s in streams.items()}, 0
        for s in p:
            left = min(s["tokens"], max(0, start + s["tokens"] - tokens_seen))
            for c, w in s["mix"].items():
                if c in out:  # (every corpus of the plan has its stream; a stray name is not this warning's to say)
                    out[c] += left * w / sum(s["mix"].values())
            start += s["tokens"]
        return out
    now, was = reads(plan), reads(before) if before is not None else {}
    return [reread_warning(c, os.path.join(data_root, c), n, streams[c].total_tokens) for c, n in sorted(now.items())
            if n > streams[c].total_tokens and n > was.get(c, -1)]


def next_step(out_dir):
    """How to go on from out_dir's checkpoint. In relay.py's dirs through relay.py: a train.py resume there trains
    steps the relay run never gets (its store holds the run)."""
    store = relay_store_of(out_dir) if out_dir else None
    if store:
        return (f"a leg of the relay run {store}: relay.py pushes it (`relay.py run` does, or `relay.py push` after a "
                f"manual `relay.py pull`); the next leg: `python relay.py run {store} --hours H`")
    if store == "":
        return "relay.py init commits this checkpoint as the run's start; then `python relay.py run STORE --hours H`"
    argv = _RUN_INFO.get("argv")
    return f"resume with: {resume_command(argv)}" if argv is not None else "resume with --init_from=resume"


def crashed(e):
    """An unforeseen error: its traceback kept (stderr, crash report), one line saying so, exit 10 (restartable)."""
    import traceback
    tb = traceback.format_exc()
    sys.stderr.write(tb)
    write_crash_report("crash", EXIT_CRASH, f"{type(e).__name__}: {e}", traceback=tb)
    die(f"unexpected {type(e).__name__}: {e} (traceback above and in {_RUN_INFO.get('out_dir') or 'out_dir'}'s "
        f"crash report); checkpoints are intact: {next_step(_RUN_INFO.get('out_dir'))}", EXIT_CRASH)


def undo_fresh_run_dir():
    """A start refused for a config mistake in an out_dir this process made: the folder goes again (its lock file and
    crash report made the fixed command's run dir look like a run that had crashed). Anything else in it: kept."""
    out, made = _RUN_INFO.get("out_dir"), _RUN_INFO.get("out_made_from")
    if not (out and made and os.path.isdir(out)):
        return
    names = os.listdir(out)
    if not all(n == ".trainer.lock" or (n.startswith("crash-") and n.endswith(".json")) for n in names):
        return
    try:  # the lock file goes while still held: a trainer waiting on it then sees it deleted and makes its own
        for n in names:
            os.remove(os.path.join(out, n))
        out = os.path.abspath(out)
        while True:  # out_dir=out/sft made out/ too
            os.rmdir(out)
            if out == made:
                break
            out = os.path.dirname(out)
    except OSError:
        pass  # (another process wrote there meanwhile: it stays)
    finally:
        if _RUN_INFO.get("lock") is not None:
            os.close(_RUN_INFO.pop("lock"))


# -----------------------------------------------------------------------------------------------------------

def split_flags(argv):
    """train.py's flags that are not config keys, apart (the guardian reads the config the same way):
    ({"--replan": bool}, the other arguments, --mirror DIR / --mirror=DIR as --mirror_dir=DIR)."""
    flags, rest, args = {"--replan": False}, [], list(argv)
    while args:
        a = args.pop(0)
        if a in flags:
            flags[a] = True
        elif a == "--mirror" or a.startswith("--mirror="):
            d = a.partition("=")[2] or (args.pop(0) if args else "")
            if not d:
                die("usage: --mirror DIR")
            rest.append(f"--mirror_dir={d}")
        else:
            rest.append(a)
    return flags, rest


def check_config(cfg):
    """The config's values refused before the run dir is touched and torch is imported, each in one line naming
    the flag and the fix (exit 1): a key the start does not read, and values that would fail later or silently
    train something else."""
    if cfg["resume_from"] and cfg["init_from"] != "resume":  # (it trained a fresh model, the flag unread)
        die(f"--resume_from={cfg['resume_from']} is read only with --init_from=resume (init_from is "
            f"{cfg['init_from']!r}); add --init_from=resume")
    # as resume_from: the other start's keys went unread (a fresh model trained; a fine-tune asked to grow did not;
    # a grow given finetune_from was taken by chat.py for a chat model); a resume keeps them (config/sft.py and
    # config/grow.py are reused to resume). grow_where: only another than its default (a config written from a
    # checkpoint's saved config holds every key)
    for k, mode in (("finetune_from", "finetune"), ("grow_from", "grow"), ("grow_layers", "grow"), ("grow_where", "grow")):
        if cfg["init_from"] not in (mode, "resume") and (cfg[k] != "interleave" if k == "grow_where" else cfg[k]):
            die(f"--{k}={cfg[k]} is read only with --init_from={mode} (init_from is {cfg['init_from']!r}); add "
                f"--init_from={mode}, or drop --{k}")
    for k, fix in (("out_dir", "a run directory"), ("dataset", "a corpus folder under data_root")):
        if not cfg[k].strip():  # (an empty out_dir was a traceback; an empty dataset read data/index.json)
            die(f"--{k} is empty; pass {fix}")
    in_the_way = rundir.file_in_the_way(cfg["out_dir"])
    if in_the_way:
        die(f"--out_dir={cfg['out_dir']}: {in_the_way} is a file, not a folder; pass a run directory")
    if cfg["init_from"] not in ("scratch", "resume", "grow", "finetune"):  # before the run dir is touched
        die(f"--init_from={cfg['init_from']}: must be scratch, resume, grow or finetune")
    if cfg["grow_where"] not in ("interleave", "top"):
        die(f"--grow_where={cfg['grow_where']}: must be interleave or top")
    # optimiser values torch refuses only at step 0 (a traceback the guardian took for a crash and restarted)
    if not (math.isfinite(cfg["learning_rate"]) and cfg["learning_rate"] > 0):
        die(f"--learning_rate={cfg['learning_rate']}: must be a finite number > 0")
    if not 0 <= cfg["min_lr"] <= cfg["learning_rate"]:
        die(f"--min_lr={cfg['min_lr']}: must be in [0, learning_rate={cfg['learning_rate']}]")
    for k in ("beta1", "beta2"):
        if not 0 <= cfg[k] < 1:
            die(f"--{k}={cfg[k]}: must be in [0, 1)")
    for k in ("weight_decay", "grad_clip", "warmup_iters", "decay_tokens"):
        if not cfg[k] >= 0:  # (a negative warmup or decay trained a longer plan without one)
            die(f"--{k}={cfg[k]}: must be >= 0")
    if not 0 <= cfg["decay_frac"] <= 1:
        die(f"--decay_frac={cfg['decay_frac']}: must be in [0, 1]")
    for k in ("eval_interval", "log_interval", "ckpt_interval", "max_iters"):
        if cfg[k] < 1:
            die(f"--{k}={cfg[k]}: must be at least 1 (a large value means rarely)")
    for k in ("batch_size", "grad_accum", "eval_iters"):
        if cfg[k] < 1:
            die(f"--{k}={cfg[k]}: must be at least 1")
    if set(cfg["lr_mult"]) - {"embedding", "old", "new"}:  # a misspelt key would leave its group at 1.0
        die(f"--lr_mult={cfg['lr_mult']}: keys must be embedding, old and new, got "
            f"{sorted(set(cfg['lr_mult']) - {'embedding', 'old', 'new'})}")
    if any(v < 0 or not math.isfinite(v) for v in cfg["lr_mult"].values()):
        die(f"--lr_mult={cfg['lr_mult']}: multipliers must be finite and >= 0 (0 freezes a group)")
    for k in ("quarantine_shards", "release_shards"):
        if not all(isinstance(n, str) and n.count("/") == 1 for n in cfg[k]):
            die(f"--{k}={cfg[k]!r}: a list of \"corpus/file\" names, e.g. \"['local/train_000003.bin']\"")
    if cfg["init_from"] == "scratch" and cfg["top_k"] == 1 and cfg["n_dense_layers"] < cfg["n_layer"]:
        # (it trained: the router's weights moved only by weight decay and Adam's epsilon, its picks at random)
        die("--top_k=1: the router gets no gradient (a lone pick's weight, normalised over the top-k, is always "
            "route_scale), so it never learns; train with --top_k=2 and serve top-1 with --experts-per-token 1")
    if cfg["device"] not in ("cpu", "cuda"):  # cuda:1 or mps would have trained on the CPU
        die(f"--device={cfg['device']}: must be cpu or cuda (pick a GPU with CUDA_VISIBLE_DEVICES; torchrun gives "
            f"each process its own)")
    if cfg["dtype"] == "float16" and cfg["device"] == "cuda":
        die("--dtype=float16 needs loss scaling, which train.py does not do (gradients would underflow); use "
            "--dtype=bfloat16")


def main(argv):
    # this start's clock: stop_after_hours and $ / elapsed count its start-up too (a leg's rented hours: loading a
    # checkpoint, building the model); durations on the monotonic clock (a wall-clock step, NTP, made them negative)
    t_invoked = time.monotonic() - process_age_s()
    _RUN_INFO["argv"] = list(argv)  # for the resume command the last line names
    import configurator
    import checkpoint

    g = {k: globals()[k] for k in _CONFIG_KEYS}
    if any(a in ("-h", "--help") for a in argv) and any(a.startswith("--status") for a in argv):
        print("usage: python train.py --status RUN_DIR   (the plan against progress, the LR, time and cost left; "
              "whether a trainer runs it now, and its newest logged step)")
        return  # (--status is no config key: the config help below refused it)
    if any(a in ("-h", "--help") for a in argv):  # with the config files and overrides given applied (their values)
        applied = split_flags([a for a in argv if a not in ("-h", "--help")])[1]
        configurator.configure_or_exit(g, applied, "train.py")
        print(configurator.help_text(g, __doc__, "train.py", applied))
        return
    flags, rest = split_flags(argv)
    if rest[:1] == ["--status"] or (rest and rest[0].startswith("--status")):
        run_dir = rest[1] if rest[0] == "--status" and len(rest) > 1 else rest[0].partition("=")[2]
        if not run_dir:
            die("usage: python train.py --status RUN_DIR")
        return print_status(run_dir)
    given = configurator.configure_or_exit(g, rest, "train.py")
    stages_at = max((i for i, (k, _) in enumerate(given) if k == "stages"), default=-1)
    ignored = [(k, src) for i, (k, src) in enumerate(given) if k in unused_with_stages(g)
               and (src is None or i > stages_at or src == given[stages_at][1])]
    if ignored:  # the stages make the plan: these would silently do nothing (set before the stages' file, overridden)
        k, src = ignored[0]
        die(f"{'--' + k if src is None else f'{k} (in {src})'} has no effect when the config sets stages; change the "
            f"stages' steps or tokens (and lr_phase) instead")
    # dataset as the keys above: given on the command line, after the stages or beside them (tiny.py's before a
    # stages file of other corpora is no mistake of this start)
    dataset_src = [src for i, (k, src) in enumerate(given) if k == "dataset"
                   and (src is None or i > stages_at or src == given[stages_at][1])][-1:]
    mixed = sorted({c for s in g["stages"] if isinstance(s, dict) and isinstance(s.get("mix"), dict) for c in s["mix"]})
    if (dataset_src and g["init_from"] != "resume" and g["stages"] and g["dataset"] not in mixed
            and all(isinstance(s, dict) and "mix" in s for s in g["stages"])):  # (a resume: resume_changes refuses it)
        src = "" if dataset_src[0] is None else f" (in {dataset_src[0]})"
        die(f"{'--' if not src else ''}dataset={g['dataset']!r}{src} is read by no stage: every stage's mix names its "
            f"corpora ({', '.join(mixed)}); drop it, or put {g['dataset']!r} in the stages' mix")
    given = {k for k, _ in given}
    globals().update(g)
    cfg = g
    check_config(cfg)

    import torch  # after the config's checks: a bad flag is refused before seconds of imports
    import torch.distributed as dist
    import shards
    from model import Picaflor, load_stats

    # --- processes and device -----------------------------------------------------------------------------
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world, local_rank = 0, 1, 0
    dev = cfg["device"]
    if dev == "cuda" and not torch.cuda.is_available():
        die("device=cuda but no CUDA GPU is visible; pass --device=cpu (and --dtype=float32) to train on the CPU")
    if ddp:
        rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        import datetime  # the other ranks wait in their first collective while rank 0 waits for the run's lock
        dist.init_process_group(backend="nccl" if dev == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=max(1800.0, cfg["lock_wait_s"] + 1200.0)))
        if dev == "cuda":
            torch.cuda.set_device(local_rank)
        # the ranks' wait for rank 0's save (a mirror copy of a big checkpoint outlasts the default group's timeout):
        # polled on a group of its own with no practical timeout; rank 0's watchdog still catches a stalled save
        save_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))
    device = f"cuda:{local_rank}" if dev == "cuda" else "cpu"
    device_type = "cuda" if dev == "cuda" else "cpu"
    master = rank == 0
    log = print_or_detach if master else (lambda *a, **k: None)
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg["dtype"])
    if ptdtype is None:
        die(f"dtype must be float32, bfloat16 or float16, got {cfg['dtype']!r}")
    autocast = (torch.autocast(device_type="cuda", dtype=ptdtype) if device_type == "cuda" and ptdtype != torch.float32
                else nullcontext())
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = cfg["out_dir"]
    # a fault before the loop gets its crash report too (a config mistake in an out_dir made here: undo_fresh_run_dir)
    made = os.path.abspath(out) if master and not os.path.exists(out) else None  # the top folder a makedirs adds
    while made and not os.path.exists(os.path.dirname(made)):
        made = os.path.dirname(made)
    _RUN_INFO.update(out_dir=out, master=master, out_made_from=made)
    tokens_per_step = lambda T: cfg["batch_size"] * T * cfg["grad_accum"] * world

    def config_wins(stored, how):
        """The checkpoint's architecture, but the training-only fields (a longer context, another balancing rate) from
        the config where it sets them (a config file or --key=value), else the checkpoint's."""
        wins = {k: cfg[k] for k in RESUME_CONFIG_WINS if k in given or k not in stored}
        for k, v in wins.items():
            if k in stored and stored[k] != v:
                log(f"{how}: {k} {stored[k]} -> {v} (the config's)")
        # a field the checkpoint decides, set otherwise (--top_k=1 on a resume): said, not silently ignored
        # (a grow's n_layer is the checkpoint's plus grow_layers; its other fields were dropped unsaid: --n_experts=4)
        for k in sorted(given & set(stored) - set(RESUME_CONFIG_WINS) - ({"n_layer"} if how == "grow" else set())):
            if stored[k] != cfg[k]:
                log(f"WARNING: {how}: {k}={cfg[k]!r} ignored; the checkpoint's {stored[k]!r} stays (the architecture "
                    f"comes from the checkpoint)")
        return wins

    def check_mirror():
        """A mirror that cannot work is refused now, not found out hours in (a resume: a warning)."""
        probe = os.path.join(cfg["mirror_dir"], f".probe-{os.getpid()}")
        try:
            os.makedirs(cfg["mirror_dir"], exist_ok=True)
            open(probe, "w").close()
            os.remove(probe)
        except OSError as e:
            if not checkpoint.list_checkpoints(out):
                raise TrainError(f"mirror_dir {cfg['mirror_dir']} is not writable ({e.strerror}); mount it, or pass "
                                 f"another --mirror_dir (or none)")
            # a resume (a guardian's restart in a bucket mount's blip): as a failed copy mid-run, a warning
            log(f"WARNING: mirror_dir {cfg['mirror_dir']} is not writable now ({e.strerror}); training goes on, "
                f"{out} holds every checkpoint")
            return
        created_at = None  # a new run (scratch, grow, finetune): its own created_at comes with its state below
        if cfg["init_from"] == "resume":
            try:
                ck_ = checkpoint.resolve(cfg["resume_from"]) if cfg["resume_from"] else checkpoint.latest_valid(out)
                st_ = rundir.read_json(os.path.join(ck_, "state.json"), None) if ck_ else None
            except (OSError, RunDirError, checkpoint.CheckpointError):
                st_ = None
            if not isinstance(st_, dict) or "created_at" not in st_:
                return  # nothing to resume, or no state: prepare_run_dir says so in its own words
            created_at = st_["created_at"]
        why = rundir.mirror_owner_error(cfg["mirror_dir"], out, created_at)
        if why:  # its retention deleted the other run's steps, its copies overwrote that run's logs
            raise TrainError(why)

    # --- state: scratch | resume | grow -------------------------------------------------------------------
    state, sd, opt_sd, layer_origin, ck = None, None, None, None, None
    mcfg = model_config_from(cfg)
    # rank 0 alone takes the run's lock, sets the run dir right (put back, set aside) and picks the checkpoint; every
    # rank resumes that one (each picking its own, a SIGTERM checkpoint landing meanwhile had ranks resume different
    # steps), and every rank stops with rank 0's error, whatever it is (else they waited in their first collective)
    # from here on a hang is caught (3x hang_timeout before the first step): a checkpoint or index read from a
    # stalled mount, or a compile that never returned, left the guardian waiting for ever
    watchdog = Watchdog(cfg["hang_timeout"], out, master)
    failure, source = None, None
    if master:
        try:
            if _RUN_INFO.get("lock") is not None:  # an earlier main() of this process (a test, a notebook) is over
                os.close(_RUN_INFO.pop("lock"))
            _RUN_INFO["lock"] = hold_run_lock(out, cfg["lock_wait_s"], log, alive=watchdog.alive)
            if cfg["mirror_dir"]:
                check_mirror()
            ck = prepare_run_dir(cfg, out, log)
            source = source_checkpoint(cfg)
        except Exception as e:
            failure = e
    if ddp:  # as bytes in a tensor: broadcast_object_list unpickles what another machine sent
        code, msg = 0, None
        if failure is not None:  # (ours say what is wrong in one line; anything else is named by its type too)
            code = failure.code if isinstance(failure, TrainError) else EXIT_ERROR
            ours = isinstance(failure, (TrainError, RunDirError, checkpoint.CheckpointError))
            msg = str(failure) if ours else f"{type(failure).__name__}: {failure}"
        data = json.dumps([ck, source, msg, code]).encode() if master else b""
        n = torch.tensor([len(data)], dtype=torch.int64, device=device)
        work = dist.broadcast(n, 0, async_op=True)
        while not work.is_completed():  # rank 0's lock wait is no hang here either (its watchdog sees a stalled mount)
            watchdog.alive()
            time.sleep(0.05)
        work.wait()
        buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if master
               else torch.zeros(int(n.item()), dtype=torch.uint8, device=device))
        dist.broadcast(buf, 0)
        ck, source, msg, code = json.loads(bytes(buf.cpu().tolist()).decode())
        if msg and not master:
            raise TrainError(f"rank 0: {msg}", code)
    if failure is not None:
        raise failure
    if cfg["init_from"] == "resume":
        state = read_json(os.path.join(ck, "state.json"))
        if not isinstance(state, dict) or not isinstance(state.get("model_config"), dict):
            raise TrainError(f"{ck}/state.json: no model_config in it (not a checkpoint train.py wrote); resume "
                             f"another checkpoint (--resume_from=STEP_DIR)")
        stored = stored_model_config(ck, state)
        mcfg = model_config_from({**cfg, **stored, **config_wins(stored, "resume")})
        check_resume_state(ck, state, mcfg.n_layer)
        sd = load_weights(ck, mcfg)
        if os.path.exists(os.path.join(ck, "optimizer.pt")):
            try:  # (its manifest verified: damaged before it was written, or the manifest rewritten) an EOFError /
                # UnpicklingError traceback, exit 10, which the guardian restarted into the same crash
                opt_sd = torch.load(os.path.join(ck, "optimizer.pt"), map_location="cpu", weights_only=True)
            except (EOFError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
                raise TrainError(f"{ck}/optimizer.pt: not a readable optimizer state ({type(e).__name__}: "
                                 f"{(str(e).splitlines() or [''])[0][:100]}); resume another checkpoint "
                                 f"(--resume_from=STEP_DIR)") from None
        else:  # (train.py always writes one: a checkpoint made by hand, or by another tool)
            log(f"WARNING: {ck} has no optimizer.pt: AdamW starts fresh (its moments at zero), not an exact resume")
        layer_origin = state["layer_origin"]
        # what the resume brings back, in one line (field reports asked whether it really loaded the optimizer)
        positions = ", ".join(f"{c} shard {p['shard']} offset {p['offset']:,}"
                              for c, p in (state.get("data_position") or {}).items())
        loaded = (["weights"] + ["AdamW state"] * (opt_sd is not None) + ["RNG state"] * ("rng" in state)
                  + [f"data position ({positions})"] * bool(positions))
        log(f"resuming from {ck} at step {state['step']}, {state['tokens']:,} tokens: {', '.join(loaded)}")
    elif cfg["init_from"] == "grow":
        ck = source  # resolved by rank 0 for every rank
        src_state = source_state(ck, "grow_from")
        from model import ModelConfig
        old = ModelConfig.from_dict(stored_model_config(ck, src_state))
        sd, layer_origin = grow_state_dict(load_weights(ck, old), old, cfg["grow_layers"], cfg["grow_where"])
        mcfg = ModelConfig.from_dict({**asdict(old), "n_layer": old.n_layer + cfg["grow_layers"],
                                      **config_wins(src_state["model_config"], "grow")})
        log(f"growing {ck}: {old.n_layer} -> {mcfg.n_layer} layers (new blocks start as identity)")
        mult = {k: float(cfg["lr_mult"].get(k, 1.0)) for k in ("embedding", "old", "new")}
        if mult["old"] >= mult["new"]:  # field report: 1B -> 2B at one LR spiked the loss 14% for thousands of steps
            log(f"WARNING: growing with lr_mult {mult}: the old layers' LR is not below the new ones' (one LR spiked a "
                f"grown model's loss for thousands of steps); set e.g. --lr_mult=\"{{'embedding': 0.3, 'old': 0.1, "
                f"'new': 1.0}}\" (config/grow.py)")
    elif cfg["init_from"] == "finetune":
        ck = source
        src_state = source_state(ck, "finetune_from")
        stored = stored_model_config(ck, src_state)
        mcfg = model_config_from({**cfg, **stored, **config_wins(stored, "finetune")})
        sd = load_weights(ck, mcfg)
        layer_origin = src_state.get("layer_origin") or ["new"] * mcfg.n_layer
        log(f"fine-tuning from {ck} (step {src_state.get('step')}); fresh optimizer and plan")
    elif cfg["init_from"] != "scratch":
        raise TrainError(f"init_from must be scratch, resume, grow or finetune, got {cfg['init_from']!r}")

    # --- data ----------------------------------------------------------------------------------------------
    try:
        plan = build_plan(cfg, tokens_per_step, refuse_short=state is None or flags["--replan"])
    except PlanError as e:
        raise TrainError(str(e)) from None
    if state is None and (note := no_decay_note(cfg)):  # (a resume keeps its stored plan: said at its start)
        log(note)
    if state is not None:
        stored = state["plan"]
        if changes := plan_changes(state, cfg):
            if not flags["--replan"]:
                raise TrainError(f"the config's plan differs from the plan stored in {os.path.join(ck, 'state.json')} "
                                 f"({'; '.join(changes)}); pass --replan to adopt the new plan, or use the run's "
                                 f"original config")
            log(f"REPLAN: adopting the config's plan ({'; '.join(changes)}; the old one stays in state.json's replans)")
            if state.get("decay_started_at_tokens") is not None and any(is_on_demand(s) for s in stored):
                # a started decay is history (control.json cannot start a second one): resume a step before it to drop
                # it; all its stages, as they were (a decay copied from one over several stages lost all but the first)
                plan = keep_on_demand_decay(plan, stored)
                log(f"REPLAN: the on-demand decay started at {state['decay_started_at_tokens']:,} tokens stays in the "
                    f"new plan; to train without it, resume a checkpoint from before it")
            state.setdefault("replans", []).append({"step": state["step"], "old": stored, "new": plan, "at": time.time()})
            # a finished (decayed) run extended by a stable stage went from min_lr straight back to the peak, unsaid
            was, now = (lr_at(p, state["tokens"], cfg["learning_rate"], cfg["min_lr"]) for p in (stored, plan))
            if now > 2 * was:
                log(f"WARNING: REPLAN: the next step trains at lr {now:.2e}, the old plan's was {was:.2e} ({now / was:.0f}x "
                    f"at once: expect a loss spike); to climb back, start the new stages with one of lr_phase='warmup'")
        else:
            plan = stored
        for s in plan:  # stages that do not pin a seq_len follow the config's, so it may change on resume
            if s.get("seq_len_from_config"):
                s["seq_len"] = cfg["seq_len"]
        # another step size (batch_size, grad_accum, world size, seq_len): steps straddled stage boundaries (on the
        # earlier stage's mix and LR) and skipped a stage shorter than a step, while the stored plan said otherwise
        aligned = align_plan(plan, state["tokens"], tokens_per_step)
        if aligned != plan:
            rows = cfg["batch_size"] * cfg["grad_accum"] * world
            log(f"resume: the step size changed (now {rows} rows of seq_len a step: batch_size x grad_accum x world"
                f" size {world}): the plan's remaining stages are rounded to whole steps: " + ", ".join(
                    f"{a['name']} {b['tokens']:,} -> {a['tokens']:,}" for a, b in zip(aligned, plan) if a != b)
                + f" tokens (the plan ends at {plan_tokens(aligned):,}, planned {plan_tokens(plan):,})")
            plan = aligned
        for line in resume_changes(ck, state, cfg, plan, tokens_per_step, given):
            log(line)
    for s in plan:  # RoPE has no learned positions: a longer max_seq_len only needs saying
        if s["seq_len"] > mcfg.max_seq_len:
            raise TrainError(f"stage {s['name']} trains on seq_len {s['seq_len']}, longer than the model's max_seq_len="
                             f"{mcfg.max_seq_len}; raise --max_seq_len or lower the stage's seq_len")
    corpora = sorted({c for s in plan for c in s["mix"]})
    quarantined = sorted((set(cfg["quarantine_shards"]) | set((state or {}).get("quarantined_shards", [])))
                         - set(cfg["release_shards"]))
    streams, val_stream, indexes = {}, None, {}
    for c in corpora:
        cdir = os.path.join(cfg["data_root"], c)
        # a corpus for a run that starts from weights must be tokenized by their tokenizer (smoltalk requires it)
        tok_arg = f" --tokenizer {ck}" if ck and os.path.isfile(os.path.join(ck, "tokenizer.json")) else ""
        # (a prepare's default --out is data/<corpus>, not data_root's)
        out_arg = f" --out {cdir}" if os.path.normpath(cdir) != os.path.join("data", c) else ""
        if not os.path.isdir(cdir):
            known = sorted(d for d in os.listdir(cfg["data_root"])) if os.path.isdir(cfg["data_root"]) else []
            raise TrainError(f"dataset {c!r}: no folder {cdir}; run python data/{c}/prepare.py{tok_arg}{out_arg} first"
                             + (f" (corpora here: {', '.join(known)})" if known else ""))
        try:
            indexes[c] = shards.load_index(cdir)
        except shards.DataError as e:  # a folder with no corpus prepared in it: a config mistake, not corrupt data
            if e.kind != "missing":
                raise
            raise TrainError(f"dataset {c!r}: {e}" + (f" (with{tok_arg}: the weights' tokenizer)" if tok_arg else "")
                             ) from None
        if master and (note := shards.interrupted_prepare(cdir)):
            log(f"WARNING: {note}")
        if indexes[c].get("vocab_size", 0) > mcfg.vocab_size:  # a config mistake, not corrupt data (no restart)
            # (from weights, the vocab is theirs: "set --vocab_size" was ignored, and said the same again)
            fix = (f"set --vocab_size={indexes[c]['vocab_size']}" if cfg["init_from"] == "scratch" else
                   f"the weights of {ck} fix the vocab; train on a corpus made by their tokenizer (python "
                   f"data/{c}/prepare.py{tok_arg} --out DIR, then --data_root and --dataset)")
            raise TrainError(f"corpus {c} has vocab_size {indexes[c]['vocab_size']} > model vocab_size "
                             f"{mcfg.vocab_size}; {fix}")
    for q in list(quarantined):  # a mistyped name quarantined nothing while the log said it was skipped
        c, _, f = q.partition("/")
        if not f:
            raise TrainError(f"quarantine_shards: {q!r} is not corpus/file, e.g. '{corpora[0]}/train_000000.bin'")
        listed = sorted(e["file"] for sp in indexes[c]["splits"].values() for e in sp) if c in indexes else None
        if listed is None or f in listed:  # (a corpus outside this plan: kept for when it comes back)
            continue
        if q not in cfg["quarantine_shards"]:
            # the checkpoint's, a shard when it was saved: the corpus was prepared again without it (this refused the
            # resume, naming a quarantine, before the position check could say what changed)
            log(f"WARNING: {q} was quarantined by the checkpoint but {c}'s index.json no longer lists it (the corpus "
                f"was prepared again); dropped from the quarantine")
            quarantined.remove(q)
        else:
            raise TrainError(f"quarantine_shards: {q!r} is not a shard of {c} (its index.json lists "
                             f"{listed[0] + ' .. ' + listed[-1] if listed else 'none'}); fix the name, or drop it "
                             f"with --release_shards=\"['{q}']\"")
    skip_of = {c: [q.split("/", 1)[1] for q in quarantined if q.startswith(c + "/")] for c in corpora}
    for c in corpora:
        if skip_of[c]:
            log(f"WARNING: QUARANTINED shards of {c} are skipped: {', '.join(skip_of[c])} (see guardian.json; a fixed "
                f"shard comes back with --release_shards=\"['{c}/{skip_of[c][0]}']\")")
        streams[c] = shards.TokenStream(os.path.join(cfg["data_root"], c), "train", vocab_size=mcfg.vocab_size,
                                        skip_shards=skip_of[c])
    first = plan[0]["mix"]
    val_corpus = max(sorted(first), key=lambda c: first[c])
    val_stream, no_val_note = open_val_stream(os.path.join(cfg["data_root"], val_corpus), mcfg.vocab_size,
                                              skip_of[val_corpus])  # None: no val loss, said once below
    index = indexes[val_corpus]
    tokenizer_file = os.path.join(cfg["data_root"], val_corpus, index.get("tokenizer", "tokenizer.json"))
    if index.get("tokenizer_sha256"):  # (copied into every checkpoint below)
        # another corpus's tokenizer.json: export, eval and chat decoded with it (DataError, kind "tokenizer"); a
        # missing one: every checkpoint lacked a tokenizer, silently
        shards.load_corpus_tokenizer(os.path.join(cfg["data_root"], val_corpus), index)
    # one tokenizer for every corpus of the plan and for the weights: token ids mean nothing across tokenizers, and a
    # corpus prepared again (a new tokenizer by default) silently retrained a resumed run on other meanings
    tok_of = {c: indexes[c].get("tokenizer_sha256") for c in corpora}
    if len(set(tok_of.values())) > 1:
        raise TrainError("the plan's corpora were tokenized with different tokenizers (" + ", ".join(
            f"{c} {h[:12]}" for c, h in sorted(tok_of.items())) + "); prepare them with one: --tokenizer FILE")
    src_tok = os.path.join(ck, "tokenizer.json") if ck else None
    if src_tok and os.path.isfile(src_tok) and tok_of[val_corpus]:
        had = checkpoint.sha256_file(src_tok)
        if had != tok_of[val_corpus]:
            raise TrainError(f"{cfg['data_root']}/{val_corpus} was tokenized with tokenizer {tok_of[val_corpus][:12]}, "
                             f"but {ck} was trained with {had[:12]} (its tokenizer.json); prepare the corpus again "
                             f"with --tokenizer {src_tok}, or start a new run")
    # packed SFT rows hold several conversations, each starting with <|bos|>: without a mask one attended to the
    # conversations packed before it in its row, which it never sees when served
    doc_bos = pad_bos = None
    masked = sorted(c for c in corpora if indexes[c].get("loss_mask"))
    if masked:  # <|bos|>: each packed conversation's start, and the padding after a row's last one
        pad_bos = shards.load_corpus_tokenizer(os.path.join(cfg["data_root"], masked[0]), indexes[masked[0]]).bos_id
    if cfg["doc_mask"] and masked:
        doc_bos = pad_bos
        log(f"doc_mask: each conversation packed in {', '.join(masked)}'s rows attends only to itself "
            f"(--doc_mask=False: to the whole row)")

    def doc_ids_of(x, masked):
        """model's doc_ids for rows of one corpus: a loss-masked one's split at each <|bos|>, another's one document."""
        return (x == doc_bos).cumsum(1) if masked else torch.zeros_like(x)
    idle_positions = {}  # a corpus a --replan dropped keeps its place: a later plan that brings it back goes on from there
    if state is not None:
        saved_splits = state.get("data_split_sha") or {}
        for c, pos in state.get("data_position", {}).items():
            if c in streams:
                streams[c].set_position(pos, saved_splits.get(c))
            else:
                idle_positions[c] = (pos, saved_splits.get(c))
                log(f"corpus {c} is not in this plan; its position is kept for a plan that trains on it again")
    # a plan longer than its data repeats it: said, not silent (positions wrap into epoch + 1); from the positions, as
    # a --replan's stages before them need not be what was read (a re-read with none of its own tokens left was unsaid)
    for line in reread_warnings(plan, state["tokens"] if state is not None else 0, streams, cfg["data_root"]):
        log(line)

    # --- model and optimizer ------------------------------------------------------------------------------
    if device_type == "cpu":
        from model import tune_cpu_malloc
        tune_cpu_malloc()  # glibc keeps freed expert-grad blocks for reuse instead of page-faulting them each step
    torch.manual_seed(cfg["seed"] + rank)
    with torch.device(device):
        model = Picaflor(mcfg)
    if sd is not None:
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if not (mcfg.tie_embeddings and m == "lm_head.weight") and not m.endswith("load_accum")]
        if missing or unexpected:
            raise TrainError(f"checkpoint weights do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if layer_origin is None:
        layer_origin = ["new"] * mcfg.n_layer
    n_params = model.num_params()
    need, parts = memory_plan(cfg, mcfg, n_params, world, device_type)
    have = device_memory(device_type)
    log(f"model: {n_params / 1e6:.1f}M params, {model.active_params() / 1e6:.1f}M active per token; memory plan per "
        f"process: " + ", ".join(f"{k} {fmt_size(v)}" for k, v in parts.items()) + f" = {fmt_size(need)}"
        + (f" of {fmt_size(have)}" if have else ""))
    if device_type != "cuda" and ptdtype != torch.float32:  # (a bfloat16 config on a CPU trained fp32 without a word)
        log(f"dtype {cfg['dtype']}: autocast runs on CUDA only; this {device_type} run computes in float32 "
            f"(--dtype=float32 says so)")
    if have and need > 0.95 * have:
        raise TrainError(f"memory plan {fmt_size(need)} exceeds the {fmt_size(have)} of {device}: lower batch_size "
                         f"(activations {fmt_size(parts['activations'])}) and raise grad_accum, shorten seq_len, or "
                         f"use more GPUs (torchrun)")
    groups = param_groups(model, layer_origin, cfg)
    opt = torch.optim.AdamW([{k: v for k, v in gr.items() if k != "names"} for gr in groups], lr=cfg["learning_rate"],
                            betas=(cfg["beta1"], cfg["beta2"]), fused=True)  # fused on CPU too: ~14x faster step there
    if opt_sd is not None:
        try:  # brings back the saved groups' lr_mult, weight_decay, betas: the config's win
            opt.load_state_dict(opt_sd)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # another model's (was exit 10)
            raise TrainError(f"{ck}/optimizer.pt: not this model's optimizer state ({type(e).__name__}: "
                             f"{(str(e).splitlines() or [''])[0][:100]}); resume another checkpoint "
                             f"(--resume_from=STEP_DIR)") from None
        for gr, want in zip(opt.param_groups, groups):
            for k, v in (("lr_mult", want["lr_mult"]), ("weight_decay", want["weight_decay"]),
                         ("betas", (cfg["beta1"], cfg["beta2"]))):
                if (tuple(gr[k]) if k == "betas" else gr[k]) != v:
                    log(f"resume: {gr['origin']} group's {k} {gr[k]} -> {v} (the config's)")
                    gr[k] = v
    if state is not None and "rng" in state:
        set_rng_state(state["rng"], device_type)
    raw_model = model
    if cfg["compile"]:
        from model import compile_model
        model = compile_model(model, device_type)
        log("compile: torch.compile traces and builds on the first step (minutes on a big model; said, not a hang)")
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # no buffer broadcast: load_accum is each rank's own count (all-reduced at the step); the bias the same update
        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None, broadcast_buffers=False)

    # --- bookkeeping --------------------------------------------------------------------------------------
    st = state or {"step": 0, "tokens": 0, "best_val_loss": None, "elapsed_seconds": 0.0, "usd_spent": 0.0,
                   "created_at": time.time(), "seq_len_history": []}
    st["plan"], st["config_stages"], st["layer_origin"] = plan, cfg["stages"], layer_origin
    st["finished"] = stage_at(plan, st["tokens"])[1] is None  # a finished run extended by --replan is not, any more
    due = st.get("eval_due")
    # why there is no val set, for the lines below that name it (the note without its prefix and advice)
    no_val_why = re.sub(r"^(WARNING|note): (no val loss will be logged: )?|; no val loss.*$", "", no_val_note or "")
    if st["finished"] and val_stream is None and isinstance(due, dict) and due.get("step") == st["step"]:
        # nothing would save again: the request stayed in state.json for good, so the guardian never recorded "done"
        raise TrainError(f"{ck}: the plan is finished, but a stop signal cut its last step {st['step']}'s evaluation "
                         f"short and it cannot be measured without the val set ({no_val_why}); nothing changed: "
                         f"resume once the val set it was measured on is back (its --data_root, its val shards "
                         f"released)")
    st["quarantined_shards"] = quarantined
    st["world_size"] = world  # --status: the tokens of the next step
    _RUN_INFO.update(out_dir=out, state=st, streams=streams, master=master)
    st["plan_source"] = {k: cfg[k] for k in PLAN_SOURCE_KEYS} if not cfg["stages"] else {"dataset": cfg["dataset"]}
    control_path = os.path.join(out, "control.json")
    gpu_name, peak = gpu_peak_flops(device_type, cfg["dtype"])
    if master:
        os.makedirs(out, exist_ok=True)
        if cfg["mirror_dir"]:  # before its first copy: another run given this mirror_dir is refused at its start
            try:
                rundir.claim_mirror(cfg["mirror_dir"], out, st["created_at"])
            except OSError as e:  # (a resume's unwritable mirror: warned above; mirror() says it again when it fails)
                log(f"WARNING: could not mark {cfg['mirror_dir']} as this run's mirror ({e})")
    # $ already spent: a resume after a crash (the guardian's restart) or a rollback took the checkpoint's usd_spent,
    # and the hours its start trained past that checkpoint, paid for, went from the run's $ (rows logged: the newest)
    newest_row = last_metrics_row(os.path.join(out, "metrics.jsonl")) if master and state is not None else None
    logged_usd = newest_row.get("usd") if newest_row else None
    if isinstance(logged_usd, (int, float)) and math.isfinite(logged_usd) and logged_usd > st.get("usd_spent", 0.0):
        log(f"resume: ${logged_usd - st.get('usd_spent', 0.0):.2f} spent past step {st['step']} (logged at step "
            f"{newest_row.get('step')}) stays in $ spent")
        st["usd_spent"] = float(logged_usd)
    # earlier starts at their own price and world size (not repriced at this one's); this start's seconds are added
    spent_before = (st["elapsed_seconds"], st.get("usd_spent", 0.0))
    metrics_f = open_metrics(os.path.join(out, "metrics.jsonl"), st["step"]) if master else None
    # trained: this invocation's last save is done; told_over: a Ctrl-C since then was told "exiting"
    stop = {"signal": None, "trained": False, "sampling": False, "told_over": False}

    def on_sigterm(signum, frame):
        # an ssh drop (SIGHUP, no nohup) killed the trainer with no checkpoint; so did a killed guardian's pipes
        detach_from_lost_terminal(tty=signum == signal.SIGHUP)
        stop["signal"] = stop["signal"] or signum  # Ctrl-C under the guardian: SIGINT first, then its SIGTERM
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)

    def on_sigint(signum, frame):  # Ctrl-C: as SIGTERM (a checkpoint at the end of this step); a second one quits now
        if stop["trained"]:  # (its checkpoint is saved: nothing is lost; "saving a checkpoint" was untrue here)
            # a second Ctrl-C (one stopped training: "again quits" was promised) quits a teardown that hangs
            if stop["sampling"] or stop["told_over"] or stop["signal"] is not None:
                log(f"Ctrl-C: training is over (its checkpoint at step {st['step']} is saved); "
                    + ("the sample is cut short" if stop["sampling"] else "quitting now"))
                raise KeyboardInterrupt
            stop["told_over"] = True
            log(f"Ctrl-C: training is over (its checkpoint at step {st['step']} is saved); exiting "
                "(Ctrl-C again quits now)")
            return
        if stop["signal"] is not None:
            raise KeyboardInterrupt
        stop["signal"] = signum
        log("Ctrl-C: saving a checkpoint at the end of this step, then exiting (Ctrl-C again quits without one)")
    signal.signal(signal.SIGINT, on_sigint)

    def on_rank0(*flags):
        """Decisions made on a clock or a signal, taken from rank 0 by every rank: under torchrun a rank that saved
        or stopped alone would wait at its barrier while the others ran on to their next collective (a hang)."""
        if not ddp:
            return flags
        t = torch.tensor([int(bool(f)) for f in flags], device=device)
        dist.broadcast(t, 0)
        return tuple(bool(v) for v in t.tolist())

    def rank0_clock_any_signal(clock, signalled):
        """(rank 0's clock decision, whether any rank was signalled), in one collective: a SIGTERM to one rank other
        than 0 (its pid, as nvidia-smi lists it) was swallowed by its handler while the run trained on."""
        if not ddp:
            return clock, signalled
        t = torch.tensor([int(bool(clock) and master), int(bool(signalled))], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0].item()), bool(t[1].item())

    control_said = set()  # the complaints about control.json already logged (said once, not every check)
    control_due = [-1]  # the step a decay taken before a crash is taken again at (-1: none), known to every rank

    def check_control():
        ctl = {}
        if master:
            try:  # `echo ... > control.json` empties the file first: a half-written one is read again next time
                ctl = read_json(control_path, {})
            except TrainError as e:
                log(f"WARNING: {e}; read again at the next check")
            except OSError as e:  # (a folder, another user's file, a mount's blip: a traceback and exit 10 each start)
                why = f"cannot read it ({e.strerror or e})"
                if why not in control_said:
                    control_said.add(why)
                    log(f"WARNING: {control_path}: {why}; read again at each check")
            ctl = ctl if isinstance(ctl, dict) else {}
            # the run's one irreversible switch: only JSON true starts it ("false" was a non-empty string, so true)
            bad = [f"unknown key {k!r}" for k in ctl if k not in CONTROL_KEYS]
            if "start_decay" in ctl and not isinstance(ctl["start_decay"], bool):
                bad.append(f"start_decay must be true or false (JSON), not {ctl['start_decay']!r}")
            for why in bad:
                if why not in control_said:
                    control_said.add(why)
                    log(f"WARNING: {control_path}: {why}; ignored (it takes {{\"start_decay\": true}})")
        want = ctl.get("start_decay") is True and st.get("decay_started_at_tokens") is None
        # taken at a later step than this resume's (a crash restart from an earlier checkpoint): taken again at that
        # very step, not now (the restarted run decayed up to ckpt_interval steps early and lost when it was asked)
        taken = ctl.get("start_decay_taken_at_step")
        due = taken if want and isinstance(taken, int) and not isinstance(taken, bool) and taken > st["step"] else -1
        want = want and due < 0
        if ddp:
            t = torch.tensor([int(want), due], device=device)
            dist.broadcast(t, 0)
            want, due = bool(t[0].item()), int(t[1].item())
        if due >= 0 and due != control_due[0]:
            log(f"control.json: its decay was taken at step {due}; this resume from step {st['step']} takes it there")
        control_due[0] = due
        if want:
            nonlocal_plan = st["plan"]
            length = on_demand_decay_tokens(nonlocal_plan, cfg["decay_tokens"], cfg["decay_frac"], st["tokens"])
            cur = stage_at(nonlocal_plan, st["tokens"])[1]
            already = cur is None or cur["lr_phase"] == "decay"
            # each stage whole steps (a last step ran past the plan's end, or across a stage boundary), at least one
            st["plan"] = decay_now(nonlocal_plan, st["tokens"], length, tokens_per_step)
            added = [s for s in st["plan"] if is_on_demand(s)] if not already else []
            st["decay_started_at_tokens"] = st["tokens"]
            st.setdefault("replans", []).append({"step": st["step"], "reason": "start_decay", "at": time.time()})
            log("control.json: start_decay: already decaying (or done); the run ends with this decay" if already else
                f"control.json: starting the decay {'after the warmup' if cur['lr_phase'] == 'warmup' else 'now'}, "
                f"over {sum(s['tokens'] for s in added):,} tokens: " + ", ".join(
                    f"{s['name']} {s['tokens']:,} (mix {s['mix']}, seq_len {s['seq_len']})" for s in added))
            for line in reread_warnings(st["plan"], st["tokens"], streams, cfg["data_root"], before=nonlocal_plan):
                log(line)  # a decay longer than the plan's rest (decay_tokens) re-read a small annealing corpus unsaid
            if master:  # the step it was taken at: a rollback to a step before it drops the request (see resume)
                ctl["start_decay_taken_at_step"] = st["step"]
                checkpoint.write_atomic_text(control_path, json.dumps(ctl) + "\n")

    def save(kind, best=False):
        """Checkpoint on rank 0 (all ranks wait); returns its path. best: it is the new best (BEST names it before
        retention runs: a kill between them left BEST on the old one, and the next save's retention deleted this)."""
        path = None
        watchdog.tick()
        t_save = time.monotonic()
        if master:
            st["kind"] = kind
            # $ and time to this save's end: it cannot time itself inside the state.json it writes, so it is charged
            # at the last save's measured seconds (a leg's last save went unbilled; the next start counts from its own)
            charged_s = t_save - t_invoked + st.get("save_seconds", 0.0)
            st["elapsed_seconds"], st["usd_spent"] = spent(spent_before, charged_s, cfg["gpu_hourly_usd"], world)
            st["data_position"] = {**{c: p for c, (p, _) in idle_positions.items()},
                                   **{c: s.position for c, s in streams.items()}}
            st["data_split_sha"] = {**{c: h for c, (_, h) in idle_positions.items() if h},  # what the positions index
                                    **{c: s.split_sha for c, s in streams.items()}}
            st["rng"] = rng_state(device_type)
            st["config"] = cfg
            # the log window's steps so far (see write_row): a resume's next rows average them too, as this run's would
            st["log_window"] = {"log_interval": cfg["log_interval"], "losses": list(window_loss),
                                "load": window_load.tolist() if window_load is not None else None}
            path = model_save(raw_model, out, st, opt, tokenizer_file)
            if best:
                checkpoint.write_atomic_text(os.path.join(out, "BEST"), os.path.basename(path) + "\n")
            retain(out, cfg["keep_last"], saved=path)
            if cfg["mirror_dir"]:
                mirror(out, cfg["mirror_dir"], keep=cfg["keep_last"], tick=watchdog.tick)
        watchdog.tick()
        # the other ranks waited in a plain barrier, their watchdogs unticked: a save past hang_timeout (rank 0's
        # ticking mirror copy) ended them with exit 8
        if ddp:
            work = dist.barrier(group=save_group, async_op=True)
            while not work.is_completed():
                watchdog.alive()
                time.sleep(0.05)
            work.wait()
        st["save_seconds"] = time.monotonic() - t_save
        return path

    def model_save(m, out_dir, state_dict, optimizer, tok_file):
        from model import save_checkpoint
        extra = {"optimizer.pt": lambda p: torch.save(optimizer.state_dict(), p)}
        try:
            # (every save: periodic, best, stage end, SIGTERM) its hash pass ticks: a 31 GB save on a 50 MB/s disk
            # outlasted a small hang_timeout, and the watchdog ended a healthy run mid-save
            return save_checkpoint(m, out_dir, state_dict["step"], state=dict(state_dict), extra_writers=extra,
                                   tokenizer_file=tok_file if os.path.exists(tok_file) else None, tick=watchdog.alive)
        except OSError as e:  # checkpoint.save names a full disk so, whatever the writer raised
            if e.errno in DISK_ERRNOS:
                raise TrainError(f"out of disk while writing a checkpoint in {out_dir} ({e.strerror}); the previous "
                                 f"checkpoint is intact; free space and resume", EXIT_DISK)
            raise

    # which val shards the val loss reads: a quarantined one (the guardian's, or by hand), another val corpus (a
    # --replan) or a val split prepared again measure another val set
    val_shards = [val_corpus, val_stream.split_sha, sorted(set(skip_of[val_corpus]) & {
        e["file"] for e in val_stream.entries})] if val_stream is not None else None

    def val_set(i_stage):
        """[rows, seq_len, [corpus, split_sha, quarantined val shards]] the val loss of a step of stage i_stage is
        measured on: another one (batch_size, eval_iters, a stage's seq_len, the val shards read) gives a val loss not
        comparable with the best's."""
        return [cfg["eval_iters"] * cfg["batch_size"], st["plan"][i_stage]["seq_len"], val_shards]

    def same_val_set(saved, i_stage):
        """Whether the best's val set is the one stage i_stage measures (a checkpoint from before the shards were
        recorded: its rows and seq_len, as it was compared then; its best did not restart on the upgrade)."""
        return saved is not None and saved == val_set(i_stage)[:len(saved)] and len(saved) >= 2

    @torch.no_grad()
    def evaluate(i_stage):
        """The val loss of a step of stage i_stage, at its seq_len (a stage's last step ran evaluate after the tokens
        moved on: at the next stage's seq_len, logged beside this one's)."""
        if val_stream is None:
            return None
        model.eval()
        val_stream.set_position({"shard": 0, "offset": 0, "epoch": 0})
        T = val_set(i_stage)[1]
        # token-weighted, as training's loss (n_targets): a mean of batch means weighed a masked (SFT) batch of 4
        # targets as one of 59; plain data has the same count in every batch, so nothing changes there
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # sum of loss x targets, targets
        # the val split's first eval_iters batches, shared among the ranks (each rank read eval_iters of its own: a
        # val set that grew with the world size, and a resume on other GPUs compared best_val_loss across val sets)
        if os.environ.get("PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP") == str(st["step"]):  # a stop mid-eval: its test
            os.kill(os.getpid(), signal.SIGTERM)
        for first in range(0, cfg["eval_iters"], world):  # batches first .. first + world - 1, one a rank
            if first + rank >= cfg["eval_iters"]:
                break  # (the last round has fewer batches than ranks)
            if stop["signal"] is not None and not ddp:  # a preemption's grace period goes to the checkpoint
                log(f"evaluation cut short by a stop signal; step {st['step']}'s val loss is measured when it resumes")
                model.train()
                return None
            watchdog.alive()  # (eval_iters x a big model's batch outlasted hang_timeout: exit 8 at every eval)
            if os.environ.get("PICAFLOR_INJECT_EVAL_BATCH_S"):  # a slow evaluation batch: the watchdog's test
                time.sleep(float(os.environ["PICAFLOR_INJECT_EVAL_BATCH_S"]))
            x, y = val_stream.next_batch(cfg["batch_size"], T, rank, world)
            y = y.to(device)
            x = x.to(device)
            with autocast:
                _, loss = model(x, y, doc_ids=doc_ids_of(x, True) if doc_bos is not None and val_stream.has_mask
                                else None)
            n = (y != -1).sum().double()
            # a batch with no target has a NaN mean and no weight (where, not an if: no host sync per batch)
            sums += torch.stack([torch.where(n > 0, loss.double() * n, torch.zeros_like(n)), n])
        if ddp:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        model.train()
        return (sums[0] / sums[1]).item() if sums[1] > 0 else float("nan")

    def note_val_loss(val_loss, i_stage):
        """Whether the step's val loss (None: not measured) is the new best; st's best is set to it if so."""
        if val_loss is not None and math.isfinite(val_loss) and not same_val_set(st.get("best_val_set"), i_stage):
            if st["best_val_loss"] is not None:  # BEST would name a step measured on other rows
                was, now = st.get("best_val_set") or [], val_set(i_stage)
                said = f"{was[:2] or 'unrecorded'} -> {now[:2]} rows, seq_len" + (
                    f"; val shards {(was[2:3] or ['unrecorded'])[0]} -> {now[2]}" if was[2:3] != now[2:3] else "")
                log(f"val set changed ({said}): best val loss {st['best_val_loss']:.4f} (step {st.get('best_step')}) "
                    f"is not comparable; the best restarts")
            st["best_val_loss"] = None
        best = (val_loss is not None and math.isfinite(val_loss)  # (a NaN first val loss stuck as the best)
                and (st["best_val_loss"] is None or val_loss < st["best_val_loss"]))
        if best:
            st["best_val_loss"], st["best_step"], st["best_val_set"] = val_loss, st["step"], val_set(i_stage)
        return best

    if val_stream is None:
        log(no_val_note)
    # a stop signal cut the resumed step's evaluation short (its checkpoint came first): it is measured now, on the
    # same weights, before any step, and recorded as the uninterrupted run did (its metrics row, the best, BEST)
    due = st.pop("eval_due", None)
    late_eval = False  # the resumed step's val loss recorded now: its state.json no longer says all this run knows
    if (isinstance(due, dict) and due.get("step") == st["step"] and type(due.get("stage")) is int
            and not 0 <= due["stage"] < len(st["plan"])):  # a --replan since, with fewer stages (it was dropped unsaid)
        due = dict(due, stage=min(stage_at(st["plan"], max(st["tokens"] - 1, 0))[0], len(st["plan"]) - 1))
    if (isinstance(due, dict) and due.get("step") == st["step"] and type(due.get("stage")) is int
            and 0 <= due["stage"] < len(st["plan"]) and val_stream is not None):
        log(f"resume: step {st['step']}'s evaluation was cut short by a stop signal; evaluating it now")
        val_loss = evaluate(due["stage"])
        if val_loss is None:  # cut short again: the checkpoint still holds the request
            st["eval_due"] = due
        else:
            late_eval = True
            log(f"step {st['step']:>6} | val {val_loss:.4f} (evaluated on resume)")
            if master:
                metrics_f.close()  # (rewritten: the step's row gets its val loss, as every step is logged once)
                add_to_metrics_row(os.path.join(out, "metrics.jsonl"), st["step"], {"val_loss": val_loss},
                                   due.get("row") if isinstance(due.get("row"), dict) else None)
                metrics_f = open(os.path.join(out, "metrics.jsonl"), "a")
                if cfg["mirror_dir"]:
                    mirror(out, cfg["mirror_dir"], checkpoints=False)
            step_dir = os.path.join(out, checkpoint.step_dir_name(st["step"]))
            if (note_val_loss(val_loss, due["stage"]) and master and ck
                    and os.path.realpath(ck) == os.path.realpath(step_dir)):  # (one elsewhere: this run has no copy)
                checkpoint.write_atomic_text(os.path.join(out, "BEST"), os.path.basename(step_dir) + "\n")
    elif isinstance(due, dict) and due.get("step") == st["step"] and val_stream is None:  # (finished: refused above)
        # kept while these are step N's weights; the first step trained drops it (a resume measures only its own
        # step's), and step N's checkpoint keeps it: a rollback to it with the val set back measures it
        st["eval_due"] = due
        log(f"WARNING: step {st['step']}'s val loss could not be measured: a stop signal cut its evaluation short "
            f"and this start has no val set ({no_val_why}); training on leaves it unmeasured; to measure it, give the "
            f"val set back (its --data_root, its val shards released) and resume with --resume_from={ck} (steps "
            f"trained after it are set aside)")
    check_control()
    total_tokens = plan_tokens(st["plan"])
    i_stage = stage_at(st["plan"], st["tokens"])[0]
    log(f"plan: {len(st['plan'])} stages, {total_tokens:,} tokens; now at stage {min(i_stage, len(st['plan']) - 1)} "
        f"({st['tokens']:,} tokens done); {tokens_per_step(st['plan'][min(i_stage, len(st['plan']) - 1)]['seq_len']):,} tokens/step")

    # --- the loop -------------------------------------------------------------------------------------------
    model.train()
    steps_this_run, t_last_ckpt = 0, time.monotonic()
    # tok/s and MFU time the training steps only: a window's evaluation and saves (a best save went into the next
    # window) are paused out (an eval step logged 178 tok/s beside 2,000); elapsed_s and $ count every second of
    # this start (its start-up, evaluations and saves), the ETA this start's pace with its evaluations and saves
    # loss and expert load average over log_interval windows (steps s-log_interval+1..s, s a multiple of it), whatever
    # rows come between (a start's first step, a checkpoint's, an evaluation's: each shows the window so far) or where
    # a run stopped: the checkpoint carries the window, so a resumed run logs the same rows as one never stopped
    window_load, window_loss, window_t = None, [], time.monotonic()
    carried = (state or {}).get("log_window")
    if (isinstance(carried, dict) and carried.get("log_interval") == cfg["log_interval"]
            and isinstance(carried.get("losses"), list) and len(carried["losses"]) < cfg["log_interval"]
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in carried["losses"])):
        window_loss = [float(v) for v in carried["losses"]]
        try:  # (the same shape as this model's load, or none: a window without it shows the load since the resume)
            window_load = torch.tensor(carried["load"], dtype=torch.float32) if carried.get("load") else None
        except (TypeError, ValueError):
            window_load = None
    window_tokens, window_flops, window_paused = 0, 0.0, 0.0  # tok/s and MFU: this start's steps since its last row
    last_row_step = st["step"]
    flops_of_len = {}  # seq_len -> training FLOPs per token (a window across a stage boundary: each step at its own)
    pace_from = (st["tokens"], window_t)  # the ETA's: this start's pace from its first step's end (see eta_seconds)

    def write_row(lr, stage_name, T, gnorm, val_loss, t_step_end):
        """metrics.jsonl's row for the step just trained, and its log line; the row (a dict)."""
        nonlocal window_load, window_loss, window_t, window_tokens, window_flops, window_paused, pace_from
        nonlocal last_row_step
        dt = time.monotonic() - window_t - window_paused
        tok_s = window_tokens / dt if dt > 0 else 0.0
        mfu = (window_flops / dt / (peak * world)) if peak and dt > 0 else None
        cv, dead = load_stats(window_load) if window_load is not None and window_load.numel() else (None, None)
        eta = eta_seconds(plan_tokens(st["plan"]) - st["tokens"],
                          (st["tokens"] - pace_from[0], t_step_end - pace_from[1]))
        if steps_this_run == 1:  # (its own pace included the first step's compilation)
            pace_from = (st["tokens"], t_step_end)
        rec = {"step": st["step"], "tokens": st["tokens"], "loss": sum(window_loss) / len(window_loss), "lr": lr,
               "tok_per_s": tok_s, "mfu": mfu, "stage": stage_name, "seq_len": T,
               "load_cv": float(cv.mean()) if cv is not None else None,
               "dead_frac": float(dead.mean()) if dead is not None else None,
               "load_cv_layers": [round(float(v), 4) for v in cv] if cv is not None else None,
               "dead_frac_layers": [round(float(v), 4) for v in dead] if dead is not None else None,
               "grad_norm": float(gnorm),
               "usd": st["usd_spent"], "usd_per_btok": st["usd_spent"] / (st["tokens"] / 1e9),
               "usd_projected": st["usd_spent"] * plan_tokens(st["plan"]) / st["tokens"],
               "elapsed_s": st["elapsed_seconds"], "gpu": gpu_name or "cpu", "world_size": world, "time": time.time()}
        if val_loss is not None:
            rec["val_loss"] = val_loss
        rec["quarantined_shards"] = len(quarantined)
        # a MoE layer starving most of its experts window after window: said once (and when it clears), not found
        # out hours later; its streaks are in state.json, so a resume goes on counting them
        collapse = None
        if st["step"] % cfg["log_interval"] == 0 and rec["dead_frac_layers"]:  # (full windows only)
            if not isinstance(st.get("load_collapse"), dict):
                st["load_collapse"] = {}
            collapse = load_collapse_line(st["load_collapse"], st["step"], rec["dead_frac_layers"], mcfg.n_experts,
                                          cfg["log_interval"], mcfg.bias_update_rate, mcfg.n_dense_layers)
        rec["load_collapsed"] = (isinstance(st.get("load_collapse"), dict)
                                 and st["load_collapse"].get("warned") is not None)
        if master:
            metrics_f.write(json.dumps(rec) + "\n")
            metrics_f.flush()
            os.fsync(metrics_f.fileno())
            if cfg["mirror_dir"]:
                mirror(out, cfg["mirror_dir"], checkpoints=False)
        log(step_line(rec, eta))
        if collapse:
            log(collapse)
        if st["step"] % cfg["log_interval"] == 0:  # the window's end (see above); the others show it so far
            window_load, window_loss = None, []
        window_t, window_tokens, window_flops, window_paused = time.monotonic(), 0, 0.0, 0.0
        last_row_step = st["step"]
        return rec

    last_saved_step = st["step"] if state is not None and not late_eval else None  # (late: saved again at the end)
    last_saved_kind = (state or {}).get("kind")
    if state is None and cfg["stop_after_steps"] == 0:
        save("periodic")
        last_saved_step = 0
    while True:
        idx_stage, stage, _ = stage_at(st["plan"], st["tokens"])
        if stage is None:
            break
        if cfg["stop_after_steps"] >= 0 and steps_this_run >= cfg["stop_after_steps"]:
            break
        hours = cfg["stop_after_hours"]
        hours_up, signalled = rank0_clock_any_signal(hours >= 0 and time.monotonic() - t_invoked >= hours * 3600,
                                                     stop["signal"] is not None)
        if signalled:
            stop["signal"] = stop["signal"] or signal.SIGTERM  # the ranks not signalled stop with the one that was
            break
        if hours_up:
            break
        T = stage["seq_len"]
        if not st["seq_len_history"] or st["seq_len_history"][-1]["seq_len"] != T:
            st["seq_len_history"].append({"step": st["step"], "tokens": st["tokens"], "seq_len": T})
        lr = lr_at(st["plan"], st["tokens"], cfg["learning_rate"], cfg["min_lr"], tokens_per_step(T))
        for gr in opt.param_groups:
            gr["lr"] = lr * gr["lr_mult"]
        if os.environ.get("PICAFLOR_INJECT_SLEEP_AT_STEP") == str(st["step"]):  # fault injection for the hang test
            time.sleep(1e6)
        if os.environ.get("PICAFLOR_INJECT_CRASH_AT_STEP") == str(st["step"]) and master:  # the guardian's restart test
            if not os.path.exists(os.path.join(out, "injected-crash")):  # once: the restart goes on
                open(os.path.join(out, "injected-crash"), "w").close()
                raise RuntimeError("injected crash")
        blips = os.environ.get("PICAFLOR_INJECT_UNREACHABLE_AT_STEPS", "").split(",")  # the guardian's outage test
        if str(st["step"]) in blips and master and not os.path.exists(os.path.join(out, f"injected-blip-{st['step']}")):
            open(os.path.join(out, f"injected-blip-{st['step']}"), "w").close()  # once per step: the restart goes on
            raise shards.StorageError("injected outage", kind="unreachable")
        loss_acc = torch.zeros((), device=device)
        stage_start_tokens = sum(s["tokens"] for s in st["plan"][:idx_stage])
        batches = []
        for micro in range(cfg["grad_accum"]):
            micro_index = (st["tokens"] - stage_start_tokens) // (cfg["batch_size"] * T * world) + micro
            parts_xy = []
            for c, rows in sorted(rows_per_stream(stage["mix"], cfg["batch_size"], micro_index).items()):
                if rows:
                    parts_xy.append((*streams[c].next_batch(rows, T, rank, world), streams[c].has_mask))
            x = torch.cat([p[0] for p in parts_xy])
            docs = None  # doc_mask: rows of loss-masked corpora attend within their conversation; the others as ever
            if doc_bos is not None and any(p[2] for p in parts_xy):
                docs = torch.cat([doc_ids_of(p[0], p[2]) for p in parts_xy]).to(device)
            # the tokens the expert load counts: not chat rows' padding (identical tokens, all routed to the same
            # experts: counted, the bias steered real tokens off those experts in every layer)
            counted = None
            if pad_bos is not None and any(p[2] for p in parts_xy):
                counted = torch.cat([~chat_padding(p[0], pad_bos) if p[2] else torch.ones_like(p[0], dtype=torch.bool)
                                     for p in parts_xy]).to(device)
            batches.append((x.to(device), torch.cat([p[1] for p in parts_xy]).to(device), docs, counted))
        # loss-masked data (SFT): every target token of the step weighs the same, whatever micro-step or rank it is in
        # (each micro-step's mean weighed equally made the gradient depend on batch_size x grad_accum x world: the
        # gradient-accumulation bug of transformers' Trainer, 2024); unmasked data keeps the plain mean, bit for bit
        n_targets = None  # the step's target tokens, over every micro-step and rank
        if any(streams[c].has_mask for c in stage["mix"]):
            counts = [(y != -1).sum() for _, y, _, _ in batches]
            n_targets = torch.stack(counts).sum().to(torch.float32)
            if ddp:
                dist.all_reduce(n_targets)
            n_targets = n_targets.clamp(min=1.0)
        for micro, (x, y, docs, counted) in enumerate(batches):
            sync = (not ddp) or micro == cfg["grad_accum"] - 1
            with (model.no_sync() if ddp and not sync else nullcontext()):
                with autocast:
                    _, loss = model(x, y, doc_ids=docs, load_mask=counted)
                if n_targets is None:
                    (loss / cfg["grad_accum"]).backward()
                else:  # the model's loss is its own rows' mean: back to their sum, over the step's targets (DDP averages)
                    (loss * (counts[micro] * world / n_targets)).backward()
            loss_acc += loss.detach() if n_targets is None else loss.detach() * counts[micro]
        if n_targets is None:
            loss_mean = loss_acc / cfg["grad_accum"]
            if ddp:
                dist.all_reduce(loss_mean, op=dist.ReduceOp.AVG)
        else:
            if ddp:
                dist.all_reduce(loss_acc)
            loss_mean = loss_acc / n_targets
        loss_val = loss_mean.item()
        if not math.isfinite(loss_val) or os.environ.get("PICAFLOR_INJECT_NAN_AT_STEP") == str(st["step"]):
            raise TrainError(f"non-finite loss ({loss_val}) at step {st['step']} (tokens {st['tokens']:,}, stage "
                             f"{stage['name']}); the step was not applied and no checkpoint holds it; lower the LR "
                             f"or resume from the last checkpoint", EXIT_NONFINITE)
        if os.environ.get("PICAFLOR_INJECT_NAN_GRAD_AT_STEP") == str(st["step"]):  # the test of the check below
            next(p for p in raw_model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        # the norm without clipping when grad_clip is 0: a NaN gradient under a finite loss (an overflow in backward)
        # would otherwise reach the weights, and the next checkpoint would verify
        gnorm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg["grad_clip"] if cfg["grad_clip"] > 0
                                               else float("inf"))
        if not math.isfinite(float(gnorm)):
            raise TrainError(f"non-finite gradient norm ({float(gnorm)}) at step {st['step']} under a finite loss "
                             f"({loss_val:.4f}); the step was not applied and no checkpoint holds it; lower the LR or "
                             f"resume from the last checkpoint", EXIT_NONFINITE)
        opt.step()
        opt.zero_grad(set_to_none=True)
        load = raw_model.take_expert_load()
        if ddp and load.numel():
            load = load.to(device)
            dist.all_reduce(load)
        raw_model.update_router_bias(router_bias_load(load, raw_model, layer_origin, cfg["lr_mult"]))
        # (a carried window of another shape, never written by this model: the window starts here)
        window_load = load.cpu() if window_load is None or window_load.shape != load.shape else window_load + load.cpu()
        step_tokens = tokens_per_step(T)
        watchdog.tick()
        st["step"] += 1
        st["tokens"] += step_tokens
        st.pop("eval_due", None)  # (a request for the step before: these weights are not its; its checkpoint keeps it)
        steps_this_run += 1
        step_stage = stage["name"]  # (the loop's top names the next step's before it stops)
        window_loss.append(loss_val)
        window_tokens += step_tokens
        if T not in flops_of_len:
            flops_of_len[T] = raw_model.flops_per_token(T)
        window_flops += flops_of_len[T] * step_tokens
        t_step_end = time.monotonic()
        st["elapsed_seconds"], st["usd_spent"] = spent(spent_before, t_step_end - t_invoked, cfg["gpu_hourly_usd"],
                                                       world)

        # log
        val_loss, eval_cut = None, False
        finished_stage = stage_at(st["plan"], st["tokens"])[0] != idx_stage
        if st["step"] % cfg["eval_interval"] == 0 or stage_at(st["plan"], st["tokens"])[1] is None:
            t_eval = time.monotonic()
            val_loss = evaluate(idx_stage)
            eval_cut = val_loss is None and val_stream is not None  # (a stop signal: the resume measures it)
            window_paused += time.monotonic() - t_eval
        # and this invocation's last step (a relay leg of 3 steps logged only its first: the ledger's loss end was it)
        last_step = cfg["stop_after_steps"] >= 0 and steps_this_run >= cfg["stop_after_steps"]
        best = note_val_loss(val_loss, idx_stage)
        if master and os.environ.get("PICAFLOR_INJECT_RANK0_LAG_S"):  # a slow rank 0 (fsync, mirror): the DDP test
            time.sleep(float(os.environ["PICAFLOR_INJECT_RANK0_LAG_S"]))
        # one save a step, under its strongest kind (the last step of a plan was written three times: best, stage
        # final, final; ~31 GB each at nano size)
        kind = None
        if finished_stage:
            st["finished"] = stage_at(st["plan"], st["tokens"])[1] is None  # (the plan's end: in its state.json)
            kind = "final" if st["finished"] else "stage_final"
        elif st["step"] % cfg["ckpt_interval"] == 0:
            kind = "periodic"
        elif best:
            kind = "best"
        elif cfg["checkpoint_minutes"] > 0 and on_rank0(
                time.monotonic() - t_last_ckpt >= cfg["checkpoint_minutes"] * 60)[0]:
            kind = "temporary"
        # and a checkpoint's step (a resume starts there: metrics.jsonl, the relay ledger's loss at a leg's end and
        # --status showed the loss up to log_interval - 1 steps before it)
        if (st["step"] % cfg["log_interval"] == 0 or val_loss is not None or eval_cut or steps_this_run == 1
                or last_step or kind):
            rec = write_row(lr, stage["name"], T, gnorm, val_loss, t_step_end)
            if eval_cut:  # in the checkpoint: the resume evaluates this step first and puts its val loss in this row
                st["eval_due"] = {"step": st["step"], "stage": idx_stage, "row": rec}
        if kind:
            t_save = time.monotonic()
            save(kind, best=best)
            window_paused += time.monotonic() - t_save
            last_saved_step, last_saved_kind, t_last_ckpt = st["step"], kind, time.monotonic()
        if (st["step"] % cfg["log_interval"] == 0 and (ddp or os.path.exists(control_path))) or st["step"] == control_due[0]:
            check_control()  # under DDP every rank joins its broadcast

    # --- end of this invocation ---------------------------------------------------------------------------
    if last_row_step != st["step"]:  # stopped by a signal or stop_after_hours: the checkpoint's step is logged
        write_row(lr, step_stage, T, gnorm, None, t_step_end)
    st["finished"] = stage_at(st["plan"], st["tokens"])[1] is None
    if last_saved_step != st["step"] or (st["finished"] and last_saved_kind != "final"):
        # a finished plan's end is "final" under a stop signal too (as "preempt", each later start saved it again)
        kind = "preempt" if stop["signal"] is not None and not st["finished"] else "final"
        save(kind)
    # a finished plan whose last step's evaluation a stop signal cut short: its val loss (maybe the best) is measured
    # by a resume, not by eval.py (the guardian does not record such a run as done)
    end_eval_due = st["finished"] and isinstance(st.get("eval_due"), dict) and st["eval_due"].get("step") == st["step"]
    if stop["signal"] is not None and (not st["finished"] or end_eval_due):  # (else one in the last step: finished)
        cut = ("; the plan is finished, but this step's evaluation was cut short: it is measured when it resumes"
               if end_eval_due else "")
        log(f"{signal.Signals(stop['signal']).name}: checkpoint saved at step {st['step']}{cut}; exiting "
            f"({next_step(out)})")
    elif st["finished"]:
        # what a finished run is for, named (the line ended there; relay dirs: relay.py says what comes next)
        after = (f"; next: python eval.py {out} --tasks piqa,arc_easy, or python export.py {out} --format int4 "
                 f"--out model.pcf4" if relay_store_of(out) is None else "")
        if masked and after:  # a chat fine-tune: its checkpoints are compared as chat models (config/sft.py's note)
            after = (f"; next: python chat.py pick {out} --data {os.path.join(cfg['data_root'], masked[0])}, then "
                     f"python chat.py {out}/step_NNNNNNN with the one picked")
        log(f"run finished: all {len(st['plan'])} planned stages done ({st['tokens']:,} tokens){after}")
    else:
        log(f"stopped at step {st['step']} ({st['tokens']:,} of {plan_tokens(st['plan']):,} planned tokens); "
            f"the plan is not finished: {next_step(out)}")
    stop["trained"] = True
    # (not in relay.py init's dir: a step-0 model's sample is noise)
    if master and cfg["sample_tokens"] > 0 and stop["signal"] is None and relay_store_of(out) != "":
        try:
            stop["sampling"] = True
            from tokenizer import Tokenizer
            tok = Tokenizer.load(tokenizer_file)
            raw_model.eval()
            prompt = torch.tensor([[tok.bos_id]], device=device)
            gen = torch.Generator(device=device).manual_seed(cfg["seed"])
            outp = raw_model.generate(prompt, min(cfg["sample_tokens"], mcfg.max_seq_len - 1), temperature=0.8, top_k=50,
                                      generator=gen)
            log("sample:", tok.decode_generated(outp[0, 1:].tolist()))  # an id no merge was learned for: U+FFFD, not an error
        except KeyboardInterrupt:  # (Ctrl-C: see on_sigint)
            pass
        except Exception as e:  # a sample is a courtesy; never fail a finished run on it
            log(f"(no sample: {e})")
        finally:
            stop["sampling"] = False
    watchdog.stop()
    if metrics_f:
        metrics_f.close()
    if _RUN_INFO.get("lock") is not None:
        os.close(_RUN_INFO.pop("lock"))
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    import checkpoint
    import errno
    import shards
    if "--supervise" in sys.argv[1:]:
        import guardian
        sys.exit(guardian.supervise([a for a in sys.argv[1:] if a != "--supervise"]))
    try:
        main(sys.argv[1:])
    except TrainError as e:
        write_crash_report(CAUSES.get(e.code, "error"), e.code, str(e))
        if e.code == EXIT_ERROR:
            undo_fresh_run_dir()
        die(str(e), e.code)
    except RunDirError as e:
        if not isinstance(e, RunLocked):
            write_crash_report("error", EXIT_ERROR, str(e))
            undo_fresh_run_dir()
        die(str(e), EXIT_ERROR)
    except checkpoint.CheckpointUnreachable as e:  # a mount that dropped mid-verify: wait for it, not exit 1
        write_crash_report(CAUSES[EXIT_UNREACHABLE], EXIT_UNREACHABLE, str(e))
        die(f"{CAUSES[EXIT_UNREACHABLE]}: {e}", EXIT_UNREACHABLE)
    except checkpoint.CheckpointError as e:
        undo_fresh_run_dir()
        die(str(e), EXIT_ERROR)
    except shards.DataError as e:
        write_crash_report("corrupt data", EXIT_DATA, str(e), path=e.path, offset=e.offset, kind=e.kind)
        die(f"corrupt data: {e}", EXIT_DATA)
    except shards.StorageError as e:
        code = {"denied": EXIT_DENIED, "disk": EXIT_DISK}.get(e.kind, EXIT_UNREACHABLE)
        write_crash_report(CAUSES[code], code, str(e), url=e.url, status=e.status)
        die(f"{CAUSES[code]}: {e}", code)
    except OSError as e:
        if e.errno in DISK_ERRNOS:
            msg = f"out of disk: {e}; free space in {_RUN_INFO.get('out_dir')} and resume (checkpoints are intact)"
            write_crash_report("out of disk", EXIT_DISK, msg)
            die(msg, EXIT_DISK)
        if e.errno in checkpoint.DENIED_ERRNOS:  # (a run dir it cannot write): restarts fail alike
            # (not os_error_line: /sys/x's EPERM said "0 MB free on its disk: free space")
            msg = rundir.denied_line(e, _RUN_INFO.get("out_dir") or ".")
            write_crash_report(CAUSES[EXIT_DENIED], EXIT_DENIED, msg)
            die(f"{CAUSES[EXIT_DENIED]}: {msg}", EXIT_DENIED)
        if e.errno in checkpoint.UNREACHABLE_ERRNOS + (errno.EIO,):  # (a save's write or hash): storage, not a crash
            msg = (f"{checkpoint.os_error_line(e, _RUN_INFO.get('out_dir') or '.')}: its mount dropped, or the disk is "
                   f"failing (dmesg)? fix the storage and resume (checkpoints are intact)")
            write_crash_report(CAUSES[EXIT_UNREACHABLE], EXIT_UNREACHABLE, msg)
            die(f"{CAUSES[EXIT_UNREACHABLE]}: {msg}", EXIT_UNREACHABLE)
        crashed(e)
    except KeyboardInterrupt:
        die("interrupted", 130)
    except Exception as e:
        crashed(e)
