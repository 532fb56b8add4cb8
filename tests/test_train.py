"""train.py end to end on a tiny model and a tiny offline corpus (subprocesses, CPU)."""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest
import torch

IMPORTED_AT = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import checkpoint  # noqa: E402
import expert_load  # noqa: E402
import forkserver  # noqa: E402
import rundir  # noqa: E402
import schedule  # noqa: E402
import train  # noqa: E402
from model import Picaflor, ModelConfig, load_checkpoint  # noqa: E402

TINY = ["config/tiny.py", "--vocab_size=320", "--n_layer=3", "--d_model=32", "--n_head=4", "--n_kv_head=1",
        "--dense_ffn=64", "--n_experts=8", "--expert_ffn=16", "--n_shared=1", "--max_seq_len=64", "--batch_size=4",
        "--seq_len=32", "--sample_tokens=0", "--log_interval=1", "--eval_iters=2"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", src, "--out", str(root / "local"),
                        "--vocab-size", "320", "--val-percent", "20"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(root)


def run(args, check=True, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = forkserver.run(["train.py", *args], cwd=REPO, env=env, **kw)  # subprocess.run, minus torch's imports
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def torchrun_env(tmp_path, **extra):
    """The environment of a torchrun test: one thread a rank, and torch's temp dirs (the agent's torchelastic_* log dir,
    never removed: ~600 piled up in /tmp) under the test's tmp_path, which pytest prunes."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp), **extra)


def main_output(argv):
    """train.main(argv) in this process: (stdout, stderr, exit code). For --status and --help, which only read and
    print (no config applied to train's globals), a subprocess start is ~3 s of imports for the same output."""
    import contextlib
    import io
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            train.main(argv)
        except SystemExit as e:
            code = e.code
    return out.getvalue(), err.getvalue(), code


def metrics(out_dir):
    """Last record per step (a killed run may have logged steps that the resumed run redoes)."""
    recs = {}
    for line in open(os.path.join(out_dir, "metrics.jsonl")):
        d = json.loads(line)
        recs[d["step"]] = d
    return recs


ON_DEMAND = ["--max_iters=100", "--warmup_iters=1", "--decay_frac=0.0", "--decay_tokens=512", "--eval_interval=1000",
             "--ckpt_interval=1", "--keep_last=10"]


@pytest.fixture(scope="module")
def three_steps(data_root, tmp_path_factory):
    """3 steps of ON_DEMAND, trained once: the on-demand decay tests, and those that need some run to resume, each
    start from a copy of it."""
    out = str(tmp_path_factory.mktemp("three_steps") / "run")
    run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND, "--stop_after_steps=3"])
    return out


def test_loss_falls(data_root, tmp_path):
    out = str(tmp_path / "run")
    r = run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=60", "--warmup_iters=5",
                    "--eval_interval=30", "--learning_rate=1e-2", "--dtype=bfloat16"])
    # bfloat16 is autocast on CUDA only: a CPU run computes in float32, and says so (it did not)
    assert "dtype bfloat16: autocast runs on CUDA only; this cpu run computes in float32" in r.stdout, r.stdout[:3000]
    # tiny's memory plan read "params 0.0 GiB, grads 0.0 GiB, adamw 0.0 GiB": below a GiB it is in MiB
    plan = next(ln for ln in r.stdout.splitlines() if "memory plan per process" in ln)
    # (the " of N GiB" free memory is no part of it: 10.0 GiB free read as "0.0 GiB", a failure on a busy machine)
    assert not re.search(r"(?<![\d.])0\.0 GiB", plan.split(" of ")[0]) and " MiB" in plan, plan
    m = metrics(out)
    first = sum(m[s]["loss"] for s in range(1, 6)) / 5
    last = sum(m[s]["loss"] for s in range(56, 61)) / 5
    assert last < first - 1.0, (first, last)
    assert m[60]["val_loss"] < m[30]["val_loss"] + 0.5
    for key in ("step", "tokens", "loss", "lr", "tok_per_s", "load_cv", "dead_frac", "usd"):
        assert key in m[60]
    st = json.load(open(os.path.join(out, "step_0000060", "state.json")))
    assert st["finished"] and st["tokens"] == 60 * 4 * 32


def test_a_checkpoint_dir_holds_what_design_md_says(three_steps):
    """DESIGN.md's checkpoint format, read back: step_NNNNNNN/ with model.safetensors, optimizer.pt (tensors only,
    weights_only=True), state.json (step, tokens, data position, RNG, best val loss, config; the stage is the plan's
    at those tokens) and a MANIFEST.json hashing every other file; LATEST names the newest valid step."""
    import hashlib
    newest = checkpoint.list_checkpoints(three_steps)[-1][1]
    assert open(os.path.join(three_steps, "LATEST")).read().strip() == os.path.basename(newest) == "step_0000003"
    names = set(os.listdir(newest))
    assert {"model.safetensors", "optimizer.pt", "state.json", "MANIFEST.json"} <= names, names
    man = json.load(open(os.path.join(newest, "MANIFEST.json")))
    assert man["step"] == 3 and set(man["files"]) == names - {"MANIFEST.json"}, man
    for name, entry in man["files"].items():
        data = open(os.path.join(newest, name), "rb").read()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, name
    st = json.load(open(os.path.join(newest, "state.json")))
    for key in ("step", "tokens", "data_position", "rng", "best_val_loss", "config", "plan", "model_config"):
        assert key in st, key
    assert st["step"] == 3 and set(st["data_position"]) == {"local"}
    assert set(st["data_position"]["local"]) == {"shard", "offset", "epoch"}
    assert schedule.stage_at(st["plan"], st["tokens"])[1]["name"] == "stable"  # 1 warmup step, then stable
    opt = torch.load(os.path.join(newest, "optimizer.pt"), map_location="cpu", weights_only=True)
    assert opt["state"] and all(isinstance(v, torch.Tensor) for s in opt["state"].values() for v in s.values())


def test_resume_with_other_batch_and_seq_len_keeps_data_position(data_root, three_steps, tmp_path):
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND]
    shutil.copytree(three_steps, out)  # base + --stop_after_steps=3
    st = json.load(open(os.path.join(out, "step_0000003", "state.json")))
    assert st["tokens"] == 3 * 4 * 32
    # the resumed leg's config wins over the checkpoint's training-only settings: a longer context (no weight depends
    # on max_seq_len) and the per-origin LR multipliers (load_state_dict brought back the saved ones: weights moved)
    r = run(base + ["--init_from=resume", "--stop_after_steps=3", "--batch_size=2", "--seq_len=80", "--max_seq_len=80",
                    "--lr_mult={'embedding': 0.0, 'old': 0.0, 'new': 0.0}", "--replan", "--learning_rate=1e-3",
                    "--seed=7"])
    # one line says what the resume brought back (field reports asked whether it really loaded the optimizer)
    assert (f"resuming from {os.path.join(out, 'step_0000003')} at step 3, {st['tokens']:,} tokens: weights, AdamW "
            f"state, RNG state, data position (local shard 0 offset {st['data_position']['local']['offset']:,})"
            in r.stdout), r.stdout[:2000]
    # each changed key said in one line, with what it does from here (the LR and the seed changed without a word)
    for said in ("resume: batch_size 4 -> 2 from step 3 (the plan and the data position are counted in tokens",
                 "resume: seq_len 32 -> 80 from step 3", "learning_rate 0.003 -> 0.001 from step 3 (the next step "
                 "trains at lr 1.00e-03)", "resume: seed 1337 -> 7 from step 3 (a resume goes on with the "
                 "checkpoint's"):
        assert said in r.stdout, (said, r.stdout[-3000:])
    # the stop's line names the command that resumes this run (it said "resume with --init_from=resume": run without
    # this start's --out_dir, that resumed another run)
    import shlex
    last = [ln for ln in r.stdout.splitlines() if ln.startswith("stopped at step 6 ")][-1]
    resume = last.partition("resume with: ")[2]
    assert shlex.split(resume)[:2] == ["python", "train.py"] and f"--out_dir={out}" in shlex.split(resume), last
    assert shlex.split(resume).count("--init_from=resume") == 1, last
    st = json.load(open(os.path.join(out, "step_0000006", "state.json")))
    assert st["tokens"] == 3 * 4 * 32 + 3 * 2 * 80
    pos = st["data_position"]["local"]
    assert pos["shard"] == 0 and pos["epoch"] == 0 and pos["offset"] == st["tokens"]
    assert [h["seq_len"] for h in st["seq_len_history"]] == [32, 80]
    assert st["model_config"]["max_seq_len"] == 80
    opt_sd = torch.load(os.path.join(out, "step_0000006", "optimizer.pt"), weights_only=True)
    assert {g["lr_mult"] for g in opt_sd["param_groups"]} == {0.0}
    from safetensors.torch import load_file
    w3, w6 = (load_file(os.path.join(out, f"step_000000{s}", "model.safetensors")) for s in (3, 6))
    moved = [k for k in w3 if not torch.equal(w3[k], w6[k])]  # the router bias too: no parameter, but frozen with them
    assert not moved, moved[:3]
    # the corpus prepared again (a new tokenizer, by default): the resume is refused, naming the fix
    other = tmp_path / "data2"
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", os.path.join(sysconfig.get_paths()["stdlib"],
                        "json"), "--out", str(other / "local"), "--vocab-size", "300", "--val-percent", "20"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = run(base + ["--init_from=resume", f"--data_root={other}", "--stop_after_steps=1"], check=False)
    assert r.returncode == 1 and "prepare the corpus again with --tokenizer" in r.stderr, r.stderr[-2000:]
    assert checkpoint.latest_valid(out).endswith("step_0000006")  # nothing trained on it


def test_a_resume_refuses_a_changed_key_that_nothing_reads():
    """A --dataset beside stages whose mixes name every corpus, a --seq_len when every stage left sets its own, or a
    --grow_layers, trained on as before while the run looked changed; unchanged keys say nothing."""
    stages = [dict(name="a", mix={"web": 1.0}, steps=4, seq_len=32, lr_phase="warmup"),
              dict(name="b", mix={"web": 1.0}, steps=4)]
    cfg = {k: getattr(train, k) for k in train._CONFIG_KEYS}
    cfg.update(stages=stages, batch_size=4, seq_len=32, dataset="local")  # (whatever an in-process test left)
    tps = lambda T: 4 * T  # noqa: E731
    plan = schedule.build_plan(cfg, tps)
    state = {"step": 6, "tokens": 4 * 4 * 32 + 2 * 4 * 32, "config": dict(cfg, grow_layers=0), "layer_origin": ["new"]}
    assert train.resume_changes("CK", state, cfg, plan, tps) == []
    # a resume grows nothing: --grow_layers=2 (config/grow.py reused on a run it did not grow) trained on unchanged;
    # unset (relay's config.py of a grown run leaves it out), the start's own value is not compared
    with pytest.raises(train.TrainError, match=r"^grow_layers 0 -> 2: a resume grows nothing .* 1 layers\); put back"):
        train.resume_changes("CK", state, dict(cfg, grow_layers=2), plan, tps, given={"grow_layers"})
    assert train.resume_changes("CK", state, dict(cfg, grow_layers=2), plan, tps) == []
    with pytest.raises(train.TrainError, match=r"^dataset 'local' -> 'web': no stage reads it .* put back "
                                               r"--dataset='local', or change the stages' mix and pass --replan$"):
        train.resume_changes("CK", state, dict(cfg, dataset="web"), plan, tps)
    pinned = [dict(s, seq_len=32) for s in stages]
    plan = schedule.build_plan(dict(cfg, stages=pinned), tps)
    state["config"]["stages"] = pinned
    with pytest.raises(train.TrainError, match=r"^seq_len 32 -> 64: no stage left reads it .* --seq_len=32"):
        train.resume_changes("CK", state, dict(cfg, stages=pinned, seq_len=64), plan, tps)


def test_a_resume_says_a_key_the_checkpoints_picaflor_did_not_have():
    """A checkpoint from before doc_mask (2026-12-06; its config has no such key) trained SFT rows attending across
    conversations; a resume switched the mask on unsaid, as it would any key added since."""
    cfg = {k: getattr(train, k) for k in train._CONFIG_KEYS}
    cfg.update(stages=[], batch_size=4, seq_len=32, dataset="local", max_iters=8, warmup_iters=2, decay_frac=0.25)
    tps = lambda T: 4 * T  # noqa: E731
    plan = schedule.build_plan(cfg, tps)
    state = {"step": 3, "tokens": 3 * 4 * 32, "config": dict(cfg), "layer_origin": ["new"]}
    assert train.resume_changes("CK", state, cfg, plan, tps) == []
    del state["config"]["doc_mask"], state["config"]["lock_wait_s"]  # (lock_wait_s: this invocation's, not compared)
    assert train.resume_changes("CK", state, cfg, plan, tps) == [
        "resume: doc_mask True from step 3, a key the picaflor that wrote CK did not have (it trained without it)"]


def test_a_resume_with_a_larger_step_keeps_each_stage_in_whole_steps(data_root, tmp_path):
    """A resume with another step size (here grad_accum 1 -> 2) kept the plan's stage boundaries, no longer whole
    steps: the step from token 128 to 384 trained stage a's mix (and LR) for b's planned tokens, and the next began
    in c: stage b (128 tokens, half a new step) was never trained, while the stored plan said it was, and no word."""
    out = str(tmp_path / "run")
    plan = tmp_path / "plan.py"
    plan.write_text("stages = [dict(name='a', steps=2), dict(name='b', steps=1), dict(name='c', steps=2, "
                    "lr_phase='decay')]\n")
    base = TINY + [str(plan), f"--data_root={data_root}", f"--out_dir={out}", "--eval_interval=100"]
    run(base + ["--stop_after_steps=1"])  # 128 of 640 tokens; a step is 4 x 32 = 128 tokens
    r = run(base + ["--init_from=resume", "--grad_accum=2"])  # 256 tokens a step
    m = metrics(out)
    assert [(m[s]["stage"], m[s]["tokens"]) for s in sorted(m)] == [("a", 128), ("b", 384), ("c", 640)]
    said = [ln for ln in r.stdout.splitlines() if "step size changed" in ln]
    assert said == ["resume: the step size changed (now 8 rows of seq_len a step: batch_size x grad_accum x world size "
                    "1): the plan's remaining stages are rounded to whole steps: a 256 -> 128, b 128 -> 256 tokens "
                    "(the plan ends at 640, planned 640)"], r.stdout[-2000:]
    st = json.load(open(os.path.join(out, "step_0000003", "state.json")))
    assert st["finished"] and [s["tokens"] for s in st["plan"]] == [128, 256, 256]  # the plan says what trained
    assert schedule.align_plan(st["plan"], 384, lambda T: 256) == st["plan"]  # whole steps: unchanged


def test_a_resume_with_a_much_larger_step_keeps_the_plans_end_within_a_step():
    """A decay split in four short stages, resumed with a step 2x to 8x the planned one: each short stage kept its
    step by moving the plan's end out (a step per stage: 4 x 1024 tokens for 512 planned at 8x); now they take their
    steps from the stable stage before them, and the plan grows by less than a step."""
    plan = [dict(name=n, mix={"a": 1.0}, tokens=t, seq_len=32, lr_phase=p) for n, t, p in
            (("w", 128, "warmup"), ("s", 128 * 40, "stable"), ("d1", 128, "decay"), ("d2", 128, "decay"),
             ("d3", 128, "decay"), ("d4", 128, "decay"))]
    for step in (256, 512, 1024):
        aligned = schedule.align_plan(plan, 3 * 128, lambda T: step)
        grown = schedule.plan_tokens(aligned) - schedule.plan_tokens(plan)
        assert 0 <= grown < step, (step, [s["tokens"] for s in aligned])
        assert [s["tokens"] for s in aligned[2:-1]] == [step] * 3 and aligned[-1]["tokens"] >= step
        assert all((schedule.plan_tokens(aligned[:i]) - 3 * 128) % step == 0 for i in range(2, 7))  # whole steps
    assert schedule.align_plan(plan, 3 * 128, lambda T: 128) == plan  # whole steps already: unchanged


