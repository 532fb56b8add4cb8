"""Fault injection against train.py and the guardian (issue: training that survives its operators)."""
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
import checkpoint  # noqa: E402
import forkserver  # noqa: E402
import shards  # noqa: E402
import train as train_py  # noqa: E402
from model import load_checkpoint  # noqa: E402
from test_train import TINY, main_output, metrics  # noqa: E402

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def make_corpus(root, src=None, shard_tokens=6000):
    src = src or os.path.join(sysconfig.get_paths()["stdlib"], "json")
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", str(src), "--out", str(root / "local"),
                        "--vocab-size", "320", "--val-percent", "20", "--shard-tokens", str(shard_tokens)],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(root)


def copy_corpus(data_root, root):
    """What make_corpus(root) makes, copied from data_root's (the same source and flags, so the same shards and index;
    a repair reads index.json's source and writes to the corpus dir it is in, not to the --out it was made with)."""
    shutil.copytree(os.path.join(data_root, "local"), os.path.join(root, "local"))
    return str(root)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def ten_steps_mirrored(data_root, tmp_path_factory):
    """10 steps (checkpoints 5 and 10) in run/, mirrored to mirror/, trained once: the mirror tests each take a copy, and
    tests that need any run at step 10 copy run/ alone (the same weights and state as unmirrored: mirror_dir and
    keep_last only echo in state.json's config, which a resume does not read)."""
    d = tmp_path_factory.mktemp("ten_steps_mirrored")
    assert train([f"--data_root={data_root}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000",
                  f"--mirror_dir={d / 'mirror'}", "--keep_last=10", f"--out_dir={d / 'run'}", "--ckpt_interval=5",
                  "--stop_after_steps=10"]).returncode == 0
    return str(d)


def train(args, env=ENV, **kw):
    return forkserver.run(["train.py", *TINY, *args], cwd=REPO, env=env, **kw)  # subprocess.run, minus torch's imports


def train_started(args, env=ENV):
    """train(args) started: (its pid, to signal or kill, a thread alive while it runs, done(timeout) -> what train
    returns); forked as train() is (a Popen'd trainer spent ~3 s importing torch before its first step)."""
    return forkserver.start(["train.py", *TINY, *args], cwd=REPO, env=env)


def zero_page(path, at_fraction=0.5):
    size = os.path.getsize(path)
    off = (int(size * at_fraction) // 4096) * 4096
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(b"\0" * 4096)
    return off // 2  # token offset of the page


def test_zeroed_page_is_caught_and_quarantined_without_looping(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(sysconfig.get_paths()["stdlib"], "json"), src)
    root = make_corpus(tmp_path, src=src)
    shard = os.path.join(root, "local", "train_000000.bin")
    tok_off = zero_page(shard)
    shutil.rmtree(src)  # the source is gone: the shard cannot be re-fetched, so it must be quarantined
    out = str(tmp_path / "run")
    r = train([f"--data_root={root}", f"--out_dir={out}", "--max_iters=4", "--warmup_iters=1", "--eval_interval=100",
               "--supervise"])
    assert r.returncode == 0, r.stderr[-3000:]
    g = json.load(open(os.path.join(out, "guardian.json")))
    assert len(g["starts"]) == 2  # one restart, no loop
    assert g["starts"][0]["cause"] == "corrupt data"
    msg = g["starts"][0]["message"]
    assert "train_000000.bin" in msg and f"offset {tok_off}" in msg
    assert g["quarantined"][0]["shard"] == "local/train_000000.bin"
    assert metrics(out)[4]["quarantined_shards"] == 1
    assert "QUARANTINED" in r.stdout + r.stderr


def test_zeroed_page_is_refetched_from_source(data_root, tmp_path):
    root = copy_corpus(data_root, tmp_path)
    shard = os.path.join(root, "local", "train_000000.bin")
    zero_page(shard, 0.7)
    out = str(tmp_path / "run")
    r = train([f"--data_root={root}", f"--out_dir={out}", "--max_iters=3", "--warmup_iters=1", "--eval_interval=100",
               "--supervise"])
    assert r.returncode == 0, r.stderr[-3000:]
    g = json.load(open(os.path.join(out, "guardian.json")))
    assert [s["cause"] for s in g["starts"]] == ["corrupt data", "ok"]
    assert g["repairs"][0]["action"] == "refetched" and not g["quarantined"]


@pytest.mark.parametrize("status, fails, code, cause", [(403, None, 4, "storage denied"),
                                                       (520, None, 5, "storage unreachable"), (520, 1, 0, "ok")])
def test_storage_fault_is_not_corrupt_data(data_root, tmp_path, status, fails, code, cause):
    """A shard is corrupt and its re-fetch meets the Hub refusing (403: credentials or billing, exit 4) or failing
    (a 5xx: unreachable): the guardian stops with that cause, not "corrupt data", and says what to check; an
    unreachable Hub is retried with backoff first (until unreachable_give_up_s, then exit 5), so a blip only delays the repair and the
    run finishes. 520 (a proxy's "unknown error") because huggingface_hub retries a 503 itself for ~23 s first."""
    from hub_server import FakeHub
    import pyarrow as pa
    import pyarrow.parquet as pq
    repo = tmp_path / "hub" / "datasets" / "HuggingFaceFW" / "fineweb-edu" / "sample" / "10BT"
    repo.mkdir(parents=True)
    rng = random.Random(0)
    words = ["the", "cell", "energy", "light", "plant", "water", "grows", "in", "of", "and"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 80))) for _ in range(120)]
    pq.write_table(pa.table({"text": texts}), repo / "000_00000.parquet")
    tok = os.path.join(data_root, "local", "tokenizer.json")
    corpus = tmp_path / "data" / "fineweb_edu"
    with FakeHub(tmp_path / "hub") as hub:
        env = dict(ENV, **hub.client_env(tmp_path / "hf_home"))
        r = subprocess.run([sys.executable, "data/fineweb_edu/prepare.py", "--tokenizer", tok, "--max-tokens", "20000",
                            "--val-tokens", "1500", "--shard-tokens", "3000", "--out", str(corpus)],
                           cwd=REPO, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        zero_page(os.path.join(corpus, "train_000000.bin"), 0.3)
        hub.status_override, hub.fail_left = status, fails  # the bill lapsed / the Hub is down or blips
        shutil.rmtree(tmp_path / "hf_home")  # a fresh machine: nothing cached
        out = str(tmp_path / "run")
        r = train([f"--data_root={tmp_path / 'data'}", "--dataset=fineweb_edu", f"--out_dir={out}", "--max_iters=3",
                   "--warmup_iters=1", "--eval_interval=100", "--unreachable_backoff_s=0.05",
                   "--unreachable_give_up_s=0.75", "--supervise"], env=env)
    assert r.returncode == code, r.stderr[-3000:]
    g = json.load(open(os.path.join(out, "guardian.json")))
    retries = [x for x in g["repairs"] if x["action"] == "re-fetch retry"]
    assert len(retries) == (0 if status == 403 else 3 if fails is None else 1), (g["repairs"], len(hub.requests))
    assert all("unreachable" in x["error"] and x["wait_s"] == 0.05 * 2 ** (i + 1) for i, x in enumerate(retries))
    if code == 0:  # recovered: re-fetched, then the restarted trainer finished
        assert [x["action"] for x in g["repairs"]] == ["re-fetch retry", "refetched"] and not g["quarantined"]
        assert [s["cause"] for s in g["starts"]] == ["corrupt data", "ok"]
        assert "retrying in 0.1 s" in r.stdout + r.stderr
        return
    msg = g["report"]["message"]
    assert g["report"]["cause"] == cause and "train_000000.bin" in msg, msg
    if status == 403:
        assert "403" in msg and ("credentials" in msg or "billing" in msg), msg
    else:
        assert "unreachable" in msg and "(4 tries)" in msg and "check the network" in msg, msg
    assert g["starts"][0]["cause"] == "corrupt data" and len(g["starts"]) == 1


def test_hang_dumps_stacks_and_exits(data_root, tmp_path):
    out = str(tmp_path / "run")
    _, thread, done = train_started([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=10",
                                     "--warmup_iters=1", "--eval_interval=100", "--hang_timeout=4"],
                                    env=dict(ENV, PICAFLOR_INJECT_SLEEP_AT_STEP="2"))
    mpath = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(mpath) and any(json.loads(l)["step"] == 2 for l in open(mpath) if l.strip())):
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.05)
    t_stall = time.time()
    r = done(timeout=60)
    err = r.stderr
    assert r.returncode == 8, err
    assert time.time() - t_stall <= 4 + 10
    dumps = [n for n in os.listdir(out) if n.startswith("hang-")]
    text = open(os.path.join(out, dumps[0])).read()
    assert "train.py" in text and " in main" in text and "in watch" in text  # the stuck main thread and the watchdog
    assert "hang" in err and len(err.strip().splitlines()) == 1


def test_a_long_evaluation_is_not_a_hang(data_root, tmp_path):
    """Helper-55's review: the watchdog heard nothing during an evaluation, so eval_iters batches of a big model
    that together outlasted hang_timeout ended the run with exit 8 at its first evaluation, and at every restart."""
    r = train([f"--data_root={data_root}", f"--out_dir={tmp_path / 'run'}", "--max_iters=3", "--warmup_iters=1",
               "--eval_interval=2", "--eval_iters=3", "--hang_timeout=2"], env=dict(ENV, PICAFLOR_INJECT_EVAL_BATCH_S="0.9"),
              timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [m["val_loss"] for m in metrics(str(tmp_path / "run")).values() if m.get("val_loss") is not None]


def test_sigterm_checkpoints_and_resume_is_bitwise(data_root, tmp_path):
    common = [f"--data_root={data_root}", "--max_iters=10", "--warmup_iters=2", "--eval_interval=100", "--ckpt_interval=100"]
    straight = str(tmp_path / "straight")
    assert train(common + [f"--out_dir={straight}"]).returncode == 0
    out = str(tmp_path / "pre")
    pid, thread, done = train_started(common + [f"--out_dir={out}"])
    mpath = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(mpath) and sum(1 for l in open(mpath) if l.strip()) >= 3):
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.02)
    os.kill(pid, signal.SIGTERM)
    r = done(timeout=60)
    so, se = r.stdout, r.stderr
    assert r.returncode == 0, se
    ck = checkpoint.latest_valid(out)
    st = json.load(open(os.path.join(ck, "state.json")))
    assert st["kind"] == "preempt" and 3 <= st["step"] < 10 and "SIGTERM" in so
    assert train(common + [f"--out_dir={out}", "--init_from=resume"]).returncode == 0
    a, b = metrics(straight), metrics(out)
    assert [a[s]["loss"] for s in range(1, 11)] == [b[s]["loss"] for s in range(1, 11)]


@pytest.mark.parametrize("inject,said,extra", [
    ("PICAFLOR_INJECT_NAN_AT_STEP", "non-finite loss", []),
    # a NaN gradient under a finite loss (an overflow in backward), without clipping: the norm is checked anyway
    ("PICAFLOR_INJECT_NAN_GRAD_AT_STEP", "non-finite gradient norm", ["--grad_clip=0"]),
])
def test_nan_never_reaches_a_checkpoint(data_root, tmp_path, inject, said, extra):
    out = str(tmp_path / "run")
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=10", "--warmup_iters=1",
               "--eval_interval=100", "--ckpt_interval=2", *extra], env=dict(ENV, **{inject: "4"}))
    assert r.returncode == 7 and said in r.stderr, r.stderr[-2000:]
    steps = [s for s, p in checkpoint.list_checkpoints(out) if checkpoint.is_valid(p)]
    assert steps and max(steps) <= 5
    for s, p in checkpoint.list_checkpoints(out):
        m = load_checkpoint(p)
        assert all(torch.isfinite(t).all() for t in m.state_dict().values())
    rep = [json.load(open(os.path.join(out, n))) for n in os.listdir(out) if n.startswith("crash-")]
    assert rep[0]["cause"] == "non-finite loss" and rep[0]["exit_code"] == 7


def test_disk_full_during_save_keeps_previous_checkpoint(data_root, tmp_path, ten_steps_mirrored):
    out = str(tmp_path / "run")
    args = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000",
            "--ckpt_interval=5"]
    shutil.copytree(os.path.join(ten_steps_mirrored, "run"), out)  # a run at step 10 (its plan); the resumes save 15
    good = checkpoint.latest_valid(out)
    # the disk fills in the weights (safetensors raises its own error type) or in the optimizer state (torch.save)
    for name in ("model.safetensors", "optimizer.pt"):
        limit = os.path.getsize(os.path.join(good, name)) // 2

        def small_disk():  # a file-size limit: writes past it fail with EFBIG, like a full disk
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        r = train(args + ["--init_from=resume"], preexec_fn=small_disk)
        assert r.returncode == 6 and "out of disk" in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
        assert checkpoint.latest_valid(out) == good and load_checkpoint(out) is not None
        assert not [n for n in os.listdir(out) if n.startswith(".tmp")]
    # a re-save of a step that died between its two renames left the old step aside (step_N.old-PID) and no step_N:
    # the resume puts it back and resumes from it, not from an earlier step
    os.replace(good, good + ".old-4242")
    r = train(args + ["--init_from=resume", "--stop_after_steps=0"])
    assert r.returncode == 0 and "put back" in r.stderr + r.stdout, r.stderr[-2000:]
    assert f"resuming from {good} at step 10" in r.stderr + r.stdout and checkpoint.is_valid(good)
    assert not [n for n in os.listdir(out) if ".old-" in n]


def test_recover_puts_back_a_step_moved_aside_and_drops_a_replaced_one(tmp_path):
    """checkpoint.recover: the two ways a re-save can die between its renames (save() calls it first, train.py's
    resume too)."""
    def write(step):
        return checkpoint.save(str(tmp_path), step, {"w.bin": lambda p: open(p, "wb").write(b"x" * step)})
    s2, s4 = write(2), write(4)
    os.replace(s4, s4 + ".old-7")  # died after moving step 4 aside
    shutil.copytree(s2, s2 + ".old-8")  # died after the new step 2 landed, before the old one was removed
    assert checkpoint.recover(str(tmp_path)) == [s4]
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_0000002", "step_0000004"]
    assert checkpoint.latest_valid(str(tmp_path)) == s4
    os.replace(s4, s4 + ".old-9")
    write(6)  # a save recovers first
    assert [s for s, _ in checkpoint.list_checkpoints(str(tmp_path))] == [2, 4, 6]


def test_a_reader_of_a_run_dir_puts_back_a_step_a_killed_resave_left_aside(tmp_path, monkeypatch):
    """chat, eval and export (checkpoint.resolve) given a run dir whose newest step was there only as step_N.old-PID
    (a re-save killed between its renames) used an older step, or found none at all. It goes back in place under
    the trainer's lock; while a trainer holds that lock (its own re-save mid-way) it is waited for, then refused."""
    import threading
    import rundir
    out = str(tmp_path)

    def write(step):
        return checkpoint.save(out, step, {"w.bin": lambda p: open(p, "wb").write(b"x" * step)})
    s1, s2 = write(1), write(2)
    os.replace(s2, s2 + ".old-4242")
    monkeypatch.setattr(rundir, "RESAVE_WAIT_S", 0.3, raising=False)  # (10 s in use)
    lock = rundir.hold_run_lock(out, 0, print)  # a live trainer: nothing of its run is touched
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.resolve(out)
    assert "being re-saved by the trainer" in str(e.value) and "\n" not in str(e.value)
    assert os.path.isdir(s2 + ".old-4242") and not os.path.exists(s2)
    # its second rename lands while the reader waits: that step is read
    threading.Timer(0.1, os.replace, (s2 + ".old-4242", s2)).start()
    monkeypatch.setattr(rundir, "RESAVE_WAIT_S", 5.0, raising=False)
    assert checkpoint.resolve(out) == s2
    os.close(lock)
    os.replace(s2, s2 + ".old-4242")  # no trainer: put back, and the lock free again afterwards
    assert checkpoint.resolve(out) == s2 and checkpoint.is_valid(s2)
    assert not [n for n in os.listdir(out) if ".old-" in n]
    os.close(rundir.hold_run_lock(out, 0, print))
    shutil.rmtree(s1)  # the run's only step left aside: found, not "holds no valid checkpoint"
    os.replace(s2, s2 + ".old-7")
    assert checkpoint.resolve(out) == s2


def test_a_resave_interrupted_between_its_renames_puts_the_old_step_back(tmp_path, monkeypatch):
    """A KeyboardInterrupt on the second rename left the only checkpoint as step_N.old-PID: eval, export, chat and
    the guardian saw none until train.py's next recover()."""
    s = checkpoint.save(str(tmp_path), 100, {"w.bin": lambda p: open(p, "wb").write(b"old")})
    real = os.replace

    def interrupted(src, dst):
        if dst == s and ".tmp" in os.path.basename(src):
            raise KeyboardInterrupt
        return real(src, dst)
    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(str(tmp_path), 100, {"w.bin": lambda p: open(p, "wb").write(b"new")})
    monkeypatch.setattr(os, "replace", real)
    assert sorted(os.listdir(tmp_path)) == ["LATEST", "step_0000100"] and checkpoint.latest_valid(str(tmp_path)) == s
    assert open(os.path.join(s, "w.bin"), "rb").read() == b"old"


def test_a_save_ticks_the_watchdog_while_it_hashes_and_between_files(tmp_path, monkeypatch):
    """A 31 GB save hashed on a 50 MB/s network disk outlasted a small hang_timeout with no tick: the watchdog ended a
    healthy run mid-save (exit 8, the steps since the last checkpoint lost)."""
    import model
    monkeypatch.setattr(checkpoint, "HASH_CHUNK", 1024)  # (64 MB in a real save)
    events = []
    blob = os.urandom(10 * 1024)
    path = checkpoint.save(str(tmp_path), 1, {"w.bin": lambda p: open(p, "wb").write(blob),
                                              "b.bin": lambda p: events.append("b") or open(p, "wb").write(b"b")},
                           tick=lambda: events.append("tick"))
    assert checkpoint.is_valid(path)
    # w.bin's 10 chunks hashed, each with its tick, before the next file is written
    assert events.index("b") >= 10 and set(events[:events.index("b")]) == {"tick"} and events[-1] == "tick"
    ticks = []  # model.save_checkpoint (train.py's every save) passes it on
    tiny = model.ModelConfig(vocab_size=300, n_layer=3, d_model=32, n_head=4, n_kv_head=1, dense_ffn=64, n_experts=8,
                             expert_ffn=16, n_shared=1, max_seq_len=64)
    model.save_checkpoint(model.Picaflor(tiny), str(tmp_path / "m"), 1, tick=lambda: ticks.append(1))
    assert len(ticks) >= 4


