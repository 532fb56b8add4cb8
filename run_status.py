"""
What a run has done, for people: `python train.py --status RUN_DIR` (print_status: the plan against progress, the LR
ahead, time and cost, whether a trainer and a guardian run it now, its newest logged step) and the training log's line
per logged step (step_line). Read-only: it reads the newest checkpoint's state.json and metrics.jsonl's tail.
"""

import json
import math
import os
import time

import rundir
from expert_load import load_collapse_status  # --status's line on an expert-load collapse not cleared
from faults import TrainError, die  # (train.py's main catches a TrainError raised here: one class, from faults.py)
from schedule import lr_at, plan_tokens, stage_at


def fmt_time(s):
    if s is None or not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def print_status(run_dir):
    import checkpoint
    for _ in range(3):  # a running trainer's retention may remove the step picked before its state.json is read
        try:
            ck = checkpoint.resolve(run_dir)
        except checkpoint.CheckpointError as e:
            die(str(e))
        st = rundir.read_json(os.path.join(ck, "state.json"), {}, error=TrainError)  # (train.read_json's)
        if st or os.path.isdir(ck):
            break
    if not all(k in st for k in ("plan", "tokens", "step", "config")):
        die(f"{ck}: no usable state.json (missing or from an older format); pass the run dir, or a step dir that "
            f"checkpoint verification accepts")
    plan, seen = st["plan"], st["tokens"]
    c = st["config"]
    total = plan_tokens(plan)
    print(f"run {run_dir}: checkpoint {os.path.basename(ck)}, step {st['step']}, {seen:,} / {total:,} tokens "
          f"({100 * seen / total:.1f}%){'  FINISHED' if st.get('finished') else ''}")
    start = 0
    for i, s in enumerate(plan):
        done = min(max(seen - start, 0), s["tokens"])
        mark = "done" if done == s["tokens"] else ("now" if done > 0 or start == seen else "ahead")
        print(f"  stage {i} {s['name']:<16} {s['lr_phase']:<7} seq {s['seq_len']:<6} mix {s['mix']}  "
              f"{done:,}/{s['tokens']:,} tokens  [{mark}]")
        start += s["tokens"]
    # the next step's LR, as the trainer computes it (tokens / steps averaged stages of other seq_lens: another LR)
    _, now, _ = stage_at(plan, seen)
    step_tokens = (c["batch_size"] * now["seq_len"] * c["grad_accum"] * st["world_size"] if now and st.get("world_size")
                   else seen // st["step"] if st.get("step") else 0)  # (checkpoints before world_size was saved)
    out_dir = os.path.dirname(ck)
    pid, row = rundir.lock_holder(out_dir), last_metrics_row(os.path.join(out_dir, "metrics.jsonl"))
    el = st.get("elapsed_seconds", 0.0)
    rate = seen / el if el > 0 else None
    usd = st.get("usd_spent", 0.0)
    best = ("none yet" if st.get("best_val_loss") is None
            else f"{st['best_val_loss']:.4f} (step {st.get('best_step')})") + (
        f"; step {st['step']}'s was cut short by a stop signal, measured when it resumes"
        if isinstance(st.get("eval_due"), dict) and st["eval_due"].get("step") == st.get("step") else "")
    if st.get("finished"):  # (the LR ahead and time left of a plan with nothing left read as a run still going)
        last = (f"; final loss {row['loss']:.4f}" if row and row.get("step") == st["step"]
                and isinstance(row.get("loss"), (int, float)) else "")
        print(f"  finished: its last step {st['step']} trained{last}")
        print(f"  trained {fmt_time(el)} at {rate or 0:,.0f} tok/s; ${usd:.2f} spent; best val loss {best}")
    else:
        lr_now = lr_at(plan, seen, c["learning_rate"], c["min_lr"], step_tokens)
        ahead = [lr_at(plan, min(total - 1, seen + int(f * (total - seen))), c["learning_rate"], c["min_lr"])
                 for f in (0.25, 0.5, 0.75, 1.0)]
        print(f"  lr now {lr_now:.3e}; at 25/50/75/100% of what remains: " + ", ".join(f"{x:.2e}" for x in ahead))
        left = (total - seen) / rate if rate else None
        proj = usd * total / seen if seen else 0.0
        # the run's average over all its starts: not the log line's ETA, which is the running start's own pace
        print(f"  trained {fmt_time(el)} at {rate or 0:,.0f} tok/s; time left {fmt_time(left)} at that average pace "
              f"of all its starts (the log line's ETA: that start's own); "
              f"${usd:.2f} spent, projected ${proj:.2f}; best val loss {best}")
    # all of the above is as of the checkpoint, up to ckpt_interval steps (hours on nano) behind a running trainer
    newer = (f"; newest logged step {row['step']} (loss {row['loss']:.4f}, {fmt_time(time.time() - row['time'])} ago)"
             if row and row.get("step", 0) > st["step"] and isinstance(row.get("loss"), (int, float))
             and isinstance(row.get("time"), (int, float)) else "")
    guardian = rundir.lock_holder(out_dir, "guardian")
    print(f"  trainer: {f'running (pid {pid})' if pid else 'not running'}"
          f"{f', supervised (guardian pid {guardian})' if guardian else ''}{newer}")
    collapse = load_collapse_status(st, row)
    if collapse:
        print(f"  {collapse}")


def step_line(rec, eta):
    """The log line of a metrics row: fixed decimals per figure, so lines read alike down a column (round() gave
    load cv 0.7 under 1.255)."""
    mfu = "-" if rec["mfu"] is None else f"{100 * rec['mfu']:.1f}%"
    cv = "-" if rec["load_cv"] is None else f"{rec['load_cv']:.3f}"
    return (f"step {rec['step']:>6} | loss {rec['loss']:.4f}"
            + (f" | val {rec['val_loss']:.4f}" if rec.get("val_loss") is not None else "")
            + f" | lr {rec['lr']:.2e} | {rec['tok_per_s']:,.0f} tok/s | MFU {mfu} | load cv {cv}"
            + f" | ETA {fmt_time(eta)} | ${rec['usd']:.2f}")


def last_metrics_row(path):
    """metrics.jsonl's last complete row (a dict), or None (no file, or none parses); reads only the file's tail."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - (1 << 16)))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:  # (a row cut by a crash, or the tail's first partial line)
            continue
        if isinstance(row, dict):
            return row
    return None