def test_torchrun_two_processes_gloo(data_root, tmp_path):
    out = str(tmp_path / "ddp")
    base = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *TINY,
            f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=6", "--warmup_iters=1", "--eval_interval=3",
            "--ckpt_interval=3"]
    env = torchrun_env(tmp_path)
    # rank 0 lags each step by more than checkpoint_minutes: a rank deciding on its own clock saved alone (a hang)
    lag = dict(env, PICAFLOR_INJECT_RANK0_LAG_S="0.4")
    r = subprocess.run(base + ["--stop_after_steps=2", "--checkpoint_minutes=0.005", "--hang_timeout=40"], cwd=REPO,
                       capture_output=True, text=True, env=lag, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(out, "step_0000002", "state.json")))["kind"] == "temporary"  # time-based
    st = json.load(open(os.path.join(out, "step_0000002", "state.json")))  # (a DDP resume: the stage-boundary test)
    assert st["tokens"] == 2 * 2 * 4 * 32 and st["data_position"]["local"]["offset"] == st["tokens"]  # both ranks' rows
    # rank 0 alone picks the checkpoint or the grow source (a source still training could hand ranks different
    # steps); when it cannot, every rank stops with its message (none waits in a collective). A resume source and a
    # grow source reach the other ranks through the same broadcast: the grow one stands for both here
    grown = str(tmp_path / "ddp-grown")
    gbase = base[:base.index(f"--out_dir={out}")] + [f"--out_dir={grown}", "--init_from=grow", "--grow_layers=1"]
    r = subprocess.run(gbase + [f"--grow_from={tmp_path / 'nowhere'}"], cwd=REPO, capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode != 0 and "rank 0:" in r.stderr and "no such file or directory" in r.stderr, r.stderr[-3000:]
    r = subprocess.run(gbase + [f"--grow_from={out}", "--stop_after_steps=0"], cwd=REPO, capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_checkpoint(grown).cfg.n_layer == load_checkpoint(out).cfg.n_layer + 1
    import fcntl  # the run's lock held elsewhere: rank 0's refusal reaches rank 1 too (it died on a closed connection)
    with open(os.path.join(out, ".trainer.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = subprocess.run(base + ["--init_from=resume", "--lock_wait_s=0.5"], cwd=REPO, capture_output=True, text=True,
                           env=env, timeout=120)
    assert r.returncode != 0 and "rank 0:" in r.stderr and "another trainer" in r.stderr, r.stderr[-3000:]


# train.py under a wrapper that logs, per rank, each train batch read (corpus, global position, rows, seq_len) and
# each router-bias update (the rank's own expert load, the load the update used, the bias after it)
RECORDING_TRAIN = """import json, os, runpy, sys
sys.path.insert(0, os.getcwd())
import model, shards
log = os.path.join(os.environ["PICAFLOR_TEST_LOG"], f"rank{os.environ.get('RANK', '0')}-")
def rec(kind, **kw):
    with open(log + kind + ".jsonl", "a") as f:
        f.write(json.dumps(kw) + "\\n")
S, P = shards.TokenStream, model.Picaflor
next_batch, take, update = S.next_batch, P.take_expert_load, P.update_router_bias
def reading(self, batch_size, seq_len, rank=0, world_size=1, device=None):
    if self.split == "train":
        rec("reads", corpus=os.path.basename(self.corpus_dir), at=self.position, rows=batch_size, T=seq_len, rank=rank,
            world=world_size)
    return next_batch(self, batch_size, seq_len, rank, world_size, device)
def taking(self):
    load = take(self)
    rec("local_load", load=load.tolist())
    return load
def updating(self, load, gamma=None):
    update(self, load, gamma)
    rec("bias", load=load.tolist(), bias=[m.e_score_correction_bias.tolist() for m in self.moe_layers()])
S.next_batch, P.take_expert_load, P.update_router_bias = reading, taking, updating
sys.argv = ["train.py"] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")
"""


def test_ddp_resume_at_a_stage_boundary_is_exact_and_another_world_size_skips_no_row(data_root, tmp_path):
    """torchrun (gloo, 2 ranks, grad_accum 2) stopped at the end of a stage and resumed: the next stage changes the mix
    and seq_len and brings in a loss-masked chat corpus (doc_mask, token-weighted loss). The resumed run trains the
    uninterrupted one's steps bit for bit; every rank's router bias moves by the all-reduced load, the same on each.
    The same checkpoint resumed on one process (another batch_size too): every rank's rows of both legs tile each
    corpus from its first token to the saved position, none skipped or read twice."""
    root = tmp_path / "data"
    shutil.copytree(os.path.join(data_root, "local"), root / "local")
    lines = [json.dumps([{"role": "user", "content": f"ping {i % 10}"},
                         {"role": "assistant", "content": " ".join(["pong"] * (1 + i % 5))}]) for i in range(300)]
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "data/smoltalk/prepare.py", "--tokenizer",
                        str(root / "local" / "tokenizer.json"), "--jsonl", str(tmp_path / "chats.jsonl"), "--max-len",
                        "16", "--val-conversations", "20", "--keep-val-copies", "--out", str(root / "chat")], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = tmp_path / "plan.py"
    plan.write_text("stages = [dict(name='a', steps=2, lr_phase='warmup', mix={'local': 1.0}), "
                    "dict(name='b', steps=3, seq_len=16, mix={'local': 1.0, 'chat': 1.0}), "
                    "dict(name='c', steps=2, seq_len=16, lr_phase='decay', mix={'chat': 1.0})]\n")
    (tmp_path / "wrap.py").write_text(RECORDING_TRAIN)
    base = TINY + [str(plan), f"--data_root={root}", "--batch_size=2", "--grad_accum=2", "--eval_interval=100",
                   "--bias_update_rate=0.05"]

    ENV1 = torchrun_env(tmp_path)

    def start(name, *extra, world=2):
        os.makedirs(tmp_path / f"log-{name}", exist_ok=True)
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] if world > 1 else []
        return subprocess.Popen([sys.executable, *launch, str(tmp_path / "wrap.py"), *base, *extra], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(ENV1, PICAFLOR_TEST_LOG=str(tmp_path / f"log-{name}")))

    def done(p):
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0, out[-3000:]
        return out

    def records(name, kind):
        d = tmp_path / f"log-{name}"
        return {int(f.name[4]): [json.loads(line) for line in open(f)] for f in d.iterdir()
                if f.name.endswith(f"-{kind}.jsonl")}

    straight, legs, other = (str(tmp_path / n) for n in ("straight", "legs", "other"))
    s = start("straight", f"--out_dir={straight}")  # alongside the legs (one thread each)
    done(start("legs", f"--out_dir={legs}", "--stop_after_steps=2"))
    assert json.load(open(os.path.join(legs, "step_0000002", "state.json")))["kind"] == "stage_final"
    shutil.copytree(legs, other)
    shutil.copytree(tmp_path / "log-legs", tmp_path / "log-other")
    resumed = start("legs", f"--out_dir={legs}", "--init_from=resume")
    one = start("other", f"--out_dir={other}", "--init_from=resume", "--batch_size=3", world=1)
    said = [done(p) for p in (s, resumed, one)]
    assert "doc_mask: each conversation packed in chat's rows" in said[1]  # the masked path is what resumed
    a, b = metrics(straight), metrics(legs)
    assert sorted(a) == sorted(b) == list(range(1, 8)) and [a[i]["loss"] for i in a] == [b[i]["loss"] for i in a]
    assert [a[i]["stage"] for i in (2, 3, 6)] == ["a", "b", "c"] and a[3]["seq_len"] == 16
    wa, wb = (load_checkpoint(d).state_dict() for d in (straight, legs))
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:3]
    # the balancing: each update from the sum of the ranks' loads, the same bias on each rank
    for name in ("straight", "legs"):
        local, bias = records(name, "local_load"), records(name, "bias")
        assert len(bias[0]) == 7 and bias[0] == bias[1], name
        for i, upd in enumerate(bias[0]):
            both = torch.tensor(local[0][i]["load"]) + torch.tensor(local[1][i]["load"])
            assert torch.equal(torch.tensor(upd["load"]), both), (name, i)
        assert max(abs(v) for layer in bias[0][-1]["bias"] for v in layer) > 0
        # and each rank's load is its whole step's: stage a's plain rows (all counted) of both micro-steps, x top_k 2
        reads = records(name, "reads")
        for r in (0, 1):
            for i in range(2):
                tokens = sum(e["rows"] * e["T"] for e in reads[r][2 * i:2 * i + 2])
                assert [sum(layer) for layer in local[r][i]["load"]] == [2 * tokens] * 2, (name, r, i)
    assert torch.equal(wb["layers.1.mlp.e_score_correction_bias"], torch.tensor(bias[0][-1]["bias"][0]))  # legs' last
    # every row read once: per corpus, all ranks' reads of both legs are one run from token 0 to the saved position
    for name, out in (("legs", legs), ("other", other)):
        st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
        assert st["finished"], name
        reads = [r for rank in records(name, "reads").values() for r in rank]
        assert {r["world"] for r in reads} == ({2} if name == "legs" else {1, 2})
        for c in ("chat", "local"):
            lengths = [int(e["tokens"]) for e in json.load(open(root / c / "index.json"))["splits"]["train"]]
            at = lambda p: p["epoch"] * sum(lengths) + sum(lengths[:p["shard"]]) + p["offset"]  # noqa: E731
            spans = sorted((at(r["at"]) + r["rank"] * r["rows"] * r["T"], r["rows"] * r["T"]) for r in reads
                           if r["corpus"] == c)
            pos = 0
            for start_at, n in spans:
                assert start_at == pos, (name, c, start_at, pos)
                pos += n
            assert pos == at(st["data_position"][c]) > 0, (name, c)


def test_the_val_set_is_the_same_whatever_the_world_size(data_root, two_of_four_steps, tmp_path):
    """Each rank evaluated eval_iters batches of its own, so two ranks measured twice the rows of one: a resume on
    another number of GPUs (a relay leg) compared best_val_loss across val sets. One checkpoint, one step that
    changes no weight (lr_mult 0, no router bias update), evaluated on two processes: the val loss one process
    measured on those weights (step 2's eval, as the step changes none). Another batch_size is another val set: the
    best restarts there, said in the log."""
    out = str(tmp_path / "one")
    base = TINY + [f"--data_root={data_root}", "--max_iters=4", "--warmup_iters=1", "--eval_interval=3",
                   "--eval_iters=3"]
    shutil.copytree(two_of_four_steps, out)  # base + --stop_after_steps=2 --eval_interval=2
    shutil.copytree(out, str(tmp_path / "two"))
    frozen = ["--init_from=resume", "--stop_after_steps=1", "--lr_mult={'embedding': 0.0, 'old': 0.0, 'new': 0.0}",
              "--bias_update_rate=0"]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
                        *base, *frozen, f"--out_dir={tmp_path / 'two'}"], cwd=REPO, capture_output=True, text=True,
                       env=torchrun_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = metrics(out)[2], metrics(str(tmp_path / "two"))[3]
    assert two["world_size"] == 2 and math.isclose(one["val_loss"], two["val_loss"], rel_tol=1e-5), (one, two)
    r = run(base + [f"--out_dir={out}", "--init_from=resume", "--batch_size=2", "--eval_interval=1"])
    st = json.load(open(os.path.join(out, "step_0000006", "state.json")))
    assert "val set changed ([12, 32] -> [6, 32] rows, seq_len)" in r.stdout, r.stdout[-2000:]
    assert st["best_step"] in (3, 4, 5, 6) and st["best_val_set"][:2] == [6, 32]  # not step 2, measured on 12 rows


def test_a_long_checkpoint_save_and_verify_say_how_far_they_are(tmp_path, monkeypatch, capsys):
    """A 30 GB save or verify was minutes without a word; each says how far it is in lines (a log holds no bar)."""
    monkeypatch.setattr(checkpoint, "PROGRESS_S", 0.0)  # a line per hashed chunk; growth checked each 10 ms
    monkeypatch.setattr(checkpoint, "GROW_POLL_S", 0.01)

    def slow_write(p):  # a writer whose file grows for a while, as torch.save's of an optimizer state
        with open(p, "wb") as f:
            for _ in range(4):
                f.write(b"x" * (1 << 20))
                f.flush()
                time.sleep(0.05)
    ck = checkpoint.save(str(tmp_path), 3, {"optimizer.pt": slow_write})
    err = capsys.readouterr().err
    assert re.search(r"checkpoint: writing step_0000003/optimizer\.pt: [\d.]+ MiB so far", err), err
    assert re.search(r"checkpoint: hashing step_0000003/optimizer\.pt: [\d.]+ MiB of 4\.0 MiB \(\d+%\), ~\d+s left",
                     err), err
    checkpoint.verify(ck)
    err = capsys.readouterr().err
    assert f"checkpoint: verifying {os.path.join(ck, 'optimizer.pt')}: 4.0 MiB of 4.0 MiB (100%)" in err, err
    rundir.copy_ticking(lambda: None)(os.path.join(ck, "optimizer.pt"), str(tmp_path / "mirrored"))  # mirror_dir's
    err = capsys.readouterr().err
    assert f"checkpoint: mirroring {os.path.join(ck, 'optimizer.pt')}: 4.0 MiB of 4.0 MiB (100%)" in err, err
    monkeypatch.setattr(checkpoint, "PROGRESS_S", 3600.0)  # a short one says nothing
    checkpoint.verify(ck)
    assert capsys.readouterr().err == ""


def test_ddp_ranks_outwait_a_save_longer_than_hang_timeout(data_root, tmp_path):
    """A save whose mirror copy outlasts hang_timeout (a big checkpoint to a slow bucket: copy_ticking ticks rank 0's
    watchdog) under torchrun: the other ranks waited in a plain barrier with their watchdogs unticked, so rank 1 exited
    8 ("hang") mid-save and took the run down; they also had the process group's 30 min timeout, as long as the
    default hang_timeout. Here the copy is slowed by a wrapper that patches rundir.mirror."""
    wrapper = tmp_path / "slow_mirror.py"
    wrapper.write_text("import os, runpy, sys, time\n"
                       "sys.path.insert(0, os.getcwd())\n"
                       "import rundir\n"
                       "real = rundir.mirror\n"
                       "def slow(out_dir, dest, checkpoints=True, keep=1, tick=None):\n"
                       "    for _ in range(20 if checkpoints else 0):  # the checkpoint's copy, 64 MB chunks, ticking\n"
                       "        time.sleep(0.2)\n"
                       "        tick and tick()\n"
                       "    return real(out_dir, dest, checkpoints, keep, tick)\n"
                       "rundir.mirror = slow\n"
                       "sys.argv = ['train.py'] + sys.argv[1:]\n"
                       "runpy.run_path('train.py', run_name='__main__')\n")
    out, mirror_dir = str(tmp_path / "run"), str(tmp_path / "mirror")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(wrapper), *TINY, "--batch_size=2", f"--data_root={data_root}", f"--out_dir={out}",
                        f"--mirror_dir={mirror_dir}", "--max_iters=2", "--warmup_iters=1", "--stop_after_steps=1",
                        "--eval_interval=100", "--hang_timeout=2"], cwd=REPO, capture_output=True, text=True,
                       env=torchrun_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [f for f in os.listdir(out) if f.startswith("hang-")]
    assert checkpoint.is_valid(os.path.join(mirror_dir, "step_0000001"))


def test_grow_starts_as_identity_and_groups_get_their_lr(data_root, tmp_path):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=320, n_layer=3, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=1, dense_ffn=64,
                      n_experts=8, expert_ffn=16, n_shared=1, max_seq_len=64, tie_embeddings=True)
    src = Picaflor(cfg)
    from model import save_checkpoint
    save_checkpoint(src, str(tmp_path / "src"), 10)
    out = str(tmp_path / "grown")
    grow = TINY + [f"--data_root={data_root}", "--init_from=grow", f"--grow_from={tmp_path / 'src'}", "--grow_layers=2",
                   "--stop_after_steps=0"]
    # growing at one LR (lr_mult's default) spiked a field run's loss 14% for thousands of steps: it says so, once
    said = [ln for ln in run(grow + [f"--out_dir={out}"]).stdout.splitlines() if "WARNING: growing with lr_mult" in ln]
    assert len(said) == 1 and "config/grow.py" in said[0], said
    differential = run(grow + [f"--out_dir={tmp_path / 'grown2'}", "--lr_mult={'old': 0.1, 'new': 1.0}",
                               "--n_experts=4"])
    assert "WARNING: growing" not in differential.stdout
    # an architecture field given beside a grow is the checkpoint's, said (it was dropped unsaid; n_layer is the grow's)
    assert "WARNING: grow: n_experts=4 ignored; the checkpoint's 8 stays" in differential.stdout, differential.stdout
    assert "n_layer=3 ignored" not in differential.stdout
    grown = load_checkpoint(out)
    assert grown.cfg.n_layer == 5
    idx = torch.randint(1, 320, (2, 16))
    with torch.no_grad():
        assert torch.equal(src.eval()(idx), grown(idx))
    st = json.load(open(os.path.join(out, "step_0000000", "state.json")))
    assert st["layer_origin"].count("new") == 2 and st["layer_origin"][0] == "old"
    groups = train.param_groups(grown, st["layer_origin"], {"lr_mult": {"embedding": 0.5, "old": 0.1, "new": 2.0},
                                                              "weight_decay": 0.1})
    for gr in groups:
        assert gr["lr_mult"] == {"embedding": 0.5, "old": 0.1, "new": 2.0}[gr["origin"]]
        for n in gr["names"]:
            assert train.origin_of(n, st["layer_origin"]) == gr["origin"]
    new_layers = {i for i, o in enumerate(st["layer_origin"]) if o == "new"}
    assert any(int(n.split(".")[1]) in new_layers for gr in groups if gr["origin"] == "new" for n in gr["names"])


def test_a_frozen_layers_router_bias_stays():
    """lr_mult 0 froze a layer's weights, but its router's selection bias (DeepSeek-V3's balancing: no parameter, no
    optimizer) went on moving, so a "frozen" old layer of a grown model routed its tokens elsewhere step by step."""
    model = Picaflor(ModelConfig(vocab_size=64, n_layer=4, n_dense_layers=1, d_model=16, n_head=2, n_kv_head=1,
                                 dense_ffn=32, n_experts=4, expert_ffn=8, n_shared=1, top_k=2, max_seq_len=16))
    layer_origin = ["old", "old", "new", "old"]  # MoE layers 1, 2, 3
    load = torch.tensor([[9.0, 1.0, 1.0, 1.0]] * 3)
    before = [m.e_score_correction_bias.clone() for m in model.moe_layers()]
    model.update_router_bias(train.router_bias_load(load, model, layer_origin, {"old": 0.0, "new": 1.0}), gamma=0.1)
    moved = [not torch.equal(b, m.e_score_correction_bias) for b, m in zip(before, model.moe_layers())]
    assert moved == [False, True, False]
    model.update_router_bias(train.router_bias_load(load, model, layer_origin, {"new": 2.0}), gamma=0.1)
    assert all(not torch.equal(b, m.e_score_correction_bias) for b, m in zip(before, model.moe_layers()))


def test_no_val_loss_says_why_quarantined_val_shards_or_no_val_split(data_root, tmp_path):
    """Every val shard quarantined was logged as "corpus local has no val split": the quarantined shards went unnamed,
    and the fix it implied (prepare.py again) left the quarantine in place. A corpus prepared with no val share says
    so, and that no val loss (nor a best-by-val checkpoint) comes."""
    corpus = os.path.join(data_root, "local")
    val = [e["file"] for e in json.load(open(os.path.join(corpus, "index.json")))["splits"]["val"]]
    stream, note = train.open_val_stream(corpus, 320, [])
    assert stream is not None and note is None
    stream, note = train.open_val_stream(corpus, 320, val + ["train_000000.bin"])
    assert stream is None and "no val split" not in note and "quarantined" in note, note
    assert all(f"local/{f}" in note for f in val) and "--release_shards=" in note and "shards.py verify" in note, note
    bare = tmp_path / "local"  # the same corpus, its val split empty (data/local/prepare.py --val-percent 0)
    shutil.copytree(corpus, bare)
    index = json.load(open(bare / "index.json"))
    index["splits"]["val"] = []
    (bare / "index.json").write_text(json.dumps(index))
    stream, note = train.open_val_stream(str(bare), 320, [])
    assert stream is None and "local has no val split" in note and "no val loss will be logged" in note, note


def test_a_resume_at_another_price_or_world_size_does_not_reprice_the_past(data_root, three_steps, tmp_path):
    """usd_spent was gpu_hourly_usd x world size x all the run's elapsed time: a leg on another GPU (relay legs run on
    contributors' machines at their own prices) or another world size repriced every earlier hour, $ spent going down
    as well as up. Each leg adds its own hours at its own price.
    And a start that crashed (the guardian restarts it), or a timeline a rollback left, trained and logged steps past
    the checkpoint the next start resumes; that start took the checkpoint's usd_spent, and the hours paid for those
    steps went from the run's $ spent, $ per billion tokens and projection (relay's ledger bills them).
    And a start's start-up (loading the checkpoint, building the model) and its last save went unbilled: elapsed and $
    began at its first step and stopped before the save; and its ETA took the whole run's rate (a leg after slow
    ones, on a faster GPU, was told the slow legs' pace)."""
    out = str(tmp_path / "run")
    shutil.copytree(three_steps, out)  # trained at gpu_hourly_usd=0: $0 so far
    rows = open(os.path.join(out, "metrics.jsonl")).read().splitlines()
    crashed = dict(json.loads(rows[-1]), step=5, usd=2.5)  # steps 4-5 logged at $2.50 in all, then a crash
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(crashed) + "\n")
    ck = os.path.join(out, "step_0000003")
    state_path, man_path = os.path.join(ck, "state.json"), os.path.join(ck, "MANIFEST.json")
    before, man = json.load(open(state_path)), json.load(open(man_path))
    before["elapsed_seconds"] = 1e6  # its 3 steps took 11 days on an earlier, slow machine
    json.dump(before, open(state_path, "w"))
    man["files"]["state.json"] = {"sha256": checkpoint.sha256_file(state_path), "bytes": os.path.getsize(state_path)}
    json.dump(man, open(man_path, "w"))
    t0 = time.monotonic()
    r = run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND, "--init_from=resume",
                    "--stop_after_steps=1", "--gpu_hourly_usd=3600.0"])  # $1 a second
    wall_s = time.monotonic() - t0
    after = json.load(open(os.path.join(out, "step_0000004", "state.json")))
    leg_s = after["elapsed_seconds"] - before["elapsed_seconds"]
    assert before["usd_spent"] == 0.0 and 0.5 * wall_s < leg_s < wall_s, (leg_s, wall_s)  # the start-up billed too
    assert "$2.50 spent past step 3 (logged at step 5)" in r.stdout, r.stdout[-1500:]
    assert "resume: gpu_hourly_usd 0.0 -> 3600.0 from step 3" in r.stdout, r.stdout[-1500:]
    assert abs(after["usd_spent"] - (2.5 + leg_s)) < 1e-6, (after["usd_spent"], leg_s)
    # the state's $ runs to its save's end, the step's row to the step's end: a save's worth of seconds apart
    assert 0 < after["usd_spent"] - metrics(out)[4]["usd"] < after["save_seconds"] + 1.0 and 5 not in metrics(out)
    eta = next(ln for ln in r.stdout.splitlines() if "step      4 |" in ln).split("| ETA ")[1].split(" |")[0]
    assert "h" not in eta, eta  # 96 steps at this leg's pace: minutes (at the run's 11 days for 3 steps: 8,900 hours)