def test_a_save_ticks_while_a_writer_s_file_grows_and_not_while_it_stalls(tmp_path, monkeypatch):
    """torch.save of a 20 GB optimizer.pt to a slow disk ran with no tick from its start to its end: past hang_timeout
    the watchdog ended a healthy save as a hang (exit 8). A writer that stops writing must still go unticked."""
    import threading
    monkeypatch.setattr(checkpoint, "GROW_POLL_S", 0.01)  # (1 s in a real save)
    events = []

    def chunked(p):  # 5 chunks, 0.05 s apart: a slow disk's torch.save
        events.append("start")
        with open(p, "wb") as f:
            for _ in range(5):
                f.write(os.urandom(1024))
                f.flush()
                time.sleep(0.05)
        events.append("end")

    def stalling(p):  # writes, then hangs without writing
        with open(p, "wb") as f:
            f.write(b"x" * 1024)
            f.flush()
            events.append("wrote")
            deadline = time.monotonic() + 5
            while events[-1] != "tick" and time.monotonic() < deadline:  # its growth seen (and ticked) once
                time.sleep(0.005)
            events.append("stalled")
            time.sleep(0.3)
            events.append("end")
    path = checkpoint.save(str(tmp_path), 1, {"a.bin": chunked, "b.bin": stalling}, tick=lambda: events.append("tick"))
    assert checkpoint.is_valid(path)
    during = events[events.index("start") + 1:events.index("end")]
    assert during.count("tick") >= 3, events  # one per growth seen, not only before and after the writer
    stall = events[events.index("stalled") + 1:]
    assert events[events.index("wrote") + 1] == "tick" and stall.index("end") == 0, events  # no growth: no tick
    assert not [t for t in threading.enumerate() if t.name == "save-growth-ticks"]  # stopped with its file


def test_a_full_disk_under_any_writer_error_is_named_out_of_disk(tmp_path, monkeypatch):
    """torch.save and safetensors raise their own errors on a full disk; the probe that told it apart ran after the
    temp dir was removed, found room again, and a real full disk became an unforeseen crash (exit 10, restarts)."""
    import errno

    def probe(directory, probe_bytes=1 << 20):  # the disk is full exactly while the temp files still exist
        return "No space left on device" if any(n.startswith(".tmp-") for n in os.listdir(directory)) else None
    monkeypatch.setattr(checkpoint, "disk_full", probe)

    def failing(message):
        def write(p):
            open(p, "wb").write(b"x" * 4096)
            raise RuntimeError(message)
        return write
    with pytest.raises(OSError) as e:
        checkpoint.save(str(tmp_path), 1, {"optimizer.pt": failing("[enforce fail] some writer failure")})
    assert e.value.errno == errno.ENOSPC and "RuntimeError" in str(e.value)
    monkeypatch.setattr(checkpoint, "disk_full", lambda d, probe_bytes=0: None)  # room: the writer's own error
    with pytest.raises(RuntimeError, match="some writer failure"):
        checkpoint.save(str(tmp_path), 1, {"optimizer.pt": failing("some writer failure")})
    # miniz's "file write failed" is any short write (EIO, a stale NFS handle): with room, the writer's own error,
    # which the guardian restarts, not exit 6, which it does not
    with pytest.raises(RuntimeError, match="file write failed"):
        checkpoint.save(str(tmp_path), 1, {"optimizer.pt": failing("PytorchStreamWriter failed writing file data/0: "
                                                                   "file write failed")})
    with pytest.raises(OSError) as e:  # a message that says so, whatever the probe finds
        checkpoint.save(str(tmp_path), 1, {"optimizer.pt": failing("No space left on device (os error 28)")})
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # no temp dir left, no step


def test_a_manifest_of_another_shape_is_an_invalid_step_not_a_crash(tmp_path):
    """Valid JSON of the wrong shape raised KeyError / AttributeError out of latest_valid: one bad newest step
    stopped the resume from the good one before it; a manifest listing no files counted as valid."""
    good = checkpoint.save(str(tmp_path), 1, {"w.bin": lambda p: open(p, "wb").write(b"x")})
    bad = checkpoint.save(str(tmp_path), 2, {"w.bin": lambda p: open(p, "wb").write(b"y")})
    for files in ([], {"w.bin": {"sha256": "0"}}, {}, {"w.bin": "x"}):
        json.dump({"step": 2, "files": files}, open(os.path.join(bad, "MANIFEST.json"), "w"))
        with pytest.raises(checkpoint.CheckpointError, match="not a picaflor manifest"):
            checkpoint.verify(bad)
        assert checkpoint.latest_valid(str(tmp_path)) == good, files


def test_a_weights_file_the_manifest_leaves_out_is_not_a_valid_step(tmp_path):
    """A MANIFEST.json rewritten without model.safetensors (or optimizer.pt, state.json, tokenizer.json) still
    verified, and readers loaded that file unchecked; a file no reader loads may stay unlisted."""
    good = checkpoint.save(str(tmp_path), 1, {"model.safetensors": lambda p: open(p, "wb").write(b"x")})
    bad = checkpoint.save(str(tmp_path), 2, {"model.safetensors": lambda p: open(p, "wb").write(b"y"),
                                              "state.json": lambda p: open(p, "w").write("{}")})
    open(os.path.join(bad, "notes.txt"), "w").write("mine")
    checkpoint.verify(bad)
    man = json.load(open(os.path.join(bad, "MANIFEST.json")))
    del man["files"]["model.safetensors"]
    json.dump(man, open(os.path.join(bad, "MANIFEST.json"), "w"))
    with pytest.raises(checkpoint.CheckpointError, match="model.safetensors: not listed in MANIFEST.json"):
        checkpoint.verify(bad)
    assert checkpoint.latest_valid(str(tmp_path)) == good


def test_an_unreadable_or_renamed_step_is_an_invalid_step_not_a_crash(tmp_path, monkeypatch):
    """An OSError while verifying (a MANIFEST.json that is a directory, EIO from a failing disk) came out of is_valid
    as a traceback, so latest_valid and resume's search stopped at it; a step dir copied under another step's name
    verified, and resume took step 1's state for step 3's."""
    import errno
    good = checkpoint.save(str(tmp_path), 1, {"w.bin": lambda p: open(p, "wb").write(b"x")})
    bad = checkpoint.save(str(tmp_path), 2, {"w.bin": lambda p: open(p, "wb").write(b"y")})
    os.remove(os.path.join(bad, "MANIFEST.json"))
    os.mkdir(os.path.join(bad, "MANIFEST.json"))
    with pytest.raises(checkpoint.CheckpointError, match="MANIFEST.json: Is a directory"):
        checkpoint.verify(bad)
    assert checkpoint.latest_valid(str(tmp_path)) == good
    shutil.rmtree(bad)
    copied = str(tmp_path / "step_0000003")
    shutil.copytree(good, copied)
    with pytest.raises(checkpoint.CheckpointError, match="step 1's .*rename it back to step_0000001"):
        checkpoint.verify(copied)
    assert checkpoint.latest_valid(str(tmp_path)) == good
    shutil.rmtree(copied)
    real = checkpoint.sha256_file

    def failing_disk(path, *a, **kw):
        if path.startswith(good):
            raise OSError(errno.EIO, "Input/output error", path)
        return real(path, *a)
    monkeypatch.setattr(checkpoint, "sha256_file", failing_disk)
    with pytest.raises(checkpoint.CheckpointError, match="w.bin: Input/output error; use an earlier step"):
        checkpoint.verify(good)
    assert checkpoint.latest_valid(str(tmp_path)) is None and checkpoint.is_valid(good, check_hashes=False)


def test_random_sigkills_mid_training_end_bitwise_equal(data_root, tmp_path):
    """Three kills, each at a random moment after the process has saved a step of its own (mid-step or mid-save:
    a step and its save take ~30 ms here), not in the start-up before training, where a kill tests nothing. Each start
    is forked from the test forkserver (a Popen'd one spent ~3 s importing torch; four came one after another)."""
    common = [f"--data_root={data_root}", "--max_iters=30", "--warmup_iters=2", "--eval_interval=8", "--ckpt_interval=1",
              "--keep_last=2"]
    straight = str(tmp_path / "straight")  # the uninterrupted run, on the other core meanwhile (one thread each)
    _, _, straight_done = train_started(common + [f"--out_dir={straight}"])
    out = str(tmp_path / "killed")
    rng = random.Random(1234)
    kills, killed_at = 0, []
    while True:
        resume = ["--init_from=resume"] if checkpoint.latest_valid(out) else []
        newest = max((s_ for s_, _ in checkpoint.list_checkpoints(out)), default=0)
        pid, thread, done = train_started([*common, f"--out_dir={out}", *resume])
        if kills < 3:
            deadline = time.time() + 120
            while thread.is_alive() and max((s_ for s_, _ in checkpoint.list_checkpoints(out)), default=0) <= newest:
                assert time.time() < deadline
                time.sleep(0.005)
            time.sleep(rng.uniform(0.0, 0.1))
            if thread.is_alive():
                os.kill(pid, signal.SIGKILL)
                done()
                kills += 1
                killed_at.append(max((s_ for s_, _ in checkpoint.list_checkpoints(out)), default=0))
                continue
        r = done()
        assert r.returncode == 0, r.stderr
        if json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["finished"]:
            break
    assert kills == 3, killed_at  # all three landed inside training (the run had not finished)
    r = straight_done(timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    la, lb = metrics(straight), metrics(out)  # the losses of every step, redone steps' last record
    assert [la[s_]["loss"] for s_ in range(1, 31)] == [lb[s_]["loss"] for s_ in range(1, 31)]
    a, b = load_checkpoint(straight), load_checkpoint(out)
    for (n, ta), (_, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(ta, tb), n


def test_a_restart_keeps_what_is_left_of_the_legs_steps(data_root, tmp_path):
    """--stop_after_steps under the guardian: train.py counts it from its own start, so a restart after a crash gets
    what is left of it (a relay leg, a rented GPU's hours), not the whole again."""
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                          "--max_iters=1000", "--warmup_iters=2", "--eval_interval=1000", "--ckpt_interval=2",
                          "--stop_after_steps=40", "--supervise"], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while (checkpoint.latest_valid(out) is None or int(os.path.basename(checkpoint.latest_valid(out)).split("_")[1]) < 4):
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.02)
    children = open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGKILL)  # the trainer, as the OOM killer would; the guardian restarts it
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    g = json.load(open(os.path.join(out, "guardian.json")))
    assert [s_["cause"] for s_ in g["starts"]] == ["killed by signal 9 (SIGKILL: the kernel's OOM killer? dmesg | grep -i "
                                                   "oom)", "ok"]
    at_restart = g["starts"][1]["checkpoint_step_at_start"]
    assert 4 <= at_restart < 40 and g["starts"][1]["leg_left"] == {"stop_after_steps": 40 - at_restart}
    assert json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"] == 40


def test_an_unforeseen_crash_is_reported_and_restarted(data_root, tmp_path):
    """Anything train.py does not name (a CUDA error, an I/O error on a network mount) exits 10 with its traceback
    kept, and the guardian restarts it (it exited 1 before, which the guardian takes for a config error). Four
    short storage outages with training between them are retried each time: the 3 retries were for the whole run,
    so the fourth outage stopped a run that was making progress. The guardian's restart limits count what they say
    (the same run, max_restarts=0): an outage before any checkpoint is not a max_restarts restart (outages have their
    own retries), starts that made progress are not counted, and each outage's retries start again (without, the
    4th wait of outages 4 to 7 passed unreachable_give_up_s)."""
    out = str(tmp_path / "run")
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=8", "--warmup_iters=1",
               "--eval_interval=1000", "--ckpt_interval=1", "--unreachable_backoff_s=0.01",
               "--unreachable_give_up_s=0.15", "--max_restarts=0", "--supervise"], timeout=300,
              env=dict(ENV, PICAFLOR_INJECT_CRASH_AT_STEP="3", PICAFLOR_INJECT_UNREACHABLE_AT_STEPS="0,4,5,6,7"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train.py: error: unexpected RuntimeError: injected crash" in r.stderr and "Traceback" in r.stderr
    assert "start 1 ended: storage unreachable" in r.stderr  # why it restarts, on the console too
    g = json.load(open(os.path.join(out, "guardian.json")))
    causes = [s_["cause"] for s_ in g["starts"]]
    assert causes == ["storage unreachable", "crash"] + ["storage unreachable"] * 4 + ["ok"], causes
    assert [s_["checkpoint_step_at_start"] for s_ in g["starts"]] == [None, None, 3, 4, 5, 6, 7], g["starts"]
    crashed = next(s_ for s_ in g["starts"] if s_["cause"] == "crash")
    assert crashed["exit_code"] == 10
    rep = json.load(open(os.path.join(out, crashed["crash_report"])))
    assert rep["cause"] == "crash" and "injected crash" in rep["traceback"]
    assert json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["finished"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_pdeathsig_setter_ends_a_child_whose_parent_is_already_gone():
    """The parent may die between fork and prctl; then no signal ever comes, so the setter ends the child itself.
    Here the setter made in this process runs in a grandchild, whose parent is not this process: as if it had died."""
    import relay
    setter = relay.pdeathsig_setter()
    pid = os.fork()
    if pid == 0:  # child: its parent is this test process, so the setter lets it go on
        try:
            setter()
            inner = os.fork()
            if inner == 0:
                setter()  # the grandchild's parent is the child, not the setter's parent: it must end here
                os._exit(0)
            _, status = os.waitpid(inner, 0)
            os._exit(3 if os.waitstatus_to_exitcode(status) == 128 + signal.SIGTERM else 4)
        except BaseException:
            os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def start_long_run(data_root, out, *args, **popen_kw):
    """A tiny run that would train for ever, started in a subprocess, once it has logged a step (metrics.jsonl is
    opened before the first step: on a loaded machine a signal sent at that came before any step). Returns the process,
    its metrics.jsonl and a deadline for what the test waits for next."""
    p = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                          "--max_iters=100000", "--warmup_iters=2", "--eval_interval=100000", "--ckpt_interval=1000",
                          *args], cwd=REPO, **{"env": ENV, **popen_kw})
    deadline = time.time() + 120
    metrics = os.path.join(out, "metrics.jsonl")
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    return p, metrics, deadline


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_guardian_leaves_no_trainer_running(data_root, tmp_path):
    out = str(tmp_path / "run")
    p, metrics, deadline = start_long_run(data_root, out, "--supervise", stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
    trainer = int(open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()[0])
    time.sleep(0.5)  # (past its first step, and training on)
    p.send_signal(signal.SIGKILL)
    p.wait()
    try:
        while os.path.exists(f"/proc/{trainer}") and open(f"/proc/{trainer}/stat").read().split()[2] != "Z":
            assert time.time() < deadline, "the trainer kept running after its guardian was killed"
            time.sleep(0.05)
    except AssertionError:
        os.kill(trainer, signal.SIGKILL)  # no orphan left behind by a failing test
        raise
    step = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"]
    # it took the SIGTERM: checkpointed where it was, then exited (printing into the dead guardian's pipe ended it)
    assert step > 0 and step == max(json.loads(l)["step"] for l in open(metrics) if l.strip())


def test_a_trainer_whose_output_pipe_dies_trains_on_and_checkpoints_at_its_signal(data_root, tmp_path):
    """A killed guardian's SIGTERM (PR_SET_PDEATHSIG) can reach the trainer before the guardian's last thread has gone
    and its pipe closed: the trainer saw a live pipe, then its next print raised BrokenPipeError and ended the run
    with the steps since the last checkpoint (the full suite caught it: checkpoint step 2, metrics at step 52). Here
    the pipe's reader goes first, with no signal: the trainer goes on, then a SIGTERM checkpoints where it is."""
    out = str(tmp_path / "run")
    p, metrics_path, deadline = start_long_run(data_root, out, "--log_interval=1", stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, env=dict(ENV, PYTHONUNBUFFERED="1"))
    p.stdout.close()  # nobody reads its output any more
    p.stderr.close()
    logged = lambda: max(json.loads(l)["step"] for l in open(metrics_path) if l.strip())  # noqa: E731
    first = logged()
    while logged() < first + 5:  # it printed (into the dead pipe) at every one of these steps
        assert time.time() < deadline and p.poll() is None, f"the trainer died on its dead pipe (exit {p.poll()})"
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    step = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"]
    assert step == logged() and step >= first + 5


def test_a_hangup_checkpoints_and_a_signal_at_startup_is_a_clean_stop(data_root, tmp_path):
    """An ssh drop (SIGHUP to the session, no nohup) killed the guardian and the trainer with no checkpoint and left
    guardian.json "running"; a SIGTERM while the trainer started (before its handler) made the guardian exit 241."""
    out = str(tmp_path / "run")
    p, metrics, deadline = start_long_run(data_root, out, "--supervise", stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True)
    os.killpg(p.pid, signal.SIGHUP)  # what the terminal's hangup sends: the whole session
    assert p.wait(timeout=120) == 0
    assert json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"] > 0
    assert json.load(open(os.path.join(out, "guardian.json")))["status"] == "stopped (SIGHUP)"
    n_starts = len(json.load(open(os.path.join(out, "guardian.json")))["starts"])
    p = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                          "--max_iters=100000", "--warmup_iters=2", "--eval_interval=100000", "--ckpt_interval=1000",
                          "--init_from=resume", "--supervise"], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(json.load(open(os.path.join(out, "guardian.json")))["starts"]) == n_starts:  # (written before the fork)
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.01)
    time.sleep(0.2)  # the trainer is importing torch: SIGTERM kills it before its handler exists
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0
    assert json.load(open(os.path.join(out, "guardian.json")))["status"] == "stopped (SIGTERM)"


