"""Shared by tests/test_relay.py and tests/test_relay_dashboard.py: a stand-in trainer that follows train.py's
contract (CONFIG --out_dir --init_from=scratch|resume --stop_after_steps/--stop_after_hours, SIGTERM ->
checkpoint + exit 0, control.json start_decay, metrics.jsonl, step_NNNNNNN/ via checkpoint.save), and helpers."""

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("RELAY_FSYNC", "0")  # before relay is imported: fsync durability is not under test here

import checkpoint  # noqa: E402

FAKE_TRAIN = r'''
import hashlib, json, os, signal, sys, time
sys.path.insert(0, os.environ["PICAFLOR_ROOT"])
import checkpoint
kv = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
out, init = kv["out_dir"], kv.get("init_from", "scratch")
steps = int(kv.get("stop_after_steps", 10 ** 9))
hours = float(kv.get("stop_after_hours", 1e9))
step_s = float(os.environ.get("FAKE_STEP_S", "0.01"))
ckpt_every = int(os.environ.get("FAKE_CKPT_EVERY", "5"))
n_layer = 3
if os.environ.get("FAKE_TRAIN_FAIL"):
    print("fake train: failing on purpose", file=sys.stderr); sys.exit(1)
if init == "resume":
    ck = checkpoint.resolve(out)
    st = json.load(open(os.path.join(ck, "state.json")))
    w = open(os.path.join(ck, "model.safetensors"), "rb").read()
else:
    st = {"step": 0, "tokens": 0, "stage": 0, "plan": [{"name": "main", "steps": 1000}],
          "model_config": {"n_layer": n_layer}}
    w = b"w" * 64
ctl = os.path.join(out, "control.json")
if os.path.isfile(ctl) and json.load(open(ctl)).get("start_decay") and st.get("decay_started_at_tokens") is None:
    st["decay_started_at_tokens"] = st["tokens"]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def save():
    checkpoint.save(out, st["step"], {
        "model.safetensors": lambda p: open(p, "wb").write(w),
        "optimizer.pt": lambda p: open(p, "wb").write(w[::-1]),
        "state.json": lambda p: json.dump(st, open(p, "w")),
        "tokenizer.json": lambda p: open(p, "w").write("{}")})
os.makedirs(out, exist_ok=True)
t0, n = time.time(), 0
if steps == 0:
    save(); sys.exit(0)
if st.get("finished"):  # train.py makes no step; a last evaluation a stop signal cut short is measured and saved
    due = st.get("eval_due") or {}
    if due.get("step") == st["step"]:
        if os.environ.get("FAKE_MEASURE_CUT"):  # cut short again (its exit status): the checkpoint still asks for it
            sys.exit(int(os.environ["FAKE_MEASURE_CUT"]))
        with open(os.path.join(out, "metrics.jsonl"), "a") as mf:  # the step's row, with its val loss (train.py's)
            mf.write(json.dumps(dict(due.get("row") or {"step": st["step"]}, val_loss=0.9375)) + "\n")
        del st["eval_due"]; st["best_val_loss"] = 0.9375; save()
    sys.exit(0)
with open(os.path.join(out, "metrics.jsonl"), "a") as mf:
    while not stop and n < steps and time.time() - t0 < hours * 3600:
        time.sleep(step_s)
        st["step"] += 1; st["tokens"] += 4096; n += 1
        w = hashlib.sha256(w).digest() * 2
        s = st["step"]
        m = {"step": s, "tokens": st["tokens"], "loss": 6.0 / (1 + 0.05 * s), "lr": 1e-3 * min(1, s / 10),
             "tok_per_s": 4096 / max(step_s, 1e-3), "mfu": 0.3, "load_cv": 0.5 / (1 + 0.1 * s) * 2, "load_cv_layers": [0.5 / (1 + 0.1 * s) * (l + 1) for l in range(n_layer)],
             "dead_frac": 0.2 / (1 + s), "dead_frac_layers": [0.2 / (1 + s)] * n_layer, "usd": 0.0, "gpu": "FakeGPU 80GB"}
        if s % 5 == 0:
            m["val_loss"] = 6.2 / (1 + 0.05 * s)
        mf.write(json.dumps(m) + "\n"); mf.flush()
        if s % ckpt_every == 0:
            save()
        if s == int(os.environ.get("FAKE_CRASH_AT_STEP", "-1")):  # a crash after some checkpoints
            print(f"fake train: crashing at step {s}", file=sys.stderr); os._exit(1)
if os.environ.get("FAKE_FINISH_CUT_EVAL"):  # the plan's end, its last evaluation cut short by a stop signal
    st["finished"], st["eval_due"] = True, {"step": st["step"], "stage": 0,
                                     "row": {k: v for k, v in m.items() if k != "val_loss"} if n else None}
save()
try:  # a lost terminal (ssh dropped, pipes closed) ends no run: train.py's print_or_detach
    print(f"fake train: stopped at step {st['step']}", flush=True)
except OSError:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
'''


def write_fake_train(tmp_path):
    p = os.path.join(str(tmp_path), "fake_train.py")
    with open(p, "w") as f:
        f.write(FAKE_TRAIN)
    return p


def save_fake_checkpoint(run_dir, step, weights=None, state=None, more=None):
    """checkpoint.save of step `step` into run dir `run_dir` as a trainer would: model.safetensors holding `weights`
    (str or bytes; default f"w{step}"), the `more` files (name -> str or bytes), then state.json holding `state`
    (default {"step": step, "tokens": 100 * step}). Returns the step dir's path."""
    files = {"model.safetensors": f"w{step}" if weights is None else weights, **(more or {})}
    files["state.json"] = json.dumps({"step": step, "tokens": 100 * step} if state is None else state)

    def writer(content):
        def write(path):
            with open(path, "wb" if isinstance(content, bytes) else "w") as f:
                f.write(content)
        return write
    return checkpoint.save(str(run_dir), step, {name: writer(content) for name, content in files.items()})


def write_config(tmp_path, text="gpu_hourly_usd = 2.0\n"):
    p = os.path.join(str(tmp_path), "run_config.py")
    with open(p, "w") as f:
        f.write(text)
    return p


def base_env(extra=None):
    env = dict(os.environ, PICAFLOR_ROOT=ROOT, PYTHONPATH=ROOT, RELAY_WHO="tester", RELAY_FSYNC="0")
    env.update(extra or {})
    return env


def relay_cli(args, env, timeout=60, cwd=None, **kw):
    """Run `python relay.py ARGS`; returns CompletedProcess (text)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "relay.py")] + [str(a) for a in args], env=env,
                          cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def init_run(url, tmp_path, env, extra=(), cli=relay_cli):
    fake = write_fake_train(tmp_path)
    cfg = write_config(tmp_path)
    r = cli(["init", url, cfg, "--train-script", fake, "--workdir", os.path.join(str(tmp_path), "w-init"),
                   "--ttl", "3", "--heartbeat", "1", *extra], env)
    assert r.returncode == 0, r.stderr
    return fake


def wait_for(pred, timeout, what, step=0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