def test_a_checkpoint_whose_model_config_lacks_a_field_is_refused(data_root, three_steps, tmp_path):
    """A state.json without rope_theta trained on: resume and finetune took the config's value, grow the default's
    (another model than the one saved, without a word). Now a one-line error naming the file, exit 1, for each."""
    out = str(tmp_path / "run")
    args = TINY + [f"--data_root={data_root}", *ON_DEMAND]
    shutil.copytree(three_steps, out)  # any run will do: its newest step loses a field
    ck = checkpoint.latest_valid(out)
    state_path, man_path = os.path.join(ck, "state.json"), os.path.join(ck, "MANIFEST.json")
    state, man = json.load(open(state_path)), json.load(open(man_path))
    del state["model_config"]["rope_theta"]
    json.dump(state, open(state_path, "w"))  # a consistent checkpoint (its manifest rewritten) that lacks the field
    man["files"]["state.json"] = {"sha256": checkpoint.sha256_file(state_path), "bytes": os.path.getsize(state_path)}
    json.dump(man, open(man_path, "w"))
    assert checkpoint.is_valid(ck)
    cases = {"resume": [f"--out_dir={out}", "--init_from=resume"],
             "grow": [f"--out_dir={tmp_path / 'grown'}", "--init_from=grow", f"--grow_from={out}", "--grow_layers=1"],
             "finetune": [f"--out_dir={tmp_path / 'tuned'}", "--init_from=finetune", f"--finetune_from={out}"]}
    for how, more in cases.items():  # each refuses before its first step
        r = run([*args, *more, "--stop_after_steps=0"], check=False, timeout=120)
        stderr = r.stderr
        err = [line for line in stderr.strip().splitlines() if line.strip()]
        assert r.returncode == 1 and len(err) == 1 and "Traceback" not in stderr, (how, stderr[-3000:])
        assert f"{ck}/state.json: its model_config lacks ['rope_theta']" in err[0], (how, err[0])


def test_a_resumed_state_json_of_another_shape_is_one_line_exit_1(data_root, three_steps, tmp_path):
    """(found by fuzzing) a state.json (its manifest made to fit) without "tokens", with a layer_origin of another
    length, a data_position or rng of another shape: a KeyError / IndexError / TypeError traceback, exit 10, which the
    guardian restarted into the same crash. Now one line naming the file and the field, exit 1."""
    out = str(tmp_path / "run")
    shutil.copytree(three_steps, out)
    ck = checkpoint.latest_valid(out)
    state = json.load(open(os.path.join(ck, "state.json")))
    train.check_resume_state(ck, state, 3)  # as train.py wrote it
    for field, value in [("tokens", None), ("layer_origin", []), ("data_position", []), ("rng", -1),
                         ("plan", [{"name": "x"}]), ("elapsed_seconds", []), ("data_split_sha", 1.5),
                         ("plan_source", -1)]:
        bad = {k: v for k, v in state.items() if k != field or value is not None} | ({} if value is None else
                                                                                      {field: value})
        with pytest.raises(train.TrainError, match=f"state.json: its {field} is not what train.py writes"):
            train.check_resume_state(ck, bad, 3)
    # weights against a config of another size before a model is built: 2^31 embedding rows asked for 274 GB (a
    # MemoryError, exit 10), 10^12 layers built modules until memory ran out
    from model import ModelConfig
    for field, value, words in [("vocab_size", 2 ** 31, "embed_tokens.weight is"), ("n_layer", 10 ** 12, "n_layer")]:
        with pytest.raises(train.TrainError, match=f"model.safetensors: does not fit its state.json .*{words}"):
            train.load_weights(ck, ModelConfig.from_dict({**state["model_config"], field: value}))
    # the same, resumed: no "tokens" in state.json; an optimizer.pt of zeros (an UnpicklingError traceback, exit 10)
    opt_out = str(tmp_path / "opt_run")
    shutil.copytree(out, opt_out)
    opt_ck = os.path.join(opt_out, os.path.basename(ck))
    del state["tokens"]
    for d, name, data in [(ck, "state.json", json.dumps(state).encode()), (opt_ck, "optimizer.pt", bytes(64))]:
        open(os.path.join(d, name), "wb").write(data)
        m = json.load(open(os.path.join(d, "MANIFEST.json")))
        m["files"][name] = {"sha256": checkpoint.sha256_file(os.path.join(d, name)), "bytes": len(data)}
        json.dump(m, open(os.path.join(d, "MANIFEST.json"), "w"))
    for d, o, words in [(ck, out, f"{ck}/state.json: its tokens is not what train.py writes (missing)"),
                        (opt_ck, opt_out, f"{opt_ck}/optimizer.pt: not a readable optimizer state (UnpicklingError")]:
        r = run([*TINY, f"--data_root={data_root}", f"--out_dir={o}", *ON_DEMAND, "--init_from=resume",
                 "--stop_after_steps=0"], check=False, timeout=120)  # each refuses before its first step
        stderr = r.stderr
        err = [line for line in stderr.strip().splitlines() if line.strip()]
        assert r.returncode == 1 and len(err) == 1 and "Traceback" not in stderr, stderr[-3000:]
        assert words in err[0], err[0]


def stage_file(tmp_path, name, decay_steps):
    f = tmp_path / name
    f.write_text("stages = [dict(name='warm', steps=3, lr_phase='warmup'), dict(name='flat', steps=4, lr_phase='stable'),"
                 f" dict(name='down', steps={decay_steps}, lr_phase='decay')]\n")
    return str(f)


def test_status_says_whether_a_trainer_runs_and_its_newest_logged_step(three_steps, tmp_path):
    """train.py --status read only the newest checkpoint: on a running nano (ckpt_interval 1000) hours behind, and it
    never said whether anything was training the run. It names the trainer holding the run's lock (its pid) and
    metrics.jsonl's newest step when that is past the checkpoint."""
    import fcntl
    import time
    out = str(tmp_path / "run")
    shutil.copytree(three_steps, out)  # newest checkpoint: step 3
    said = main_output(["--status", out])[0].splitlines()
    assert said[-1] == "  trainer: not running", said
    # its time left is the run's average pace, said so (the log line's ETA, this start's pace, differs from it)
    assert [x for x in said if " at that average pace of all its starts (the log line's ETA: that start's own); " in x]
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:  # a trainer's log, 5 steps past the checkpoint
        f.write(json.dumps({"step": 8, "loss": 6.25, "time": time.time() - 65}) + "\n" + '{"step": 9, "lo')
    with open(os.path.join(out, ".trainer.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242")
        lock.flush()
        said = main_output(["--status", out])[0].splitlines()
    assert said[-1].startswith("  trainer: running (pid 4242); newest logged step 8 (loss 6.2500, 1m0"), said
    assert main_output(["--status", out])[0].splitlines()[-1].startswith("  trainer: not running; newest logged step 8")


def test_the_log_line_gives_each_figure_fixed_decimals():
    """The step log line rounded load cv (0.7 under 1.255, 1.28 beside it): each figure has its own fixed decimals,
    so the lines read alike down a column; a figure not measured is "-" (load cv printed None)."""
    rec = {"step": 7, "loss": 3.5, "lr": 3e-4, "tok_per_s": 1234.4, "mfu": None, "load_cv": 0.7, "usd": 0.1}
    assert train.step_line(rec, 65) == ("step      7 | loss 3.5000 | lr 3.00e-04 | 1,234 tok/s | MFU - "
                                        "| load cv 0.700 | ETA 1m05s | $0.10")
    said = train.step_line({**rec, "val_loss": 3.25, "mfu": 0.4, "load_cv": 1.28}, None)
    assert "| val 3.2500 |" in said and "| MFU 40.0% |" in said and "| load cv 1.280 |" in said, said
    assert "| load cv - |" in train.step_line({**rec, "load_cv": None}, 0)


def test_an_expert_load_collapse_is_said_once_at_onset_and_once_when_it_clears():
    """A router that sent most tokens to a few experts (bias_update_rate=0, or a bug) was found out hours later in
    metrics.jsonl. Past the grace (1/bias_update_rate steps, at least three windows), a MoE layer starving over half
    its experts three full windows in a row is one WARNING line naming it; the next windows say nothing until every
    layer has been at or under half for three windows: one line that it recovered. The streaks are JSON (state.json):
    a resume goes on counting them."""
    def judge(state, step, dead, rate=1e-2, n_experts=16):
        return expert_load.load_collapse_line(state, step, dead, n_experts, 10, rate, first_moe_layer=1)

    st, starved, fine = {}, [0.25, 0.75, 0.25], [0.25, 0.5, 0.25]  # (half starved is no collapse)
    assert [judge(st, s, starved) for s in range(10, 101, 10)] == [None] * 10  # warm-up: 1/0.01 steps
    assert judge(st, 110, starved) is None and judge(st, 120, starved) is None
    said = judge(st, 130, [0.25, 0.75, 0.8125])
    assert said.startswith("WARNING: expert load collapsed at step 130: layer 2: 12 of 16 experts starved") and (
        "layer 3" not in said and "for the last 30 steps" in said and "bias_update_rate is 0.01" in
        said and "dead_frac_layers in metrics.jsonl" in said), said
    st = json.loads(json.dumps(st))  # (a resume: the checkpoint's state.json)
    flicker = [starved, fine, fine, starved, fine, starved, fine, fine]  # over half again before three calm windows
    assert [judge(st, 140 + 10 * i, d) for i, d in enumerate(flicker)] == [None] * len(flicker)
    said = judge(st, 220, fine)
    assert said == ("expert load recovered at step 220: no MoE layer has starved over 50% of its experts for 3 log "
                    "windows (collapsed since the warning at step 130)"), said
    assert [judge(st, s, fine) for s in (230, 240)] == [None, None]
    # no balancing: nothing to wait for past three windows; every collapsed layer named, worst first, the line capped
    st = {"streak": "hand-edited"}  # (recounted, not a crash)
    dead = [0.625] * 5 + [0.875] + [0.75] * 4
    assert [judge(st, s, dead, rate=0.0, n_experts=64) for s in (10, 20, 30, 40, 50)] == [None] * 5
    said = judge(st, 60, dead, rate=0.0, n_experts=64)
    assert "at step 60: layer 6: 56 of 64 experts starved, layer 7: 48 of 64" in said and (
        "(and 2 more layers)" in said and "for the last 30 steps" in said and "bias_update_rate is 0: nothing balances"
        in said), said
    assert expert_load.collapse_grace_steps(10, 1e-3) == 1000 and expert_load.collapse_grace_steps(1, 1e-6) == 1000


def test_a_collapsed_routers_run_warns_and_records_it(data_root, tmp_path):
    """bias_update_rate=0 on the suite's tiny model: from step ~8 two or three experts of eight take nearly every
    token, in each MoE layer (5 or 6 of 8 starved a step, where 1e-2 starves 0-6 with no trend): the log says so
    once, the rows and state.json record it."""
    out = str(tmp_path / "run")
    r = run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=14", "--warmup_iters=1",
                    "--eval_interval=1000", "--bias_update_rate=0"])
    said = [ln for ln in r.stdout.splitlines() if "expert load" in ln]
    assert len(said) == 1 and said[0].startswith("WARNING: expert load collapsed at step ") and (
        "bias_update_rate is 0" in said[0]), r.stdout[-3000:]
    m = metrics(out)
    assert not m[1]["load_collapsed"] and m[14]["load_collapsed"], [m[s]["dead_frac_layers"] for s in m]
    st = json.load(open(os.path.join(out, "step_0000014", "state.json")))
    assert st["load_collapse"]["warned"] == int(said[0].split("at step ")[1].split(":")[0])


def test_status_says_an_ongoing_expert_load_collapse_and_its_layers(tmp_path):
    """A collapse was said once, in the trainer's log; `--status` (what a user runs later) said nothing of it. The
    newest checkpoint's state.json warned (load_collapse.warned, not cleared): one line, since when, and the layers
    metrics.jsonl's newest row starves over half their experts (MoE layers numbered after the dense ones); a row past
    the checkpoint that says it cleared, or one that says it began after the checkpoint, is said too."""
    ck = tmp_path / "run" / "step_0000140"
    ck.mkdir(parents=True)
    plan = [{"name": "main", "lr_phase": "stable", "seq_len": 64, "mix": {"local": 1.0}, "tokens": 100000}]
    st = {"step": 140, "tokens": 8960, "plan": plan, "world_size": 1, "elapsed_seconds": 10.0,
          "config": {"batch_size": 1, "grad_accum": 1, "learning_rate": 1e-3, "min_lr": 1e-4},
          "model_config": {"n_dense_layers": 1, "bias_update_rate": 0.01},
          "load_collapse": {"streak": [0, 4, 1], "since": [0, 101, 131], "warned": 130, "calm": 0}}
    (ck / "state.json").write_text(json.dumps(st))
    row = lambda step, collapsed, dead: {"step": step, "loss": 5.0, "time": 1.7e9, "load_collapsed": collapsed,  # noqa
                                         "dead_frac_layers": dead}
    log = tmp_path / "run" / "metrics.jsonl"
    log.write_text(json.dumps(row(140, True, [0.25, 0.75, 0.8125])) + "\n")
    said = [ln for ln in main_output(["--status", str(ck)])[0].splitlines() if "expert load" in ln]
    assert said == ["  WARNING: expert load collapsed since step 130 (said once, in the trainer's log); at logged step "
                    "140 layers 2, 3 starve over 50% of their experts; bias_update_rate 0.01; per-layer figures: "
                    "dead_frac_layers in metrics.jsonl"], said
    with open(log, "a") as f:  # the trainer went on past the checkpoint: the load recovered at step 170
        f.write(json.dumps(row(170, False, [0.25, 0.5, 0.25])) + "\n")
    said = [ln for ln in main_output(["--status", str(ck)])[0].splitlines() if "expert load" in ln]
    assert said == ["  expert load collapsed at step 130 (the checkpoint's state); recovered by the newest logged step "
                    "170"], said
    st["load_collapse"]["warned"] = None  # a healthy checkpoint: nothing said, unless a newer row says it collapsed
    (ck / "state.json").write_text(json.dumps(st))
    assert "expert load" not in main_output(["--status", str(ck)])[0]
    with open(log, "a") as f:
        f.write(json.dumps(row(190, True, [0.25, 0.5, 0.875])) + "\n")
    said = [ln for ln in main_output(["--status", str(ck)])[0].splitlines() if "expert load" in ln]
    assert said and said[0].startswith("  WARNING: expert load collapsed after the checkpoint's step 140 (said once, "
                                       "in the trainer's log); at logged step 190 layer 3 starves over 50% of its "
                                       "experts;"), said


def test_a_refused_replan_names_what_differs():
    """A resume whose config plans otherwise was refused with "the config's plan differs" alone: a user who had
    trained with --max_iters=60 --warmup_iters=5 could not tell which of them to put back. Each change is named, and a
    key the config's stages leave unread (max_iters beside stages) is not."""
    no_stages = {"max_iters": 60, "warmup_iters": 5, "decay_frac": 0.2, "dataset": "local"}
    state = {"config_stages": [], "plan_source": dict(no_stages)}
    assert schedule.plan_changes(state, {**no_stages, "stages": []}) == []
    assert schedule.plan_changes(state, {**no_stages, "stages": [], "max_iters": 100, "warmup_iters": 30}) == [
        "max_iters: stored 60, config 100", "warmup_iters: stored 5, config 30"]
    staged = [dict(name="warm", steps=3, lr_phase="warmup"), dict(name="down", steps=4, lr_phase="decay")]
    assert schedule.plan_changes(state, {**no_stages, "max_iters": 300, "stages": staged}) == [
        "stages: stored none (from max_iters), config 2 stages"]
    longer = [staged[0], {**staged[1], "steps": 6}]
    said = schedule.plan_changes({"config_stages": staged, "plan_source": {"dataset": "local"}},
                                 {**no_stages, "stages": longer})
    assert said == [f"stage 1: stored {staged[1]}, config {longer[1]}"]


def test_a_checkpoint_from_before_plan_source_named_its_dataset_refuses_another_dataset():
    """A checkpoint saved before plan_source recorded the dataset (2026-12-03) resumed with --dataset=other kept its
    stored plan and trained on, unsaid, on the corpus it was asked to leave; its saved config names the dataset."""
    no_stages = {"max_iters": 60, "warmup_iters": 5, "decay_frac": 0.2}
    state = {"config_stages": [], "plan_source": dict(no_stages), "config": {**no_stages, "dataset": "local"}}
    assert schedule.plan_changes(state, {**no_stages, "dataset": "local", "stages": []}) == []
    assert schedule.plan_changes(state, {**no_stages, "dataset": "other", "stages": []}) == [
        "dataset: stored 'local', config 'other'"]
    bare = [dict(name="a", steps=4, lr_phase="stable")]  # (stages without a mix train on the dataset too)
    state = dict(state, config_stages=bare, plan_source={})
    assert schedule.plan_changes(state, {**no_stages, "dataset": "other", "stages": bare}) == [
        "dataset: stored 'local', config 'other'"]