def test_a_restart_of_a_run_begun_from_resume_from_resumes_its_own_newest(data_root, tmp_path):
    """A supervised run started with --resume_from (a checkpoint elsewhere): a restart resumes the run's own newest
    checkpoint, not that first one again, and the leg's steps count from the step it began at."""
    common = [f"--data_root={data_root}", "--max_iters=1000", "--warmup_iters=2", "--eval_interval=1000",
              "--ckpt_interval=2"]
    first = str(tmp_path / "first")
    assert train(common + [f"--out_dir={first}", "--stop_after_steps=4"]).returncode == 0
    out = str(tmp_path / "run")
    pid, alive, done = train_started(common + [f"--out_dir={out}", "--init_from=resume",
                                               f"--resume_from={checkpoint.latest_valid(first)}",
                                               "--stop_after_steps=30", "--supervise"])
    deadline = time.time() + 120
    while (checkpoint.latest_valid(out) is None or int(os.path.basename(checkpoint.latest_valid(out)).split("_")[1]) < 8):
        assert time.time() < deadline and alive.is_alive()
        time.sleep(0.02)
    os.kill(int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0]), signal.SIGKILL)
    r = done(timeout=300)
    err = r.stdout + r.stderr  # (both, as the Popen with stderr=STDOUT read them)
    assert r.returncode == 0, err[-3000:]
    g = json.load(open(os.path.join(out, "guardian.json")))
    at_restart = g["starts"][1]["checkpoint_step_at_start"]
    assert at_restart >= 8 and g["starts"][1]["leg_left"] == {"stop_after_steps": 34 - at_restart}
    assert f"resuming from {os.path.join(out, 'step_')}" in err  # its own checkpoint, not first/step_0000004
    assert json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"] == 34


def test_a_supervised_rollback_resumes_the_step_it_names(data_root, tmp_path):
    """`--supervise --init_from=resume --resume_from=RUN/step_2` on a run at step 6: the first start resumes step 2
    (the guardian had replaced it with the newest), steps 4 and 6 move to RUN/abandoned/ (else a plain resume went
    back to step 6 and retention pruned the new timeline), --replan and --mirror DIR pass through the guardian, and
    max_restarts counts this invocation's starts only (the second invocation with max_restarts=0 used to give up)."""
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    common = [*TINY, f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=40", "--warmup_iters=2",
              "--eval_interval=2", "--ckpt_interval=2", "--keep_last=10"]

    def supervised(extra):
        return train([*common[len(TINY):], "--max_restarts=0", *extra, "--supervise"], timeout=300)
    r = supervised(["--stop_after_steps=6", f"--mirror_dir={mirror}"])
    assert r.returncode == 0, r.stderr[-2000:]
    steps = lambda: [s_ for s_, _ in checkpoint.list_checkpoints(out)]  # noqa: E731
    assert steps() == [2, 4, 6] == [s_ for s_, _ in checkpoint.list_checkpoints(mirror)]
    r = supervised(["--init_from=resume", f"--resume_from={os.path.join(out, 'step_0000002')}", "--stop_after_steps=1",
                    "--replan", "--mirror", mirror])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming from {os.path.join(out, 'step_0000002')} at step 2" in r.stdout
    assert steps() == [2, 3] and open(os.path.join(out, "LATEST")).read().strip() == "step_0000003"
    aside = [os.path.join(dp, d) for dp, ds, _ in os.walk(os.path.join(out, "abandoned")) for d in ds if d.startswith("step_")]
    assert sorted(os.path.basename(p) for p in aside) == ["step_0000004", "step_0000006"]
    assert all(checkpoint.is_valid(p) for p in aside)  # kept whole, only set aside
    assert os.path.exists(os.path.join(mirror, "metrics.jsonl"))
    logged = [json.loads(l)["step"] for l in open(os.path.join(out, "metrics.jsonl"))]  # each step once, none past 3
    assert logged == sorted(set(logged)) and logged[-1] == 3 and 2 in logged, logged
    assert [json.loads(l)["step"] for l in open(os.path.join(out, "metrics.abandoned.jsonl"))] == [3, 4, 5, 6]
    assert os.path.exists(os.path.join(mirror, "metrics.abandoned.jsonl"))
    assert [s_ for s_, _ in checkpoint.list_checkpoints(mirror)] == [2, 3]  # its steps 4 and 6 set aside too
    best = os.path.join(out, "BEST")  # it named a step set aside: now the resumed state's best, or none
    assert not os.path.exists(best) or os.path.isdir(os.path.join(out, open(best).read().strip()))
    r = train(common[len(TINY):] + ["--init_from=resume", "--stop_after_steps=1"])
    assert r.returncode == 0 and f"resuming from {os.path.join(out, 'step_0000003')}" in r.stdout, r.stderr[-2000:]
    assert steps() == [2, 3, 4]


def test_the_guardians_first_start_rolls_back_only_within_its_run(tmp_path):
    """--resume_from a checkpoint of another run starts this one; rerunning the same supervised command later must
    continue this run's own checkpoints, not roll it back to the start (and set its progress aside)."""
    import guardian
    out, other = tmp_path / "run", tmp_path / "other"
    for d, step in ((out, 8), (other, 4)):
        checkpoint.save(str(d), step, {"state.json": lambda p, s=step: json.dump({"step": s}, open(p, "w"))})
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}", "--init_from=resume",
                           f"--resume_from={other / 'step_0000004'}"])
    assert "--resume_from=" in g.child_argv(first=True)  # continues out's newest
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}", "--init_from=resume",
                           f"--resume_from={out / 'step_0000008'}/"])
    assert "--resume_from=" not in g.child_argv(first=True)  # a rollback: the first start gets exactly that one
    assert "--resume_from=" in g.child_argv(first=False)  # a restart: the new timeline's newest


def test_a_rollback_whose_first_start_died_before_setting_aside_is_not_dropped_by_the_restart(tmp_path):
    """A supervised rollback (--resume_from=RUN/step_4 with step_8 in RUN) whose first start ended before train.py
    set step_8 aside (storage unreachable while it verified step_4, exit 5): the restart resumed the old timeline's
    newest, step_8, silently undoing the rollback; with stop_after_steps=2 the leg was even taken for done."""
    import guardian
    out = tmp_path / "run"
    for step in (4, 8):
        checkpoint.save(str(out), step, {"state.json": lambda p, s=step: json.dump({"step": s}, open(p, "w"))})
    target = str(out / "step_0000004")
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}", "--init_from=resume", f"--resume_from={target}",
                           "--stop_after_steps=2"])
    g.n_started, g.first_step, g.t_first = 1, 4, time.monotonic()  # the first start died before its set-aside
    argv = g.child_argv(g.leg_left(), first=False)
    assert [a for a in argv if a.startswith("--resume_from")][-1] == f"--resume_from={target}", argv  # again
    assert g.leg_left() == {"stop_after_steps": 2}
    os.makedirs(out / "abandoned" / "x")
    os.replace(out / "step_0000008", out / "abandoned" / "x" / "step_0000008")  # a start set the old timeline aside
    checkpoint.save(str(out), 5, {"state.json": lambda p: json.dump({"step": 5}, open(p, "w"))})
    argv = g.child_argv(g.leg_left(), first=False)
    assert [a for a in argv if a.startswith("--resume_from")][-1] == "--resume_from=", argv  # the new timeline's
    assert g.leg_left() == {"stop_after_steps": 1}


def test_a_trainer_locked_out_by_a_killed_guardians_trainer_is_restarted_once_that_one_exits(tmp_path):
    """A guardian relaunched after a kill: its trainer waited lock_wait_s for the killed guardian's trainer, still
    writing (and mirroring) its SIGTERM checkpoint, then exited 1, and the guardian stopped for good ("restarting
    cannot fix this") though the run was fine once that trainer was out."""
    import threading
    import guardian
    import rundir
    out = str(tmp_path / "run")
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    held = rundir.hold_run_lock(out, 0, lambda m: None)  # the killed guardian's trainer, saving
    children = []

    def child_argv(left=None, first=False):  # a stand-in trainer: the first is locked out (exit 1), the next trains
        children.append(1)
        return [sys.executable, "-c", f"raise SystemExit({1 if len(children) == 1 else 0})"]
    g.child_argv = child_argv
    timer = threading.Timer(1.5, lambda: os.close(held))
    signal_before = signal.getsignal(signal.SIGTERM)
    try:
        timer.start()
        assert g.run() == 0
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, signal_before)
    assert len(children) == 2


def test_a_trainer_locked_out_by_one_that_exits_before_the_guardian_looks_is_restarted(tmp_path):
    """The guardian told a locked-out trainer's exit 1 from a config error only by a lock holder still there when it
    looked: one that exited between the refusal and the look stopped supervision for good. The refused trainer now
    says so in the guardian's file (rundir.LOCKED_OUT_ENV); the other run's dir gets no crash report."""
    import threading
    import guardian
    import rundir
    out = str(tmp_path / "run")
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    held = rundir.hold_run_lock(out, 0, lambda m: None)  # the killed guardian's trainer, saving
    refused = str(tmp_path / "refused")

    def release_once_refused():  # the holder exits right after the refusal, before the guardian looks
        while not os.path.exists(refused):
            time.sleep(0.005)
        os.close(held)
    threading.Thread(target=release_once_refused, daemon=True).start()
    started = stand_in_trainers(g, f"import rundir\ntry:\n    rundir.hold_run_lock({out!r}, 0, print)\n"
                                   f"except rundir.RunLocked:\n    open({refused!r}, 'w').close()\n    raise",
                                "raise SystemExit(0)")
    assert run_guardian(g) == 0
    assert len(started) == 2 and not guardian.crash_reports(out)
    log = json.load(open(os.path.join(out, "guardian.json")))
    assert [s["exit_code"] for s in log["starts"]] == [1, 0]


def test_sigterm_between_starts_starts_no_trainer(tmp_path):
    """A SIGTERM while no trainer runs (the backoff after unreachable storage, a repair) ends supervision: before,
    the next start ran a whole new trainer (under relay: training on after the lease was gone)."""
    import threading
    import guardian
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", "--unreachable_backoff_s=1"])
    children = []

    def child_argv(left=None, first=False):  # a stand-in trainer: the first exits "storage unreachable", any later one trains
        children.append(1)
        code = train_py.EXIT_UNREACHABLE if len(children) == 1 else 0
        return [sys.executable, "-c", f"import time; time.sleep({0.2 if code else 30}); raise SystemExit({code})"]
    g.child_argv = child_argv
    signal_before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))  # during the 2 s backoff
    try:
        timer.start()
        t0 = time.time()
        assert g.run() == 0
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, signal_before)
    log = json.load(open(tmp_path / "run" / "guardian.json"))
    assert len(children) == 1 and len(log["starts"]) == 1 and log["status"] == "stopped (SIGTERM)"
    assert time.time() - t0 < 10


def test_a_hand_edited_guardian_log_is_one_line_and_kept(tmp_path, capsys):
    """A guardian.json missing "repairs" / "quarantined" was a KeyError traceback; one of the wrong type a TypeError.
    A missing list is filled empty (the same as an empty one); a wrong type is one line naming the file, exit 2, the
    file unchanged."""
    import guardian
    out = tmp_path / "run"
    out.mkdir()
    (out / "guardian.json").write_text(json.dumps({"starts": [{"started_at": 1.0}], "status": "stopped"}))
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    assert g.log["quarantined"] == [] and g.log["repairs"] == [] and len(g.log["starts"]) == 1
    for bad in ({"starts": [], "quarantined": {}, "repairs": []}, {"starts": [], "quarantined": [{"at": 1}]},
                {"starts": "x"}, [1]):
        (out / "guardian.json").write_text(json.dumps(bad))
        assert guardian.supervise(["config/tiny.py", f"--out_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"guardian: error: {out / 'guardian.json'}: ") and err.count("\n") == 1, err
        assert "move the file aside" in err or "move it aside" in err
        assert json.loads((out / "guardian.json").read_text()) == bad


def test_a_killed_guardians_temp_log_is_removed_at_the_next_start(tmp_path):
    """A guardian SIGKILLed inside write_atomic left guardian.json.tmp-PID-* for good: the next start removes those of
    dead PIDs (and very old ones), never a live writer's."""
    import guardian
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale, live = out / f"guardian.json.tmp-{dead.pid}-1", out / f"guardian.json.tmp-{os.getppid()}-1"
    old = out / f"guardian.json.tmp-{os.getppid()}-2"
    for f in (stale, live, old):
        f.write_text('{"starts": [')
    os.utime(old, (time.time() - 2 * guardian.STALE_TEMP_S,) * 2)
    guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    assert not stale.exists() and not old.exists() and live.exists()


def test_a_stop_during_the_release_check_starts_no_trainer(tmp_path, monkeypatch):
    """A SIGTERM while release_fixed hashed a quarantined shard (minutes for a big one) took effect only after: a
    trainer was started just to be stopped. Now none is; and on_stuck's verify hashes no further corpus."""
    import guardian
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}"])
    started = []
    g.child_argv = lambda left=None, first=False: started.append(1) or [sys.executable, "-c", ""]
    monkeypatch.setattr(g, "release_fixed", lambda: g.on_signal(signal.SIGTERM, None))  # the signal mid-hash
    assert run_guardian(g) == 0
    log = json.load(open(tmp_path / "run" / "guardian.json"))
    assert started == [] and log["starts"] == [] and log["status"] == "stopped (SIGTERM)"
    verified = []
    g.stopping = None
    monkeypatch.setattr(g, "corpora", lambda: {"a": "A", "b": "B"})
    monkeypatch.setattr(g, "verify_corpus", lambda c: (verified.append(c), g.on_signal(signal.SIGTERM, None),
                                                       ([], None))[-1])
    assert g.on_stuck(["hang"] * 3) is False and verified == ["A"]


def test_a_stop_signal_mid_hash_ends_the_guardians_verify_there(data_root, tmp_path, monkeypatch):
    """A SIGTERM / Ctrl-C while the guardian re-hashed a corpus (on_stuck's verify, release_fixed's check of a
    quarantined shard: minutes for GBs) took effect only once the hash ended, which then re-fetched or released on
    it. The hash now stops at its next chunk: nothing re-fetched, quarantined or released, no trainer started after."""
    import guardian
    root = shutil.copytree(data_root, tmp_path / "data")
    shard = os.path.join(root, "local", "train_000000.bin")
    good = open(shard, "rb").read()
    zero_page(shard)  # corrupt on disk: a whole hash re-fetches it from its source
    damaged = open(shard, "rb").read()
    real_hash, chunks, stop = shards.sha256_file, [], [lambda: os.kill(os.getpid(), signal.SIGTERM)]

    def small_chunks(path, bufsize=1 << 20, tick=None, what=None):  # a big corpus' many chunks
        def chunk():
            chunks.append(path)
            if len(chunks) == 3:
                stop[0]()  # the signal mid-hash
            if tick:
                tick()
        return real_hash(path, 256, chunk, what)
    monkeypatch.setattr(shards, "sha256_file", small_chunks)
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}", "--max_stuck_starts=1"])
    started = stand_in_trainers(g, "raise SystemExit(8)")  # a hang: on_stuck verifies the corpus
    assert run_guardian(g) == 0
    log = json.load(open(tmp_path / "run" / "guardian.json"))
    assert started == [1] and len(log["starts"]) == 1 and log["status"] == "stopped (SIGTERM)"
    assert log["repairs"] == [] and log["quarantined"] == [] and open(shard, "rb").read() == damaged
    assert len(chunks) < 5 < len(good) // 256, len(chunks)
    # release_fixed hashing a quarantined shard the operator replaced with a good copy: held, not released
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run2'}"])
    assert g.quarantine(shard, 0, "corrupt on disk and not re-fetchable: test")
    with open(shard + ".new", "wb") as f:
        f.write(good)
    os.replace(shard + ".new", shard)
    chunks.clear()
    stop[0] = lambda: g.on_signal(signal.SIGTERM, None)
    g.release_fixed()
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000000.bin"] and g.log["repairs"] == []
    assert len(chunks) < 5


def test_guardian_log_keeps_the_newest_starts_and_numbers_on(tmp_path, monkeypatch, capsys):
    """guardian.json grew ~300 bytes a start for good: the newest STARTS_KEPT are kept, starts_dropped counts the
    rest, and a start's number (its crash log's, its lines') goes on from all of them."""
    import guardian
    monkeypatch.setattr(guardian, "STARTS_KEPT", 3)
    out = tmp_path / "run"
    out.mkdir()
    (out / "guardian.json").write_text(json.dumps({"starts": [{"started_at": float(i)} for i in range(3)],
                                                   "starts_dropped": 2, "quarantined": [], "repairs": []}))
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    g.child_argv = lambda left=None, first=False: [sys.executable, "-c", "raise SystemExit(2)"]  # a config error
    assert run_guardian(g) == 2
    log = json.load(open(out / "guardian.json"))
    assert log["starts_dropped"] == 3 and [s["started_at"] for s in log["starts"][:2]] == [1.0, 2.0]
    assert log["starts"][-1]["output_tail"] == os.path.join("guardian", "crash-0006.log")
    assert (out / "guardian" / "crash-0006.log").exists() and "start 6 (checkpoint" in capsys.readouterr().err


def test_a_restart_gets_what_is_left_of_the_legs_hours(tmp_path):
    import guardian
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", "--stop_after_hours=1"])
    g.n_started, g.t_first = 1, time.monotonic() - 1800  # a first start half an hour ago
    left = g.leg_left()
    assert abs(left["stop_after_hours"] - 0.5) < 0.01
    argv = g.child_argv(left)
    assert argv.index("--stop_after_hours=1") < argv.index(f"--stop_after_hours={left['stop_after_hours']:.6f}")
    g.t_first = time.monotonic() - 3599.9995  # less than its printed precision left (--stop_after_hours=0.000000)
    assert -1e-3 < g.leg_left()["stop_after_hours"] <= 0  # counts as used up: no trainer started for nothing
    g.t_first = time.monotonic() - 3601  # used up: no restart, a clean end
    signal_before = signal.getsignal(signal.SIGTERM)
    try:
        assert g.run() == 0
    finally:
        signal.signal(signal.SIGTERM, signal_before)
    log = json.load(open(tmp_path / "run" / "guardian.json"))
    assert log["starts"] == [] and log["status"].startswith("done")