def test_wsd_lr_matches_plan_and_three_stages_run_across_two_resumes(data_root, tmp_path):
    out = str(tmp_path / "run")
    base = TINY + [stage_file(tmp_path, "plan.py", 4), f"--data_root={data_root}", f"--out_dir={out}",
                   "--eval_interval=100", "--learning_rate=1e-3", "--min_lr=1e-4"]
    run(base + ["--stop_after_steps=5"])
    st = json.load(open(os.path.join(out, "step_0000005", "state.json")))
    assert not st["finished"]
    run(base + ["--init_from=resume", "--stop_after_steps=4"])
    run(base + ["--init_from=resume"])
    m = metrics(out)
    assert sorted(m) == list(range(1, 12))
    step_tokens = 4 * 32
    # the decay's last step runs at min_lr, as warmup's last runs at the peak (it ended at 1e-4 + 9e-4 * (1 - 0.87))
    expect = [1e-3 * 1 / 3, 1e-3 * 2 / 3, 1e-3] + [1e-3] * 4 + [1e-4 + 9e-4 * (1 - ((i + 1) / 4) ** 0.5) for i in range(4)]
    for s in range(1, 12):
        assert abs(m[s]["lr"] - expect[s - 1]) < 1e-12, (s, m[s]["lr"], expect[s - 1])
        assert m[s]["tokens"] == s * step_tokens
    assert [m[s]["stage"] for s in (1, 5, 11)] == ["warm", "flat", "down"]
    st = json.load(open(os.path.join(out, "step_0000011", "state.json")))
    assert st["finished"]
    # stage finals are kept by retention
    assert os.path.isdir(os.path.join(out, "step_0000003")) and os.path.isdir(os.path.join(out, "step_0000007"))
    # a changed plan on resume is refused without --replan
    changed = [a for a in base if not a.endswith("plan.py")] + [stage_file(tmp_path, "plan2.py", 6)]
    r = run(changed + ["--init_from=resume"], check=False)
    assert r.returncode == 1 and "--replan" in r.stderr and "Traceback" not in r.stderr
    assert "(stage 2: stored {'name': 'down', 'steps': 4," in r.stderr, r.stderr  # what differs, not only that it does
    # so is another --dataset: stages without a mix train on it (it trained on the old corpus, the config said other)
    r = run(base + ["--init_from=resume", "--dataset=other"], check=False)
    assert r.returncode == 1 and "--replan" in r.stderr and "dataset: stored 'local', config 'other'" in r.stderr
    # --status prints plan against progress
    said = main_output(["--status", out])[0]
    assert "FINISHED" in said and "down" in said and "  finished: its last step 11 trained" in said
    # a --replan that extends the finished plan keeps its end: saved again as "final", it was an ordinary checkpoint
    # that keep_last deleted (the finished model); --resume_from takes the run dir, as grow_from and finetune_from do
    longer = tmp_path / "plan3.py"
    longer.write_text(open(base[len(TINY)]).read().replace("]\n", ", dict(name='more', steps=4)]\n"))
    # a field the checkpoint decides, set otherwise on a resume, was ignored without a word
    top_k = st["model_config"]["top_k"]
    r = run([a for a in base if not a.endswith("plan.py")] + [str(longer), "--init_from=resume", f"--resume_from={out}",
                                                               "--replan", "--ckpt_interval=2", "--keep_last=1",
                                                               f"--top_k={3 - top_k}"])
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [3, 7, 11, 15]
    assert "REPLAN: adopting the config's plan (stages: stored 3 stages, config 4 stages;" in r.stdout + r.stderr
    # its stable stage after the decay: from min_lr back to the peak at once, which was unsaid
    assert "WARNING: REPLAN: the next step trains at lr 1.00e-03, the old plan's was 1.00e-04 (10x" in r.stdout, r.stdout
    assert metrics(out)[12]["lr"] == 1e-3
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "ignored; the checkpoint's" in ln]
    assert said == [f"WARNING: resume: top_k={3 - top_k} ignored; the checkpoint's {top_k} stays (the "
                    f"architecture comes from the checkpoint)"], said
    # a fine-tune takes the config's longer context and balancing rate (the checkpoint's, with its max_seq_len 64,
    # refused a longer seq_len while the error said to raise --max_seq_len)
    ft = str(tmp_path / "ft")
    run(TINY + [f"--data_root={data_root}", f"--out_dir={ft}", "--init_from=finetune", f"--finetune_from={out}",
                "--max_iters=20", "--warmup_iters=1", "--eval_interval=100", "--max_seq_len=128", "--seq_len=128",
                "--bias_update_rate=0.5", "--stop_after_steps=1"])
    mc = json.load(open(os.path.join(checkpoint.latest_valid(ft), "state.json")))["model_config"]
    assert mc["max_seq_len"] == 128 and mc["bias_update_rate"] == 0.5


def test_the_resume_command_keeps_the_start_s_arguments_but_not_how_it_began(monkeypatch):
    """A rollback's --resume_from repeated would roll back again; the guardian's child says --supervise; a path with
    a space stays one argument."""
    import shlex
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setitem(train._RUN_INFO, "argv", ["config/tiny.py", "--out_dir=my runs/a", "--init_from=resume",
                                                  "--resume_from=my runs/a/step_0000010", "--stop_after_steps=5"])
    monkeypatch.delenv(rundir.LOCKED_OUT_ENV, raising=False)
    said = train.next_step(None)
    assert shlex.split(said.partition("resume with: ")[2]) == [
        "python", "train.py", "config/tiny.py", "--out_dir=my runs/a", "--stop_after_steps=5", "--init_from=resume"]
    monkeypatch.setenv(rundir.LOCKED_OUT_ENV, "/x/guardian/locked-out")
    assert train.next_step(None).endswith("--stop_after_steps=5 --init_from=resume --supervise")
    # a guardian's restart appends what is left of the stop: the user's own is the one to repeat
    train._RUN_INFO["argv"] += ["--stop_after_steps=2", "--init_from=resume", "--resume_from="]
    assert train.next_step(None).endswith("'--out_dir=my runs/a' --stop_after_steps=5 --init_from=resume --supervise")


def test_a_corpus_read_again_names_the_script_that_made_it(data_root, tmp_path):
    """A corpus prepared under another name (--out data/mine) named data/mine/prepare.py, which does not exist."""
    mine = tmp_path / "mine"
    mine.mkdir()
    shutil.copyfile(os.path.join(data_root, "local", "index.json"), mine / "index.json")
    said = train.reread_warning("mine", str(mine), 3000, 1000)
    assert "read ~3.0 times; prepare more (python data/local/prepare.py --help)" in said, said
    assert "(python data/none/prepare.py --help)" in train.reread_warning("none", str(tmp_path / "none"), 3000, 1000)