def test_mirror_keeps_logs_and_newest_checkpoint_elsewhere(data_root, tmp_path):
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=6", "--warmup_iters=1",
               "--eval_interval=100", "--ckpt_interval=1", "--keep_last=1", "--mirror", mirror])
    assert r.returncode == 0, r.stderr
    assert open(os.path.join(mirror, "metrics.jsonl")).read() == open(os.path.join(out, "metrics.jsonl")).read()
    newest = os.path.basename(checkpoint.latest_valid(out))
    assert checkpoint.is_valid(os.path.join(mirror, newest))
    assert load_checkpoint(mirror) is not None
    # retention there as here (every checkpoint ever made piled up in the mirror)
    steps = lambda d: {s_ for s_, _ in checkpoint.list_checkpoints(d)}
    assert steps(mirror) <= steps(out) and len(steps(out)) < 6
    # a mirror that cannot be written is refused at the start, in one line
    (tmp_path / "file").write_text("")
    r = train([f"--data_root={data_root}", f"--out_dir={tmp_path / 'run2'}", "--max_iters=2", "--warmup_iters=1",
               "--mirror", str(tmp_path / "file" / "mirror")])
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(err) == 1 and "mirror_dir" in err[0] and "not writable" in err[0], r.stderr


def test_ctrl_c_under_the_guardian_checkpoints_and_a_torn_guardian_log_is_set_aside(data_root, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) under --supervise: the trainer saves a checkpoint
    and exits 0, the guardian records "stopped (SIGINT)", no traceback. A torn guardian.json (a full disk) is kept
    aside and a fresh log begins, instead of a traceback."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "guardian.json").write_text('{"starts": [')
    p = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                          "--max_iters=100000", "--warmup_iters=2", "--eval_interval=100000", "--ckpt_interval=1000",
                          "--supervise"], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    deadline = time.time() + 120
    mpath = out / "metrics.jsonl"
    while not (mpath.exists() and mpath.stat().st_size):  # a step logged (the file is opened before the first step)
        assert time.time() < deadline and p.poll() is None, p.stdout.read()
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGINT)
    err, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "Ctrl-C: saving a checkpoint" in err and "SIGINT: checkpoint saved" in err
    log = json.load(open(out / "guardian.json"))
    assert log["status"] == "stopped (SIGINT)" and len(log["starts"]) == 1
    assert [n for n in os.listdir(out) if n.startswith("guardian.json.corrupt-")]
    step = json.load(open(os.path.join(checkpoint.latest_valid(str(out)), "state.json")))["step"]
    assert step > 0


def test_quarantine_holds_for_val_shards_release_brings_one_back_and_a_torn_control_file_waits(data_root, tmp_path):
    """A quarantined val shard is skipped as train ones are (the guardian restarted on it until it gave up);
    --release_shards reads it again without touching a checkpoint (the old advice, editing state.json, broke every
    checkpoint's hash); an empty control.json (`echo ... >` truncates first) is a warning, read again later."""
    root = copy_corpus(data_root, tmp_path / "data")
    val = os.path.join(root, "local", "val_000000.bin")
    zero_page(val)
    out = str(tmp_path / "run")
    base = [f"--data_root={root}", f"--out_dir={out}", "--max_iters=400", "--warmup_iters=1", "--eval_interval=2"]
    r = train(base + ["--stop_after_steps=3", "--quarantine_shards=['local/val_000000.bin']"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--release_shards" in r.stdout + r.stderr
    assert (r.stdout + r.stderr).count("val_000000.bin is quarantined") == 1  # by the val stream only, not the train's
    assert "WARNING: the plan trains" in r.stdout  # 400 steps of 128 tokens: more than the corpus holds, said
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["quarantined_shards"] == ["local/val_000000.bin"]
    open(os.path.join(out, "control.json"), "w").close()
    r = train(base + ["--init_from=resume", "--stop_after_steps=2", "--release_shards=['local/val_000000.bin']"])
    assert "control.json: not valid JSON" in r.stdout + r.stderr
    assert r.returncode == 3 and "val_000000.bin" in r.stderr and "corrupt data" in r.stderr, r.stderr[-2000:]
    assert checkpoint.latest_valid(out) and checkpoint.is_valid(checkpoint.latest_valid(out))
    # the corpus prepared again with the same tokenizer but other shards: the saved position would land elsewhere
    tokfile = tmp_path / "tok.json"
    shutil.copy(os.path.join(root, "local", "tokenizer.json"), tokfile)
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", os.path.join(sysconfig.get_paths()["stdlib"],
                        "json"), "--out", os.path.join(root, "local"), "--tokenizer", str(tokfile), "--val-percent",
                        "20", "--shard-tokens", "100000"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = train(base + ["--init_from=resume", "--stop_after_steps=2", "--quarantine_shards=['local/val_000000.bin']"])
    assert r.returncode == 3 and "prepared again" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_config_mistakes_before_training_are_not_corrupt_data(data_root, tmp_path):
    """A corpus with a larger vocabulary than the model is a config error (exit 1, which the guardian does not
    restart), not corrupt data (3, restarted up to max_restarts), and gets a crash report; a corrupt index.json is
    not a shard to quarantine: the guardian stops after one start."""
    os.makedirs(tmp_path / "a")  # (as the guardian makes it; an out_dir the refused start made itself is removed)
    r = train([f"--data_root={data_root}", f"--out_dir={tmp_path / 'a'}", "--vocab_size=256", "--max_iters=4",
               "--warmup_iters=1"])
    assert r.returncode == 1 and "set --vocab_size=320" in r.stderr, r.stderr[-2000:]
    assert [n for n in os.listdir(tmp_path / "a") if n.startswith("crash-")]
    shutil.copytree(os.path.join(data_root, "local"), tmp_path / "data" / "local")
    with open(tmp_path / "data" / "local" / "index.json", "w") as f:
        f.write('{"splits": ')
    out = tmp_path / "b"
    r = train([f"--data_root={tmp_path / 'data'}", f"--out_dir={out}", "--max_iters=4", "--warmup_iters=1", "--supervise",
               "--max_restarts=3"])
    log = json.load(open(out / "guardian.json"))
    assert r.returncode == 3 and len(log["starts"]) == 1 and not log["quarantined"], (r.stderr[-2000:], log)
    assert "restarting cannot fix this" in log["report"]["message"]


def test_an_out_dir_that_is_or_lies_under_a_file_is_one_line_not_a_restartable_crash(tmp_path):
    """makedirs' FileExistsError / NotADirectoryError was a traceback and exit 10 (which the guardian restarts),
    saying "checkpoints are intact: resume"; the guardian's own makedirs, a traceback."""
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    for out, extra, code, who in [(f, [], 1, "train.py"), (f / "run", [], 1, "train.py"),
                                  (f, ["--supervise"], 2, "guardian")]:
        r = train([f"--data_root={tmp_path}", f"--out_dir={out}", "--max_iters=2", *extra])
        assert r.returncode == code and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr == f"{who}: error: --out_dir={out}: {f} is a file, not a folder; pass a run directory\n"
    assert f.read_text() == "mine"


def test_an_out_dir_that_cannot_be_made_or_written_is_one_line(capsys):
    """--out_dir=/proc/x was an unexpected FileNotFoundError, exit 10 (restarted as a crash), "checkpoints are intact";
    /proc/self's lock file the same; the guardian's a traceback for each, and for a run dir it may not write (/sys/x)
    too; train.py said of /sys/x "0 MB free on its disk: free space". Now one line each: exit 1 for a folder no files
    can be made in, storage denied (4) for one it may not write."""
    import errno
    import guardian
    import rundir
    for out, made in (("/proc/x", "/proc/x"), ("/proc/x/y", "/proc/x"), ("/proc/self", "/proc/self/.trainer.lock")):
        with pytest.raises(rundir.RunDirError, match=rf"^--out_dir={out}: cannot create {made} \(No such file or "
                                                     r"directory: .*\); pass a run directory on a disk it can write$"):
            rundir.hold_run_lock(out, 0, print)
    assert guardian.supervise(["config/tiny.py", "--out_dir=/proc/x"]) == 1
    assert capsys.readouterr().err == ("guardian: error: --out_dir=/proc/x: cannot create /proc/x (No such file or "
                                       "directory: no folder files can be made in, as /proc or /sys); pass a run "
                                       "directory on a disk it can write\n")
    assert guardian.supervise(["config/tiny.py", "--out_dir=/sys/x"]) == train_py.EXIT_DENIED
    assert re.fullmatch(r"guardian: error: storage denied: /sys/x: [^;(]+; fix its permissions, or pass another "
                        r"--out_dir\n", capsys.readouterr().err)
    ro = OSError(errno.EROFS, "Read-only file system", "/mnt/run")
    assert rundir.denied_line(ro, "x") == ("/mnt/run: Read-only file system; remount it read-write, or pass another "
                                           "--out_dir")


def test_a_corrupt_shard_of_a_read_only_corpus_is_quarantined_not_out_of_disk(data_root, tmp_path, monkeypatch):
    """A corrupt shard the guardian re-made from its source but could not write back (a read-only corpus: another
    user's, an NFS export) stopped the run as "out of disk", to "free space"; now it is quarantined, as one whose
    source is gone, and training goes on without it."""
    import errno
    import guardian
    root = str(shutil.copytree(data_root, tmp_path / "data"))
    shard = os.path.join(root, "local", "train_000000.bin")
    zero_page(shard)

    def read_only(path, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path + ".tmp")
    monkeypatch.setattr(shards, "_atomic_write", read_only)
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}"])
    assert g.repair_shard(shard, 0, False) is None
    [q] = g.log["quarantined"]
    assert q["shard"] == "local/train_000000.bin" and "(Read-only file system); make " in q["reason"], q


def test_guardian_quarantines_a_mask_by_its_shard_and_counts_no_old_quarantine_as_a_fix(tmp_path):
    """A corrupt loss mask quarantined `x.mask.bin`, which train.py (skipping shards by name) never skipped; and
    on_stuck counted a shard it had quarantined before, still corrupt on disk, as fixed: every restart was burnt."""
    import guardian
    src = shutil.copytree(os.path.join(sysconfig.get_paths()["stdlib"], "json"), tmp_path / "src")
    root = make_corpus(tmp_path / "data", src=src)
    shutil.rmtree(src)  # the recorded source is gone: a corrupt shard cannot be re-fetched
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}"])
    mask = os.path.join(root, "local", "train_000000.mask.bin")
    assert g.quarantine(mask, 0, "test") and not g.quarantine(os.path.join(root, "local", "train_000000.bin"), 0, "x")
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000000.bin"]
    shard = os.path.join(root, "local", "train_000001.bin")
    zero_page(shard)  # corrupt on disk, no source to re-fetch from: quarantined by the first on_stuck
    assert g.on_stuck(["corrupt data"] * 3) is True and "local/train_000001.bin" in [q["shard"] for q in g.log["quarantined"]]
    assert g.on_stuck(["corrupt data"] * 3) is False  # the same shard again: nothing was fixed


def test_a_stuck_report_says_what_the_verify_found_and_a_dropped_index_mount_is_no_traceback(tmp_path, monkeypatch):
    """The stuck report said "data verifies" when on_stuck's verify had found a shard still corrupt on disk (quarantined
    before, not re-fetchable): it now names the problems and the quarantined count. And a dropped mount under index.json
    (now a StorageError, no longer "missing") is no traceback out of quarantine or release_fixed."""
    import errno
    import guardian
    src = shutil.copytree(os.path.join(sysconfig.get_paths()["stdlib"], "json"), tmp_path / "src")
    root = make_corpus(tmp_path / "data", src=src)
    shutil.rmtree(src)  # no source: a corrupt shard cannot be re-fetched
    shard = os.path.join(root, "local", "train_000001.bin")
    zero_page(shard)
    run = tmp_path / "run"
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={run}", "--max_stuck_starts=1", "--max_restarts=5"])
    assert g.quarantine(shard, 0, "corrupt on disk and not re-fetchable: test")
    stand_in_trainers(g, "raise SystemExit(8)")
    assert run_guardian(g) == guardian.EXIT_STUCK
    msg = json.load(open(run / "guardian.json"))["report"]["message"]
    assert "data verifies" not in msg and "does not verify: 1 problem, 1 shard quarantined" in msg, msg
    assert f"python shards.py verify {os.path.join(root, 'local')}" in msg, msg
    # index.json on a mount that dropped: quarantined without a fingerprint, and release_fixed waits
    index, real_stat = os.path.join(root, "local", "index.json"), os.stat

    def stat(path, *a, **k):
        if str(path) == index:
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), str(path))
        return real_stat(path, *a, **k)
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run2'}"])
    monkeypatch.setattr(os, "stat", stat)
    assert g.quarantine(shard, 0, "test") and g.log["quarantined"][0]["fingerprint"] is None
    g.release_fixed()
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000001.bin"]


def test_review_round_guardian_on_stuck_signals_and_quarantined_splits(data_root, tmp_path):
    """A failing on_stuck command counted as a fix (a hang burnt max_restarts starts, ~10 GPU-hours, then exit 1
    instead of 9); a signal during a backoff waited it out (PEP 475 resumed the sleep); a split whose every shard is
    quarantined said to run prepare.py, after which the quarantine still held; a truncated val shard was taken for
    "no val split" (no val loss, never repaired)."""
    import guardian
    import threading
    root = copy_corpus(data_root, tmp_path / "data")
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}", "--on_stuck=exit 3"])
    assert g.on_stuck(["hang"] * 3) is False and g.log["repairs"][-1]["exit_code"] == 3
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}", "--on_stuck=true"])
    assert g.on_stuck(["hang"] * 3) is True
    # a signal cuts a wait short
    threading.Timer(0.3, lambda: g.on_signal(signal.SIGTERM, None)).start()
    t0 = time.time()
    assert g.wait(30) is True and time.time() - t0 < 5
    # every train shard quarantined: the fix named is --release_shards, not prepare.py
    files = [e["file"] for e in shards.load_index(os.path.join(root, "local"))["splits"]["train"]]
    with pytest.raises(shards.DataError) as e:
        shards.TokenStream(os.path.join(root, "local"), skip_shards=files)
    assert "--release_shards" in str(e.value) and "local/" + files[0] in str(e.value), str(e.value)
    # a truncated val shard: exit 3 naming it (the guardian's repair), not a run without val loss
    val = os.path.join(root, "local", "val_000000.bin")
    with open(val, "r+b") as f:
        f.truncate(100)
    r = train([f"--data_root={root}", f"--out_dir={tmp_path / 'run2'}", "--max_iters=4", "--warmup_iters=1"])
    assert r.returncode == 3 and "val_000000.bin" in r.stderr and "truncated" in r.stderr, r.stderr[-2000:]


def test_a_full_disk_while_refetching_stops_as_out_of_disk_not_a_traceback(data_root, tmp_path, monkeypatch):
    """refetch_shard's write met a full disk: an OSError traceback out of `shards.py refetch`, and out of the guardian
    (it caught StorageError and DataError only), which ended the supervisor; now a StorageError of kind disk, exit 6."""
    import errno
    import guardian
    root = copy_corpus(data_root, tmp_path / "data")
    shard = os.path.join(root, "local", "train_000000.bin")
    zero_page(shard)
    damaged = open(shard, "rb").read()

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shards, "_atomic_write", full)
    with pytest.raises(shards.StorageError) as e:
        shards.refetch_shard(os.path.dirname(shard), "train_000000.bin")
    assert e.value.kind == "disk" and shard in str(e.value) and "free space" in str(e.value)
    assert open(shard, "rb").read() == damaged  # left as it was
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}"])
    code, msg = g.repair_shard(shard, 0, repeated=False)
    assert code == train_py.EXIT_DISK and "out of disk" in msg and shard in msg, msg