def test_a_corpus_read_again_is_said_from_its_position_and_when_an_on_demand_decay_reads_past_it(data_root, tmp_path):
    """The re-read warning counted the whole plan's share of a corpus from token 0: a --replan whose stages before
    the resume were not what was read (the stream had given more), and an on-demand decay longer than the plan's rest
    (--decay_tokens: a small annealing corpus read again), re-read it without a word; 3% over said "read ~1.0 times".
    Now: what the stream gave (its position) plus the plan's share from there, which is what the mix delivers."""
    import numpy as np
    import shards
    local = os.path.join(data_root, "local")
    for name, n in (("small", 1000), ("big", 5000)):
        d = tmp_path / name
        d.mkdir()
        shutil.copyfile(os.path.join(local, "tokenizer.json"), d / "tokenizer.json")
        tokens = np.random.default_rng(0).integers(1, 320, n).astype(np.uint16)
        entry = {"file": "train_000000.bin", "tokens": n, "sha256": shards.write_shard(d / "train_000000.bin", tokens)}
        shards.write_index(d, {"version": 1, "tokenizer": "tokenizer.json", "vocab_size": 320,
                               "tokenizer_sha256": checkpoint.sha256_file(str(d / "tokenizer.json")),
                               "splits": {"train": [entry]}})
    streams = {c: shards.TokenStream(tmp_path / c) for c in ("big", "small")}
    plan = [dict(name="w", mix={"big": 1.0}, tokens=320, seq_len=8, lr_phase="warmup"),
            dict(name="main", mix={"big": 3, "small": 1}, tokens=3200, seq_len=8, lr_phase="stable")]
    assert train.reread_warnings(plan, 0, streams, str(tmp_path)) == []  # 800 of small's 1000 tokens
    # what the warning counts is what the mix delivers: train.py's loop on the streams (4 rows of 8 a step)
    for tokens in range(0, 3520, 32):
        i, stage, into = schedule.stage_at(plan, tokens)
        for c, rows in schedule.rows_per_stream(stage["mix"], 4, into // 32).items():
            if rows:
                streams[c].next_batch(rows, 8)
    assert (streams["small"].tokens_read, streams["big"].tokens_read) == (800, 2720)
    # resumed at the end of w after a --replan (w read small, 900 tokens): 900 + 800 of small's 1000
    streams["small"].set_position({"shard": 0, "offset": 900, "epoch": 0})
    streams["big"].set_position({"shard": 0, "offset": 0, "epoch": 0})
    said = train.reread_warnings(plan, 320, streams, str(tmp_path))
    assert len(said) == 1 and "~1,700 tokens of small, which holds 1,000 train tokens: it is read ~1.7 times" in said[0]
    # an on-demand decay at 1,920 (small at 400: a quarter of main's 1,600 so far) on main's mix: one of 1,600 tokens
    # (the plan's rest) reads 400 more of small, 800 in all; one of 2,560 reads 1,040 (said once, at the decay)
    streams["small"].set_position({"shard": 0, "offset": 400, "epoch": 0})
    for length, read in ((1600, None), (2560, 1040)):
        cut = schedule.decay_now(plan, 1920, length, lambda T: 32)
        said = train.reread_warnings(cut, 1920, streams, str(tmp_path), before=plan)
        assert said == ([] if read is None else [train.reread_warning("small", str(tmp_path / "small"), read, 1000)])
    assert "~1,040 tokens of small, which holds 1,000 train tokens: it is read ~1.04 times" in said[0], said
    assert train.reread_warnings(cut, 1920, streams, str(tmp_path), before=cut) == []  # (nothing more than before)

def test_status_says_the_lr_the_next_step_trains_at(data_root, tmp_path):
    """--status took a step's tokens as tokens / steps, an average over stages of other seq_lens (or an earlier
    batch_size, grad_accum): 1 step into this decay it said lr now 2.7e-4 where the next step trained at 3.6e-4."""
    out = str(tmp_path / "run")
    plan = tmp_path / "plan.py"
    plan.write_text("stages = [dict(name='warm', steps=2, lr_phase='warmup'), dict(name='down', steps=4, seq_len=16, "
                    "lr_phase='decay')]\n")
    base = TINY + [str(plan), f"--data_root={data_root}", f"--out_dir={out}", "--eval_interval=100",
                   "--learning_rate=1e-3", "--min_lr=1e-4", "--grad_accum=2"]
    run(base + ["--stop_after_steps=3"])
    said = float(main_output(["--status", out])[0].split("lr now ")[1].split(";")[0])
    run(base + ["--init_from=resume", "--stop_after_steps=1"])
    assert said == pytest.approx(metrics(out)[4]["lr"], rel=1e-3), (said, metrics(out)[4]["lr"])


def test_start_decay_on_demand(data_root, three_steps, tmp_path):
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND]
    shutil.copytree(three_steps, out)
    json.dump({"start_decay": True}, open(os.path.join(out, "control.json"), "w"))
    run(base + ["--init_from=resume", "--stop_after_steps=1"])
    # another decay_tokens once the decay began was used nowhere (the stored decay trained on): refused, nothing trained
    r = run(base + ["--init_from=resume", "--decay_tokens=256"], check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr[-2000:]
    assert "decay_tokens 512 -> 256: the decay started at 384 tokens" in r.stderr and "--decay_tokens=512" in r.stderr
    assert checkpoint.latest_valid(out).endswith("step_0000004")
    # a --replan (a longer plan) keeps the decay that started: control.json could not start it again
    run([a for a in base if a != "--max_iters=100"] + ["--max_iters=200", "--init_from=resume", "--replan"])
    st = json.load(open(os.path.join(out, open(os.path.join(out, "LATEST")).read().strip(), "state.json")))
    assert st["finished"] and st["step"] == 3 + 512 // 128 and st["plan"][-1]["lr_phase"] == "decay"
    assert st["plan"][-1]["name"] == "decay-on-demand" and st["decay_started_at_tokens"] == 3 * 128


def test_decay_frac_sizes_an_on_demand_decay_of_stages_without_one(data_root, tmp_path):
    """With stages, --decay_frac was refused as having no effect; a plan with no decay stage (and no decay_tokens)
    sizes its on-demand decay by it."""
    out = str(tmp_path / "run")
    plan = tmp_path / "plan.py"
    plan.write_text("stages = [dict(name='warm', steps=2, lr_phase='warmup'), dict(name='main', steps=6)]\n")
    base = TINY + [str(plan), f"--data_root={data_root}", f"--out_dir={out}", "--decay_frac=0.5", "--eval_interval=1000"]
    run(base + ["--stop_after_steps=2"])
    json.dump({"start_decay": True}, open(os.path.join(out, "control.json"), "w"))
    run(base + ["--init_from=resume"])
    st = json.load(open(os.path.join(out, open(os.path.join(out, "LATEST")).read().strip(), "state.json")))
    assert st["finished"] and st["plan"][-1]["name"] == "decay-on-demand" and st["plan"][-1]["tokens"] == 8 * 128 // 2


def test_decay_on_demand_during_or_after_the_decay_never_returns_to_the_peak_lr():
    plan = [dict(name=n, mix={"a": 1.0}, tokens=t, seq_len=8, lr_phase=p)
            for n, t, p in (("w", 10, "warmup"), ("s", 70, "stable"), ("d", 20, "decay"))]
    lr = lambda pl, t: schedule.lr_at(pl, t, 3e-3, 3e-4)
    cut = schedule.decay_now(plan, 40, 30)  # in the stable stage: cut there, then 30 tokens of decay
    assert schedule.plan_tokens(cut) == 70 and cut[-1]["lr_phase"] == "decay" and lr(cut, 40) == 3e-3
    for at in (90, 100, 130):  # inside the plan's own decay, at its end, after it
        again = schedule.decay_now(plan, at, 30)
        assert schedule.plan_tokens(again) == 100 and lr(again, at) == lr(plan, at) < 3e-3
    # asked during the warmup: the warmup ends first (the decay began at the peak LR: an unwarmed 5x jump)
    early = schedule.decay_now(plan, 4, 30)
    assert schedule.plan_tokens(early) == 40 and lr(early, 4) == lr(plan, 4) < 3e-3 and lr(early, 10) == 3e-3
    # the decay's last step runs at min_lr (counted from the step's start, it ran above it, and min_lr never trained)
    assert schedule.lr_at(early, 38, 3e-3, 3e-4, step_tokens=2) == 3e-4
    assert 3e-4 < schedule.lr_at(early, 36, 3e-3, 3e-4, step_tokens=2) < schedule.lr_at(early, 10, 3e-3, 3e-4, 2) < 3e-3


def test_a_run_too_short_for_a_decay_step_says_so_and_ends_at_its_lr():
    """config/tiny.py --max_iters=4 --warmup_iters=0: 0.2 x 4 rounds to no decay step, silently, and --status then
    said "lr now" min_lr for a run that never decayed (past the plan's end lr_at was min_lr whatever the plan)."""
    cfg = dict(stages=None, max_iters=4, warmup_iters=0, decay_frac=0.2, seq_len=8, dataset="a")
    plan = schedule.build_plan(cfg, lambda T: T)
    assert [s["lr_phase"] for s in plan] == ["stable"]
    assert "no decay step" in schedule.no_decay_note(cfg) and "at least 5" in schedule.no_decay_note(cfg)
    assert schedule.no_decay_note({**cfg, "max_iters": 5}) is None and schedule.no_decay_note({**cfg, "decay_frac": 0}) is None
    assert schedule.lr_at(plan, 32, 3e-3, 3e-4) == 3e-3  # finished: where the stable stage left it
    decayed = schedule.build_plan({**cfg, "max_iters": 5}, lambda T: T)
    assert schedule.lr_at(decayed, 40, 3e-3, 3e-4) == 3e-4


def test_a_warmup_after_a_decay_climbs_from_min_lr():
    """A warmup stage after a decay (a finished run replanned to climb back, as the replan warning advises) began at
    lr/n, far under min_lr (1e-4 -> 1e-5 here), then climbed; the plan's first warmup still starts from 0."""
    plan = [dict(name=n, mix={"a": 1.0}, tokens=t, seq_len=8, lr_phase=p) for n, t, p in
            (("w", 40, "warmup"), ("s", 20, "stable"), ("d", 40, "decay"), ("w2", 100, "warmup"), ("s2", 10, "stable"))]
    lr = [schedule.lr_at(plan, t, 1e-3, 1e-4, 10) for t in range(0, 210, 10)]
    assert lr[:4] == pytest.approx([1e-3 * k / 4 for k in range(1, 5)])  # the first warmup: from 0
    assert lr[9] == 1e-4  # the decay's last step
    assert lr[10:20] == pytest.approx([1e-4 + 9e-4 * k / 10 for k in range(1, 11)])  # from min_lr to the peak
    assert lr[20] == 1e-3


def test_a_warmup_or_decay_split_over_stages_is_one_ramp():
    """A decay split into two stages (another mix or seq_len for its end) went back up to the peak LR at the second
    (1e-4 -> 4.8e-4 mid-decay, then down to min_lr again); a split warmup dropped from the peak to lr/n; and an
    on-demand decay asked in the first of two warmup stages began (at the peak) before the warmup was over."""
    plan = [dict(name=n, mix={"a": 1.0}, tokens=t, seq_len=8, lr_phase=p) for n, t, p in
            (("w1", 20, "warmup"), ("w2", 20, "warmup"), ("s", 40, "stable"), ("d1", 30, "decay"), ("d2", 30, "decay"))]
    one = [plan[0] | dict(tokens=40), plan[2], plan[3] | dict(tokens=60)]  # the same plan, one stage per phase
    for t in range(0, 140, 10):
        assert schedule.lr_at(plan, t, 1e-3, 1e-4, 10) == schedule.lr_at(one, t, 1e-3, 1e-4, 10), t
    lrs = [schedule.lr_at(plan, t, 1e-3, 1e-4, 10) for t in range(80, 140, 10)]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 1e-4 and lrs[-2] > 1e-4
    early = schedule.decay_now(plan, 5, 30)  # in w1: the decay starts after w2, at the peak the warmup reached
    assert [s["name"] for s in early] == ["w1", "w2", "decay-on-demand:d1", "decay-on-demand:d2"]
    assert schedule.lr_at(early, 30, 1e-3, 1e-4, 10) == 1e-3
    # an on-demand decay is as long as the plan's whole decay (it took d1's 30 tokens alone), unless decay_tokens
    assert schedule.on_demand_decay_tokens(plan, 0, 0.2) == 60 and schedule.on_demand_decay_tokens(plan, 24, 0.2) == 24
    assert schedule.on_demand_decay_tokens(plan[:3], 0, 0.25) == schedule.decay_length(0.25, 80)
    during = schedule.decay_now(plan, 90, 30)  # in d1: the plan's decay goes on to its end (d2), on the same ramp
    assert during == plan and schedule.lr_at(during, 90, 1e-3, 1e-4, 10) == schedule.lr_at(plan, 90, 1e-3, 1e-4, 10)


def test_a_plan_with_two_decays_follows_wsd_on_every_step_and_an_on_demand_decay_is_a_ramp_of_its_own():
    """Stages may hold more than one decay (a stable stage between them, the second split over two mixes): each
    ramp (1 - sqrt) from the peak to min_lr on its last step, whole steps each. An on-demand decay asked just as the
    first decay ended joined its ramp: the LR went from min_lr back up to 3.6e-4 mid-ramp (and the stored plan's
    finished decay got another shape)."""
    lr, lr_min, T, tps = 1e-3, 1e-4, 8, 4 * 8
    per_step = lambda _T: tps  # noqa: E731
    phases = [("w", 3, "warmup"), ("s", 5, "stable"), ("d1", 4, "decay"), ("s2", 3, "stable"), ("d2a", 2, "decay"),
              ("d2b", 2, "decay")]  # tokens off whole steps by under half a step: build_plan rounds them
    stages = [dict(name=n, tokens=k * tps + (-1) ** k * (tps // 2 - 1), lr_phase=p, mix={"a": 1.0} if n != "d2b" else
                   {"b": 1.0}) for n, k, p in phases]
    plan = schedule.build_plan(dict(stages=stages, seq_len=T, dataset="a"), per_step)
    assert [(s["name"], s["tokens"]) for s in plan] == [(n, k * tps) for n, k, _ in phases]

    def wsd(ramps):  # the LR of every step from [(phase, steps)], each warmup or decay a ramp of its own
        out = []
        for p, n in ramps:
            out += [lr * (k + 1) / n if p == "warmup" else lr if p == "stable" else
                    lr_min + (lr - lr_min) * (1 - math.sqrt((k + 1) / n)) for k in range(n)]
        return out

    def check(pl, ramps):
        assert all(s["tokens"] > 0 and s["tokens"] % tps == 0 for s in pl), pl  # stage boundaries on whole steps
        got = [schedule.lr_at(pl, k * tps, lr, lr_min, tps) for k in range(schedule.plan_tokens(pl) // tps)]
        assert got == pytest.approx(wsd(ramps), rel=1e-12, abs=0), [s["name"] for s in pl]
        assert schedule.lr_at(pl, schedule.plan_tokens(pl), lr, lr_min, tps) == lr_min  # past the end: at min_lr
    check(plan, [("warmup", 3), ("stable", 5), ("decay", 4), ("stable", 3), ("decay", 4)])
    ask = lambda k: schedule.decay_now(plan, k * tps, schedule.on_demand_decay_tokens(plan, 0, 0.2, k * tps),  # noqa
                                       per_step)
    # in s: a copy of the first decay; in d1: the plan ends with it; just after d1 or in s2: a copy of the second
    check(ask(5), [("warmup", 3), ("stable", 2), ("decay", 4)])
    assert ask(9) == plan[:3]
    after = ask(12)
    assert [s["name"] for s in after] == ["w", "s", "d1", "decay-on-demand:d2a", "decay-on-demand:d2b"]
    check(after, [("warmup", 3), ("stable", 5), ("decay", 4), ("decay", 4)])
    check(ask(13), [("warmup", 3), ("stable", 5), ("decay", 4), ("stable", 1), ("decay", 4)])


def test_an_on_demand_decay_trains_as_the_plans_own_decay_would():
    """An on-demand decay was one stage on the mix and seq_len of the stage it cut: a decay planned on an annealing
    mix (and another seq_len), here over two stages, was lost for the stable stage's mix; only its length was kept."""
    plan = [dict(name=n, mix=m, tokens=t, seq_len=T, lr_phase=p) for n, m, t, T, p in
            (("w", {"web": 1.0}, 16, 8, "warmup"), ("s", {"web": 1.0}, 64, 8, "stable"),
             ("anneal", {"web": 0.5, "books": 0.5}, 64, 16, "decay"), ("code", {"code": 1.0}, 32, 4, "decay"))]
    tail = lambda pl: [(s["name"], s["mix"], s["tokens"], s["seq_len"], s["lr_phase"]) for s in pl[2:]]  # noqa: E731
    cut = schedule.decay_now(plan, 40, schedule.on_demand_decay_tokens(plan, 0, 0.2))  # as long as planned
    assert cut[:2] == [plan[0], dict(plan[1], tokens=24)]
    assert tail(cut) == [("decay-on-demand:anneal", {"web": 0.5, "books": 0.5}, 64, 16, "decay"),
                         ("decay-on-demand:code", {"code": 1.0}, 32, 4, "decay")]
    # decay_tokens=40: each stage scaled in proportion (26.7 and 13.3 tokens), then to whole steps of its own seq_len
    per_step = lambda T: T  # noqa: E731
    short = schedule.decay_now(plan, 40, 40, per_step)
    assert tail(short) == [("decay-on-demand:anneal", {"web": 0.5, "books": 0.5}, 32, 16, "decay"),
                           ("decay-on-demand:code", {"code": 1.0}, 8, 4, "decay")]
    # one ramp down over both, to min_lr on its last step
    end = schedule.plan_tokens(short)
    lrs = [schedule.lr_at(short, t, 1e-3, 1e-4, per_step(schedule.stage_at(short, t)[1]["seq_len"]))
           for t in (40, 56, 72, 76)]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 1e-4 and end == 80
    # asked during the warmup: still the planned decay's stages, after the warmup
    early = schedule.decay_now(plan, 4, 96)
    assert [s["name"] for s in early] == ["w", "decay-on-demand:anneal", "decay-on-demand:code"]
    # a single planned decay stage keeps the name others look for (train.py --replan, tests, operators' greps)
    one = schedule.decay_now(plan[:3], 40, 20, per_step)
    assert [(s["name"], s["seq_len"], s["tokens"]) for s in one[2:]] == [("decay-on-demand", 16, 16)]
    assert all(schedule.is_on_demand(s) for s in cut[2:] + one[2:]) and not any(map(schedule.is_on_demand, plan))


def test_an_on_demand_decay_without_a_planned_one_uses_the_stage_it_replaces():
    """Without a decay stage the on-demand decay takes the current stage's mix and seq_len; asked exactly at a stage
    boundary it took the previous stage's (here the short-context stage's, for a decay meant for the long one)."""
    plan = [dict(name=n, mix=m, tokens=t, seq_len=T, lr_phase=p) for n, m, t, T, p in
            (("w", {"a": 1.0}, 16, 8, "warmup"), ("short", {"a": 1.0}, 32, 8, "stable"),
             ("long", {"b": 1.0}, 64, 32, "stable"))]
    at = schedule.decay_now(plan, 48, 32)  # the first token of "long"
    assert [s["name"] for s in at] == ["w", "short", "decay-on-demand"]
    assert (at[-1]["mix"], at[-1]["seq_len"], at[-1]["tokens"]) == ({"b": 1.0}, 32, 32)
    assert schedule.decay_now(plan, 50, 32)[-1]["mix"] == {"b": 1.0}
    assert schedule.decay_now(plan, 20, 32)[-1]["mix"] == {"a": 1.0}  # inside "short"
    # asked during the warmup: the stage after it (the one the decay replaces), not the warmup's
    assert schedule.decay_now(plan, 4, 32)[-1]["name"] == "decay-on-demand"


def test_a_replan_keeps_every_stage_of_a_started_on_demand_decay(data_root, tmp_path):
    """A run whose plan decays over two stages (seq_len 16, then 8) decayed on demand on the stable stage's seq_len
    (32), and --replan kept only a stage named decay-on-demand (so would have dropped a decay copied in several)."""
    out = str(tmp_path / "run")
    plan = tmp_path / "plan.py"
    stages = ("dict(name='warm', steps=1, lr_phase='warmup'), dict(name='main', steps={}), "
              "dict(name='d1', steps=2, seq_len=16, lr_phase='decay'), dict(name='d2', steps=2, seq_len=8, lr_phase='decay')")
    plan.write_text(f"stages = [{stages.format(30)}]\n")
    # planned decay: 2 x 64 + 2 x 32 = 192 tokens; decay_tokens=384 doubles each stage: 4 steps of each
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--decay_tokens=384", "--eval_interval=1000",
                   "--min_lr=1e-4"]
    run([base[0], str(plan)] + base[1:] + ["--stop_after_steps=3"])
    json.dump({"start_decay": True}, open(os.path.join(out, "control.json"), "w"))
    run([base[0], str(plan)] + base[1:] + ["--init_from=resume", "--stop_after_steps=2"])
    longer = tmp_path / "longer.py"
    longer.write_text(f"stages = [{stages.format(60)}]\n")
    run([base[0], str(longer)] + base[1:] + ["--init_from=resume", "--replan"])
    st = json.load(open(os.path.join(out, open(os.path.join(out, "LATEST")).read().strip(), "state.json")))
    assert [(s["name"], s["tokens"], s["seq_len"]) for s in st["plan"]] == [
        ("warm", 128, 32), ("main", 2 * 128, 32), ("decay-on-demand:d1", 4 * 64, 16), ("decay-on-demand:d2", 4 * 32, 8)]
    assert st["finished"] and st["step"] == 3 + 4 + 4
    m = metrics(out)
    assert [m[k]["seq_len"] for k in range(4, 12)] == [16] * 4 + [8] * 4
    assert m[11]["lr"] == pytest.approx(1e-4) and m[8]["lr"] < m[7]["lr"]


@pytest.fixture(scope="module")
def two_of_four_steps(data_root, tmp_path_factory):
    """2 steps of a 4-step plan, evaluated at step 2 on 3 batches, trained once: the val-set test and the bad-input
    cases that need a run each start from a copy of it."""
    out = str(tmp_path_factory.mktemp("two_of_four_steps") / "run")
    run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=4", "--warmup_iters=1", "--eval_iters=3",
                "--stop_after_steps=2", "--eval_interval=2"])
    return out


@pytest.mark.parametrize("case", ["syntax", "missing_data", "unknown_dataset", "corrupt_checkpoint", "bad_override",
                                  "too_big", "zero_interval", "scratch_over_a_run", "status_of_a_damaged_step",
                                  "zero_batch_size", "zero_grad_accum", "seq_len_over_max", "lr_mult_typo", "cuda_index",
                                  "cuda_without_gpu",
                                  "float16", "max_iters_with_stages", "zero_heads", "shard_list", "swapped_tokenizer",
                                  "missing_tokenizer", "finetune_unreadable_weights", "resume_a_config_of_another_type",
                                  "beta_out_of_range", "negative_warmup", "empty_out_dir", "negative_rope_theta",
                                  "init_from_typo", "max_iters_in_the_stages_file", "warmup_iters_as_before_in_the_stages_file",
                                  "file_edits_a_default_in_place",
                                  "resume_a_step_without_state", "quarantine_typo", "finetune_from_unread",
                                  "grow_from_unread", "resume_another_runs_step", "finetune_from_stateless",
                                  "unprepared_dataset", "finetune_on_an_unprepared_dataset",
                                  "finetune_from_an_untrained_run", "top_k_one", "finetune_from_a_smaller_vocab",
                                  "grow_keys_on_a_finetune", "finetune_from_on_a_grow", "grow_where_on_a_finetune"])
def test_bad_input_one_line_errors(data_root, tmp_path, case, request):
    out = str(tmp_path / "run")
    args = TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=4", "--warmup_iters=1"]
    if case in ("corrupt_checkpoint", "resume_another_runs_step"):  # (only these train: the fixture, built once)
        two_of_four_steps = request.getfixturevalue("two_of_four_steps")
    if case == "syntax":
        bad = tmp_path / "bad.py"
        bad.write_text("batch_size = (\n")
        args = args + [str(bad)]
    elif case == "missing_data":
        args = args + ["--data_root=/nonexistent/data"]
    elif case == "unknown_dataset":
        args = args + ["--dataset=nope"]
    elif case == "unprepared_dataset":  # data/smoltalk before its prepare: "corrupt data", exit 3
        shutil.copytree(os.path.join(data_root, "local"), tmp_path / "data" / "local")
        os.makedirs(tmp_path / "data" / "sft")
        args = args + [f"--data_root={tmp_path / 'data'}", "--dataset=sft"]
    elif case == "finetune_on_an_unprepared_dataset":  # it said to run smoltalk's prepare, which requires --tokenizer
        shutil.copytree(os.path.join(data_root, "local"), tmp_path / "data" / "local")
        os.makedirs(tmp_path / "data" / "sft")
        src = request.getfixturevalue("three_steps")
        args = args + [f"--data_root={tmp_path / 'data'}", "--dataset=sft", "--init_from=finetune",
                       f"--finetune_from={src}"]
    elif case == "finetune_from_an_untrained_run":  # config/sft.py before out/tiny: the error named no key, and the
        out = str(tmp_path / "out" / "sft")  # refused start left out/sft/.trainer.lock and a crash report behind
        args = args + [f"--out_dir={out}", "--init_from=finetune", f"--finetune_from={tmp_path / 'out' / 'tiny'}"]
    elif case == "bad_override":
        args = args + ["--batch_size=many"]
    elif case == "too_big":  # the memory plan refuses before allocating anything
        args = args + ["--batch_size=1000000"]
    elif case == "zero_interval":
        args = args + ["--eval_interval=0"]
    elif case in ("zero_batch_size", "zero_grad_accum"):
        args = args + [f"--{case[5:]}=0"]
    elif case == "seq_len_over_max":  # refused before the model is built, naming the fix
        args = args + ["--seq_len=128"]
    elif case == "lr_mult_typo":
        args = args + ["--lr_mult={'embeddings': 0.3, 'old': 1.0, 'new': 1.0}"]
    elif case == "cuda_index":  # it trained on the CPU without a word
        args = args + ["--device=cuda:0"]
    elif case == "float16":
        args = args + ["--device=cuda", "--dtype=float16"]
    elif case == "cuda_without_gpu":  # (CUDA_VISIBLE_DEVICES hides a GPU where the suite has one)
        request.getfixturevalue("monkeypatch").setenv("CUDA_VISIBLE_DEVICES", "")
        args = args + ["--device=cuda", "--dtype=float32"]
    elif case == "finetune_from_unread":  # a fresh model trained, the checkpoint unread
        args = args + [f"--finetune_from={tmp_path}"]
    elif case == "finetune_from_stateless":  # a TypeError traceback, exit 10 (which the guardian restarted)
        checkpoint.save(str(tmp_path / "src"), 2, {"model.safetensors": lambda p: open(p, "w").write("x")})
        args = args + ["--init_from=finetune", f"--finetune_from={tmp_path / 'src'}"]
    elif case == "grow_from_unread":
        args = args + [f"--grow_from={tmp_path}", "--grow_layers=2"]
    elif case in ("grow_keys_on_a_finetune", "finetune_from_on_a_grow", "grow_where_on_a_finetune"):
        # the other start's keys went unread: a 3-layer fine-tune asked to grow 2 layers trained 3 layers, without a
        # word (and a grow given finetune_from was a base model that chat.py took for a chat-tuned one)
        src = request.getfixturevalue("three_steps")
        args = args + ["--stop_after_steps=0"] + {
            "grow_keys_on_a_finetune": ["--init_from=finetune", f"--finetune_from={src}", f"--grow_from={src}",
                                        "--grow_layers=2"],
            "finetune_from_on_a_grow": ["--init_from=grow", f"--grow_from={src}", "--grow_layers=1",
                                        f"--finetune_from={src}"],
            "grow_where_on_a_finetune": ["--init_from=finetune", f"--finetune_from={src}", "--grow_where=top"]}[case]
    elif case == "resume_another_runs_step":  # another run's step resumed in out_dir: out_dir's steps set aside
        other = str(tmp_path / "other")
        shutil.copytree(request.getfixturevalue("three_steps"), other)  # another run (any will do), trained once
        shutil.copytree(two_of_four_steps, out)
        before = sorted(n for n in os.listdir(out) if n.startswith("step_"))
        args = args + ["--init_from=resume", f"--resume_from={checkpoint.latest_valid(other)}"]
    elif case == "quarantine_typo":  # quarantined nothing, while the log said the shard was skipped
        args = args + ["--quarantine_shards=['local/train_00001.bin']"]
    elif case == "shard_list":  # a TypeError traceback when the quarantine was applied (exit 10: restarted)
        args = args + ["--quarantine_shards=[3]"]
    elif case == "swapped_tokenizer":  # another corpus's tokenizer.json: trained, and copied into every checkpoint
        shutil.copytree(os.path.join(data_root, "local"), tmp_path / "data" / "local")
        tok_file = tmp_path / "data" / "local" / "tokenizer.json"
        tok_file.write_text(json.dumps(json.loads(tok_file.read_text()), indent=2))  # other bytes, still a tokenizer
        args = args + [f"--data_root={tmp_path / 'data'}"]
    elif case == "missing_tokenizer":  # the tokenizer index.json pins, gone: trained silently, no checkpoint had one
        shutil.copytree(os.path.join(data_root, "local"), tmp_path / "data" / "local")
        os.remove(tmp_path / "data" / "local" / "tokenizer.json")
        args = args + [f"--data_root={tmp_path / 'data'}"]
    elif case in ("finetune_unreadable_weights", "resume_a_config_of_another_type"):  # manifests that verify: a
        from model import ModelConfig  # SafetensorError / TypeError traceback, exit 10 (the guardian restarted it)
        from dataclasses import asdict
        good = asdict(ModelConfig())
        bad = case == "resume_a_config_of_another_type"
        checkpoint.save(out if bad else str(tmp_path / "src"), 2, {
            "state.json": lambda p: json.dump({"step": 2, "model_config": {**good, "n_layer": "3"} if bad else good},
                                              open(p, "w")),
            "model.safetensors": lambda p: open(p, "wb").write(b"\x08" + b"\0" * 7 + b"{}garbage")})
        args = args + (["--init_from=resume"] if bad else
                       ["--init_from=finetune", f"--finetune_from={tmp_path / 'src'}"])
    elif case == "beta_out_of_range":  # torch's ValueError at step 0: exit 10, which the guardian restarted
        args = args + ["--beta1=1.5"]
    elif case == "negative_warmup":  # trained a longer plan without a warmup
        args = args + ["--warmup_iters=-5"]
    elif case == "empty_out_dir":  # a FileNotFoundError traceback
        args = args + ["--out_dir="]
    elif case == "negative_rope_theta":  # a NaN loss at step 0, blamed on the LR
        args = args + ["--rope_theta=-10000.0"]
    elif case == "init_from_typo":  # refused only after the run dir's control.json was set aside
        os.makedirs(out)
        open(os.path.join(out, "control.json"), "w").write("{}")
        args = args + ["--init_from=resum"]
    elif case == "max_iters_in_the_stages_file":  # the file's own max_iters did nothing, silently
        stage_file = tmp_path / "stages.py"
        stage_file.write_text("stages = [dict(name='all', steps=4, lr_phase='stable')]\nmax_iters = 500\n")
        args = TINY + [str(stage_file), f"--data_root={data_root}", f"--out_dir={out}"]
    elif case == "warmup_iters_as_before_in_the_stages_file":  # tiny.py's 30 again: the same int object, unseen
        stage_file = tmp_path / "stages.py"
        stage_file.write_text("stages = [dict(name='all', steps=4, lr_phase='stable')]\nwarmup_iters = 30\n")
        args = TINY + [str(stage_file), f"--data_root={data_root}", f"--out_dir={out}"]
    elif case == "file_edits_a_default_in_place":  # edited train.py's own dict, unchecked: a TypeError, exit 10
        edit = tmp_path / "edit.py"
        edit.write_text("lr_mult['old'] = 'fast'\n")
        args = args + [str(edit)]
    elif case == "finetune_from_a_smaller_vocab":  # it said "set --vocab_size=320", which the weights' 300 overrode
        import model as M
        M.save_checkpoint(M.Picaflor(M.ModelConfig(vocab_size=300, n_layer=3, d_model=32, n_head=4, n_kv_head=1,
                                                   dense_ffn=64, n_experts=8, expert_ffn=16, n_shared=1,
                                                   max_seq_len=64)), str(tmp_path / "src"), 2)
        args = args + ["--init_from=finetune", f"--finetune_from={tmp_path / 'src'}", "--vocab_size=320"]
    elif case == "top_k_one":  # trained a router that got no gradient (top-1 weights are normalised to 1)
        args = args + ["--top_k=1"]
    elif case == "zero_heads":  # a ZeroDivisionError traceback
        args = args + ["--n_head=0"]
    elif case == "max_iters_with_stages":  # the stages make the plan; the override did nothing
        stage_file = tmp_path / "stages.py"
        stage_file.write_text("stages = [dict(name='all', steps=4, lr_phase='stable')]\n")
        args = TINY + [str(stage_file), f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=100"]
    elif case == "scratch_over_a_run":  # the same command again after a crash, without --init_from=resume
        for step in (1, 2):  # a run's checkpoints (their content does not matter to the refusal)
            checkpoint.save(out, step, {"state.json": lambda p, s=step: json.dump({"step": s}, open(p, "w"))})
        before = {n: open(os.path.join(out, n, "state.json")).read() for n in os.listdir(out) if n.startswith("step_")}
    elif case == "resume_a_step_without_state":  # its manifest verifies without one: a TypeError traceback, exit 10
        checkpoint.save(out, 2, {"model.safetensors": lambda p: open(p, "w").write("x")})
        args = args + ["--init_from=resume"]
    elif case == "status_of_a_damaged_step":  # a step dir whose state.json is gone
        checkpoint.save(out, 2, {"model.safetensors": lambda p: open(p, "w").write("x")})
        args = ["--status", os.path.join(out, "step_0000002")]
    elif case == "corrupt_checkpoint":
        shutil.copytree(two_of_four_steps, out)
        for name in os.listdir(out):  # every checkpoint corrupt (resume skips a bad newest one for an older valid one)
            if name.startswith("step_"):
                f = os.path.join(out, name, "model.safetensors")
                data = bytearray(open(f, "rb").read())
                data[len(data) // 2] ^= 0xFF
                open(f, "wb").write(bytes(data))
        args = args + ["--init_from=resume"]
    out_existed = os.path.exists(out)
    r = run(args, check=False)
    assert r.returncode != 0
    if not out_existed and r.returncode == 1:  # a refused start left a lock file and a crash report: a run dir
        assert not os.path.exists(out), os.listdir(out)  # that looked like a crashed run to the fixed command
    err = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert len(err) == 1 and "error" in err[0] and "Traceback" not in r.stderr, r.stderr
    fix = {"seq_len_over_max": "--max_seq_len", "lr_mult_typo": "embedding, old and new", "cuda_index": "cpu or cuda",
           "cuda_without_gpu": "no CUDA GPU is visible; pass --device=cpu",
           "float16": "bfloat16", "max_iters_with_stages": "stages", "zero_batch_size": "at least 1",
           "zero_heads": "n_head=0 must be at least 1", "shard_list": "corpus/file",
           "top_k_one": "router gets no gradient", "finetune_from_a_smaller_vocab": "fix the vocab; train on a corpus",
           "quarantine_typo": "'local/train_00001.bin' is not a shard of local (its index.json lists",
           "finetune_from_unread": "is read only with --init_from=finetune", "grow_from_unread": "--init_from=grow",
           "grow_keys_on_a_finetune": "is read only with --init_from=grow (init_from is 'finetune')",
           "finetune_from_on_a_grow": "is read only with --init_from=finetune (init_from is 'grow')",
           "grow_where_on_a_finetune": "--grow_where=top is read only with --init_from=grow (init_from is 'finetune')",
           "resume_another_runs_step": "is a checkpoint of another run than the one in",
           "finetune_from_stateless": "no state.json with a model_config",
           "swapped_tokenizer": "differs from index.json's",
           "missing_tokenizer": "tokenizer.json: cannot read tokenizer file (No such file or directory); re-run",
           "finetune_unreadable_weights": "model.safetensors: not a readable safetensors file",
           "resume_a_config_of_another_type": "state.json: no model config this picaflor can build (ValueError: model "
                                              "config field n_layer='3' is not of its kind",
           "beta_out_of_range": "[0, 1)",
           "negative_warmup": "warmup_iters=-5: must be >= 0", "empty_out_dir": "--out_dir is empty",
           "negative_rope_theta": "rope_theta=-10000.0 must be", "init_from_typo": "scratch, resume, grow or finetune",
           "max_iters_in_the_stages_file": "max_iters (in ",
           "warmup_iters_as_before_in_the_stages_file": "warmup_iters (in ", "resume_a_step_without_state": "holds no training state.json", "file_edits_a_default_in_place": "lr_mult['old'] must be"}
    assert fix.get(case, "") in err[0], err[0]
    if case == "resume_another_runs_step":
        assert sorted(n for n in os.listdir(out) if n.startswith("step_")) == before  # nothing set aside
    if case == "init_from_typo":
        assert os.listdir(out) == ["control.json"]  # nothing moved, nothing written
    if case == "file_edits_a_default_in_place":
        assert train.lr_mult["old"] == 1.0
    if case == "corrupt_checkpoint":
        assert os.path.isdir(os.path.join(out, "step_0000002"))  # nothing deleted
        assert "no valid checkpoint" in err[0] and "--init_from=scratch" in err[0]
        # and that advice works: only invalid checkpoints do not make the run dir "a run" a scratch start refuses
        assert run([a for a in args if a != "--init_from=resume"] + ["--stop_after_steps=1"], check=False).returncode == 0
    if case in ("missing_data", "unknown_dataset", "unprepared_dataset"):
        assert "prepare.py" in err[0]
    if case == "missing_data":  # its default --out is data/<corpus>: the corpus went where this run never looks
        assert "prepare.py --out /nonexistent/data/local first" in err[0], err[0]
    if case == "unprepared_dataset":
        assert r.returncode == 1 and "corrupt" not in err[0], err[0]
        assert "--tokenizer" not in err[0]  # a scratch run's corpus trains its own
    if case == "finetune_from_an_untrained_run":
        assert err[0].startswith("train.py: error: --finetune_from: ") and not (tmp_path / "out").exists(), err[0]
    if case == "finetune_on_an_unprepared_dataset":  # the weights' tokenizer: their checkpoint, which holds it
        assert f"--tokenizer {checkpoint.latest_valid(src)}" in err[0], err[0]
    if case == "too_big":
        assert "memory plan" in err[0] and "lower batch_size" in err[0]
    if case == "scratch_over_a_run":  # refused before anything was written: every checkpoint as it was
        assert "--init_from=resume" in err[0]
        assert before and before == {n: open(os.path.join(out, n, "state.json")).read() for n in os.listdir(out)
                                     if n.startswith("step_")}
    expect = {"zero_interval": "--eval_interval=0", "status_of_a_damaged_step": "state.json"}
    assert expect.get(case, "") in err[0]


def test_plans_that_cannot_run_are_refused():
    """Each was a traceback (a stage field given as text) or trained something else silently (a 4-step run with
    tiny.py's 30 warmup steps trained 30)."""
    g = {k: getattr(train, k) for k in train._CONFIG_KEYS}
    per_step = lambda T: 128  # noqa: E731
    for stages, want in [([dict(name="a", tokens="2e3")], "whole number"), ([dict(name="a", steps=4.5)], "whole number"),
                         ([dict(name="a", steps=4, mix={"local": "1"})], "mix must be"),
                         ([dict(name="a", steps=4, mix="local")], "mix must be"),
                         ([dict(name="a", steps=4, mix={"a": float("nan"), "b": 1.0})], "finite"),  # NaN passed w < 0
                         ([dict(name="a", steps=4, mix={})], "mix must be"),  # trained on --dataset silently
                         ([dict(name=1, steps=4)], "name must be a string")]:
        with pytest.raises(schedule.PlanError, match=want):
            schedule.build_plan(dict(g, stages=stages), per_step)
    for stages in ([dict(name="w", steps=-20, lr_phase="warmup"), dict(name="d", steps=10, lr_phase="decay")],
                   [dict(name="main", tokens=-4096), dict(name="d", steps=10, lr_phase="decay")]):
        with pytest.raises(schedule.PlanError, match=">= 0"):  # was skipped: the run trained only its decay
            schedule.build_plan(dict(g, stages=stages), per_step)
    with pytest.raises(schedule.PlanError, match="warmup_iters=30"):
        schedule.build_plan(dict(g, stages=[], max_iters=4, warmup_iters=30), per_step)
    assert schedule.build_plan(dict(g, stages=[dict(name="a", tokens=2e3)]), per_step)[0]["tokens"] == 2048  # 2e3 is fine


def test_review_round_plans_are_whole_steps_and_keep_what_they_say():
    """Helper-54's review: a tokens stage shorter than a step was never trained (the step that crossed it trained its
    neighbour's mix), silently; decay_frac x max_iters lost a step to float error (0.35 x 180 = 62.99..., 62 steps);
    an on-demand decay pinned the seq_len of a stage that follows the config's."""
    g = {k: getattr(train, k) for k in train._CONFIG_KEYS}
    per_step = lambda T: 4 * T  # noqa: E731
    stages = [dict(name="main", tokens=2000, mix={"a": 1.0}, seq_len=64), dict(name="anneal", tokens=40, mix={"b": 1.0}),
              dict(name="decay", steps=2, lr_phase="decay")]
    with pytest.raises(schedule.PlanError, match=r"stages\[1\] \(anneal\): tokens=40 is less than half a step"):
        schedule.build_plan(dict(g, stages=stages, seq_len=64), per_step)
    # a resume keeps its stored plan: the config's is only compared, never refused for it (a larger --batch_size)
    assert schedule.build_plan(dict(g, stages=stages, seq_len=64), per_step, refuse_short=False)[1]["tokens"] == 256
    stages[1]["tokens"] = 200  # 0.78 of a step: one step
    plan = schedule.build_plan(dict(g, stages=stages, seq_len=64), per_step)
    assert [s["tokens"] for s in plan] == [2048, 256, 512]  # whole steps: each stage trains its own mix
    plan = schedule.build_plan(dict(g, stages=[], max_iters=180, warmup_iters=10, decay_frac=0.35), per_step)
    assert [s["tokens"] // per_step(g["seq_len"]) for s in plan] == [10, 107, 63]
    cut = schedule.decay_now(plan, 50 * per_step(g["seq_len"]), 20 * per_step(g["seq_len"]))
    assert cut[-1]["name"] == "decay-on-demand" and cut[-1]["seq_len_from_config"] is True


def test_a_mix_splits_every_micro_step_into_counts_of_zero_or_more_that_follow_the_weights():
    """rows_per_stream gave the last-named corpus what rounding left: -1 rows at times (a crash in the data loader,
    restarted for ever by the guardian) whenever it had less than a row per micro-step, and a weight of 0 a row."""
    import random
    rng = random.Random(0)
    mixes = [{"a": 2, "b": 1, "zzz": 0}, {"code": .525, "fineweb": .4625, "wiki": .0125}, {"a": 1.0, "b": 1.0},
             {"x": 0.3}] + [{c: rng.choice([0, rng.random(), rng.randint(1, 5)]) for c in "pqrst"} for _ in range(20)]
    for mix in mixes:
        if sum(mix.values()) == 0:
            continue
        rows = rng.randint(1, 9)
        got = dict.fromkeys(mix, 0)
        for micro in range(600):
            counts = schedule.rows_per_stream(mix, rows, micro)
            assert set(counts) == set(mix) and sum(counts.values()) == rows and min(counts.values()) >= 0, (mix, counts)
            for c, n in counts.items():
                got[c] += n
        total = sum(mix.values())
        for c, w in mix.items():  # the long-run share: within a row per corpus of the weights
            assert abs(got[c] - 600 * rows * w / total) <= len(mix), (mix, c, got)
            assert w > 0 or got[c] == 0
    # two corpora: the split the old rounding gave (runs that resume across this change read the same rows)
    for micro in range(50):
        share = 3 / 7
        first = math.floor((micro + 1) * 5 * share) - math.floor(micro * 5 * share)
        assert schedule.rows_per_stream({"b": 4, "a": 3}, 5, micro) == {"a": first, "b": 5 - first}


@pytest.mark.parametrize("path", sorted(f"config/{n}" for n in os.listdir(os.path.join(REPO, "config")) if n.endswith(".py")))
def test_every_config_file_is_valid(path):
    import configurator
    g = {k: getattr(train, k) for k in train._CONFIG_KEYS}
    configurator.configure(g, [os.path.join(REPO, path)])  # unknown keys or wrong types raise
    cfg = train.model_config_from(g)
    assert cfg.vocab_size <= 65535
    plan = schedule.build_plan(g, lambda T: g["batch_size"] * T * g["grad_accum"])
    assert schedule.plan_tokens(plan) > 0


def test_retention_keeps_the_last_k_every_stage_end_and_the_best(tmp_path):
    """DESIGN.md's retention: the last K (permanent ones), every stage's final one, the best by val loss; never the
    only valid checkpoint (a temporary one alone stays)."""
    out = str(tmp_path / "run")
    kinds = {1: "periodic", 2: "stage_final", 3: "temporary", 4: "periodic", 5: "best", 6: "periodic", 7: "temporary",
             8: "periodic"}
    for step, kind in kinds.items():
        checkpoint.save(out, step, {"state.json": lambda p, s=step, k=kind: open(p, "w").write(json.dumps(
            {"kind": k, "step": s}))})
    checkpoint.write_atomic_text(os.path.join(out, "BEST"), "step_0000005\n")
    rundir.retain(out, 2, saved=os.path.join(out, "step_0000008"))
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [2, 5, 6, 8]
    alone = str(tmp_path / "alone")
    checkpoint.save(alone, 4, {"state.json": lambda p: open(p, "w").write('{"kind": "temporary", "step": 4}')})
    assert rundir.retain(alone, 1) == [] and [s for s, _ in checkpoint.list_checkpoints(alone)] == [4]


def test_retention_skips_a_checkpoint_whose_state_is_unreadable(tmp_path):
    """One corrupt old state.json (a flipped byte, same size) stopped every later save with a JSON error: retention
    now leaves it alone (resume skips it by its hash) and prunes the rest as usual."""
    out = str(tmp_path)
    for step in range(1, 6):
        checkpoint.save(out, step, {"state.json": lambda p, s=step: open(p, "w").write(json.dumps({"kind": "periodic", "step": s}))})
    with open(os.path.join(out, "step_0000001", "state.json"), "r+") as f:
        f.write("X")
    removed = rundir.retain(out, 2)
    assert sorted(removed) == ["step_0000002", "step_0000003"]
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [1, 4, 5]


def test_a_rollback_before_an_on_demand_decay_trains_without_it(data_root, three_steps, tmp_path):
    """control.json stayed as it was after the trainer took start_decay, so resuming a step from before the decay (as
    README says, to train on without it) started it again at once; the file now records the step it was taken at."""
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND]
    shutil.copytree(three_steps, out)
    json.dump({"start_decay": True}, open(os.path.join(out, "control.json"), "w"))
    run(base + ["--init_from=resume", "--stop_after_steps=2"])
    assert json.load(open(os.path.join(out, "control.json")))["start_decay_taken_at_step"] == 3
    assert json.load(open(os.path.join(out, "step_0000004", "state.json")))["decay_started_at_tokens"] is not None
    # back to step 3 itself: saved before control.json was read there, so from before the decay too
    r = run(base + ["--init_from=resume", f"--resume_from={os.path.join(out, 'step_0000003')}", "--stop_after_steps=2"])
    st = json.load(open(os.path.join(out, "step_0000004", "state.json")))
    assert st.get("decay_started_at_tokens") is None and st["plan"][-1]["name"] != "decay-on-demand"
    assert not os.path.exists(os.path.join(out, "control.json")) and "trains without it" in r.stdout
    # a crash after the decay was taken at step 9, before a checkpoint held it: no rollback, so the request stays and
    # is taken again at step 9 itself (it was taken at once, at the resumed step 5: the run decayed 4 steps early)
    json.dump({"start_decay": True, "start_decay_taken_at_step": 9}, open(os.path.join(out, "control.json"), "w"))
    r = run(base + ["--init_from=resume", "--stop_after_steps=5"])
    assert "taken at step 9; this resume from step 5 takes it there" in r.stdout, r.stdout
    started = {s: json.load(open(os.path.join(out, f"step_{s:07d}", "state.json"))).get("decay_started_at_tokens")
               for s in (6, 9, 10)}
    assert started == {6: None, 9: None, 10: 9 * 128}, started
    assert json.load(open(os.path.join(out, "control.json")))["start_decay_taken_at_step"] == 9
    # --resume_from=OUT_DIR itself is a plain resume: a LATEST that lags (a kill between the rename and its write)
    # made it a rollback that set the newest valid step aside
    checkpoint.write_atomic_text(os.path.join(out, "LATEST"), "step_0000005\n")
    r = run(base + ["--init_from=resume", f"--resume_from={out}", "--stop_after_steps=1"])
    assert "step_0000010 at step 10" in r.stdout and "moved" not in r.stdout, r.stdout[-2000:]


def test_control_json_takes_only_true_and_resume_from_needs_init_from_resume(data_root, three_steps, tmp_path):
    """{"start_decay": "false"} started the decay (a non-empty string is truthy) and a misspelt key was ignored
    without a word; --resume_from without --init_from=resume trained a fresh model, the flag unread."""
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND]
    shutil.copytree(three_steps, out)
    json.dump({"start_decay": "false", "stat_decay": True}, open(os.path.join(out, "control.json"), "w"))
    r = run(base + ["--init_from=resume", "--stop_after_steps=1"])
    assert json.load(open(os.path.join(out, "step_0000004", "state.json"))).get("decay_started_at_tokens") is None
    assert "start_decay must be true or false" in r.stdout and "unknown key 'stat_decay'" in r.stdout, r.stdout[-2000:]
    r = run(TINY + [f"--data_root={data_root}", f"--out_dir={tmp_path / 'fresh'}",
                    f"--resume_from={os.path.join(out, 'step_0000004')}", "--stop_after_steps=1"], check=False)
    assert r.returncode == 1 and "--init_from=resume" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "fresh" / "step_0000001")
    # an earlier run's control.json in a fresh out_dir: set aside (read at step 0, the run skipped warmup and trained
    # only a decay)
    stale = tmp_path / "stale"
    stale.mkdir()
    json.dump({"start_decay": True, "start_decay_taken_at_step": 15}, open(stale / "control.json", "w"))
    r = run(TINY + [f"--data_root={data_root}", f"--out_dir={stale}", "--max_iters=6", "--warmup_iters=2",
                    "--eval_interval=1000"])
    st = json.load(open(os.path.join(checkpoint.latest_valid(str(stale)), "state.json")))
    assert st["step"] == 6 and st.get("decay_started_at_tokens") is None and "is from before this start" in r.stdout
    assert not (stale / "control.json").exists()


def test_one_trainer_per_run_dir_and_a_mirror_blip_on_resume_is_a_warning(data_root, three_steps, tmp_path):
    """Two trainers on one out_dir: the second's save() deleted the first's temp dir mid-save. And a mirror that was
    briefly unwritable when the guardian restarted the trainer ended the run (refused as a config error)."""
    import signal
    import time
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=40", "--warmup_iters=1",
                   "--eval_interval=1000"]
    first, alive, done = forkserver.start(["train.py", *base], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                                                 PICAFLOR_INJECT_SLEEP_AT_STEP="1"))
    try:
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(out, "metrics.jsonl")):  # past start-up: it holds the lock
            assert time.time() < deadline and alive.is_alive()
            time.sleep(0.1)
        r = run(base + ["--init_from=resume", "--lock_wait_s=1"], check=False, timeout=120)
        assert r.returncode == 1 and f"another trainer (pid {first})" in r.stderr, r.stderr[-2000:]
        assert len(r.stderr.strip().splitlines()) == 1 and "waiting up to 1 s" in r.stdout
        # no crash report: in the holder's run dir it would read as the holder's cause
        assert not [n for n in os.listdir(out) if n.startswith("crash-")]
    finally:
        if alive.is_alive():
            os.kill(first, signal.SIGKILL)
        done()
    other = TINY + [f"--data_root={data_root}", f"--out_dir={tmp_path / 'other'}", *ON_DEMAND]
    blocked = tmp_path / "mirror"
    blocked.write_text("a file where the mount should be")
    r = run(other + ["--stop_after_steps=3", f"--mirror_dir={blocked}"], check=False)
    assert r.returncode == 1 and "is not writable" in r.stderr  # a new run: refused before anything is trained
    assert checkpoint.latest_valid(str(tmp_path / "other")) is None
    shutil.copytree(three_steps, tmp_path / "other", dirs_exist_ok=True)  # other + --stop_after_steps=3, trained once
    r = run(other + ["--init_from=resume", "--stop_after_steps=1", f"--mirror_dir={blocked}"])
    assert "is not writable now" in r.stdout and "training goes on" in r.stdout


def test_the_last_step_of_a_plan_is_written_once(data_root, tmp_path):
    """A plan's last step was saved three times (best, stage final, final: ~31 GB each at nano size); one save under
    its strongest kind keeps what the three did: finished, protected, and BEST."""
    out = str(tmp_path / "run")
    wrapper = ("import atexit, runpy, sys, model\n"
               "saved, real = [], model.save_checkpoint\n"
               "def counting(m, out_dir, step, **kw):\n"
               "    saved.append(step)\n"
               "    return real(m, out_dir, step, **kw)\n"
               "model.save_checkpoint = counting\n"
               "atexit.register(lambda: print('SAVED', saved))\n"
               "sys.argv = ['train.py'] + sys.argv[1:]\n"
               "runpy.run_path('train.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", wrapper, *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                        "--max_iters=4", "--warmup_iters=1", "--eval_interval=4"], cwd=REPO, capture_output=True,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "SAVED [1, 4]" in r.stdout, r.stdout[-1500:]  # the warmup stage's end, then the plan's (was [1, 4, 4, 4])
    st = json.load(open(os.path.join(out, "step_0000004", "state.json")))
    assert st["finished"] and st["kind"] == "final" and st["best_step"] == 4
    assert open(os.path.join(out, "BEST")).read().strip() == "step_0000004"
    said = main_output(["--status", out])[0]
    assert "FINISHED" in said and f"best val loss {st['best_val_loss']:.4f} (step 4)" in said, said  # (17 digits before)
    # a finished run says so, its last step and loss (it printed the LR "of what remains" and "time left 0m00s")
    last = metrics(out)[4]["loss"]
    assert f"  finished: its last step 4 trained; final loss {last:.4f}\n" in said, said
    assert "of what remains" not in said and "time left" not in said, said
    # the finished run's last line names what to do with the model (it named nothing)
    assert f"planned stages done (512 tokens); next: python eval.py {out} " in r.stdout, r.stdout[-1500:]