def test_a_corrupt_newest_step_is_set_aside_so_retention_keeps_the_new_ones(data_root, tmp_path, ten_steps_mirrored):
    """The newest step fails its hash (a flipped byte; the size still matches): resume takes the step before it, but
    retention (a size check) kept the corrupt newest as 'the newest' and pruned every step the new start saved."""
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000"]
    shutil.copytree(os.path.join(ten_steps_mirrored, "run"), out)  # checkpoints 5 and 10; no mirror here
    with open(os.path.join(out, "step_0000010", "model.safetensors"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    r = train(common + ["--init_from=resume", "--ckpt_interval=1", "--keep_last=1", "--stop_after_steps=3"])
    assert r.returncode == 0 and "resuming from" in r.stdout and "step_0000005" in r.stdout, r.stderr[-2000:]
    assert [s_ for s_, _ in checkpoint.list_checkpoints(out) if s_ > 5] == [8]  # keep_last=1: the newest stays
    assert checkpoint.latest_valid(out).endswith("step_0000008")
    aside = [d for dp, ds, _ in os.walk(os.path.join(out, "abandoned")) for d in ds if d.startswith("step_")]
    assert aside == ["step_0000010"]  # kept whole for a look, out of the way


def test_a_corrupt_newest_step_comes_back_from_the_mirror_and_a_rollback_sets_the_mirrors_aside(data_root, tmp_path,
                                                                                             ten_steps_mirrored):
    """The mirror's copy of a newest step that fails here verifies: it is this timeline's newest, copied back and
    resumed (it was set aside with the corrupt one: hidden, and the work redone). A rollback into a fresh out_dir
    from the mirror sets the mirror's later steps aside (only out_dir's were: the mirror's newest was the old
    timeline's, a resume from it went back there)."""
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    common = [f"--data_root={data_root}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000",
              f"--mirror_dir={mirror}", "--keep_last=10"]
    for name in ("run", "mirror"):
        shutil.copytree(os.path.join(ten_steps_mirrored, name), tmp_path / name)
    with open(os.path.join(out, "step_0000010", "model.safetensors"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000010"))
    r = train(common + [f"--out_dir={out}", "--init_from=resume", "--ckpt_interval=1", "--stop_after_steps=1"])
    assert r.returncode == 0 and "copied back" in r.stdout and "at step 10" in r.stdout, r.stdout[-2000:]
    assert "is invalid" not in r.stdout  # (said before the copy-back, it named the older step as the one resumed)
    assert checkpoint.latest_valid(out).endswith("step_0000011") and checkpoint.is_valid(os.path.join(out, "step_0000010"))
    assert os.path.isdir(os.path.join(mirror, "step_0000010"))  # the mirror's copy stays where it was
    fresh = str(tmp_path / "fresh")
    r = train(common + [f"--out_dir={fresh}", "--init_from=resume", f"--resume_from={mirror}/step_0000005",
                        "--ckpt_interval=1", "--stop_after_steps=1"])
    assert r.returncode == 0 and f"of {mirror}" in r.stdout, r.stdout[-2000:]
    assert [s_ for s_, _ in checkpoint.list_checkpoints(mirror) if s_ >= 5] == [5, 6]
    assert json.load(open(os.path.join(mirror, "step_0000006", "state.json")))["tokens"] == \
        json.load(open(os.path.join(fresh, "step_0000006", "state.json")))["tokens"]


def test_a_second_run_given_the_same_mirror_dir_is_refused_and_the_same_run_resumed_is_not(data_root, tmp_path,
                                                                                           ten_steps_mirrored):
    """Two runs with one mirror_dir: the second's retention there deleted the first's steps and its copies overwrote
    the first's metrics.jsonl: the off-machine copy lost without a word. The mirror names its run (MIRROR_OF.json);
    another run is refused at its start, nothing there touched; the same run resumed goes on (a pre-marker mirror:
    its steps' state.json says whose it is)."""
    import rundir
    out, mirror = str(tmp_path / "run"), str(tmp_path / "mirror")
    for name in ("run", "mirror"):
        shutil.copytree(os.path.join(ten_steps_mirrored, name), tmp_path / name)
    before = {n: open(os.path.join(mirror, n), "rb").read() for n in ("metrics.jsonl", "LATEST")}
    steps_before = sorted(os.listdir(mirror))
    common = [f"--data_root={data_root}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000",
              f"--mirror_dir={mirror}", "--keep_last=1", "--ckpt_interval=1", "--stop_after_steps=1"]
    r = train(common + [f"--out_dir={tmp_path / 'other'}"])
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1, r.stderr[-2000:]
    named = os.path.realpath(os.path.join(ten_steps_mirrored, "run"))  # the run that mirrored there (out/ is its copy)
    assert mirror in err[0] and named in err[0] and "another --mirror_dir" in err[0], err[0]
    assert sorted(os.listdir(mirror)) == steps_before and not os.path.exists(tmp_path / "other" / "step_0000001")
    assert all(open(os.path.join(mirror, n), "rb").read() == b for n, b in before.items())
    # a mirror from before the marker: its steps' run may claim it, a new run may not
    os.remove(os.path.join(mirror, "MIRROR_OF.json"))
    created_at = json.load(open(os.path.join(out, "step_0000010", "state.json")))["created_at"]
    assert "another --mirror_dir" in rundir.mirror_owner_error(mirror, str(tmp_path / "other"), None)
    assert "another --mirror_dir" in rundir.mirror_owner_error(mirror, str(tmp_path / "other"), created_at + 1)
    assert rundir.mirror_owner_error(mirror, out, created_at) is None
    assert rundir.mirror_owner_error(str(tmp_path / "absent"), out, None) is None
    r = train(common + [f"--out_dir={out}", "--init_from=resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.load(open(os.path.join(mirror, "MIRROR_OF.json")))["created_at"] == created_at
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000011"))  # mirrored on: no warning, no refusal


def test_a_run_dir_resolved_past_a_corrupt_newest_step_says_so(tmp_path, capsys):
    """export.py / eval.py of a run dir whose newest step (the one LATEST names) fails verification used an older
    step without a word."""
    old = checkpoint.save(str(tmp_path), 1, {"w.bin": lambda p: open(p, "wb").write(b"old")})
    new = checkpoint.save(str(tmp_path), 2, {"w.bin": lambda p: open(p, "wb").write(b"new")})
    assert checkpoint.resolve(str(tmp_path)) == new and capsys.readouterr().err == ""
    open(os.path.join(new, "w.bin"), "wb").write(b"bad")
    assert checkpoint.resolve(str(tmp_path)) == old
    err = capsys.readouterr().err
    assert "step_0000002 does not verify" in err and old in err and len(err.strip().splitlines()) == 1
    os.remove(os.path.join(str(tmp_path), "LATEST"))  # no LATEST: the newest step dir is the one skipped
    assert checkpoint.resolve(str(tmp_path)) == old and "step_0000002 does not verify" in capsys.readouterr().err


def test_a_run_dir_with_no_step_that_verifies_names_each_step_and_its_cause(tmp_path):
    """chat.py / export.py / eval.py of a run dir whose only step fails verification said "holds no valid checkpoint
    (no step_* dir with an intact MANIFEST.json)": no step, no cause, no fix (naming the step dir said all three)."""
    import chat
    import export
    run = str(tmp_path / "run")
    steps = [checkpoint.save(run, s_, {"w.bin": lambda p: open(p, "wb").write(b"x")}) for s_ in range(1, 6)]
    for p in steps[:-1]:
        shutil.rmtree(p)
    open(os.path.join(steps[-1], "w.bin"), "wb").write(b"y")
    for load in (checkpoint.resolve, chat.load_model, export.Source):
        with pytest.raises((checkpoint.CheckpointError, chat.ChatError)) as e:
            load(run)
        msg = str(e.value)
        assert msg.startswith(f"{run}: holds no valid checkpoint") and "\n" not in msg, msg
        assert f"{steps[-1]}/w.bin: sha256 does not match MANIFEST.json (corrupt)" in msg, msg
        assert "re-copy it" in msg and "another checkpoint" in msg and "use an earlier step" not in msg, msg
    for p in steps[:-1]:  # many bad steps: the three newest are named, the rest counted
        shutil.copytree(steps[-1], p)
        json.dump({**json.load(open(os.path.join(p, "MANIFEST.json"))), "step": int(p[-7:])},
                  open(os.path.join(p, "MANIFEST.json"), "w"))
    os.remove(os.path.join(steps[0], "MANIFEST.json"))
    msg = str(pytest.raises(checkpoint.CheckpointError, checkpoint.resolve, run).value)
    assert all(os.path.basename(p) in msg for p in steps[2:]) and "step_0000002" not in msg, msg
    assert "2 older step(s) do not verify either" in msg and "\n" not in msg, msg
    os.makedirs(tmp_path / "empty")
    with pytest.raises(checkpoint.CheckpointError, match=r"no step_\* dir in it\); pass a run dir train.py wrote"):
        checkpoint.resolve(str(tmp_path / "empty"))


def test_a_latest_naming_a_step_that_is_not_there_is_said(tmp_path, capsys):
    """A mirror whose copy of the newest step failed (a full disk) holds LATEST naming that step: chat / export / eval
    of it used the older step there without a word (as for a newest step that does not verify, said since)."""
    old = checkpoint.save(str(tmp_path), 1, {"w.bin": lambda p: open(p, "wb").write(b"x")})
    checkpoint.write_atomic_text(os.path.join(str(tmp_path), "LATEST"), "step_0000002\n")
    assert checkpoint.resolve(str(tmp_path)) == old
    err = capsys.readouterr().err
    assert "LATEST names step_0000002, which is not there; using" in err and old in err and err.count("\n") == 1, err
    # a save that died before LATEST's write: the newer step, no warning
    checkpoint.save(str(tmp_path), 3, {"w.bin": lambda p: open(p, "wb").write(b"x")})
    checkpoint.write_atomic_text(os.path.join(str(tmp_path), "LATEST"), "step_0000002\n")
    assert checkpoint.resolve(str(tmp_path)).endswith("step_0000003") and capsys.readouterr().err == ""


def test_a_run_dir_it_may_not_read_is_one_line(tmp_path, monkeypatch, capsys):
    """chat.py / eval.py of a run dir they may not list (another user's, mode 700) ended in a PermissionError traceback
    from checkpoint.resolve."""
    import errno
    import chat
    import eval as ev
    run, real = str(tmp_path / "run"), os.listdir
    checkpoint.save(run, 1, {"w.bin": lambda p: open(p, "wb").write(b"x")})

    def listdir(path="."):
        if str(path).rstrip("/") == run:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real(path)
    monkeypatch.setattr(os, "listdir", listdir)
    want = f"{run}: Permission denied; fix its permissions, or pass a step_NNNNNNN dir"
    with pytest.raises(checkpoint.CheckpointError, match=want):
        checkpoint.resolve(run)
    capsys.readouterr()
    assert chat.main([run]) == 1 and capsys.readouterr().err == f"chat.py: error: {want}\n"
    assert ev.main([run, "--tasks", "piqa", "--device", "cpu"]) == 2 and capsys.readouterr().err == f"error: {want}\n"


def test_a_shard_unreadable_while_hashed_is_a_storage_error(data_root, monkeypatch):
    """A shard whose sha256 read failed after its stat (a mount dropped mid-hash, a failing disk) came out of the
    stream as an OSError: train.py exit 10, an unforeseen crash, not exit 5 (storage unreachable)."""
    import errno
    monkeypatch.setattr(shards, "_VERIFIED", set())  # hashed once per process: maybe by an earlier test
    for code, kind in ((errno.ENOTCONN, "unreachable"), (errno.EIO, "io")):
        unreadable_shards(monkeypatch, [code, "always"])
        stream = shards.TokenStream(os.path.join(data_root, "local"))
        with pytest.raises(shards.StorageError) as e:
            stream.next_batch(2, 16)
        assert e.value.kind == kind and "train_000000.bin: cannot be read" in str(e.value), str(e.value)


def train_patched(args, patch):
    """train.py (as __main__, so its exit codes) after the Python source `patch` ran in its process."""
    wrapper = (f"import errno, os, runpy, sys; sys.path.insert(0, {REPO!r}); import checkpoint, shards\n{patch}\n"
               f"sys.argv = ['train.py', *{[*TINY, *args]!r}]\nrunpy.run_path('train.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", wrapper], cwd=REPO, capture_output=True, text=True, env=ENV,
                          timeout=300)


def train_with_unreadable(args, match, code):
    """train.py, every checkpoint or shard file whose path holds `match` failing its sha256 read with errno `code`."""
    return train_patched(args, f"real = checkpoint.sha256_file\n"
                               f"def sha(path, *a, **k):\n"
                               f"    if {match!r} in path: raise OSError({code}, os.strerror({code}), path)\n"
                               f"    return real(path, *a, **k)\n"
                               f"checkpoint.sha256_file = shards.sha256_file = sha")


def test_a_checkpoint_unreadable_while_hashed_or_a_denied_run_dir_is_a_storage_exit(data_root, tmp_path,
                                                                                     ten_steps_mirrored):
    """A mount that dropped while resume hashed the newest step: the step was taken for corrupt, set aside to
    abandoned/ and the run went back to the step before it (or, with none, "start with --init_from=scratch", exit 1);
    a save whose hash of its own new file failed so was exit 10. Both are storage unreachable now: exit 5. A run dir
    it may not write was exit 10 too (restarted, failing alike): storage denied, exit 4."""
    import errno
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--warmup_iters=1", "--eval_interval=1000",
              "--ckpt_interval=1", "--max_iters=40"]
    shutil.copytree(os.path.join(ten_steps_mirrored, "run"), out)  # a run at step 10
    steps = [s_ for s_, _ in checkpoint.list_checkpoints(out)]
    r = train_with_unreadable([*common, "--init_from=resume"], "step_0000010", errno.ENOTCONN)
    assert r.returncode == train_py.EXIT_UNREACHABLE, r.stderr[-3000:]
    assert "storage unreachable:" in r.stderr and "step_0000010" in r.stderr and "Traceback" not in r.stderr
    assert [s_ for s_, _ in checkpoint.list_checkpoints(out)] == steps and not os.path.exists(f"{out}/abandoned")
    r = train_with_unreadable([*common, "--init_from=resume"], ".tmp-step_", errno.ENOTCONN)
    assert r.returncode == train_py.EXIT_UNREACHABLE, r.stderr[-3000:]
    assert "storage unreachable:" in r.stderr and ".tmp-step_0000011" in r.stderr, r.stderr[-3000:]
    assert checkpoint.latest_valid(out).endswith("step_0000010")
    # a run dir it may not write (another user's, a read-only mount): exit 10 and a traceback at every restart
    r = train_patched([*common, "--init_from=resume"], "real = os.open\n"
                      "def denied(path, *a, **k):\n"
                      "    if str(path).endswith('.trainer.lock'):\n"
                      "        raise PermissionError(errno.EACCES, 'Permission denied', path)\n"
                      "    return real(path, *a, **k)\n"
                      "os.open = denied")
    assert r.returncode == train_py.EXIT_DENIED and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().endswith(f"storage denied: {out}/.trainer.lock: Permission denied; fix its permissions, "
                                     f"or pass another --out_dir"), r.stderr[-3000:]


def test_only_the_same_checkpoint_comes_back_from_the_mirror(data_root, tmp_path, ten_steps_mirrored):
    """The mirror's newest valid step was copied back whatever it was: another run's sharing the mirror, or the old
    timeline's after a rollback the mirror missed, was resumed as this run's. Only a copy with the very manifest of
    the step that fails here comes back."""
    import shutil
    out, other, mirror = str(tmp_path / "run"), str(tmp_path / "other"), str(tmp_path / "mirror")
    common = [f"--data_root={data_root}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000", "--keep_last=10",
              "--ckpt_interval=5", "--stop_after_steps=10"]
    for name, to in (("run", out), ("mirror", mirror)):
        shutil.copytree(os.path.join(ten_steps_mirrored, name), to)
    assert train(common + [f"--out_dir={other}", "--seed=7"]).returncode == 0
    shutil.rmtree(os.path.join(mirror, "step_0000010"))  # the mirror's step 10 is now another run's, valid there
    shutil.copytree(os.path.join(other, "step_0000010"), os.path.join(mirror, "step_0000010"))
    assert checkpoint.is_valid(os.path.join(mirror, "step_0000010"))
    with open(os.path.join(out, "step_0000010", "model.safetensors"), "r+b") as f:
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))
    r = train([a for a in common if not a.startswith("--stop")] + [f"--out_dir={out}", f"--mirror_dir={mirror}",
                                                                   "--init_from=resume", "--stop_after_steps=1"])
    assert r.returncode == 0 and "copied back" not in r.stdout and "step_0000005 at step 5" in r.stdout, r.stdout[-2000:]
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-restore-")]


@pytest.mark.parametrize("blips, extra, code, said", [
    # (max_restarts and outages after progress: test_an_unforeseen_crash_is_reported_and_restarted, in its run)
    # outages with no checkpoint between them: the retries (up to unreachable_give_up_s) come before the stuck check
    ("0,1,2,3,4", ["--ckpt_interval=1000", "--warmup_iters=5"], 5, "storage unreachable 4 times"),
])
def test_the_guardians_restart_limits_count_what_they_say(data_root, tmp_path, blips, extra, code, said):
    out = str(tmp_path / "run")
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=10", "--warmup_iters=1",
               "--eval_interval=1000", "--unreachable_backoff_s=0.01", "--unreachable_give_up_s=0.15", *extra,
               "--supervise"], timeout=300, env=dict(ENV, PICAFLOR_INJECT_UNREACHABLE_AT_STEPS=blips))
    assert r.returncode == code, r.stderr[-3000:]
    assert "start 1 ended: storage unreachable" in r.stderr  # why it restarts, on the console too
    g = json.load(open(os.path.join(out, "guardian.json")))
    assert said in g["report"]["message"] and g["report"]["cause"] == "storage unreachable", g["report"]


def test_a_leg_resumed_from_a_run_dir_counts_its_steps_from_that_runs_newest(data_root, tmp_path, ten_steps_mirrored):
    """--resume_from=RUN_DIR (not a step dir): the guardian read RUN_DIR/state.json, which does not exist, took the
    leg's first step as 0, and after a crash counted the whole run's steps as the leg's: 'used up', 3 of 10 trained."""
    src, out = str(tmp_path / "src"), str(tmp_path / "run")
    common = [*TINY, f"--data_root={data_root}", "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000",
              "--ckpt_interval=1"]
    shutil.copytree(os.path.join(ten_steps_mirrored, "run"), src)  # a run at step 10 (the same plan)
    r = train([*common[len(TINY):], f"--out_dir={out}", "--init_from=resume", f"--resume_from={src}",
               "--stop_after_steps=10", "--supervise"], timeout=300, env=dict(ENV, PICAFLOR_INJECT_CRASH_AT_STEP="13"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))["step"] == 20
    bad = tmp_path / "bad" / "step_0000010"  # a rollback target whose state.json is cut: train.py's one line, no traceback
    shutil.copytree(os.path.join(src, "step_0000010"), bad)
    (bad / "state.json").write_text('{"step": 10, ')
    r = train([*common[len(TINY):], f"--out_dir={tmp_path / 'bad'}", "--init_from=resume", f"--resume_from={bad}",
               "--supervise"], timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "state.json" in r.stderr, r.stderr[-3000:]


def test_a_hang_before_the_first_step_is_caught(data_root, tmp_path):
    """The watchdog started just before the loop: a corpus index on a stalled mount (here a FIFO nobody writes)
    blocked the trainer at startup for ever, and the guardian waited with it."""
    import shutil
    root = tmp_path / "data"
    shutil.copytree(os.path.join(data_root, "local"), root / "local")
    os.remove(root / "local" / "index.json")
    os.mkfifo(root / "local" / "index.json")
    out = str(tmp_path / "run")
    t0 = time.time()
    r = train([f"--data_root={root}", f"--out_dir={out}", "--max_iters=10", "--warmup_iters=1", "--hang_timeout=2"],
              timeout=120)
    assert r.returncode == 8 and "hang" in r.stderr, r.stderr[-2000:]
    assert time.time() - t0 < 60
    text = open(os.path.join(out, [n for n in os.listdir(out) if n.startswith("hang-")][0])).read()
    assert "load_index" in text  # where it hung


def test_stop_after_hours_counts_the_start_up(data_root, tmp_path):
    """A leg's hours were counted from the first step: a slow start-up (a big checkpoint, a slow mount; here 3 s
    waiting for the run's lock) ran that much past them."""
    import fcntl
    out = tmp_path / "run"
    out.mkdir()
    lock = open(out / ".trainer.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another trainer's, for the first 3 s
    p = subprocess.Popen([sys.executable, "train.py", *TINY, f"--data_root={data_root}", f"--out_dir={out}",
                          "--max_iters=40", "--warmup_iters=1", "--eval_interval=1000", "--lock_wait_s=60",
                          f"--stop_after_hours={2 / 3600}"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    lock.close()
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr[-2000:]
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    assert not steps, steps  # the 2 s were up before the first step


def test_a_second_guardian_on_a_run_is_refused_before_it_writes(data_root, tmp_path):
    """A second guardian rewrote the first's guardian.json (as stopped, while the first trained on), and said only
    'see the trainer output'."""
    out = tmp_path / "run"
    out.mkdir()
    lock = os.open(out / ".guardian.lock", os.O_RDWR | os.O_CREAT)
    import fcntl
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.pwrite(lock, b"4242", 0)
    open(out / "guardian.json", "w").write('{"starts": [], "quarantined": [], "repairs": [], "status": "running"}')
    before = (out / "guardian.json").read_text()
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--supervise", "--lock_wait_s=1"], timeout=60)
    os.close(lock)
    assert r.returncode == 1 and "another guardian (pid 4242)" in r.stderr, r.stderr
    assert (out / "guardian.json").read_text() == before


def test_a_stop_signal_cuts_a_long_evaluation_short(data_root, tmp_path):
    """A SIGTERM during evaluation waited for every eval batch: with a large eval_iters the checkpoint came after
    a cloud's grace period."""
    out = str(tmp_path / "run")
    pid, thread, done = train_started([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=40",
                                       "--warmup_iters=1", "--eval_interval=2", "--eval_iters=1000000"])
    mpath = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(mpath) and any(l.strip() for l in open(mpath))):  # step 1 logged: step 2 evaluates
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.02)
    time.sleep(1.0)
    t0 = time.time()
    os.kill(pid, signal.SIGTERM)
    r = done(timeout=60)
    so, se = r.stdout, r.stderr
    assert r.returncode == 0 and time.time() - t0 < 30, se
    assert "evaluation cut short" in so + se
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["kind"] == "preempt" and st["step"] == 2


def train_here(args, inject=None):
    """train.main(TINY + args) in this process (a start's imports are ~3 s as a subprocess): stdout's lines; train's
    config globals and the signal handlers main sets are put back after. inject: {env var: value} while it runs."""
    import contextlib
    import copy
    import io
    keys = {k: copy.deepcopy(getattr(train_py, k)) for k in train_py._CONFIG_KEYS}
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    env = {k: os.environ.get(k) for k in (inject or {})}
    out = io.StringIO()
    try:
        os.environ.update(inject or {})
        with contextlib.redirect_stdout(out):
            train_py.main([*TINY, *args])
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for s, h in handlers.items():
            signal.signal(s, h)
        for k, v in keys.items():
            setattr(train_py, k, v)
    return out.getvalue()


def test_a_stop_during_an_evaluation_is_measured_on_resume_as_the_uninterrupted_run_did(data_root, tmp_path):
    """A stop signal that cut an evaluation short left its step without a val loss for good: the resume trained on, so
    a step that was the best was never recorded (best_val_loss, best_step, BEST, its metrics row). The resume now
    evaluates the saved step first: it records what the uninterrupted run did, and trains on as it did (bitwise)."""
    common = [f"--data_root={data_root}", "--max_iters=4", "--warmup_iters=1", "--eval_interval=2",
              "--ckpt_interval=100"]
    straight, cut = str(tmp_path / "straight"), str(tmp_path / "cut")
    inject = "PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP"
    train_here(common + [f"--out_dir={straight}"])
    said = train_here(common + [f"--out_dir={cut}"], {inject: "2"})  # cut at step 2's evaluation: a preemption
    said += train_here(common + [f"--out_dir={cut}", "--init_from=resume"], {inject: "4"})  # 2 measured; 4 cut
    assert "step 4's was cut short by a stop signal, measured when it resumes" in main_output(["--status", cut])[0]
    said += train_here(common + [f"--out_dir={cut}", "--init_from=resume"])  # the last step's: the run's best
    a, b = metrics(straight), metrics(cut)
    assert [(s, a[s]["loss"], a[s].get("val_loss")) for s in a] == [(s, b[s]["loss"], b[s].get("val_loss")) for s in b]
    assert [s for s in b if "val_loss" in b[s]] == [2, 4]
    assert len(open(os.path.join(cut, "metrics.jsonl")).readlines()) == 4  # each step logged once

    def newest(run):
        ck = checkpoint.latest_valid(run)
        return json.load(open(os.path.join(ck, "state.json"))), load_checkpoint(ck).state_dict()
    (sa, wa), (sb, wb) = newest(straight), newest(cut)
    assert sb["best_step"] == sa["best_step"] == 4 and sb["best_val_loss"] == sa["best_val_loss"]
    assert sb["step"] == 4 and "eval_due" not in sb
    assert open(os.path.join(cut, "BEST")).read() == open(os.path.join(straight, "BEST")).read() == "step_0000004\n"
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert said.count("evaluation cut short") == 2 and said.count("evaluating it now") == 2, said


def stand_in_trainers(g, *scripts):
    """Replace the guardian's trainer with tiny Python programs, one per start (the last one repeats)."""
    started = []

    def child_argv(left=None, first=False):
        started.append(1)
        return [sys.executable, "-c", scripts[min(len(started), len(scripts)) - 1]]
    g.child_argv = child_argv
    return started


def run_guardian(g, signal_after=None):
    import threading
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    timer = threading.Timer(signal_after, lambda: os.kill(os.getpid(), signal.SIGTERM)) if signal_after else None
    try:
        if timer:
            timer.start()
        return g.run()
    finally:
        if timer:
            timer.cancel()
        for s, h in before.items():
            signal.signal(s, h)


def test_review_round_guardian_ends_say_what_happened(tmp_path, capsys, monkeypatch):
    """Helper-55's review: a stop whose trainer died instead of checkpointing (a hang while stopping) exited 0 as a
    clean stop; max_restarts said "restarting" and then exited 1 "error"; an on_stuck command hung on a dead mount
    held the guardian forever, deaf to SIGTERM; a full disk under guardian.json was a traceback that left the
    trainer unsupervised; a trainer stopped on its own (a SIGTERM to it alone) was recorded as "done". The summary
    said "newest checkpoint step None -> 20" (Python's None) for a run that had none yet."""
    import guardian
    run = tmp_path / "run"
    log = lambda: json.load(open(run / "guardian.json"))  # noqa: E731
    # the guardian's SIGTERM reaches a trainer that dies with exit 8 (its watchdog) instead of saving
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(8)); time.sleep(30)")
    assert run_guardian(g, signal_after=1.0) == 8
    assert log()["status"] == "stopped (SIGTERM), trainer hang" and "steps after it are lost" in log()["report"]["message"]
    # every start crashes with no checkpoint: max_restarts=1 gives up after two starts with exit 9 and the causes,
    # having said "restarting" once (the restart it made)
    capsys.readouterr()
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--max_restarts=1", "--max_stuck_starts=100"])
    started = stand_in_trainers(g, "raise SystemExit(10)")
    assert run_guardian(g) == guardian.EXIT_STUCK and len(started) == 2
    err = capsys.readouterr().err
    assert err.count("restarting") == 1 and "crash x2" in err and log()["report"]["cause"] == "stuck", err
    assert "guardian: summary: 2 starts (crash x2); newest checkpoint step none -> none; exit 9 (stopped)" in err, err
    assert "(checkpoint step none)" in err and "None" not in err, err  # (its start line said "None" too)
    # on_stuck that does not end is killed after ON_STUCK_TIMEOUT_S (not a fix), or at once by a SIGTERM
    monkeypatch.setattr(guardian, "ON_STUCK_TIMEOUT_S", 0.5)
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--max_stuck_starts=1", "--on_stuck=sleep 30"])
    stand_in_trainers(g, "raise SystemExit(10)")
    t0 = time.time()
    assert run_guardian(g) == guardian.EXIT_STUCK and time.time() - t0 < 20
    assert log()["repairs"][-1]["action"] == "on_stuck" and log()["repairs"][-1]["exit_code"] != 0
    assert "ran past 0.5 s and was killed" in capsys.readouterr().err
    monkeypatch.setattr(guardian, "ON_STUCK_TIMEOUT_S", 3600.0)
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--max_stuck_starts=1", "--on_stuck=sleep 30"])
    started = stand_in_trainers(g, "raise SystemExit(10)")
    t0 = time.time()
    assert run_guardian(g, signal_after=1.5) == 0 and time.time() - t0 < 20 and len(started) == 1
    assert log()["status"] == "stopped (SIGTERM)"
    # guardian.json cannot be written: one warning, supervision goes on to the trainer's own end
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "raise SystemExit(0)")

    def full_disk(path, text):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(guardian.checkpoint, "write_atomic_text", full_disk)
    assert run_guardian(g) == 0
    assert capsys.readouterr().err.count("warning: cannot write") == 1
    monkeypatch.undo()
    # a trainer that exits 0 with the plan unfinished and no signal to the guardian: not "done"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "raise SystemExit(0)")
    assert run_guardian(g) == 0 and log()["status"].startswith("stopped: the trainer alone was stopped")
    checkpoint.save(str(run), 5, {"state.json": lambda p: json.dump({"step": 5, "finished": True}, open(p, "w"))})
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "raise SystemExit(0)")
    assert run_guardian(g) == 0 and log()["status"] == "done"


def test_the_guardian_hashes_a_checkpoint_again_only_when_its_files_changed(tmp_path, monkeypatch):
    """Helper-55's review: latest_step hashed the newest checkpoint (tens of GB for nano) 4-5 times per restart while
    the GPU stood idle; a step's files unchanged since they verified are not hashed again, a changed one is."""
    import guardian
    out = str(tmp_path / "run")
    for step in (2, 4):
        checkpoint.save(out, step, {"state.json": lambda p, s=step: json.dump({"step": s}, open(p, "w"))})
    hashed, verify = [], checkpoint.verify
    monkeypatch.setattr(checkpoint, "verify", lambda d, check_hashes=True: (hashed.append(os.path.basename(d)),
                                                                              verify(d, check_hashes))[1])
    assert [guardian.latest_step(out) for _ in range(4)] == [4] * 4 and hashed == ["step_0000004"]
    state = os.path.join(out, "step_0000004", "state.json")
    with open(state, "r+b") as f:  # a flipped byte: another mtime, hashed again, and found corrupt
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    os.utime(state, ns=(time.time_ns(), time.time_ns() + 10**9))  # (a later write: mtime is coarser than this test)
    assert guardian.latest_step(out) == 2 and hashed[1:] == ["step_0000004", "step_0000002"]


def test_a_quarantined_shard_fixed_or_gone_after_a_re_prepare_is_released(tmp_path, capsys):
    """A shard stayed quarantined after the operator replaced it with a good copy (skipped forever), and a name the
    corpus, prepared again, no longer lists refused every resume (train.py: 'is not a shard of'). Released now, in one
    loud line, when its files changed since the quarantine and verify, or when index.json no longer lists it. One that
    verified when quarantined (the crash repeated there) is held while its hashes stay the same: touched, it was released
    to crash the trainer again."""
    import guardian
    root = make_corpus(tmp_path / "data")
    cdir = os.path.join(root, "local")
    shard, other = os.path.join(cdir, "train_000000.bin"), os.path.join(cdir, "train_000001.bin")
    good = open(shard, "rb").read()
    zero_page(shard)
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}"])
    g.quarantine(shard, 0, "corrupt on disk and not re-fetchable: test")
    g.quarantine(other, 0, "the crash repeated at the same place though the file verifies")
    g.release_fixed()  # one still corrupt, one unchanged since it verified: both held
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000000.bin", "local/train_000001.bin"]
    with open(shard + ".new", "wb") as f:  # the operator puts a good copy in its place
        f.write(good)
    os.replace(shard + ".new", shard)
    later = time.time_ns() + 10**9  # the verifying one copied or touched: the same bytes, which crashed, stay held
    os.utime(other, ns=(later, later))
    g.release_fixed()
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000001.bin"]
    err = capsys.readouterr().err
    assert "RELEASED local/train_000000.bin from quarantine: its files changed" in err, err
    argv = g.child_argv()
    assert "--release_shards=['local/train_000000.bin']" in argv  # the checkpoint's quarantine holds it too
    assert "--quarantine_shards=['local/train_000001.bin']" in argv
    # prepared again without train_000001.bin: released, not passed on to be refused
    index = json.load(open(os.path.join(cdir, "index.json")))
    index["splits"]["train"] = [e for e in index["splits"]["train"] if e["file"] != "train_000001.bin"]
    json.dump(index, open(os.path.join(cdir, "index.json"), "w"))
    g.release_fixed()
    assert not g.log["quarantined"] and "no longer lists it" in capsys.readouterr().err
    assert not [a for a in g.child_argv() if a.startswith("--quarantine_shards")]
    assert [r["action"].split(":")[0] for r in g.log["repairs"]] == ["released", "released"]


def test_a_quarantined_name_a_re_prepared_corpus_no_longer_lists_is_dropped_with_a_warning(tmp_path):
    """A checkpoint's quarantined shard that the corpus, prepared again, no longer lists refused the resume ('fix the
    name'); it is dropped with a warning. A name typed on the command line is still refused (a typo)."""
    root = make_corpus(tmp_path / "data")
    out = str(tmp_path / "run")
    base = [f"--data_root={root}", f"--out_dir={out}", "--max_iters=4", "--warmup_iters=1", "--eval_interval=100"]
    r = train(base + ["--stop_after_steps=0", "--quarantine_shards=['local/val_000001.bin']"])
    assert r.returncode == 0, r.stderr[-2000:]
    ipath = os.path.join(root, "local", "index.json")
    index = json.load(open(ipath))
    index["splits"]["val"] = [e for e in index["splits"]["val"] if e["file"] != "val_000001.bin"]
    json.dump(index, open(ipath, "w"))
    r = train(base + ["--stop_after_steps=1", "--init_from=resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "local/val_000001.bin was quarantined by the checkpoint but local's index.json no longer lists it" in r.stdout
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] == 1 and st["quarantined_shards"] == []


def test_a_trainer_deaf_to_the_stop_signal_is_killed_after_stop_grace_s(tmp_path):
    """The guardian passed SIGTERM on and waited forever for a trainer stuck where not even its watchdog runs."""
    import guardian
    run = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--stop_grace_s=0.5"])
    stand_in_trainers(g, "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(20)")
    t0 = time.time()
    assert run_guardian(g, signal_after=1.0) == 128 + signal.SIGKILL
    assert time.time() - t0 < 10
    log = json.load(open(run / "guardian.json"))
    assert log["starts"][0]["cause"] == "killed by the guardian (SIGKILL) 0.5 s after the SIGTERM", log["starts"]
    assert "steps after it are lost" in log["report"]["message"]


def test_a_double_ctrl_c_under_the_guardian_says_what_the_trainer_trained_and_saved(tmp_path, capsys):
    """A second Ctrl-C quits the trainer with exit 130. The guardian said "before it trained" (exit 0) whenever no new
    checkpoint came, though the steps trained since the last one were lost; and "not a checkpoint ... lost" (exit
    130) when the second Ctrl-C came after the trainer's checkpoint of every step it trained. The stand-in trainers
    log a step, press Ctrl-C (SIGINT to the guardian), and quit at the guardian's SIGTERM, after a save or not."""
    import guardian
    run = tmp_path / "run"
    checkpoint.save(str(run), 3, {"state.json": lambda p: json.dump({"step": 3}, open(p, "w"))})
    trainer = (f"import json, os, signal, sys, time; sys.path.insert(0, {REPO!r}); import checkpoint\n"
               f"def quit(*a):\n"
               f"    if SAVE:\n"
               f"        checkpoint.save({str(run)!r}, 7, {{'state.json': lambda p: open(p, 'w').write('{{}}')}})\n"
               f"    os._exit(130)\n"
               f"signal.signal(signal.SIGTERM, quit)\n"
               f"with open({str(run / 'metrics.jsonl')!r}, 'a') as f:\n"
               f"    f.write(json.dumps({{'step': STEP, 'time': time.time()}}) + '\\n')\n"
               f"os.kill(os.getppid(), signal.SIGINT)\n"
               f"time.sleep(30)\n")
    log = lambda: json.load(open(run / "guardian.json"))  # noqa: E731
    # steps 4-6 trained (6 logged), none saved: they are lost, said, and the guardian ends as the trainer did
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "SAVE, STEP = False, 6\n" + trainer)
    assert run_guardian(g) == 130
    err = capsys.readouterr().err
    assert "before it trained" not in err and log()["status"] == "stopped (SIGINT), trainer exit 130", err
    msg = log()["report"]["message"]
    assert "second Ctrl-C" in msg and "newest is step 3" in msg and "(logged to step 6) are lost" in msg, msg
    # steps 4-7 trained and saved (step 7), then the second Ctrl-C: a clean stop, nothing lost
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    stand_in_trainers(g, "SAVE, STEP = True, 7\n" + trainer)
    assert run_guardian(g) == 0
    err = capsys.readouterr().err
    assert "lost" not in err and "before it trained" not in err and "checkpoint of every step it trained: step 7" in err
    assert log()["status"] == "stopped (SIGINT)", log()

def test_unreachable_storage_is_retried_up_to_unreachable_give_up_s(tmp_path, capsys):
    """3 retries (~70 s of waits by default) gave up on outages a network blip outlasts; now capped exponential waits
    until one outage's waits would pass unreachable_give_up_s (30 min), each try said."""
    import guardian
    run = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--unreachable_backoff_s=0.01",
                           "--unreachable_give_up_s=0.35", "--max_stuck_starts=100"])
    started = stand_in_trainers(g, f"raise SystemExit({train_py.EXIT_UNREACHABLE})")
    assert run_guardian(g) == train_py.EXIT_UNREACHABLE and len(started) == 5  # waits 0.02 + 0.04 + 0.08 + 0.16
    err = capsys.readouterr().err
    assert "restarting in 0.16 s (retry 4; 0.3 s of unreachable_give_up_s=0.35 waited)" in err, err
    assert "storage unreachable 5 times" in json.load(open(run / "guardian.json"))["report"]["message"]
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run2'}"])  # the defaults
    waits = []
    while (w := g.retry_wait(len(waits) + 1, sum(waits))) is not None:
        waits.append(w)
    assert max(waits) == 60 and 1700 < sum(waits) <= 1800 and len(waits) > 25