def test_the_val_loss_of_a_stages_last_step_is_at_that_stages_seq_len(data_root, tmp_path):
    """evaluate() read the seq_len of the stage the tokens are in after the step: a stage's last step was measured at
    the next stage's seq_len (logged beside its own, best_val_set saying the next one's). Each step's val loss is at
    the seq_len it trained at; the next stage's other seq_len is another val set, and the best restarts, said."""
    plan = tmp_path / "plan.py"
    plan.write_text("stages = [dict(name='short', steps=2, seq_len=16, lr_phase='warmup'),"
                    " dict(name='long', steps=1, seq_len=32, lr_phase='stable')]\n")
    out = str(tmp_path / "run")
    r = run(TINY + [str(plan), f"--data_root={data_root}", f"--out_dir={out}", "--eval_interval=2"])
    m = metrics(out)
    assert [(m[s]["seq_len"], "val_loss" in m[s]) for s in (1, 2, 3)] == [(16, False), (16, True), (32, True)]
    at_2, at_3 = (json.load(open(os.path.join(out, f"step_000000{s}", "state.json"))) for s in (2, 3))
    assert at_2["best_step"] == 2 and at_2["best_val_set"][:2] == [2 * 4, 16], at_2["best_val_set"]
    assert at_3["best_step"] == 3 and at_3["best_val_set"][:2] == [2 * 4, 32], at_3["best_val_set"]
    assert "val set changed ([8, 16] -> [8, 32] rows, seq_len)" in r.stdout + r.stderr, r.stdout[-2000:]

def test_a_corpus_a_replan_drops_keeps_its_position_for_a_plan_that_brings_it_back(data_root, tmp_path):
    """A --replan without corpus b saved no position for it, so a later plan with b again started b from its first
    token: the same documents trained twice, silently."""
    root = tmp_path / "data"
    root.mkdir()
    for c in ("a", "b"):
        shutil.copytree(os.path.join(data_root, "local"), root / c)
    out = str(tmp_path / "run")
    plan = lambda name, mix: str(tmp_path / name) if (tmp_path / name).write_text(  # noqa: E731
        f"stages = [dict(name='warm', steps=2, lr_phase='warmup', mix={mix}), "
        f"dict(name='flat', steps=20, lr_phase='stable', mix={mix})]\n") else None
    base = TINY + [f"--data_root={root}", f"--out_dir={out}", "--eval_interval=1000"]
    both, only_a = plan("both.py", {"a": 1.0, "b": 1.0}), plan("a.py", {"a": 1.0})
    latest = lambda: json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))  # noqa: E731
    run(base + [both, "--stop_after_steps=3"])
    b_before = latest()["data_position"]["b"]
    r = run(base + [only_a, "--init_from=resume", "--replan", "--stop_after_steps=2"])
    assert "corpus b is not in this plan" in r.stdout + r.stderr
    st = latest()
    assert st["step"] == 5 and st["data_position"]["b"] == b_before and "b" in st["data_split_sha"]
    run(base + [both, "--init_from=resume", "--replan", "--stop_after_steps=1"])
    lengths = [int(e["tokens"]) for e in json.load(open(root / "b" / "index.json"))["splits"]["train"]]
    at = lambda p: p["epoch"] * sum(lengths) + sum(lengths[:p["shard"]]) + p["offset"]  # noqa: E731
    assert at(latest()["data_position"]["b"]) > at(b_before) > 0  # it went on from there, not from the start


def test_a_config_file_on_resume_wins_as_its_flags_do(data_root, three_steps, tmp_path):
    """max_seq_len set in a config file lost to the checkpoint's (only flags counted as given), and the longer
    seq_len was then refused, asking to raise the max_seq_len the file had raised."""
    out = str(tmp_path / "run")
    longer = tmp_path / "longer.py"
    longer.write_text("max_seq_len = 128\nseq_len = 128\n")
    # (after the config file, before the flags: a flag given before a file that sets its key is refused)
    flags = [a for a in TINY[1:] if not a.startswith(("--max_seq_len=", "--seq_len="))]
    base = [TINY[0], str(longer), *flags, f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND]
    shutil.copytree(three_steps, out)
    run(base + ["--init_from=resume", "--stop_after_steps=1"])
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] == 4 and st["model_config"]["max_seq_len"] == 128


def test_help_shows_the_values_of_the_config_files_given_beside_it(monkeypatch):
    """`train.py config/nano.py --help` printed train.py's own defaults, not the ones the config file sets."""
    monkeypatch.chdir(REPO)  # config/tiny.py as given on the command line
    plain = main_output(["--help"])[0]
    tiny = main_output(["config/tiny.py", "--batch_size=3", "--help"])[0]
    assert "--max_iters=1000" in plain and "--max_iters=300" in tiny and "--batch_size=3" in tiny
    assert "config/tiny.py --batch_size=3 applied" in tiny
    _, err, code = main_output(["--help", "--nope=1"])
    assert code == 2 and "unknown config key 'nope'" in err
    _, err, code = main_output(["--help", "--qqqq=1"])  # no near key: it said no fix
    assert code == 2 and "unknown config key 'qqqq'; drop --qqqq" in err
    assert train.max_iters == 1000 and train.batch_size != 3  # train's own globals untouched (the next test reads them)


def test_status_help_prints_its_usage(capsys):
    """`train.py --status --help` was "error: --status: overrides are written --key=value" (exit 2): the config
    help read --status as an override."""
    train.main(["--status", "--help"])
    assert "usage: python train.py --status RUN_DIR" in capsys.readouterr().out


def test_a_dataset_no_stage_reads_is_refused_on_a_first_start(tmp_path):
    """--dataset=X beside stages whose mixes all name their corpora trained on those corpora, X unread and unsaid (a
    resume refused the same change). Refused in one line naming the stages' corpora; a dataset one of the mixes
    names (config/nano.py's), or one set before the stages' file (tiny.py's), goes on (to the bad learning_rate)."""
    stages = tmp_path / "stages.py"
    stages.write_text("stages = [dict(name='a', steps=2, lr_phase='stable', mix={'local': 0.5, 'web': 0.5})]\n")
    args = TINY + [f"--out_dir={tmp_path / 'run'}", str(stages)]
    _, err, code = main_output(args + ["--dataset=fineweb_edu"])
    assert code == 1 and err == ("train.py: error: --dataset='fineweb_edu' is read by no stage: every stage's mix "
                                 "names its corpora (local, web); drop it, or put 'fineweb_edu' in the stages' mix\n")
    (tmp_path / "mine.py").write_text("dataset = 'fineweb_edu'\n")
    assert f"error: dataset='fineweb_edu' (in {tmp_path / 'mine.py'}) is read by no stage" in main_output(
        args + [str(tmp_path / "mine.py")])[1]
    other = tmp_path / "other.py"  # stages of another corpus than tiny.py's dataset, set before them
    other.write_text("stages = [dict(name='a', steps=2, lr_phase='stable', mix={'web': 1.0})]\n")
    for ok in (args + ["--dataset=web"], args, TINY + [f"--out_dir={tmp_path / 'run'}", str(other)]):
        assert "learning_rate" in main_output(ok + ["--learning_rate=-1.0"])[1]
    assert not os.path.exists(tmp_path / "run")


def test_retention_and_the_mirror_after_kills(tmp_path):
    """Review findings (kill -9 at chosen moments): retention protected the newest size-valid step even when it was
    an earlier run's corrupt leftover, newer than anything this run saved, and deleted each step this run wrote; a
    kill between a best save and BEST's write let the next save delete the best step; a kill mid-delete left a
    half-deleted step for good, a killed mirror copy a .tmp-step_* dir that filled the mirror disk."""
    out = str(tmp_path / "run")
    save = lambda d, step, **st: checkpoint.save(d, step, {  # noqa: E731
        "state.json": lambda p: open(p, "w").write(json.dumps({"kind": "periodic", "step": step, **st}))})
    save(out, 20)
    with open(os.path.join(out, "step_0000020", "state.json"), "r+") as f:
        f.write("X")  # same size, bad hash: an earlier run's step, left corrupt
    for step in (4, 8):  # this run's saves, keep_last=1
        rundir.retain(out, 1, saved=save(out, step))
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [8, 20]  # 8 kept, not deleted as soon as it was saved
    # the newest state's best_step is kept even when BEST still names an older step (or is missing)
    save(out, 9, kind="best", best_step=9)
    rundir.retain(out, 1, saved=save(out, 12, best_step=9))
    assert [s for s, _ in checkpoint.list_checkpoints(out)] == [9, 12, 20]
    # a kill mid-delete leaves a .trash-* dir; a kill mid-write a pointer's temp file: the next start clears both
    os.makedirs(os.path.join(out, ".trash-step_0000003-77"))
    open(os.path.join(out, "BEST.tmp-77-1234"), "w").write("step_0000009\n")
    said = []
    rundir.clear_leftovers(out, said.append)
    assert not [n for n in os.listdir(out) if n.startswith(".trash") or ".tmp-" in n] and len(said) == 2
    # a fresh start over only corrupt steps sets them aside (they were left in place, the newest protected)
    bad = str(tmp_path / "bad")
    save(bad, 5)
    open(os.path.join(bad, "step_0000005", "state.json"), "a").write(" ")
    cfg = {"init_from": "scratch", "mirror_dir": "", "resume_from": ""}
    assert rundir.prepare_run_dir(cfg, bad, said.append) is None
    assert checkpoint.list_checkpoints(bad) == [] and "do not verify" in said[-1]
    # the mirror clears what killed copies left, and keeps the newest valid step
    mirror = str(tmp_path / "mirror")
    os.makedirs(os.path.join(mirror, ".tmp-step_0000004"))
    open(os.path.join(mirror, ".tmp-step_0000004", "model.safetensors"), "w").write("x" * 1000)
    ticks = []
    assert rundir.mirror(out, mirror, keep=1, tick=lambda: ticks.append(1))
    assert sorted(n for n in os.listdir(mirror) if n.startswith(("step_", ".tmp", ".trash"))) == ["step_0000012"]
    assert len(ticks) >= 1  # the copy keeps the hang watchdog fed (a long copy was taken for a hang)
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000012"))


def test_a_newer_step_of_another_timeline_in_the_mirror_does_not_delete_each_copy(tmp_path):
    """The mirror's retention protected its newest step, another timeline's (its weights rotted, out_dir's copy set
    aside on resume), and deleted every step copied there as soon as it landed: the mirror held no valid checkpoint."""
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    save = lambda d, step: checkpoint.save(d, step, {  # noqa: E731
        "state.json": lambda p: open(p, "w").write(json.dumps({"kind": "periodic", "step": step})),
        "model.safetensors": lambda p: open(p, "wb").write(b"w" * 100)})
    save(mirror, 20)
    with open(os.path.join(mirror, "step_0000020", "model.safetensors"), "r+b") as f:
        f.write(b"X")  # same size, bad hash
    for step in (4, 8):
        save(out, step)
        assert rundir.mirror(out, mirror, keep=1)
    assert [s for s, _ in checkpoint.list_checkpoints(mirror)] == [8, 20]
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000008"))


def test_a_failing_mirror_is_said_once_not_at_every_log_step(tmp_path, capsys):
    """A mirror that failed printed its warning at every log step (143 times in one run), a copy error's as a
    multi-line list."""
    out, dest = str(tmp_path / "run"), str(tmp_path / "blocked")
    os.makedirs(out)
    open(os.path.join(out, "metrics.jsonl"), "w").write("{}\n")
    open(dest, "w").write("a file where the mirror dir should be")
    for _ in range(5):
        assert not rundir.mirror(out, dest, checkpoints=False)
    err = capsys.readouterr().err
    assert err.count("WARNING: mirror") == 1 and len(err.strip().splitlines()) == 1, err
    os.remove(dest)
    assert rundir.mirror(out, dest, checkpoints=False)
    assert "works again" in capsys.readouterr().err


class LostTerminal:
    """stderr on a terminal that hung up (EIO) or a pipe nobody reads (EPIPE): every write fails."""

    def __init__(self, error):
        self.error, self.tries = error, 0

    def write(self, text):
        self.tries += 1
        raise self.error

    def flush(self):
        raise self.error


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), BrokenPipeError(32, "Broken pipe")])
def test_a_mirror_warning_on_a_lost_terminal_does_not_end_the_run(tmp_path, monkeypatch, error):
    """mirror()'s warnings went to stderr with a bare print: with the terminal gone, the failing mirror's warning
    raised EIO / EPIPE into train.py (taken for a storage error, exit 5), ending a healthy run."""
    out, dest = str(tmp_path / "run"), str(tmp_path / "blocked")
    os.makedirs(out)
    open(os.path.join(out, "metrics.jsonl"), "w").write("{}\n")
    open(dest, "w").write("a file where the mirror dir should be")
    monkeypatch.setattr(sys, "stderr", LostTerminal(error))
    assert not rundir.mirror(out, dest, checkpoints=False)
    os.remove(dest)
    assert rundir.mirror(out, dest, checkpoints=False)  # "works again"
    assert sys.stderr.tries >= 2  # both warnings were tried


def test_a_run_dir_resolves_to_a_newer_whole_step_than_its_lagging_latest(tmp_path, capsys):
    """A save killed between its step's rename and LATEST's write: export, eval and chat of the run dir silently
    used the older step."""
    out = str(tmp_path)
    for step in (4, 8):
        checkpoint.save(out, step, {"state.json": lambda p, s=step: open(p, "w").write(json.dumps({"step": s}))})
    checkpoint.write_atomic_text(os.path.join(out, "LATEST"), "step_0000004\n")
    capsys.readouterr()
    assert checkpoint.resolve(out) == os.path.join(out, "step_0000008")
    assert "a save died before updating LATEST" in capsys.readouterr().err
    open(os.path.join(out, "step_0000008", "state.json"), "a").write(" ")  # the newer one corrupt: LATEST's, quietly
    assert checkpoint.resolve(out) == os.path.join(out, "step_0000004")
    assert "LATEST" not in capsys.readouterr().err


def test_grow_interleave_spreads_new_blocks_up_to_the_top_layer():
    # 3 MoE layers, 2 new: the old rule put both below layer 3 and none after the top block
    cfg = ModelConfig(vocab_size=64, n_layer=4, n_dense_layers=1, d_model=16, n_head=2, n_kv_head=1, dense_ffn=32,
                      n_experts=4, expert_ffn=8, n_shared=1, max_seq_len=16, tie_embeddings=True)
    sd = Picaflor(cfg).state_dict()
    for n_new, want in [(2, ["old", "old", "old", "new", "old", "new"]),
                        (3, ["old", "old", "new", "old", "new", "old", "new"]),
                        (1, ["old", "old", "old", "old", "new"]),
                        (5, ["old", "old", "new", "old", "new", "new", "old", "new", "new"])]:
        _, origin = train.grow_state_dict(sd, cfg, n_new, "interleave")
        assert origin == want, (n_new, origin)
    dense = ModelConfig(vocab_size=64, n_layer=2, n_dense_layers=2, d_model=16, n_head=2, n_kv_head=1, dense_ffn=32,
                        n_experts=0, max_seq_len=16, tie_embeddings=True)  # no MoE block to copy: it said no fix
    with pytest.raises(train.TrainError, match="grow a checkpoint with MoE layers"):
        train.grow_state_dict(sd, dense, 1, "top")


def test_an_invocations_last_step_is_logged_whatever_log_interval(data_root, three_steps, tmp_path):
    """A relay leg of fewer steps than log_interval logged only its first step, so the ledger's 'loss end' was the
    loss at the leg's start."""
    out = str(tmp_path / "run")
    shutil.copytree(three_steps, out)
    run(TINY + [f"--data_root={data_root}", f"--out_dir={out}", *ON_DEMAND, "--init_from=resume",
                "--log_interval=10", "--stop_after_steps=3", "--ckpt_interval=1000"])  # (a checkpoint's step is logged)
    assert [s for s in metrics(out) if s > 3] == [4, 6]


def test_mfu_peak_is_the_cards_own_variant(monkeypatch):
    """REFERENCES: 989e12 is the H100/H200 SXM dense bf16 peak. A PCIe or NVL card (the field's 3B ran on an H200 NVL)
    was given the SXM figure, its MFU understated by 15-24%; an L40 took the L4's 121e12 (a prefix of its name)."""
    want = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA GH200 480GB": 989e12,
            "NVIDIA H200 NVL": 835e12, "NVIDIA H100 NVL": 835e12, "NVIDIA H100 PCIe": 756e12,
            "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA L40S": 362e12,
            "NVIDIA L40": 181e12, "NVIDIA L4": 121e12, "NVIDIA A10": 125e12, "Some Other GPU": None}
    for name, peak in want.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
        assert train.gpu_peak_flops("cuda") == (name, peak), name
    assert train.gpu_peak_flops("cpu") == (None, None)