def test_a_failed_trainers_output_tail_is_kept_in_the_run_dir(tmp_path, capsys, monkeypatch):
    """A crashed or hung trainer's stdout / stderr were on a console that may be gone: their tails go to
    out_dir/guardian/crash-NNNN.log (the newest CRASH_LOGS_KEPT), and are still passed on as they come."""
    import guardian
    monkeypatch.setattr(guardian, "CRASH_LOGS_KEPT", 2)
    monkeypatch.setattr(guardian, "TAIL_BYTES", 200)
    run = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--max_stuck_starts=100"])
    crash = "import sys; [print('line', i) for i in range(100)]; print('boom', file=sys.stderr); raise SystemExit(10)"
    stand_in_trainers(g, crash, crash, crash, "raise SystemExit(0)")
    assert run_guardian(g) == 0
    assert sorted(os.listdir(run / "guardian")) == ["crash-0002.log", "crash-0003.log"]
    text = (run / "guardian" / "crash-0003.log").read_text()
    assert text.startswith("start 3: exit 10 (crash)") and "line 99" in text and "line 1\n" not in text
    assert "boom" in text
    log = json.load(open(run / "guardian.json"))
    assert [s_.get("output_tail") for s_ in log["starts"]] == [f"guardian/crash-000{i}.log" for i in (1, 2, 3)] + [None]
    out = capsys.readouterr()
    assert out.out.count("line 99") == 3 and out.err.count("boom") == 3  # passed on as before


def test_guardian_review_round_closed_stdout_zero_backoff_and_restarted_numbering(tmp_path, monkeypatch):
    """Review of the output pipes and retries: with the guardian's stdout closed (sys.stdout None) its pump thread died
    on None.write and the trainer blocked on a full pipe; --unreachable_backoff_s=0 never gave up (waits of 0 s add
    up to nothing); a fresh guardian.json's crash-0001.log sorted before older logs and was pruned as it was written."""
    import subprocess
    import threading
    import guardian
    child = subprocess.Popen([sys.executable, "-c", "[print('x' * 100) for _ in range(3000)]"], stdout=subprocess.PIPE)
    monkeypatch.setattr(sys, "stdout", None)
    tail = bytearray()
    t = threading.Thread(target=guardian.pump, args=(child.stdout, "stdout", tail), daemon=True)
    t.start()
    assert child.wait(timeout=20) == 0  # 300 KB through a 64 KB pipe: drained though nothing can be shown
    t.join(5)
    monkeypatch.undo()
    assert not t.is_alive() and tail.endswith(b"x" * 100 + b"\n")
    for bad in ("--unreachable_backoff_s=0", "--unreachable_give_up_s=-1", "--stop_grace_s=0"):
        with pytest.raises(guardian.configurator.ConfigError, match=bad.split("=")[0][2:] + ".*> 0"):
            guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", bad])
    assert guardian.supervise(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", "--unreachable_backoff_s=0"]) == 2
    monkeypatch.setattr(guardian, "CRASH_LOGS_KEPT", 3)
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}"])
    os.makedirs(tmp_path / "run" / "guardian")
    for n in (30, 31, 32):
        (tmp_path / "run" / "guardian" / f"crash-{n:04d}.log").write_text("old")
        os.utime(tmp_path / "run" / "guardian" / f"crash-{n:04d}.log", (n, n))
    assert g.keep_crash_log(1, 10, "crash", {"stdout": bytearray(b"a"), "stderr": bytearray()}) == os.path.join(
        "guardian", "crash-0001.log")
    assert sorted(os.listdir(tmp_path / "run" / "guardian")) == ["crash-0001.log", "crash-0031.log", "crash-0032.log"]


def data_fault_trainer(out, path, kind, offset=None):
    """A stand-in trainer that ends as train.py does on a DataError: its crash report, exit 3."""
    rep = {"cause": "corrupt data", "exit_code": 3, "message": f"{path}: test fault", "path": path, "offset": offset,
           "kind": kind}
    return (f"import json, time; json.dump({rep!r}, open({str(out)!r} + f'/crash-{{int(time.time() * 1000)}}.json', "
            f"'w')); raise SystemExit(3)")


def test_a_missing_index_json_stops_at_once_and_quarantines_nothing(tmp_path):
    """A corpus folder without index.json (kind "missing", not "index") was taken for a corrupt shard: the guardian
    QUARANTINED "local/index.json" ("training goes on without it"), restarted twice, then stopped with exit 9
    "stuck ... data verifies". Now it stops at once with exit 3, as for a corrupt index, and quarantines nothing."""
    import guardian
    os.makedirs(tmp_path / "data" / "local")
    run = tmp_path / "run"
    g = guardian.Guardian([f"--data_root={tmp_path / 'data'}", f"--out_dir={run}"])
    started = stand_in_trainers(g, data_fault_trainer(run, str(tmp_path / "data" / "local" / "index.json"), "missing"))
    assert run_guardian(g) == train_py.EXIT_DATA and len(started) == 1
    log = json.load(open(run / "guardian.json"))
    assert log["quarantined"] == [] and "restarting cannot fix this" in log["report"]["message"], log


def corpus_with_three_truncated_shards(tmp_path):
    """(data_root, its corpus dir, its first three train shards), each truncated to 100 bytes (a bad copy)."""
    root = make_corpus(tmp_path / "data")
    cdir = os.path.join(root, "local")
    paths = [os.path.join(cdir, f"train_00000{i}.bin") for i in range(3)]
    for p in paths:
        with open(p, "r+b") as f:
            f.truncate(100)
    return root, cdir, paths


def test_consecutive_starts_each_ending_in_a_repaired_shard_are_not_stuck(tmp_path):
    """Three truncated shards (a bad copy), each named by one start and re-fetched by the guardian: after the third
    repair it stopped with exit 9 "stuck: 3 consecutive starts produced no new checkpoint ... data verifies" instead
    of restarting onto the repaired data. A start whose shard was repaired is not a stuck one."""
    import guardian
    root, cdir, paths = corpus_with_three_truncated_shards(tmp_path)
    run = tmp_path / "run"
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={run}"])
    started = stand_in_trainers(g, *[data_fault_trainer(run, p, "truncated", 50) for p in paths], "raise SystemExit(0)")
    assert run_guardian(g) == 0 and len(started) == 4
    log = json.load(open(run / "guardian.json"))
    assert [r["action"] for r in log["repairs"]] == ["refetched"] * 3 and not shards.verify_corpus(cdir)



def test_restarts_after_a_first_repair_of_a_shard_are_not_counted_toward_max_restarts(tmp_path):
    """More truncated shards than max_restarts, each named by one start and re-fetched: the guardian gave up ("gave
    up: 2 starts made no new checkpoint, more than max_restarts=1") though every restart fixed one. A shard's first
    repair in an invocation frees its restart; the same shard again (a repair that did not hold) still counts."""
    import guardian
    root, cdir, paths = corpus_with_three_truncated_shards(tmp_path)
    run = tmp_path / "run"
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={run}", "--max_restarts=1"])
    started = stand_in_trainers(g, *[data_fault_trainer(run, p, "truncated", 50) for p in paths], "raise SystemExit(0)")
    assert run_guardian(g) == 0 and len(started) == 4
    assert "gave up" not in json.load(open(run / "guardian.json"))["status"]
    # a repeat: re-fetched, then named again at the same place (quarantined, counted), then again: gives up
    with open(paths[0], "r+b") as f:
        f.truncate(100)
    run2 = tmp_path / "run2"
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={run2}", "--max_restarts=1", "--max_stuck_starts=100"])
    started = stand_in_trainers(g, data_fault_trainer(run2, paths[0], "truncated", 50))
    assert run_guardian(g) == guardian.EXIT_STUCK and len(started) == 3
    log = json.load(open(run2 / "guardian.json"))
    assert [r["action"] for r in log["repairs"]] == ["refetched"] and log["quarantined"][0]["shard"].endswith("00.bin")


def unreadable_shards(monkeypatch, fails):
    """shards.sha256_file raises OSError(fails.pop(0)) while `fails` holds errnos (a dropped mount, a failing disk)."""
    import errno
    real = shards.sha256_file

    def sha256_file(path, *a, **k):
        if fails:
            code = fails.pop(0) if len(fails) > 1 or fails[0] != "always" else errno.ENOTCONN
            raise OSError(code, os.strerror(code), path)
        return real(path, *a, **k)
    monkeypatch.setattr(shards, "sha256_file", sha256_file)


def test_a_shard_unreadable_while_the_guardian_verifies_is_storage_not_corrupt_data(data_root, tmp_path, monkeypatch,
                                                                                     capsys):
    """shards.verify_shard caught DataError only: an OSError reading a shard (ENOTCONN / ETIMEDOUT / ESTALE of a network
    or bucket mount that dropped, EIO of a failing disk) in repair_shard, on_stuck or release_fixed was a traceback that
    ended the guardian (exit 1). Unreachable storage is now waited for with the guardian's backoff (never quarantined or
    re-fetched for it) up to unreachable_give_up_s, then exit 5; an EIO stops at once, exit 5, naming the file; a
    quarantined shard that cannot be read stays quarantined, said in one line."""
    import errno
    import guardian
    root = copy_corpus(data_root, tmp_path / "data")
    cdir = os.path.join(root, "local")
    shard = os.path.join(cdir, "train_000000.bin")
    args = [f"--data_root={root}", "--unreachable_backoff_s=0.01", "--unreachable_give_up_s=0.35"]

    def no_refetch(*a):
        raise AssertionError("re-fetched for a storage fault")
    monkeypatch.setattr(shards, "refetch_shard", no_refetch)
    # repair_shard: the mount comes back after two tries; the shard verifies and nothing is done to it
    fails = [errno.ENOTCONN, errno.ETIMEDOUT]
    unreadable_shards(monkeypatch, fails)
    g = guardian.Guardian(args + [f"--out_dir={tmp_path / 'run'}"])
    assert g.repair_shard(shard, 0, repeated=False) is None and not fails
    assert not g.log["quarantined"] and not g.log["repairs"], g.log
    assert "storage unreachable while verifying" in capsys.readouterr().err
    # ... it stays away: exit 5 once unreachable_give_up_s would pass, nothing quarantined
    fails[:] = ["always"]
    code, msg = g.repair_shard(shard, 0, repeated=True)
    assert code == train_py.EXIT_UNREACHABLE and "storage unreachable" in msg and "tries" in msg, msg
    assert not g.log["quarantined"] and "\n" not in msg
    # a failing disk (EIO): stops at once, naming the file
    fails[:] = [errno.EIO, "always"]
    code, msg = g.repair_shard(shard, 0, repeated=True)
    assert code == train_py.EXIT_UNREACHABLE and shard in msg and "Input/output error" in msg and "tries" not in msg, msg
    assert fails == ["always"] and not g.log["quarantined"]
    # on_stuck's verify of every corpus, in the supervision loop: a report and exit 5, not a traceback
    fails[:] = ["always"]
    run = tmp_path / "run2"
    g = guardian.Guardian(args + [f"--out_dir={run}", "--max_stuck_starts=1"])
    started = stand_in_trainers(g, "raise SystemExit(8)")
    assert run_guardian(g) == train_py.EXIT_UNREACHABLE and len(started) == 1
    log = json.load(open(run / "guardian.json"))
    assert log["report"]["cause"] == "storage unreachable" and not log["quarantined"], log
    # release_fixed: a quarantined shard replaced by a good copy that cannot be read now stays quarantined
    good = open(shard, "rb").read()
    zero_page(shard)
    g = guardian.Guardian(args + [f"--out_dir={tmp_path / 'run3'}"])
    g.quarantine(shard, 0, "corrupt on disk and not re-fetchable: test")
    with open(shard + ".new", "wb") as f:
        f.write(good)
    os.replace(shard + ".new", shard)
    capsys.readouterr()
    fails[:] = [errno.ESTALE]
    g.release_fixed()
    assert [q["shard"] for q in g.log["quarantined"]] == ["local/train_000000.bin"]
    err = capsys.readouterr().err
    assert "local/train_000000.bin stays quarantined" in err and err.count("\n") == 1, err
    g.release_fixed()  # readable again: released
    assert not g.log["quarantined"]


def test_the_legs_hours_and_the_crash_report_survive_a_wall_clock_step(tmp_path, monkeypatch):
    """The guardian timed stop_after_hours with time.time(): NTP stepping a fresh VM's clock 2 h forward ended a 1-hour
    leg at its first restart ("used up"), a step back gave it 3 h; and it took a start's crash report by mtime >= its
    start's wall-clock time, so a clock stepped back mid-start lost the report (the cause's message, the shard to
    repair). Durations are now monotonic; a start's report is one that was not in out_dir before it."""
    import types
    import guardian
    shift = [0.0]
    monkeypatch.setattr(guardian, "time", types.SimpleNamespace(
        time=lambda: time.time() + shift[0], monotonic=time.monotonic, strftime=time.strftime))
    run = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--stop_after_hours=1"])
    started = stand_in_trainers(g, "raise SystemExit(10)", "raise SystemExit(0)")
    argv_of = g.child_argv

    def child_argv(left=None, first=False):
        shift[0] = 7200.0 if first else 0.0  # the clock jumps 2 h forward during the first start
        return argv_of(left, first)
    g.child_argv = child_argv
    assert run_guardian(g) == 0 and len(started) == 2  # restarted: the leg has most of its hour left
    log = json.load(open(run / "guardian.json"))
    assert 0.99 < log["starts"][1]["leg_left"]["stop_after_hours"] <= 1, log["starts"]
    # a report written while the clock stood an hour behind the start's own time is still this start's
    report = ("import json, os, time; p = os.path.join({run!r}, 'crash-1.json'); "
              "json.dump({{'message': 'HTTP 403 from the bucket'}}, open(p, 'w')); "
              "os.utime(p, (time.time() - 3600,) * 2); raise SystemExit(4)").format(run=str(run / "r2"))
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run / 'r2'}"])
    stand_in_trainers(g, report)
    assert run_guardian(g) == train_py.EXIT_DENIED
    log = json.load(open(run / "r2" / "guardian.json"))
    assert log["starts"][0]["crash_report"] == "crash-1.json", log["starts"]
    assert "HTTP 403 from the bucket" in log["report"]["message"], log["report"]


def test_on_stuck_repairs_a_corrupt_shard_under_a_data_root_with_a_space(data_root, tmp_path):
    """on_stuck took a verify problem's first word for the shard's path: under a data_root with a space in it (Colab's
    "/content/drive/My Drive") it found no such file, repaired nothing, and stopped with exit 9 on a shard it could
    have re-fetched or quarantined."""
    import guardian
    root = str(tmp_path / "My Drive" / "data")
    shutil.copytree(data_root, root)
    shard = os.path.join(root, "local", "train_000001.bin")
    zero_page(shard)
    g = guardian.Guardian([f"--data_root={root}", f"--out_dir={tmp_path / 'run'}"])
    assert g.on_stuck(["corrupt data"] * 3) is True, g.log
    assert [r["shard"] for r in g.log["repairs"]] == [shard] and not shards.verify_corpus(os.path.join(root, "local"))


def test_a_grandchild_holding_the_trainers_pipes_delays_a_restart_by_one_drain_wait(tmp_path, monkeypatch):
    """Each of the trainer's two output pipes was joined with its own 5 s timeout: a grandchild left holding both (a
    dead trainer's worker process) held every restart 10 s. One PUMP_DRAIN_S now covers both, and the trainer's own
    last words still reach its crash log."""
    import guardian
    monkeypatch.setattr(guardian, "PUMP_DRAIN_S", 1.0, raising=False)
    pid_file = tmp_path / "grandchild.pid"
    script = (f"import os, sys, time\nif os.fork() == 0:\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              f"    time.sleep(30); os._exit(0)\nprint('boom', file=sys.stderr); raise SystemExit(10)")
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", "--max_restarts=0"])
    stand_in_trainers(g, script)
    t0 = time.monotonic()
    try:
        assert run_guardian(g) == guardian.EXIT_STUCK
        took = time.monotonic() - t0
    finally:
        while not pid_file.exists() or not pid_file.read_text():
            time.sleep(0.01)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert took < 1.9, took  # one drain wait (1 s), not one per pipe
    assert "boom" in (tmp_path / "run" / "guardian" / "crash-0001.log").read_text()


def test_a_leg_begun_from_another_runs_checkpoint_is_not_lengthened_by_a_crash_before_its_first_save(tmp_path):
    """--resume_from=OTHER/step_40 --stop_after_steps=5 into an empty out_dir: a first start that died before its
    first checkpoint there (an OOM kill) had its restart given stop_after_steps=45 (the steps done counted as
    0 - 40), training 9 times the leg."""
    import guardian
    other = tmp_path / "other"
    checkpoint.save(str(other), 40, {"state.json": lambda p: json.dump({"step": 40}, open(p, "w"))})
    out = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}", "--init_from=resume",
                           f"--resume_from={other / 'step_0000040'}", "--stop_after_steps=5"])
    started = stand_in_trainers(g, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "raise SystemExit(0)")
    assert run_guardian(g) == 0 and len(started) == 2
    log = json.load(open(out / "guardian.json"))
    assert log["starts"][1]["leg_left"] == {"stop_after_steps": 5}, log["starts"]


def test_a_crash_at_the_end_of_the_leg_does_not_say_restarting(tmp_path, monkeypatch, capsys):
    """A trainer that crashed once the leg's hours were used up: the guardian said "restarting", then "the leg's
    stop_after_hours are used up; not restarting" (its comment: "restarting" only once it is decided)."""
    import types
    import guardian
    shift = [0.0]
    monkeypatch.setattr(guardian, "time", types.SimpleNamespace(
        time=time.time, monotonic=lambda: time.monotonic() + shift[0], strftime=time.strftime))
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}", "--stop_after_hours=1"])
    started = stand_in_trainers(g, "raise SystemExit(10)")
    argv_of = g.child_argv

    def child_argv(left=None, first=False):
        shift[0] = 3601.0  # the hour passes while the first start trains
        return argv_of(left, first)
    g.child_argv = child_argv
    assert run_guardian(g) == 0 and len(started) == 1
    err = capsys.readouterr().err
    assert "not restarting" in err and "guardian: restarting" not in err, err


def test_a_trainer_stopped_alone_before_its_first_checkpoint_is_said_without_none(tmp_path):
    """guardian.json's status and the console said "stopped: the trainer alone was stopped ... at step None" (Python's
    None, as the summary line once did) for a trainer that exited 0 with no checkpoint yet."""
    import guardian
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={tmp_path / 'run'}"])
    stand_in_trainers(g, "raise SystemExit(0)")
    assert run_guardian(g) == 0
    status = json.load(open(tmp_path / "run" / "guardian.json"))["status"]
    assert status.startswith("stopped: the trainer alone was stopped") and "None" not in status, status
    assert "with no checkpoint" in status, status