def test_mfu_peak_matches_the_cards_name_by_words_in_any_order(monkeypatch):
    """"A10" in "NVIDIA A10G" gave an A10G (AWS G5; 70e12 dense bf16, its datasheet) the A10's 125e12; and only the
    table's order kept an L40S from the L40's peak and an L40 from the L4's. Now an entry matches whole words of the
    card's name, the one naming most of them winning, in whatever order the table lists them."""
    want = {"NVIDIA A10G": 70e12, "NVIDIA A10": 125e12, "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12,
            "NVIDIA L4": 121e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 80GB HBM3": 989e12,
            "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA GH200 480GB": 989e12}
    for table in (train.PEAK_BF16_FLOPS, train.PEAK_BF16_FLOPS[::-1]):
        monkeypatch.setattr(train, "PEAK_BF16_FLOPS", table)
        for name, peak in want.items():
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=name: name)
            assert train.gpu_peak_flops("cuda") == (name, peak), (name, table[0])


def test_the_forkserver_answers_as_a_fresh_train_py_does(tmp_path):
    """run() forks train.py from a process that imported torch: its exit code, stdout and stderr are a fresh
    process's (a refusal, a config file's help, a config file that prints and then exits)."""
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nprint('from the config')\nsys.exit(3)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for args in (["--batch_size=many"], ["config/tiny.py", "--help"], [str(exits)]):
        fresh = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, env=env)
        forked = forkserver.run(["train.py", *args], cwd=REPO, env=env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and "from the config" in fresh.stdout and "calls sys.exit(3)" in fresh.stderr


def test_a_starts_seconds_count_from_its_process_start():
    """A start's elapsed and $ counted from main(): the interpreter's start and the imports before it went unbilled.
    This process started before this file was imported."""
    assert time.monotonic() - IMPORTED_AT < train.process_age_s() < 30 * 24 * 3600


def test_eta_is_this_starts_pace_not_the_runs_history():
    """The ETA was the tokens left at the run's whole rate (tokens / elapsed_seconds): a leg on an H100 after 100 hours
    of legs on slower cards was told their pace. Now this start's: the tokens it trained in its seconds."""
    assert train.eta_seconds(9_000_000, (1_000_000, 100.0)) == pytest.approx(900.0)
    assert train.eta_seconds(0, (1_000_000, 100.0)) == 0.0
    assert train.eta_seconds(1000, (0, 5.0)) is None and train.eta_seconds(1000, (10, 0.0)) is None


def test_mfu_of_a_float32_run_is_against_the_tf32_peak(monkeypatch):
    """--dtype=float32 on CUDA runs its matmuls in TF32 (train.py enables it), whose dense peak is half the bf16 one on
    every card listed (H100 SXM 494.5e12 vs 989e12, A100 156e12 vs 312e12): its MFU was against the bf16 peak, half."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert train.gpu_peak_flops("cuda", "float32") == ("NVIDIA A100-SXM4-80GB", 156e12)
    assert train.gpu_peak_flops("cuda", "bfloat16") == ("NVIDIA A100-SXM4-80GB", 312e12)


def test_gpu_memory_plan_counts_activations_in_the_dtype_they_run_in(monkeypatch):
    """The memory plan before launch on CUDA: bf16 autocast keeps activations in 2 bytes, a --dtype=float32 run in 4
    (as on a CPU); the plan counted 2 for every CUDA run, half a float32 run's activations, so one that could not fit
    passed the plan and ran out of GPU memory at its first step. The card's size is what mem_get_info says."""
    mcfg = ModelConfig(vocab_size=320, n_layer=3, d_model=32, n_head=4, n_kv_head=1, dense_ffn=64, n_experts=8,
                       expert_ffn=16, n_shared=1, max_seq_len=64)
    cfg = {"batch_size": 4, "seq_len": 32, "stages": [dict(seq_len=64)]}
    acts = {(dt, dev): train.memory_plan({**cfg, "dtype": dt}, mcfg, 1000, 1, dev)[1]["activations"]
            for dt in ("bfloat16", "float32") for dev in ("cuda", "cpu")}
    assert acts["float32", "cuda"] == acts["float32", "cpu"] == acts["bfloat16", "cpu"] > acts["bfloat16", "cuda"]
    total, parts = train.memory_plan({**cfg, "dtype": "bfloat16"}, mcfg, 1000, 1, "cuda")
    assert total == sum(parts.values()) and parts["params"] == parts["grads"] == 4000 and parts["adamw"] == 8000
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (3 << 30, 80 << 30))
    assert train.device_memory("cuda") == 80 << 30  # the card's, not what happens to be free before the model is built
    assert train.device_memory("cpu") > 0  # /proc/meminfo's MemAvailable


def test_rng_state_on_cuda_round_trips_through_state_json(monkeypatch):
    """A CUDA run's checkpoint keeps the GPU generator's state beside the CPU one (base64 in state.json), and a
    resume sets both back: the same bytes, through JSON."""
    gpu = [torch.arange(16, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: gpu[0].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, *a: gpu.__setitem__(0, t))
    st = json.loads(json.dumps(train.rng_state("cuda")))
    assert "cuda" not in train.rng_state("cpu")
    cpu_before = torch.get_rng_state()
    gpu[0], _ = torch.zeros(16, dtype=torch.uint8), torch.rand(3)  # both generators moved on
    train.set_rng_state(st, "cuda")
    assert torch.equal(gpu[0], torch.arange(16, dtype=torch.uint8)) and torch.equal(torch.get_rng_state(), cpu_before)
    gpu[0] = torch.zeros(16, dtype=torch.uint8)
    train.set_rng_state({"torch": st["torch"]}, "cuda")  # a CPU run's checkpoint resumed on a GPU: its CUDA one kept
    assert not gpu[0].any()


def test_tok_per_s_and_mfu_time_the_training_steps_of_their_window(data_root, tmp_path):
    """A log window's tok/s and MFU counted its evaluation (an eval step of tiny logged 178 tok/s beside 2,000) and the
    save of the step before it; and its MFU took every step at the last step's seq_len (a window across a stage
    boundary). Now: the window's training time only, and each step's FLOPs at its own seq_len.
    And durations were differences of time.time(): the wall clock stepped back (NTP) gave negative windows (0 tok/s)
    and elapsed seconds. Here it steps back an hour at every reading: durations are on the monotonic clock."""
    out = str(tmp_path / "run")
    stages = ("--stages=[{'name': 'short', 'steps': 2, 'seq_len': 16, 'lr_phase': 'stable'}, "
              "{'name': 'long', 'steps': 2, 'seq_len': 32, 'lr_phase': 'decay'}]")
    # (and each step's expert load, recorded: the window's load_cv and dead_frac are of their sum, not the last step's)
    clock_steps_back = ("import itertools, json, runpy, sys, time\nreal, n = time.time, itertools.count(1)\n"
                        "time.time = lambda: real() - 3600 * next(n)\nsys.argv[0] = 'train.py'\n"
                        "sys.path.insert(0, '.')\nimport model\ntake = model.Picaflor.take_expert_load\n"
                        f"def taking(self):\n    load = take(self)\n    open({str(tmp_path / 'loads.jsonl')!r}, 'a')"
                        ".write(json.dumps(load.tolist()) + '\\n')\n    return load\n"
                        "model.Picaflor.take_expert_load = taking\n"
                        "runpy.run_path('train.py', run_name='__main__')")
    # 0.6 s of injected evaluation at the plan's end (step 4, whose window is steps 2-4)
    r = subprocess.run([sys.executable, "-c", clock_steps_back, *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                        stages, "--log_interval=4", "--eval_interval=1000", "--eval_iters=1"], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PICAFLOR_INJECT_EVAL_BATCH_S="0.6",
                                PICAFLOR_INJECT_PEAK_FLOPS="1e9"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = metrics(out)[4]
    # (the short stage's end, a checkpoint, is logged at step 2: tok/s and MFU time steps 3-4, since that row)
    window_tokens = 2 * 4 * 32  # steps 3, 4
    assert "val_loss" in row and row["tokens"] - metrics(out)[2]["tokens"] == window_tokens
    assert window_tokens / row["tok_per_s"] < 0.6, row  # the window's seconds, less than its evaluation slept
    assert 0 < metrics(out)[1]["elapsed_s"] < row["elapsed_s"] < 300, row  # (negative, the clock stepped back)
    m = load_checkpoint(os.path.join(out, "step_0000004"))
    flops = 2 * 4 * 32 * m.flops_per_token(32)
    assert row["mfu"] == pytest.approx(flops / (window_tokens / row["tok_per_s"]) / 1e9, rel=1e-6), row
    m2 = metrics(out)[2]  # step 2's own row: the short stage's seq_len
    assert m2["mfu"] == pytest.approx(4 * 16 * m.flops_per_token(16) / (4 * 16 / m2["tok_per_s"]) / 1e9, rel=1e-6)
    from model import load_stats
    loads = [torch.tensor(json.loads(line)) for line in open(tmp_path / "loads.jsonl")]
    assert len(loads) == 4
    cv, dead = load_stats(sum(loads))  # the loss and load window: steps 1-4 (rows between show it so far)
    assert row["load_cv_layers"] == [round(float(v), 4) for v in cv]
    assert row["load_cv"] == pytest.approx(float(cv.mean()))
    assert row["dead_frac"] == pytest.approx(float(dead.mean()))
    assert row["load_cv_layers"] != [round(float(v), 4) for v in load_stats(loads[-1])[0]]  # (the last step's differ)


def test_a_val_set_changed_by_a_quarantined_val_shard_restarts_the_best(tmp_path):
    """best_val_set said only [rows, seq_len]: a val shard quarantined (by the guardian, or by hand) changed the
    tokens the val loss is measured on, and the best val loss, BEST and retention went on comparing losses of two val
    sets without a word. The val corpus and the shards its val split is read from are part of the val set now."""
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", src, "--out", str(tmp_path / "d" / "local"),
                        "--vocab-size", "320", "--val-percent", "20", "--shard-tokens", "3000"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    val = json.load(open(tmp_path / "d" / "local" / "index.json"))["splits"]["val"]
    assert len(val) == 2 and val[0]["tokens"] > 4 * 32 * 2  # the val loss reads val_000000 alone
    out = str(tmp_path / "run")
    base = TINY + [f"--data_root={tmp_path / 'd'}", f"--out_dir={out}", "--max_iters=10", "--warmup_iters=1",
                   "--eval_interval=1", "--stop_after_steps=1"]
    run(base)
    first = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert first["best_step"] == 1
    r = run(base + ["--init_from=resume", "--quarantine_shards=['local/val_000000.bin']"])
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert "val set changed" in r.stdout + r.stderr and st["best_step"] == 2, r.stdout[-2000:]
    assert st["best_val_set"][:2] == first["best_val_set"][:2]  # the same rows and seq_len: the shards differ


def test_a_lock_file_deleted_under_a_waiting_trainer_is_not_held_twice(tmp_path, monkeypatch):
    """A refused fresh start removes the out_dir it made, lock file and all (undo_fresh_run_dir): a second trainer
    waiting on that lock file then locked the deleted inode, and a third one created a new lock file and locked it
    too: two trainers writing one run dir."""
    import threading
    import time
    out = str(tmp_path / "run")
    monkeypatch.setattr(train, "_RUN_INFO", {"out_dir": out, "out_made_from": os.path.abspath(out)})
    train._RUN_INFO["lock"] = rundir.hold_run_lock(out, 0, lambda m: None)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(fd=rundir.hold_run_lock(out, 10, lambda m: None)))
    waiter.start()
    time.sleep(0.3)  # the waiter has opened the lock file and polls it
    train.undo_fresh_run_dir()  # the first trainer's start was refused: its lock and run dir go
    waiter.join(15)
    assert "fd" in got
    try:
        with pytest.raises(rundir.RunLocked):
            os.close(rundir.hold_run_lock(out, 0, lambda m: None))
        assert rundir.lock_holder(out) == str(os.getpid())
    finally:
        os.close(got["fd"])


def test_the_mirror_copy_is_on_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """The mirror renamed its copy into place (and deleted the old copy, and retention the older steps) with none of
    its files fsynced: a power loss then left the mirror, the copy meant to outlive the machine, with no valid step."""
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    checkpoint.save(out, 4, {"state.json": lambda p: open(p, "w").write(json.dumps({"kind": "periodic", "step": 4})),
                             "model.safetensors": lambda p: open(p, "wb").write(b"w" * 100)})
    synced, unsynced_at_rename = set(), []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        return real_fsync(fd)

    def replace(src, dst, *a, **kw):
        if os.path.basename(str(dst)) == "step_0000004" and os.path.isdir(src):
            unsynced_at_rename.extend(n for n in os.listdir(src) if os.stat(os.path.join(src, n)).st_ino not in synced)
            if os.stat(src).st_ino not in synced:
                unsynced_at_rename.append("(its directory)")
        return real_replace(src, dst, *a, **kw)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    assert rundir.mirror(out, mirror, keep=1)
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000004"))
    assert unsynced_at_rename == []


def test_chat_padding_is_routed_but_not_counted_in_the_expert_load():
    """Packed chat rows end in <|bos|> padding; under doc_mask each pad token attends only to itself, so all of them
    pick the same top_k experts in every MoE layer. Counted, they made those experts look overloaded and the bias
    steered the real tokens off them. The pads still run through the experts; the load counts the real tokens."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, n_layer=3, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=2, dense_ffn=64,
                      n_experts=8, expert_ffn=16, n_shared=1, top_k=2, max_seq_len=64)
    m = Picaflor(cfg).train()
    bos = 1
    x = torch.randint(2, 96, (4, 32))
    x[:, 0] = bos
    x[:2, 11] = bos  # two conversations in rows 0 and 1, one in rows 2 and 3
    x[:, 20:] = bos  # then 12 tokens of padding a row
    pad = train.chat_padding(x, bos)
    assert pad.sum() == 4 * 12 and not pad[:, :20].any()
    docs = (x == bos).cumsum(1)  # train.py's doc_ids of a masked corpus
    m(x[:, 20:], x[:, 20:], doc_ids=docs[:, 20:])
    assert all((layer > 0).sum() == cfg.top_k for layer in m.take_expert_load())  # every pad on the same experts
    _, _, routed = m(x, x, doc_ids=docs, return_load=True, load_mask=~pad)
    counted = m.take_expert_load()
    assert (routed.sum(1) == 4 * 32 * cfg.top_k).all() and (counted.sum(1) == 4 * 20 * cfg.top_k).all()
    m(x[:, :20], x[:, :20], doc_ids=docs[:, :20])  # the real tokens alone (causal: pads after them change nothing)
    assert torch.equal(counted, m.take_expert_load())


def test_ddp_a_stop_signal_or_a_fault_on_another_rank_than_0_is_not_lost(data_root, tmp_path):
    """torchrun, 2 ranks. A SIGTERM to rank 1 alone (its pid, as nvidia-smi lists it): only rank 0's flag was
    broadcast, so rank 1's handler swallowed the signal and the run trained on to its end with no preemption
    checkpoint. And a corrupt batch read by rank 1 alone (its rows): crash reports were rank 0's only, so the run dir
    held only rank 0's "crash" (its collective broken by rank 1's exit), never the shard and offset at fault."""
    wrapper = tmp_path / "ranked.py"
    wrapper.write_text("import os, runpy, sys\n"
                       "sys.path.insert(0, os.getcwd())\n"
                       "import shards\n"
                       "rank = os.environ['RANK']\n"
                       "pid = os.path.join(os.environ['PICAFLOR_TEST_LOG'], 'pid-rank' + rank)\n"
                       "open(pid, 'w').write(str(os.getpid()))\n"
                       "real, reads = shards.TokenStream.next_batch, [0]\n"
                       "def bad(self, *a, **k):  # rank 1's third train batch: a token id past the vocab\n"
                       "    reads[0] += self.split == 'train'\n"
                       "    if rank == '1' and reads[0] == 3 and os.environ.get('PICAFLOR_TEST_BAD_READ'):\n"
                       "        raise shards.DataError('token id 999 >= vocab_size', path='x/train_000000.bin',"
                       " offset=77, kind='vocab')\n"
                       "    return real(self, *a, **k)\n"
                       "shards.TokenStream.next_batch = bad\n"
                       "sys.argv = ['train.py'] + sys.argv[1:]\n"
                       "runpy.run_path('train.py', run_name='__main__')\n")
    env = torchrun_env(tmp_path, PICAFLOR_TEST_LOG=str(tmp_path), PICAFLOR_INJECT_RANK0_LAG_S="0.3")
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(wrapper), *TINY,
           "--batch_size=2", f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=60", "--warmup_iters=1",
           "--eval_interval=1000", "--ckpt_interval=1000"]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    import time
    deadline = time.time() + 90
    while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and metrics(out)) and time.time() < deadline:
        time.sleep(0.2)
    os.kill(int(open(tmp_path / "pid-rank1").read()), signal.SIGTERM)
    said = p.communicate(timeout=120)[0]
    assert p.returncode == 0, said[-3000:]
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] < 60 and "SIGTERM: checkpoint saved at step" in said, (st["kind"], st["step"], said[-2000:])
    bad = str(tmp_path / "bad")
    r = subprocess.run([a.replace(f"--out_dir={out}", f"--out_dir={bad}") for a in cmd] + ["--max_iters=4"], cwd=REPO,
                       capture_output=True, text=True, env=dict(env, PICAFLOR_TEST_BAD_READ="1"), timeout=120)
    assert r.returncode != 0 and os.path.isdir(bad), r.stderr[-5000:]
    reports = [json.load(open(os.path.join(bad, n))) for n in os.listdir(bad) if n.startswith("crash-")]
    assert [(x["cause"], x["path"], x["offset"]) for x in reports if x["exit_code"] == 3] == [
        ("corrupt data", "x/train_000000.bin", 77)], (reports, r.stderr[-3000:])


def test_status_while_a_trainer_saves_reads_a_whole_step_and_says_nothing_false(three_steps, tmp_path, capsys,
                                                                                monkeypatch):
    """train.py --status in a loop beside a running trainer (keep_last=1): once in ~50 a step it picked was pruned
    before its state.json was read ("no usable state.json"), and a save between its step's rename and LATEST's
    write was called "a save died before updating LATEST" (~1 in 50)."""
    import fcntl
    out = str(tmp_path / "run")
    shutil.copytree(three_steps, out)
    newest = os.path.join(out, "step_0000003")
    checkpoint.write_atomic_text(os.path.join(out, "LATEST"), "step_0000002\n")  # the save of step 3 not done
    with open(os.path.join(out, ".trainer.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the trainer, running
        assert checkpoint.resolve(out) == newest and capsys.readouterr().err == ""
    real = checkpoint.resolve

    def pruned_after_the_pick(path):
        picked = real(path)
        if picked == newest:  # the trainer's retention removes it just then (a newer save, keep_last=1)
            shutil.rmtree(picked)
        return picked
    monkeypatch.setattr(checkpoint, "resolve", pruned_after_the_pick)
    said, err, code = main_output(["--status", out])
    assert code in (0, None) and "checkpoint step_0000002, step 2" in said, err