def signal_at_call(monkeypatch, method, signum, at_call):
    """model.Picaflor.<method> sends this process signum at its at_call-th call (take_expert_load: once a step;
    generate: the end-of-run sample): a signal at a known point of train_here's run, not after a sleep."""
    import model
    real, calls = getattr(model.Picaflor, method), []

    def signalling(self, *a, **kw):
        calls.append(1)
        if len(calls) == at_call:
            os.kill(os.getpid(), signum)
        return real(self, *a, **kw)
    monkeypatch.setattr(model.Picaflor, method, signalling)


def test_a_stop_between_log_steps_logs_its_step_and_the_resume_logs_as_the_run_never_stopped(data_root, tmp_path,
                                                                                              monkeypatch):
    """log_interval 4: a run stopped by a signal at step 5 (or checkpointed at step 3 by ckpt_interval, or by
    checkpoint_minutes) logged no row for the checkpointed step, so the relay ledger's loss at a leg's end and --status
    showed a loss up to 3 steps old; and the resumed run's next rows averaged other steps than the run never stopped
    (its first row ended the window there). Now a checkpoint's step is logged, the window carried in the checkpoint."""
    common = [f"--data_root={data_root}", "--max_iters=8", "--warmup_iters=1", "--decay_frac=0", "--eval_interval=1000",
              "--ckpt_interval=3", "--log_interval=4", "--sample_tokens=0"]
    straight, out = str(tmp_path / "straight"), str(tmp_path / "run")
    train_here(common + [f"--out_dir={straight}"])
    with monkeypatch.context() as m:
        signal_at_call(m, "take_expert_load", signal.SIGINT, 5)  # during step 5 (Ctrl-C: as SIGTERM, in this process)
        said = train_here(common + [f"--out_dir={out}"])
    assert "SIGINT: checkpoint saved at step 5" in said, said[-2000:]
    assert sorted(metrics(out)) == [1, 3, 4, 5]  # the first step, the checkpoints (3 and 5) and the log step
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] == 5 and st["log_window"]["losses"] == [metrics(out)[5]["loss"]]
    train_here(common + [f"--out_dir={out}", "--init_from=resume"])
    a, b = metrics(straight), metrics(out)
    assert sorted(a) == [1, 3, 4, 6, 8] and sorted(b) == [1, 3, 4, 5, 6, 8]
    keys = ("tokens", "loss", "lr", "load_cv", "dead_frac", "load_cv_layers", "grad_norm", "stage", "val_loss")
    for s in a:  # row 6 (the resumed start's first) and row 8 average steps 5-6 and 5-8 as the straight run's
        assert {k: a[s].get(k) for k in keys} == {k: b[s].get(k) for k in keys}, s


def test_ctrl_c_during_the_end_of_run_sample_says_training_is_over_and_the_guardian_records_done(data_root, tmp_path,
                                                                                                 monkeypatch):
    """Ctrl-C during the sample a finished run prints said "saving a checkpoint at the end of this step" (training was
    over), and the guardian, Ctrl-C'd with it, recorded the finished run as "stopped (SIGINT)"."""
    import threading
    import guardian
    out = str(tmp_path / "run")
    with monkeypatch.context() as m:
        signal_at_call(m, "generate", signal.SIGINT, 1)
        said = train_here([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=2", "--warmup_iters=1",
                           "--eval_interval=1000", "--sample_tokens=8"])  # (no exception: exit 0)
    assert "saving a checkpoint" not in said and "sample:" not in said, said[-2000:]
    assert "Ctrl-C: training is over (its checkpoint at step 2 is saved); the sample is cut short" in said, said[-2000:]
    # the guardian's side: its trainer (a stand-in, sampling) gets the guardian's SIGTERM and exits 0
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}", "--init_from=resume"])
    stand_in_trainers(g, "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                         "time.sleep(60)")
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    try:
        timer.start()
        assert run_guardian(g) == 0
    finally:
        timer.cancel()
    log = json.load(open(os.path.join(out, "guardian.json")))
    assert log["status"] == "done" and log["starts"][-1]["exit_code"] == 0, log


def test_a_second_ctrl_c_after_training_quits_a_teardown_that_hangs(data_root, tmp_path, monkeypatch):
    """Once training was over (no sample), every Ctrl-C only logged "exiting" and returned: a teardown that hung
    (watchdog.stop, destroy_process_group, a mirror copy) could not be stopped. Now the second one quits (exit 130)."""
    import faults
    real_stop, quit_by = faults.Watchdog.stop, []

    def stop_ctrl_c_twice(self, *a, **kw):  # two Ctrl-Cs while the teardown runs: the first says it is exiting
        try:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:  # (caught here, not in main: train_here's captured lines are kept)
            quit_by.append(2)
        return real_stop(self, *a, **kw)
    monkeypatch.setattr(faults.Watchdog, "stop", stop_ctrl_c_twice)
    said = train_here([f"--data_root={data_root}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                       "--warmup_iters=1", "--eval_interval=1000", "--sample_tokens=0"])
    assert quit_by == [2], said[-2000:]  # KeyboardInterrupt: __main__ exits 130
    assert ("Ctrl-C: training is over (its checkpoint at step 1 is saved); exiting (Ctrl-C again quits now)\n"
            in said), said[-2000:]
    assert "Ctrl-C: training is over (its checkpoint at step 1 is saved); quitting now\n" in said, said[-2000:]


def test_a_finished_runs_end_saved_under_a_stop_signal_is_final(data_root, tmp_path, monkeypatch):
    """A finished plan's end saved by the end of an invocation a stop signal reached (here: a resume measuring the last
    step's cut evaluation, SIGTERM'd during it) was kind "preempt": each later start of the finished run saved the
    same step again (a whole checkpoint, and its mirror copy) to make it "final". Now it is "final" at once."""
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=2", "--warmup_iters=1",
              "--eval_interval=1000", "--eval_iters=1", "--sample_tokens=0"]
    train_here(common, inject={"PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP": "2"})  # the last step's evaluation is cut
    step_dir = checkpoint.latest_valid(out)
    assert json.load(open(os.path.join(step_dir, "state.json")))["eval_due"]["step"] == 2
    with monkeypatch.context() as m:
        signal_at_call(m, "forward", signal.SIGTERM, 1)  # during the resume's one evaluation batch (measured)
        said = train_here(common + ["--init_from=resume"])
    assert "(evaluated on resume)" in said and "run finished" in said, said[-2000:]
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] == 2 and st["finished"] and st["kind"] == "final", (st["kind"], said[-2000:])


def test_a_finished_run_whose_last_evaluation_was_cut_is_not_done_until_a_resume_measures_it(data_root, tmp_path,
                                                                                              capsys):
    """A stop signal that cut the plan's LAST step's evaluation short left a finished run: the trainer said "run
    finished ... next: python eval.py" and the guardian recorded it "done" (a preemption's launcher starts no more), so
    that val loss, maybe the best (BEST), was never measured. Now neither says done until a resume has measured it."""
    import guardian
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=2", "--warmup_iters=1",
              "--eval_interval=1000", "--eval_iters=1", "--sample_tokens=0"]
    said = train_here(common, inject={"PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP": "2"})  # the last step's evaluation
    assert "the plan is finished, but this step's evaluation was cut short" in said, said[-2000:]
    assert "run finished" not in said and "resume with:" in said, said[-2000:]
    assert "step 2's was cut short by a stop signal" in main_output(["--status", out])[0]
    log = lambda: json.load(open(os.path.join(out, "guardian.json")))  # noqa: E731
    for signal_after in (None, 0.5):  # its trainer stopped alone (exit 0), then the guardian's own SIGTERM with it
        g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
        stand_in_trainers(g, "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                             "time.sleep(%d)" % (30 if signal_after else 0))
        assert run_guardian(g, signal_after=signal_after) == 0
        assert log()["status"] == ("stopped (SIGTERM)" if signal_after else
                                   "stopped: the plan is finished, but a stop signal cut its last step 2's evaluation "
                                   "short; not restarting (a resume measures it: run the guardian again)"), log()
    capsys.readouterr()
    said = train_here(common + ["--init_from=resume"])  # the user's (or the guardian's next) resume measures it
    assert "(evaluated on resume)" in said and "run finished" in said, said[-2000:]
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["finished"] and "eval_due" not in st and st["best_step"] == 2
    assert open(os.path.join(out, "BEST")).read() == "step_0000002\n" and metrics(out)[2]["val_loss"] > 0
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={out}"])
    stand_in_trainers(g, "raise SystemExit(0)")
    assert run_guardian(g) == 0 and log()["status"] == "done"


def test_a_ctrl_c_in_the_teardown_after_a_ctrl_c_stopped_training_quits_at_once(data_root, tmp_path, monkeypatch):
    """A Ctrl-C that stopped training promised "Ctrl-C again quits without one"; one in the teardown after its save
    only said "exiting (Ctrl-C again quits now)" and a third was needed. Now the second quits (exit 130)."""
    import faults
    real_stop, quit_by = faults.Watchdog.stop, []

    def stop_ctrl_c(self, *a, **kw):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:  # (caught here, not in main: train_here's captured lines are kept)
            quit_by.append(1)
        return real_stop(self, *a, **kw)
    monkeypatch.setattr(faults.Watchdog, "stop", stop_ctrl_c)
    signal_at_call(monkeypatch, "take_expert_load", signal.SIGINT, 1)  # Ctrl-C during step 1: it stops training
    said = train_here([f"--data_root={data_root}", f"--out_dir={tmp_path / 'run'}", "--max_iters=3",
                       "--warmup_iters=1", "--eval_interval=1000", "--sample_tokens=0"])
    assert "SIGINT: checkpoint saved at step 1" in said and quit_by == [1], said[-2000:]
    assert "Ctrl-C: training is over (its checkpoint at step 1 is saved); quitting now\n" in said, said[-2000:]


def test_a_finished_runs_cut_last_evaluation_with_no_val_set_stops_and_changes_nothing(data_root, tmp_path):
    """A finished run whose last evaluation a stop signal cut, resumed with its val set gone (quarantined, another
    --data_root), dropped the request unsaid and saved nothing: eval_due stayed in state.json for good, so the guardian
    never recorded it done. Now that resume stops with one line naming why and the fix, the checkpoint untouched."""
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=2", "--warmup_iters=1",
              "--eval_interval=1000", "--eval_iters=1", "--sample_tokens=0"]
    train_here(common, inject={"PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP": "2"})  # the last step's evaluation is cut
    ck = checkpoint.latest_valid(out)
    before = {f: open(os.path.join(ck, f), "rb").read() for f in sorted(os.listdir(ck))}
    assert json.loads(before["state.json"])["eval_due"]["step"] == 2
    val = [e["file"] for e in shards.load_index(os.path.join(data_root, "local"))["splits"]["val"]]
    with pytest.raises(train_py.TrainError) as e:
        train_here(common + ["--init_from=resume", f"--quarantine_shards={['local/' + f for f in val]}"])
    said = str(e.value)
    assert "\n" not in said and "cannot be measured without the val set" in said, said
    assert "--release_shards=" in said and "nothing changed" in said, said
    assert checkpoint.latest_valid(out) == ck and sorted(os.listdir(ck)) == list(before)
    assert all(open(os.path.join(ck, f), "rb").read() == b for f, b in before.items())


def test_an_unfinished_runs_cut_evaluation_with_no_val_set_is_said_and_kept_in_its_checkpoint(data_root, tmp_path):
    """An unfinished run whose step's evaluation a stop signal cut, resumed with its val set gone (quarantined, a
    --replan whose val corpus is not there), dropped the request unsaid and trained on: that step's val loss (maybe the
    best) was lost without a word. Now the resume says which step's val loss could not be measured and how to measure
    it; the step's own checkpoint keeps the request, so a rollback to it with the val set back measures it."""
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=3", "--warmup_iters=1",
              "--eval_interval=2", "--eval_iters=1", "--sample_tokens=0"]
    train_here(common, inject={"PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP": "2"})  # step 2's evaluation is cut
    ck = checkpoint.latest_valid(out)
    assert json.load(open(os.path.join(ck, "state.json")))["eval_due"]["step"] == 2
    val = [e["file"] for e in shards.load_index(os.path.join(data_root, "local"))["splits"]["val"]]
    said = train_here(common + ["--init_from=resume", f"--quarantine_shards={['local/' + f for f in val]}"])
    warned = [ln for ln in said.splitlines() if "step 2's val loss could not be measured" in ln]
    assert len(warned) == 1 and "no val set" in warned[0] and "--release_shards=" in warned[0], said[-2000:]
    assert f"--resume_from={ck}" in warned[0], warned
    assert "run finished" in said, said[-2000:]  # trained on (the warning is not a refusal)
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["step"] == 3 and "eval_due" not in st  # (step 3's weights: step 2's request is not theirs)
    assert json.load(open(os.path.join(ck, "state.json")))["eval_due"]["step"] == 2  # step 2's kept it
    said = train_here(common + ["--init_from=resume", f"--resume_from={ck}",
                                f"--release_shards={['local/' + f for f in val]}", "--stop_after_steps=0"])
    assert "(evaluated on resume)" in said, said[-2000:]
    assert metrics(out)[2]["val_loss"] > 0


def test_a_cut_evaluation_is_measured_after_a_replan_with_fewer_stages(data_root, tmp_path):
    """A step's evaluation cut by a stop signal in the plan's third stage, resumed with --replan to a one-stage plan:
    the request named stage 2, which the new plan has not, and was dropped unsaid. It is measured at the stage the new
    plan trains that step in."""
    out = str(tmp_path / "run")
    common = [f"--data_root={data_root}", f"--out_dir={out}", "--eval_iters=1", "--sample_tokens=0"]
    train_here(common + ["--max_iters=4", "--warmup_iters=1", "--decay_frac=0.5", "--eval_interval=3"],
               inject={"PICAFLOR_INJECT_SIGTERM_IN_EVAL_AT_STEP": "3"})
    st = json.load(open(os.path.join(checkpoint.latest_valid(out), "state.json")))
    assert st["eval_due"]["step"] == 3 and st["eval_due"]["stage"] == 2, st.get("eval_due")
    one = "--stages=[{'name': 'all', 'mix': {'local': 1.0}, 'tokens': %d, 'lr_phase': 'stable'}]" % (2 * st["tokens"])
    said = train_here(common + ["--init_from=resume", "--replan", one, "--eval_interval=100", "--stop_after_steps=0"])
    assert "(evaluated on resume)" in said, said[-2000:]
    assert metrics(out)[3]["val_loss"] > 0


def test_a_compiled_run_says_its_first_step_compiles(data_root, tmp_path, monkeypatch):
    """--compile=True: torch.compile builds on the first step, minutes on a big model with no line after the model
    was built (a user took it for a hang). It is said. (compile_model itself is test_model's; here an identity.)"""
    import model as model_py
    monkeypatch.setattr(model_py, "compile_model", lambda m, device_type: m)
    said = train_here([f"--data_root={data_root}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                       "--warmup_iters=0", "--eval_interval=100", "--sample_tokens=0", "--compile=True"])
    assert "compile: torch.compile traces and builds on the first step" in said, said[-2000:]


def test_the_guardian_resumes_a_step_a_killed_re_save_left_aside(tmp_path):
    """A re-save of the newest step (a measuring resume's final save) killed between its renames left it only as
    step_N.old-PID: the guardian saw no checkpoint and restarted a fresh start, which the trainer refused (exit 1,
    supervision over); it puts the step back and resumes it."""
    import guardian
    run = tmp_path / "run"
    state = {"state.json": lambda p: json.dump({"step": 5, "finished": True}, open(p, "w"))}
    path = checkpoint.save(str(run), 5, state)
    os.replace(path, path + ".old-999")
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    assert "--init_from=resume" in g.child_argv(first=True) and guardian.latest_step(str(run)) == 5
    assert os.path.isdir(path) and not os.path.exists(path + ".old-999")


def test_a_release_holds_across_invocations_until_a_shard_is_quarantined_by_hand_again(tmp_path):
    """--release_shards was passed on only in its own invocation (a next one without it left the shard quarantined by
    the checkpoint saved before, guardian.json saying released); a release in guardian.json overrode the operator's
    --quarantine_shards of the same shard later (train.py reads release last)."""
    import guardian
    run = tmp_path / "run"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"])
    g.log["quarantined"].append({"shard": "local/b.bin", "offset": None, "reason": "crash repeated", "at": 0})
    g.save()
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--release_shards=['local/b.bin']"])
    g.save()
    argv = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"]).child_argv()
    assert argv[-1] == "--release_shards=['local/b.bin']"
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--quarantine_shards=['local/b.bin']"])
    g.save()
    assert not any(a.startswith("--release_shards") for a in g.child_argv())
    assert not any(a.startswith("--release_shards") for a in guardian.Guardian(
        ["config/tiny.py", f"--out_dir={run}"]).child_argv())
    # a shard quarantined by hand (the checkpoint's quarantine, not guardian.json's): its release holds the same way
    guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--quarantine_shards=['local/c.bin']"]).save()
    guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--release_shards=['local/c.bin']"]).save()
    argv = guardian.Guardian(["config/tiny.py", f"--out_dir={run}"]).child_argv()
    assert argv[-1] == "--release_shards=['local/c.bin']", argv


def test_a_restart_while_out_dir_reads_empty_resumes_the_checkpoint_an_earlier_start_saw(tmp_path):
    """out_dir on a mount still down at a restart reads as empty: the restart went without --init_from=resume, and its
    trainer, reaching out_dir once the mount was back, refused the run's checkpoints (exit 1, supervision over)."""
    import guardian
    run, away = tmp_path / "run", tmp_path / "away"
    state = {"state.json": lambda p: json.dump({"step": 5, "finished": True}, open(p, "w"))}
    step = checkpoint.save(str(run), 5, state)
    g = guardian.Guardian(["config/tiny.py", f"--out_dir={run}", "--unreachable_backoff_s=0.01"])
    own_argv, argvs = g.child_argv, []
    scripts = [f"import os; os.replace({step!r}, {str(away)!r}); raise SystemExit({train_py.EXIT_UNREACHABLE})",
               f"import os; os.replace({str(away)!r}, {step!r})"]

    def child_argv(left=None, first=False):  # what the guardian would run, recorded; a stand-in runs instead
        argvs.append(own_argv(left, first))
        return [sys.executable, "-c", scripts[len(argvs) - 1]]
    g.child_argv = child_argv
    assert run_guardian(g) == 0 and len(argvs) == 2
    assert "--init_from=resume" in argvs[0] and "--init_from=resume" in argvs[1], argvs
