"""relay.py: stores (file:// and hf:// through the real huggingface_hub client against tests/hub_server.py's
RelayHub), lease + fencing, contention, stale / killed holders, 5xx-after-commit, bad input, decay."""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from relay_fixtures import (FAKE_TRAIN, ROOT, base_env, init_run, relay_cli, save_fake_checkpoint, wait_for,
                            write_config, write_fake_train)

import checkpoint  # noqa: E402
import forkserver  # noqa: E402
import relay  # noqa: E402
import relay_dashboard  # noqa: E402
from hub_server import RelayHub  # noqa: E402

# huggingface_hub's own LFS PUT (lfs.py: http_backoff("PUT", data=fileobj)) trips an httpx2 deprecation notice
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning")


def push(store, lease, run_dir, **kw):
    """One commit as `relay.py push` makes it: checkpoint/ (verified first), training_state.json, logs/leg-N.jsonl,
    a LEDGER.md row, RELAY.json, chained from our last commit."""
    return relay.commit_push(store, lease, relay.prepare_push(store, lease, run_dir, **kw), run_dir)


@pytest.fixture
def hub(tmp_path):
    with RelayHub(tmp_path / "hub_root") as h:
        yield h


def store_url(kind, tmp_path, hub, name="alice/run"):
    if kind == "file":
        return f"file://{tmp_path}/store"
    return f"hf://{name}"


def env_for(kind, tmp_path, hub, **extra):
    env = base_env(extra)
    if kind == "hf":
        env.update(hub.client_env(tmp_path / "hf_home"))
    return env


@pytest.fixture
def hf_env(hub, tmp_path, monkeypatch):
    """In-process hf:// use: relay_store.HfStore reads endpoint, token and cache from the environment when built."""
    for k, v in hub.client_env(tmp_path / "hf_home_inproc").items():
        monkeypatch.setenv(k, v)


@pytest.fixture(autouse=True)
def in_its_own_cwd(tmp_path, monkeypatch):
    """A command without --workdir uses ./relay-work: the test's folder, not the repository's."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def no_xet_in_process(monkeypatch):
    """huggingface_hub reads HF_HUB_DISABLE_XET once, at import, which an earlier test file may have done without
    it; with hf_xet installed the client would then try Xet, which the fake Hub (like the tests) does not speak."""
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def rl(monkeypatch, capsys):
    """`python relay.py ARGS` run in this process (no interpreter start-up): returns returncode, stdout, stderr."""
    def call(args, env=None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, str(v))
        capsys.readouterr()
        rc = relay.main([str(a) for a in args])
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)
    return call


def train_leg(fake, run_dir, steps, env=None):
    """The stand-in trainer resumes the leg in run_dir (relay.prepare_leg's) for `steps` steps, as `run` starts it."""
    t = subprocess.run([sys.executable, fake, os.path.join(run_dir, "relay_config.py"), f"--out_dir={run_dir}",
                        "--init_from=resume", f"--stop_after_steps={steps}"], env=env or base_env(), capture_output=True,
                       text=True, timeout=60)
    assert t.returncode == 0, t.stderr


def ledger_rows(store):
    snap = relay.Snapshot(store)
    return relay.parse_ledger(snap.ledger()), snap


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_init_run_two_legs_status_pull(kind, tmp_path, hub, monkeypatch, rl):
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub)
    relay_cli = globals()["relay_cli"] if kind == "file" else rl  # the script's entry point once, in-process for hf
    fake = init_run(url, tmp_path, env, cli=relay_cli)
    common = ["--train-script", fake, "--ttl", "3", "--heartbeat", "0.5"]
    r = relay_cli(["run", url, "--steps", "7", "--workdir", tmp_path / "wa", *common], env)
    assert r.returncode == 0, r.stderr
    leg1 = tmp_path / "wa" / "leg-0001-gen1"  # pushed, kept till the next run: the leg's last line says so
    assert re.search(rf"relay: {re.escape(str(leg1))} \(\d+\.\d MiB\) stays on disk until the next `relay.py run` "
                     rf"\(or `relay.py pull` holding the baton\) from this workdir removes it .*; to free it now: "
                     rf"rm -r {re.escape(str(leg1))}\n", r.stdout), r.stdout
    assert leg1.is_dir()
    r = relay_cli(["run", url, "--steps", "4", "--workdir", tmp_path / "wb", *common], dict(env, RELAY_WHO="bob"))
    assert r.returncode == 0, r.stderr
    r = relay_cli(["status", url, "--json"], env)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert (st["step"], st["legs"], st["holder"], st["tokens"]) == (11, 2, None, 11 * 4096)
    rows = st["ledger"]
    assert [(x["leg"], x["who"], x["step_range"], x["steps"], x["gpu"]) for x in rows] == [
        (1, "tester", "0-7", 7, "FakeGPU 80GB"), (2, "bob", "7-11", 4, "FakeGPU 80GB")]
    assert rows[0]["loss_start"] == pytest.approx(6.0 / 1.05, abs=1e-3) and rows[1]["loss_end"] == pytest.approx(6.0 / 1.55, abs=1e-3)
    assert rows[0]["usd"] is not None and rows[0]["usd"] >= 0
    # the leg's metrics are in logs/, the checkpoint is step 11 and verifies after a pull into a fresh dir
    r = relay_cli(["pull", url, "--out", tmp_path / "pulled"], env)
    assert r.returncode == 0, r.stderr
    ck = checkpoint.resolve(str(tmp_path / "pulled"))
    assert os.path.basename(ck) == "step_0000011" and checkpoint.verify(ck)["step"] == 11
    if kind == "file":
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    store = relay.open_store(url)
    head = store.head()[0]
    logs = store.list(head, "logs/")
    assert logs == ["logs/leg-0001.jsonl", "logs/leg-0002.jsonl"]
    steps = [json.loads(l)["step"] for l in store.read(head, "logs/leg-0002.jsonl").decode().splitlines()]
    assert steps == [8, 9, 10, 11]
    text = relay_cli(["status", url], env).stdout
    assert "baton: free" in text and "leg 2: bob" in text
    d = relay_dashboard.dashboard_data(url)  # what the dashboard page is built from, read through the same store
    assert [m["step"] for m in d["metrics"]] == list(range(1, 12)) and len(d["ledger"]) == 2
    assert d["baton"]["holder"] is None and d["state"]["step"] == 11
    if kind == "file":  # as that line said: the next run from its workdir removes the pushed leg's folder
        assert relay_cli(["run", url, "--steps", "1", "--workdir", tmp_path / "wa", *common], env).returncode == 0
        assert not leg1.exists()


def contention_worker_src():
    return r'''
import json, os, random, sys, time
sys.path[:0] = [os.environ["PICAFLOR_ROOT"], os.path.join(os.environ["PICAFLOR_ROOT"], "tests")]
import relay
from relay_fixtures import save_fake_checkpoint
url, wid, rounds, outp, go, poll = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], float(sys.argv[6])
store = relay.open_store(url)  # imports the Hub client before the start line, so all 8 start claiming together
open(outp + ".ready", "w").close()
while not os.path.exists(go):
    time.sleep(0.005)
work = os.path.join(os.path.dirname(outp), f"worker-{wid}")
log, busy = [], 0
random.seed(wid)
while True:
    try:
        lease = relay.claim(store, work, f"w{wid}", ttl=60, heartbeat=20)
    except relay.Busy:
        busy += 1
        if busy % 5 == 0 and relay.Snapshot(store).state["legs"] >= rounds:
            break
        time.sleep(random.uniform(0.2, 1.0) * poll)
        continue
    except relay.Transient:
        time.sleep(poll)
        continue
    if lease.leg > rounds:
        relay.release(store, lease)
        break
    log.append({"generation": lease.generation, "leg": lease.leg, "who": f"w{wid}"})
    run_dir = relay.prepare_leg(store, lease, work)
    step = lease.base_step + 1
    save_fake_checkpoint(run_dir, step, f"w{wid} step {step}")
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": step, "tokens": step * 100, "loss": 1.0 / step}) + "\n")
    relay.commit_push(store, lease, relay.prepare_push(store, lease, run_dir, wall_s=1.0), run_dir)
    relay.release(store, lease)
json.dump(log, open(outp, "w"))
'''


@pytest.mark.parametrize("kind,rounds", [("file", 50), ("hf", 30)])
def test_contention_eight_claimers(kind, rounds, tmp_path, hub, monkeypatch):
    """8 processes race for the baton; every leg is one claim -> pull -> checkpoint -> push -> release. The same 50
    rounds on both stores (hf: ~20 s on 2 busy cores, most of it the 8 clients' CPU, not the server)."""
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub)
    init_run(url, tmp_path, env)
    worker = tmp_path / "worker.py"
    worker.write_text(contention_worker_src())
    go = tmp_path / "go"
    poll = "0.05" if kind == "file" else "0.3"
    procs = [subprocess.Popen([sys.executable, str(worker), url, str(i), str(rounds), str(tmp_path / f"log{i}.json"),
                               str(go), poll], env=env, stderr=subprocess.PIPE, text=True) for i in range(8)]
    wait_for(lambda: all(os.path.exists(tmp_path / f"log{i}.json.ready") for i in range(8)), 90, "workers ready")
    go.write_text("go")
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
    logs = [e for i in range(8) for e in json.load(open(tmp_path / f"log{i}.json"))]
    gens = [e["generation"] for e in logs]
    assert len(gens) == len(set(gens)) == rounds  # exactly one holder per generation
    assert sorted(e["leg"] for e in logs) == list(range(1, rounds + 1))
    if kind == "hf":
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home2"))
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert [r["leg"] for r in rows] == list(range(1, rounds + 1))  # every leg once, in order
    by_leg = {e["leg"]: e for e in logs}
    for r in rows:  # the chain of checkpoints is unbroken: leg i trained from i-1, and the ledger names its holder
        assert r["step_range"] == f"{r['leg'] - 1}-{r['leg']}"
        assert (r["who"], r["generation"]) == (by_leg[r["leg"]]["who"], by_leg[r["leg"]]["generation"])
    assert snap.state["step"] == rounds and snap.relay["holder"] is None
    relay.pull(store, str(tmp_path / "final"))
    ck = checkpoint.resolve(str(tmp_path / "final"))
    who = by_leg[rounds]["who"]
    assert open(os.path.join(ck, "model.safetensors")).read() == f"{who} step {rounds}"


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_two_claims_at_the_same_moment_one_wins_the_loser_names_the_holder(kind, tmp_path, hub, request):
    """Two contributors read the free baton, then commit their claims together (a barrier in each store's commit):
    exactly one lease is granted, and the loser says who holds it and when it expires (it said only "someone else
    committed first")."""
    import threading
    url = store_url(kind, tmp_path, hub)
    init_run(url, tmp_path, env_for(kind, tmp_path, hub))
    if kind == "hf":
        request.getfixturevalue("hf_env")
    both_read = threading.Barrier(2)
    out = {}

    def claim(who):
        store = relay.open_store(url)
        commit = store.commit
        store.commit = lambda *a: (both_read.wait(10), commit(*a))[1]  # both snapshots taken before either commits
        try:
            out[who] = relay.claim(store, str(tmp_path / who), who, ttl=60, heartbeat=20)
        except relay.Busy as e:
            out[who] = e
    threads = [threading.Thread(target=claim, args=(who,)) for who in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    won = [who for who, v in out.items() if isinstance(v, relay.Lease)]
    assert len(out) == 2 and len(won) == 1, out
    lost = out["bob" if won == ["alice"] else "alice"]
    assert f"lost the race: {won[0]} holds the baton (leg 1, generation 1" in str(lost), lost
    assert re.search(r"it expires at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC unless renewed", str(lost)), lost
    snap = relay.Snapshot(relay.open_store(url))
    assert (snap.relay["holder"], snap.relay["generation"]) == (won[0], 1)


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_stale_holder_is_fenced(kind, tmp_path, hub, request):
    """A pauses past its TTL; B claims and pushes; A's heartbeat and push are rejected, A's checkpoint survives."""
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub)
    init_run(url, tmp_path, env)
    if kind == "hf":
        request.getfixturevalue("hf_env")
    store = relay.open_store(url)
    a = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=1.5, heartbeat=0.5)
    again = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=1.5, heartbeat=0.5)  # renews, same generation
    assert (again.generation, again.leg) == (a.generation, a.leg) and again.sha == store.head()[0]
    a = again
    with pytest.raises(relay.Busy):
        relay.claim(store, str(tmp_path / "wb"), "bob", ttl=1.5, heartbeat=0.5)
    a_dir = relay.prepare_leg(store, a, str(tmp_path / "wa"))
    ck_a = save_fake_checkpoint(a_dir, 3, "alice")
    time.sleep(2.8)  # A is "paused": no heartbeat for longer than the TTL (+1 s: HTTP Date has 1 s resolution)
    b = relay.claim(store, str(tmp_path / "wb"), "bob", ttl=1.5, heartbeat=0.5)
    assert b.generation == a.generation + 1 and b.leg == a.leg
    b_dir = relay.prepare_leg(store, b, str(tmp_path / "wb"))
    save_fake_checkpoint(b_dir, 2, "bob")
    push(store, b, b_dir, wall_s=1)
    with pytest.raises(relay.Fenced, match="lease lost"):
        relay.renew(store, a)
    with pytest.raises(relay.Fenced, match="push rejected.*kept"):
        push(store, a, a_dir, wall_s=1)
    assert checkpoint.verify(ck_a)["step"] == 3  # A's work is untouched
    relay.release(store, b)
    rows, snap = ledger_rows(store)
    assert [(r["leg"], r["who"]) for r in rows] == [(1, "bob")] and snap.state["step"] == 2


def test_a_second_heartbeat_counts_from_the_last_renewal(tmp_path, hub):
    """relay run beats once while pulling and again while training: the trainer's heartbeat must give up by the
    lease's last successful renewal, not by its own start, or its holder trains on after someone else claims."""
    url = store_url("file", tmp_path, hub)
    init_run(url, tmp_path, env_for("file", tmp_path, hub))
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=3.0, heartbeat=1.0)
    pull = relay.Heartbeat(store, lease, lambda: None)
    pull.start()
    time.sleep(1.95)  # the pull's heartbeat renewed once, at ~1 s
    pull.stop.set()
    pull.join()

    def unreachable(*a, **k):
        raise relay.StoreError("injected: the store is unreachable for writes")
    commit = store.commit
    store.commit = unreachable  # from now on every renewal fails
    trainer = relay.Heartbeat(store, lease, lambda: None)
    trainer.start()
    other, claimed_while_training = relay.open_store(url), False
    t0 = relay.lease_clock()
    while not trainer.overdue() and relay.lease_clock() - t0 < 6:
        try:
            relay.claim(other, str(tmp_path / "wb"), "bob", ttl=3.0, heartbeat=1.0)
            claimed_while_training = True
            break
        except relay.Busy:
            time.sleep(0.02)
    trainer.stop.set()
    trainer.join()
    store.commit = commit
    assert trainer.overdue() and not claimed_while_training  # alice stopped before bob could take the baton


def start_run(url, tmp_path, env, workdir, fake, steps, ttl, hb):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "relay.py"), "run", url, "--steps", str(steps),
                             "--train-script", fake, "--workdir", str(workdir), "--ttl", str(ttl), "--heartbeat", str(hb)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def ckpt_step(run_dir):
    """Step of the newest valid checkpoint in run_dir, -1 if none (polling for ">= N" cannot miss a step)."""
    ck = checkpoint.latest_valid(str(run_dir))
    return int(os.path.basename(ck).split("_")[1]) if ck else -1


# (ttl, heartbeat) of the holder in the paused / killed tests: slack for a renewal over HTTP on 2 busy cores before
# the holder's own deadline (ttl - ttl/5) trips, and for bob's interpreter start-up before the dead lease expires
LEASE_TIMES = {"file": (3.0, 0.75), "hf": (3.0, 0.75)}


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_paused_relay_run_stops_itself_and_keeps_checkpoint(kind, tmp_path, hub, rl):
    """`relay run` SIGSTOPped past the TTL (its trainer runs on, in its own session), another claims; on SIGCONT it
    stops training at once, pushes nothing (a push it tries is refused), exits 4 saying why, and its local
    checkpoint is kept."""
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub, FAKE_STEP_S="0.03", FAKE_CKPT_EVERY="5")
    ttl, hb = LEASE_TIMES[kind]
    fake = init_run(url, tmp_path, env)
    p = start_run(url, tmp_path, env, tmp_path / "wa", fake, 100000, ttl, hb)
    leg = tmp_path / "wa" / "leg-0001-gen1"
    wait_for(lambda: ckpt_step(leg) >= 10, 30, "training")
    os.killpg(p.pid, signal.SIGSTOP)
    # bob claims as soon as the store says the lease expired (HTTP Date has 1 s resolution: up to ttl + 1 s)
    bob = dict(env, RELAY_WHO="bob")
    wait_for(lambda: rl(["claim", url, "--workdir", tmp_path / "wb", "--ttl", "30", "--heartbeat", "10"], bob).returncode == 0,
             ttl + 20, "bob's claim", step=0.2)
    os.killpg(p.pid, signal.SIGCONT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 4, err
    last = err.strip().splitlines()[-1]
    # fenced by its heartbeat (nothing pushed), or stopped as overdue and its push refused by the compare-and-swap
    assert "error:" in last and ("lease lost" in last or "push rejected" in last) and "kept" in last, last
    assert "Traceback" not in err
    ck = checkpoint.latest_valid(str(leg))
    assert ck is not None and checkpoint.verify(ck)["step"] >= 10
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert rows == [] and snap.relay["holder"] == "bob" and snap.state["step"] == 0


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_sigkill_holder_mid_leg_next_resumes_from_last_push(kind, tmp_path, hub, monkeypatch):
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub, FAKE_STEP_S="0.02")
    ttl, hb = LEASE_TIMES[kind]
    lease_args = ["--ttl", str(ttl), "--heartbeat", str(hb)]
    fake = init_run(url, tmp_path, env)
    r = relay_cli(["run", url, "--steps", "4", "--train-script", fake, "--workdir", tmp_path / "wa", *lease_args], env)
    assert r.returncode == 0, r.stderr
    p = start_run(url, tmp_path, dict(env, RELAY_WHO="doomed"), tmp_path / "wk", fake, 100000, ttl, hb)
    leg = tmp_path / "wk" / "leg-0002-gen2"
    wait_for(lambda: ckpt_step(leg) >= 10, 30, "training")
    os.killpg(p.pid, signal.SIGKILL)  # relay dies at once, no release; its trainer (own session) gets SIGTERM
    p.communicate(timeout=10)
    # bob starts at once with --wait: the dead holder's lease is still live, so he has to wait for it to expire
    bob = subprocess.Popen([sys.executable, os.path.join(ROOT, "relay.py"), "run", url, "--steps", "3", "--train-script",
                            fake, "--workdir", str(tmp_path / "wb"), *lease_args, "--wait", "--poll", "0.3"],
                           env=dict(env, RELAY_WHO="bob"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def trainer_alive():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if f"--out_dir={leg}".encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    return True
            except OSError:
                pass
        return False
    wait_for(lambda: not trainer_alive(), 30, "the orphaned trainer to stop (PR_SET_PDEATHSIG)")
    out, err = bob.communicate(timeout=60)
    assert bob.returncode == 0, err
    assert "doomed holds the baton" in err  # it had to wait for the lease to expire
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rows, snap = ledger_rows(relay.open_store(url))
    assert [(x["leg"], x["who"], x["step_range"], x["generation"]) for x in rows] == [(1, "tester", "0-4", 1), (2, "bob", "4-7", 3)]
    assert snap.state["step"] == 7
    assert checkpoint.latest_valid(str(leg)) is not None  # the killed holder's local work was not deleted


def test_hf_checkpoint_travels_through_git_lfs(tmp_path, hub, hf_env):
    """As on the Hub, model.safetensors (an LFS pattern), the binary optimizer.pt and any file over the size
    threshold go through Git LFS: preupload says "lfs", the bytes are PUT to the storage server, the commit names
    them by sha256, and downloads follow the 302 to the CDN. What comes back is bit-identical to the manifest."""
    import hashlib
    import numpy as np
    import relay_store
    from safetensors.numpy import save as safetensors_bytes
    url = "hf://alice/run"
    init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    hub.lfs_threshold = 10_000  # so the leg's metrics log (> 10 kB, plain text) goes through LFS by size
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, str(tmp_path / "wa"))
    weights = {"wte": np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)}  # 64 kB of weights
    ck = save_fake_checkpoint(run_dir, 9, safetensors_bytes(weights), more={"optimizer.pt": bytes(range(256)) * 40})
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        for s in range(1, 10):
            f.write(json.dumps({"step": s, "tokens": s * 100, "loss": 5.0 / s, "pad": "x" * 2000}) + "\n")
    push(store, lease, run_dir, wall_s=1)
    relay.release(store, lease)
    man = json.load(open(os.path.join(ck, "MANIFEST.json")))
    stored = hub.lfs_objects[("models", "alice/run")]
    for name in ("model.safetensors", "optimizer.pt"):
        assert man["files"][name]["sha256"] in stored  # uploaded as an LFS object, by its sha256
    tree = {f.path: f for f in store.api.list_repo_tree("alice/run", recursive=True) if hasattr(f, "lfs")}  # files
    assert tree["checkpoint/model.safetensors"].lfs.sha256 == man["files"]["model.safetensors"]["sha256"]
    assert tree["logs/leg-0001.jsonl"].lfs is not None  # LFS by size
    assert tree["checkpoint/state.json"].lfs is None and tree["RELAY.json"].lfs is None  # small text: regular
    n0 = len(hub.requests)
    out = relay.pull(relay.open_store(url), str(tmp_path / "pulled"))  # relay's pull verifies the manifest too
    for name in ("model.safetensors", "optimizer.pt"):
        data = open(os.path.join(out, name), "rb").read()
        assert hashlib.sha256(data).hexdigest() == man["files"][name]["sha256"] and data == open(os.path.join(ck, name), "rb").read()
    sha = man["files"]["model.safetensors"]["sha256"]
    assert any(p.startswith("STORAGE/lfs-cdn/") and p.endswith(sha) for _, p in hub.requests[n0:])  # bytes from the CDN
    assert not any(p.startswith("/alice/run/resolve/") and p.endswith("model.safetensors") and m == "GET"
                   for m, p in hub.requests[n0:])
    d = relay_dashboard.dashboard_data(url)  # relay's small-file reads follow the redirect too (the log is an LFS file now)
    assert [m["step"] for m in d["metrics"]] == list(range(1, 10))
    # the lease's clock is the newest relay commit's, not a card edit's after it (the Hub's commit list, by title)
    relay_time = store.head()[1]
    time.sleep(1.1)  # (the commit list's dates have whole seconds)
    edit = store.commit(store.head()[0], {"notes.txt": b"a note\n"}, [], "Upload notes.txt")
    assert store.head()[0] == edit and store.head()[1] == relay_time
    assert hub.vrepos[("models", "alice/run")]["commits"][edit]["time"] > relay_time + 1
    # the small-file cache is bounded (a dashboard left running kept every head's files for months)
    head = store.head()[0]
    for i in range(relay_store.READ_CACHE_ENTRIES + 10):
        store.read(head, f"no-such-file-{i}.json")
    assert len(store.cache) == relay_store.READ_CACHE_ENTRIES and store.read(head, "RELAY.json") is not None


def test_hf_lfs_upload_with_wrong_bytes_is_refused(tmp_path, hub, hf_env):
    """The fake Hub's LFS checks, raw: preupload's rule; a PUT whose sha256 or size is not the signed one is
    refused and stores nothing; a commit naming an object never uploaded is refused; then the right bytes go through.
    Through relay: an upload damaged in transit makes the push fail with a one-line error, nothing committed,
    the lease and the local checkpoint kept."""
    import base64
    import hashlib
    import urllib.error
    import urllib.request

    def call(method, url, body=b"", ctype="application/json"):
        req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": ctype})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    url = "hf://alice/run"
    init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    api = f"{hub.endpoint}/api/models/alice/run"
    files = [{"path": "a/model.safetensors", "size": 5, "text": b"hello"}, {"path": "notes.txt", "size": 5, "text": b"hello"},
             {"path": "blob.dat", "size": 6, "text": b"ab\0cde"}, {"path": "big.txt", "size": 11_000_000, "text": b"aaaa"}]
    st, body = call("POST", f"{api}/preupload/main", json.dumps({"files": [
        {"path": f["path"], "size": f["size"], "sample": base64.b64encode(f["text"]).decode()} for f in files]}).encode())
    assert st == 200 and [f["uploadMode"] for f in json.loads(body)["files"]] == ["lfs", "regular", "lfs", "lfs"]

    good = os.urandom(4096)
    oid = hashlib.sha256(good).hexdigest()
    st, body = call("POST", f"{hub.endpoint}/alice/run.git/info/lfs/objects/batch", json.dumps(
        {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256", "objects": [{"oid": oid, "size": len(good)}]}).encode())
    assert st == 200
    actions = json.loads(body)["objects"][0]["actions"]
    put, verify = actions["upload"]["href"], actions["verify"]["href"]
    assert put.startswith(hub.storage_endpoint)  # another origin, like S3
    bad_content = bytes([good[0] ^ 1]) + good[1:]
    assert call("PUT", put, bad_content, "application/octet-stream")[0] == 400  # same size, wrong sha256
    assert call("PUT", put, good[:-1], "application/octet-stream")[0] == 400  # wrong size
    assert oid not in hub.lfs_objects[("models", "alice/run")]
    assert call("POST", verify, json.dumps({"oid": oid, "size": len(good)}).encode())[0] == 404
    store = relay.open_store(url)
    head = store.head()[0]
    commit = "\n".join(json.dumps(l) for l in [
        {"key": "header", "value": {"summary": "sneak", "parentCommit": head}},
        {"key": "lfsFile", "value": {"path": "extra/blob.bin", "algo": "sha256", "oid": oid, "size": len(good)}}])
    st, body = call("POST", f"{api}/commit/main", commit.encode(), "application/x-ndjson")
    assert st == 400 and b"never uploaded" in body and store.head()[0] == head
    assert call("PUT", put, good, "application/octet-stream")[0] == 200
    assert call("POST", verify, json.dumps({"oid": oid, "size": len(good)}).encode())[0] == 200
    st, body = call("POST", f"{api}/commit/main", commit.encode(), "application/x-ndjson")
    assert st == 200 and store.head()[0] == json.loads(body)["commitOid"]
    assert relay.open_store(url).read(json.loads(body)["commitOid"], "extra/blob.bin") == good
    # through relay: the push's LFS upload arrives damaged, the storage refuses it
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, str(tmp_path / "wa"))
    ck = save_fake_checkpoint(run_dir, 3, os.urandom(3000))
    hub.corrupt_uploads = 1
    with pytest.raises(relay.StoreError, match="upload") as e:
        push(store, lease, run_dir, wall_s=1)
    assert "\n" not in str(e.value) and "HTTP 400" in str(e.value) and "model.safetensors" in str(e.value), str(e.value)
    assert hub.corrupt_uploads == 0 and store.head()[0] == lease.sha  # nothing committed, our lease still the head
    assert checkpoint.verify(ck)["step"] == 3
    push(store, lease, run_dir, wall_s=1)  # the retry goes through
    relay.release(store, lease)
    assert relay.Snapshot(store).state["step"] == 3


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_5xx_after_commit_landed_no_duplicate(kind, tmp_path, hub, rl):
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub)
    relay_cli = rl
    fake = init_run(url, tmp_path, env, cli=rl)
    if kind == "hf":
        n0 = len(hub.vrepos[("models", "alice/run")]["commits"])
        hub.fail_after_commit = 3  # claim, push and release each land and then answer 500
    else:
        env["RELAY_TEST_FAULT"] = "file-commit-then-fail"  # every commit lands, then raises a transient error
    r = relay_cli(["run", url, "--steps", "3", "--train-script", fake, "--workdir", tmp_path / "wa", "--ttl", "60",
                   "--heartbeat", "20"], env)
    assert r.returncode == 0, r.stderr
    env.pop("RELAY_TEST_FAULT", None)
    os.environ.pop("RELAY_TEST_FAULT", None)
    r = relay_cli(["status", url, "--json"], env)
    st = json.loads(r.stdout)
    assert [x["leg"] for x in st["ledger"]] == [1] and st["step"] == 3 and st["holder"] is None and st["generation"] == 1
    if kind == "hf":
        assert hub.fail_after_commit == 0
        msgs = [c["message"] for c in hub.vrepos[("models", "alice/run")]["commits"].values()]
        assert len(msgs) - n0 == 3 and sum("leg 1 by" in m for m in msgs) == 1


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_bad_input_one_line_errors_nothing_overwritten(kind, tmp_path, hub, rl):
    url = store_url(kind, tmp_path, hub)
    env = env_for(kind, tmp_path, hub)
    relay_cli = rl  # in-process: an escaping exception would fail the test just as a traceback would
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)

    def one_line_error(r, *words):
        assert r.returncode == 3, (r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        for w in words:
            assert w in lines[0], lines[0]

    # init over an existing run
    head0 = store.head()[0]
    one_line_error(relay_cli(["init", url, tmp_path / "run_config.py", "--train-script", fake], env), "already a relay run")
    if kind == "hf":  # one 503 made exists() say "no run here", and init committed step 0 over the live run
        hub.status_override, hub.fail_left = 503, 1
        r = relay_cli(["init", url, tmp_path / "run_config.py", "--train-script", fake], env)
        assert r.returncode != 0 and "created run" not in r.stdout and store.head()[0] == head0, (r.stdout, r.stderr)
    # ttl shorter than 3 heartbeats
    one_line_error(relay_cli(["claim", url, "--ttl", "2", "--heartbeat", "1"], env), "3x")
    assert store.head()[0] == head0
    # a push whose local checkpoint has a bad manifest: refused before any upload, lease kept
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, str(tmp_path / "wa"))
    ck = save_fake_checkpoint(run_dir, 5, "good", state={"step": 5, "tokens": 50})
    with open(os.path.join(ck, "model.safetensors"), "w") as f:
        f.write("evil")
    head1 = store.head()[0]
    one_line_error(relay_cli(["push", url, "--workdir", tmp_path / "wa"], env), "push refused", "sha256")
    assert store.head()[0] == head1 == lease.sha
    relay.release(store, relay.Lease.load(str(tmp_path / "wa"), store))
    # a checkpoint in the store that fails its manifest: pull refuses, installs nothing
    head = store.head()[0]
    man = json.loads(store.read(head, "checkpoint/MANIFEST.json"))
    bad_head = store.commit(head, {"checkpoint/model.safetensors": b"tampered"}, [], "tamper")
    one_line_error(relay_cli(["pull", url, "--out", tmp_path / "pulled"], env), "fails verification")
    assert not [n for n in os.listdir(tmp_path / "pulled") if n.startswith("step_")]
    assert man["step"] == 0
    # malformed RELAY.json: claim and status refuse, nothing is committed
    bad = store.commit(bad_head, {"RELAY.json": b"{not json"}, [], "break the lease file")
    one_line_error(relay_cli(["claim", url, "--workdir", tmp_path / "wc"], env), "RELAY.json", "malformed")
    one_line_error(relay_cli(["status", url], env), "RELAY.json", "malformed")
    assert store.head()[0] == bad
    # a repo / dir that is not a relay run
    if kind == "hf":
        relay.open_store("hf://alice/other").create()
        other = "hf://alice/other"
    else:
        os.makedirs(tmp_path / "empty")
        other = f"file://{tmp_path}/empty"
    one_line_error(relay_cli(["status", other], env), "not a relay")
    one_line_error(relay_cli(["claim", other, "--workdir", tmp_path / "wd"], env), "not a relay")
    one_line_error(relay_cli(["status", "s3://bucket/x"], env), "unknown store")


def test_a_malformed_store_url_exits_3_an_error_not_2_a_usage_error(tmp_path, rl, capsys):
    """relay.py's exit statuses: a store URL relay cannot open is an error (3, one line naming the URL and the forms
    a store takes), as a bad --steps value is; 2 is a usage error (a missing or unknown argument)."""
    for url, says in [("s3://bucket/x", "unknown store"), ("hf://owner", "expected hf://owner/name"),
                      ("file://relative/dir", "needs an absolute path")]:
        for argv in (["status", url], ["claim", url, "--workdir", tmp_path / "wd"]):
            r = rl(argv)
            assert r.returncode == 3 and r.stderr.count("\n") == 1 and url in r.stderr and says in r.stderr, (argv, r)
    r = rl(["status", "file:///x", "--nope"])
    assert r.returncode == 2 and "unrecognized arguments --nope" in r.stderr, r.stderr
    with pytest.raises(SystemExit) as e:  # (argparse's own)
        relay.main(["status"])
    assert e.value.code == 2 and "usage: relay.py status" in capsys.readouterr().err


def test_decay_flag_travels_to_the_next_leg(tmp_path, hub, rl):
    url = store_url("file", tmp_path, hub)
    env = base_env()
    relay_cli = rl
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    r = relay_cli(["decay", url], env)
    assert r.returncode == 3 and "alice holds the baton" in r.stderr  # would fence alice out
    relay.release(store, lease)
    r = relay_cli(["decay", url], env)
    assert r.returncode == 0, r.stderr
    assert relay.Snapshot(store).state["decay_requested"] is True
    r = relay_cli(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wb"], env)
    assert r.returncode == 0, r.stderr
    st = relay.Snapshot(store).state
    assert st["decay_requested"] is False and st["decay_started_at_tokens"] == 0 and st["step"] == 2
    r = relay_cli(["status", url], env)  # once taken, neither status nor the page said the run was decaying
    assert r.returncode == 0 and ", decaying" in r.stdout, r.stdout


def test_decay_after_a_holder_expired_does_not_revive_its_lease(tmp_path, hub, rl):
    """A lease's age counts from the newest commit: decay's commit kept the dead holder's name, which made its lease
    live again for another ttl (nobody could claim)."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    relay.claim(store, str(tmp_path / "wa"), "alice", ttl=1.0, heartbeat=0.25)  # then alice's machine dies
    time.sleep(1.5)
    assert rl(["decay", url], env).returncode == 0
    lease = relay.claim(store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=10)
    assert lease.who == "bob" and relay.Snapshot(store).state["decay_requested"]


def test_a_second_relay_in_the_same_workdir_is_refused(tmp_path, hub, rl):
    """Two `relay.py run` in one workdir: the second renewed the first one's lease as its own and trained in its leg
    dir. One relay.py at a time holds a workdir (flock); another one says so and changes nothing."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    wa = tmp_path / "wa"
    with relay.workdir_locked(str(wa)):  # as a running `relay.py run` holds it
        for args in (["run", url, "--steps", "2", "--train-script", fake], ["claim", url], ["push", url],
                     ["release", url], ["pull", url]):
            r = rl(args + ["--workdir", wa], env)
            assert r.returncode == 3 and f"another relay.py is working in {wa}" in r.stderr, (args, r.stderr)
        r = rl(["pull", url, "--workdir", wa, "--out", tmp_path / "copy"], env)  # a read-only copy needs no lease
        assert r.returncode == 0 and checkpoint.latest_valid(str(tmp_path / "copy")), r.stderr
    assert relay.Snapshot(relay.open_store(url)).relay["holder"] is None
    assert rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", wa], env).returncode == 0


def test_a_read_only_store_or_out_is_one_line(tmp_path, hub, rl, monkeypatch):
    """A file:// store this user may only read (another user's, a read-only mount): status and pull read it, but claim
    ended in an OSError traceback; so did pull --out into a read-only folder. One line each now."""
    import errno
    url, env = store_url("file", tmp_path, hub), base_env()
    init_run(url, tmp_path, env, cli=rl)
    store, ro, real = str(tmp_path / "store"), str(tmp_path / "ro"), os.makedirs

    def makedirs(path, *a, **k):  # the store and ro/ on a read-only mount
        if os.path.abspath(path).startswith((store + os.sep, ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real(path, *a, **k)
    monkeypatch.setattr(os, "makedirs", makedirs)
    assert rl(["status", url], env).returncode == 0
    assert rl(["pull", url, "--workdir", tmp_path / "wp"], env).returncode == 0
    r = rl(["claim", url, "--workdir", tmp_path / "wc"], env)
    assert r.returncode == 3 and re.fullmatch(
        rf"relay.py claim: error: {url}: {store}/objects/\w\w: Read-only file system; this user can only read the "
        rf"store \(status, pull, dashboard\): to claim or push, remount it read-write or fix its permissions\n",
        r.stderr), r.stderr
    r = rl(["pull", url, "--workdir", tmp_path / "wp", "--out", f"{ro}/copy"], env)
    assert (r.returncode, r.stderr) == (3, f"relay.py pull: error: --out {ro}/copy: Read-only file system; pass a "
                                           f"directory this user can write\n")
    real_open = open

    def unreadable_objects(path, *a, **k):  # another user's objects: a writable --out is no fix
        if str(path).startswith(store + os.sep + "objects"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr("builtins.open", unreadable_objects)
    r = rl(["pull", url, "--workdir", tmp_path / "wp", "--out", tmp_path / "copy"], env)
    assert r.returncode == 3 and r.stderr.startswith(f"relay.py pull: error: {url}: {store}/objects/") and \
        r.stderr.endswith("Permission denied; this user cannot read the store's files: fix their permissions\n")


def test_init_with_a_config_that_is_not_utf8_is_one_line(tmp_path):
    """A config file saved in Latin-1 (or a binary file passed by mistake) was a UnicodeDecodeError traceback."""
    cfg = tmp_path / "latin1.py"
    cfg.write_bytes("# caf\xe9\ngpu_hourly_usd = 2.0\n".encode("latin-1"))
    r = relay_cli(["init", f"file://{tmp_path}/store", cfg, "--workdir", tmp_path / "w"], base_env())
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().endswith(f"{cfg}: not UTF-8 text (byte 5: invalid continuation byte); save it as UTF-8")
    assert not (tmp_path / "store").exists()


def test_a_config_with_code_is_never_run(tmp_path, hub, rl):
    """train.py execs the run's config.py on every contributor's machine: a store's config.py that is more than
    data (a repo writer's `import os; os.system(...)`) is refused before anything runs, and init refuses one."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    marker = tmp_path / "PWNED"
    evil = f"gpu_hourly_usd = 2.0\nimport pathlib\npathlib.Path({str(marker)!r}).touch()\n"
    relay.commit_cas(store, snap.sha, {"config.py": evil.encode()}, [], "a test", snap.relay)
    r = rl(["run", url, "--steps", "2", "--train-script", write_fake_train(tmp_path), "--workdir", tmp_path / "wb"], env)
    assert r.returncode == 3 and "line 2: `import pathlib` is not plain data" in r.stderr, r.stderr
    assert not marker.exists()
    assert relay.Snapshot(store).relay["holder"] is None  # the claim was released
    cfg = write_config(tmp_path / "x", "batch_size = int('4')\n") if (tmp_path / "x").mkdir() is None else None
    r = rl(["init", f"file://{tmp_path}/store2", cfg, "--workdir", tmp_path / "wi"], env)
    assert r.returncode == 3 and "init refused" in r.stderr and "int('4')" in r.stderr, r.stderr


def test_a_store_config_cannot_set_a_shell_command_or_a_local_path(tmp_path, hub, rl):
    """A data-only config.py still ran code: on_stuck is a shell command the guardian runs (`relay.py run --supervise`
    trains under it) and mirror_dir a folder every contributor's trainer writes into; from the store, both refused
    (a contributor passes their own with --on_stuck= / --mirror_dir=), and init puts neither into config.py."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    marker = tmp_path / "PWNED"
    for i, line in enumerate([f"on_stuck = 'touch {marker}'", f"mirror_dir = {str(tmp_path / 'theirs')!r}"]):
        snap = relay.Snapshot(store)
        relay.commit_cas(store, snap.sha, {"config.py": f"gpu_hourly_usd = 2.0\n{line}\n".encode()}, [], "a test",
                         snap.relay)
        r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / f"wb{i}", "--supervise"],
               env)
        key = line.split()[0]
        assert r.returncode == 3 and f"sets {key}" in r.stderr and "--" + key in r.stderr, r.stderr
        assert relay.Snapshot(store).relay["holder"] is None and not (tmp_path / "theirs").exists()
    cfg = write_config(tmp_path / "x", "on_stuck = 'rm -rf data'\n") if (tmp_path / "x").mkdir() is None else None
    r = rl(["init", f"file://{tmp_path}/store2", cfg, "--workdir", tmp_path / "wi"], env)
    assert r.returncode == 3 and "init refused" in r.stderr and "sets on_stuck" in r.stderr, r.stderr
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "state.json").write_text(json.dumps({"config": {"on_stuck": "remount.sh", "batch_size": 4}}))
    text = relay.config_from_checkpoint(str(tmp_path / "ck"))
    assert "on_stuck" not in text and "batch_size = 4" in text


def test_trainer_failure_releases_and_pushes_nothing(tmp_path, hub, rl):
    url = store_url("file", tmp_path, hub)
    env = base_env()
    relay_cli = rl
    fake = init_run(url, tmp_path, env, cli=rl)
    r = relay_cli(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wa"],
                  dict(env, FAKE_TRAIN_FAIL="1"))
    os.environ.pop("FAKE_TRAIN_FAIL")
    assert r.returncode == 3 and "trainer exited with status 1" in r.stderr and "lease released" in r.stderr
    rows, snap = ledger_rows(relay.open_store(url))
    assert rows == [] and snap.relay["holder"] is None and snap.state["step"] == 0
    assert "nothing pushed (no checkpoint past the pulled step 0)" in r.stderr  # says why


def test_trainer_crash_after_checkpoints_pushes_the_newest(tmp_path, hub, rl):
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    r = rl(["run", url, "--steps", "20", "--train-script", fake, "--workdir", tmp_path / "wa"],
           dict(env, FAKE_CKPT_EVERY="5", FAKE_CRASH_AT_STEP="12"))
    os.environ.pop("FAKE_CKPT_EVERY"), os.environ.pop("FAKE_CRASH_AT_STEP")
    assert r.returncode == 3 and "trainer exited with status 1" in r.stderr and "step 10" in r.stderr, r.stderr
    assert "was pushed" in r.stderr and "lease released" in r.stderr
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert len(rows) == 1 and rows[0]["steps"] == 10 and snap.state["step"] == 10 and snap.relay["holder"] is None
    release_commit = json.load(open(store._p("commits", snap.sha + ".json")))  # the file store's records
    push_commit = json.load(open(store._p("commits", release_commit["parent"] + ".json")))
    assert push_commit["message"].endswith("steps 0-10 (trainer exited with status 1)")
    # the leg's log and the ledger's last loss stop at the pushed step (steps 11-12 are the next leg's to redo)
    leg_log = [json.loads(line) for line in store.read(snap.sha, "logs/leg-0001.jsonl").decode().splitlines()]
    assert max(m["step"] for m in leg_log) == 10 and rows[0]["loss_end"] == leg_log[-1]["loss"]
    # the next leg resumes from the pushed step
    r = rl(["run", url, "--steps", "3", "--train-script", fake, "--workdir", tmp_path / "wb"], env)
    assert r.returncode == 0, r.stderr
    assert relay.Snapshot(store).state["step"] == 13


def test_bad_lease_flags_and_workdir_are_refused_before_any_commit(tmp_path, hub, rl):
    """A claim committed before its LEASE.json could be written (--workdir a file) held the baton for its whole TTL
    with nothing able to release it; --heartbeat 0 renewed in a loop (1,449 commits in a 2 s leg); a negative
    --steps claimed and pulled before failing. All are one-line errors now, and the store is untouched."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    head = store.head()[0]
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, want in [(["claim", url, "--workdir", str(afile)], "--workdir"),
                       (["run", url, "--steps", "2", "--heartbeat", "0", "--train-script", fake], "--heartbeat 0"),
                       (["run", url, "--steps", "-5", "--train-script", fake], "--steps -5"),
                       (["claim", url, "--ttl", "1e9", "--heartbeat", "100", "--workdir", tmp_path / "wt"],
                        "at most 86400s"),
                       (["run", url, "--hours", "1", "--wait", "--poll", "-1", "--train-script", fake], "--poll -1")]:
        r = rl(argv, env)
        assert r.returncode == 3 and want in r.stderr and "Traceback" not in r.stderr, (argv, r.stderr)
        assert store.head()[0] == head, argv  # nothing committed: the baton is free
    r = rl(["status", f"file://{afile}"], env)  # a store URL naming a file
    assert r.returncode == 3 and "not a relay store" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_trainer_crash_whose_push_fails_still_releases(tmp_path, hub, rl, monkeypatch):
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)

    def refused(*a, **k):
        raise relay.StoreError("the store refused the commit (a test)")
    monkeypatch.setattr(relay, "commit_push", refused)
    r = rl(["run", url, "--steps", "20", "--train-script", fake, "--workdir", tmp_path / "wa"],
           dict(env, FAKE_CKPT_EVERY="5", FAKE_CRASH_AT_STEP="12"))
    assert r.returncode == 3 and "trainer exited with status 1" in r.stderr, r.stderr
    assert "pushing its newest checkpoint failed (the store refused" in r.stderr and "lease released" in r.stderr
    rows, snap = ledger_rows(relay.open_store(url))
    assert rows == [] and snap.relay["holder"] is None and snap.state["step"] == 0  # released, nothing half-pushed


def test_leg_whose_push_fails_keeps_the_lease_for_a_retry(tmp_path, hub, rl, monkeypatch):
    """A finished leg whose push the store fails (unreachable, refused) exists only locally: the run says so in one
    line and keeps the baton (a release would let the next contributor train again from the pulled step), and the
    `push` and `release` it names finish the leg."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    real = relay.commit_push

    def refused(*a, **k):
        raise relay.Transient("the store timed out (a test)")
    monkeypatch.setattr(relay, "commit_push", refused)
    r = rl(["run", url, "--steps", "4", "--train-script", fake, "--workdir", tmp_path / "wa"], env)
    assert r.returncode == 3 and "push failed: the store timed out (a test)" in r.stderr, r.stderr
    assert "it may have landed" in r.stderr and "lease stays yours" in r.stderr and "Traceback" not in r.stderr
    assert f"relay.py push {url} --workdir {tmp_path / 'wa'}" in r.stderr
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert rows == [] and snap.relay["holder"] and snap.state["step"] == 0  # held, nothing pushed
    monkeypatch.setattr(relay, "commit_push", real)
    assert rl(["push", url, "--workdir", tmp_path / "wa"], env).returncode == 0
    assert rl(["release", url, "--workdir", tmp_path / "wa"], env).returncode == 0
    rows, snap = ledger_rows(store)
    assert len(rows) == 1 and snap.state["step"] == 4 and snap.relay["holder"] is None


@pytest.mark.parametrize("fault", ["HTTP 503 (a test)", "No space left on device"])
def test_leg_whose_upload_fails_keeps_the_lease_for_a_retry(fault, tmp_path, hub, rl, monkeypatch):
    """The upload before the commit (store.stage: the checkpoint's big files) fails for longer than the client's own
    retries, or the file store's disk is full: the finished leg is kept with the baton, as when the commit fails (it
    was released, and redone). The retried push bills the trainer's time, not the wait until the retry."""
    import errno
    import relay_store
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    real = relay_store.FileStore.stage

    def failing(self, adds):  # the checkpoint's upload only (a commit stages its small files too)
        if any(p.startswith(relay.CKPT_PREFIX + "/") for p in adds):
            if fault.startswith("HTTP"):
                raise relay.Transient(fault)
            raise OSError(errno.ENOSPC, fault, "/store/disk")
        return real(self, adds)
    monkeypatch.setattr(relay_store.FileStore, "stage", failing)
    r = rl(["run", url, "--steps", "4", "--train-script", fake, "--workdir", tmp_path / "wa"], env)
    assert r.returncode == 3 and fault in r.stderr and "lease stays yours" in r.stderr, r.stderr
    assert "may have landed" not in r.stderr  # nothing was committed: an upload that failed cannot have landed
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert rows == [] and snap.relay["holder"] and snap.state["step"] == 0
    monkeypatch.setattr(relay_store.FileStore, "stage", real)
    leg_wall_s = json.load(open(tmp_path / "wa" / "LEASE.json"))["leg_wall_s"]
    time.sleep(1.5)  # the retry comes later: not billed
    assert rl(["push", url, "--workdir", tmp_path / "wa"], env).returncode == 0
    assert rl(["release", url, "--workdir", tmp_path / "wa"], env).returncode == 0
    rows, snap = ledger_rows(store)
    assert len(rows) == 1 and snap.state["step"] == 4 and snap.relay["holder"] is None
    assert rows[0]["wall"] == relay.fmt_wall(leg_wall_s)


def test_a_file_store_push_and_pull_say_how_far_a_big_file_is(tmp_path, monkeypatch, capsys):
    """A 30 GB checkpoint pushed to or pulled from a file:// store (hashed, copied) was minutes without a word; each
    long hash and copy now says how far it is in stderr lines (checkpoint.progress_lines)."""
    import relay_store
    monkeypatch.setattr(checkpoint, "PROGRESS_S", 0.0)  # (a line at every chunk: as a 30 GB copy's every 15 s)
    monkeypatch.setattr(checkpoint, "HASH_CHUNK", 1 << 20)  # the copies' pieces: three for this 3 MiB file
    big = tmp_path / "optimizer.pt"
    big.write_bytes(os.urandom(3 << 20))
    store = relay_store.FileStore(str(tmp_path / "store"))
    store.create()
    head = store.commit(store.head()[0], {"checkpoint/optimizer.pt": str(big)}, [], "push")
    err = capsys.readouterr().err
    assert re.search(rf"checkpoint: hashing {re.escape(str(big))}: [\d.]+ MiB of 3\.0 MiB \(\d+%\)", err), err
    assert re.search(rf"checkpoint: uploading {re.escape(str(big))}: [\d.]+ MiB of 3\.0 MiB", err), err
    store.download(head, ["checkpoint/optimizer.pt"], str(tmp_path / "pulled"))
    err = capsys.readouterr().err
    assert re.search(r"checkpoint: downloading checkpoint/optimizer\.pt: [\d.]+ MiB of 3\.0 MiB", err), err
    assert (tmp_path / "pulled" / "checkpoint" / "optimizer.pt").read_bytes() == big.read_bytes()


def test_a_file_store_upload_cut_short_leaves_no_partial_object(tmp_path, monkeypatch):
    """A Ctrl-C (or a full disk) while a push or init copied a file into a file:// store left its partial copy there
    for good (objects/ab/<sha>.tmp-PID-*: GBs of a checkpoint, nothing ever removed it); now it is removed."""
    import relay_store
    monkeypatch.setattr(checkpoint, "HASH_CHUNK", 1 << 20)
    big = tmp_path / "optimizer.pt"
    big.write_bytes(os.urandom(3 << 20))
    store = relay_store.FileStore(str(tmp_path / "store"))
    store.create()
    real_progress = checkpoint.progress_lines

    def ctrl_c_mid_copy(what, total):  # the copy's report after its first piece: a Ctrl-C there
        report = real_progress(what, total)

        def cut(done):
            if what.startswith("uploading") and done >= 1 << 20:
                raise KeyboardInterrupt
            report(done)
        return cut
    monkeypatch.setattr(checkpoint, "progress_lines", ctrl_c_mid_copy)
    head = store.head()[0]
    with pytest.raises(KeyboardInterrupt):
        store.commit(head, {"checkpoint/optimizer.pt": str(big)}, [], "push")
    assert [str(p) for p in (tmp_path / "store" / "objects").rglob("*")
            if p.is_file() and ".tmp-" in p.name] == [] and store.head()[0] == head
    monkeypatch.setattr(checkpoint, "progress_lines", real_progress)
    store.commit(head, {"checkpoint/optimizer.pt": str(big)}, [], "push")  # the retry lands


def test_a_file_store_create_cut_short_is_finished_by_the_next_init(tmp_path, monkeypatch):
    """A Ctrl-C or kill while `relay.py init` created a file:// store, after its marker and before its first commit,
    left a folder every later init refused ("not an empty directory nor a relay store; pick a new path")."""
    import relay_store
    store = relay_store.FileStore(str(tmp_path / "store"))
    real = relay_store.FileStore._write_commit

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(relay_store.FileStore, "_write_commit", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        store.create()
    monkeypatch.setattr(relay_store.FileStore, "_write_commit", real)
    assert not store.exists() and os.listdir(tmp_path / "store")
    store.create()
    assert store.exists() and store.list(store.head()[0]) == []
    other = tmp_path / "other"  # a folder of someone else's files is refused as before
    other.mkdir()
    (other / "STORE").write_text("mine")
    with pytest.raises(relay_store.StoreError, match="not an empty directory nor a relay store"):
        relay_store.FileStore(str(other)).create()


def test_push_that_landed_unseen_is_found_by_the_retry(tmp_path, hub, rl, monkeypatch):
    """The store takes the push but fails every reply (unknown whether it landed): the named `push` finds it by its
    write_id instead of being fenced off by our own commit, and `release` hands the baton back (both failed, and
    nobody could claim until the ttl ran out). A disk that fails the commit is one line, not a traceback."""
    import errno
    import relay_store
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    real = relay.commit_cas

    def landed_unseen(*a, **k):
        if "steps" not in a[4]:  # the push's commit only
            return real(*a, **k)
        real(*a, **k)
        raise relay.Transient("the store stayed unreachable, so it is unknown whether the commit landed")
    monkeypatch.setattr(relay, "commit_cas", landed_unseen)
    r = rl(["run", url, "--steps", "4", "--train-script", fake, "--workdir", tmp_path / "wa"], env)
    assert r.returncode == 3 and "it may have landed" in r.stderr, r.stderr
    monkeypatch.setattr(relay, "commit_cas", real)
    p = rl(["push", url, "--workdir", tmp_path / "wa"], env)
    assert p.returncode == 0 and "the earlier push had landed" in p.stdout, p.stderr
    q = rl(["release", url, "--workdir", tmp_path / "wa"], env)
    assert q.returncode == 0, q.stderr
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert len(rows) == 1 and snap.state["step"] == 4 and snap.relay["holder"] is None
    # the next leg: the store's disk fails the push's commit
    real_write = relay_store.FileStore._write_commit

    def full(self, parent, tree, message):
        if "steps" in message:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, parent, tree, message)
    monkeypatch.setattr(relay_store.FileStore, "_write_commit", full)
    r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wb"], env)
    assert r.returncode == 3 and "No space left on device" in r.stderr and "lease stays yours" in r.stderr, r.stderr


def test_a_hub_that_never_answers_times_out(monkeypatch):
    """huggingface_hub's client waits forever by default: a lease renewal in a dead connection hung `relay.py run`
    for good. Requests time out (relay_store.HTTP_TIMEOUT_S) as a Transient, which the callers retry or report."""
    import socket
    import threading
    import relay_store
    from huggingface_hub.utils import _http
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held = []
    threading.Thread(target=lambda: [held.append(srv.accept()) for _ in iter(int, 1)], daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.getsockname()[1]}")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(relay_store, "HTTP_TIMEOUT_S", 0.5)
    store = relay_store.open_store("hf://alice/run")
    _http.close_session()  # the next request makes a client with this test's timeout
    try:
        for call in (store.head, lambda: store.read("a" * 40, "RELAY.json")):
            t0 = time.time()
            with pytest.raises(relay.Transient, match="Timeout"):
                call()
            assert time.time() - t0 < 30
    finally:
        _http.close_session()
        srv.close()


def test_a_locked_repo_is_transient(tmp_path, hub, hf_env):
    """HTTP 409 (the repo locked by another commit in progress: ours did not land) is retried, not fatal (`run --wait`
    quit on it)."""
    url = "hf://alice/run"
    init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    store = relay.open_store(url)
    sha = store.head()[0]
    hub.status_override = 409
    try:
        with pytest.raises(relay.Transient, match="409"):
            store.commit(sha, {"x.txt": b"1"}, [], "a test")
    finally:
        hub.status_override = None
    assert store.head()[0] == sha


def test_a_retry_refused_by_our_own_late_commit_is_success(tmp_path):
    """A commit whose reply is lost (a gateway 504) lands only after commit_cas looked: the retry is refused
    because the head moved, by our own commit. Its write_id says so; it was reported as fenced (a ghost lease)."""
    import relay_store

    class LateLanding(relay_store.FileStore):
        pending, seen = None, False

        def commit(self, parent, adds, deletes, message):
            if self.pending is None:
                self.pending = (parent, adds, deletes, message)
                raise relay.Transient("HTTP 504 (a test)")
            return super().commit(parent, adds, deletes, message)

        def head(self):
            h = super().head()
            if self.pending and not self.seen:  # the re-check sees the old head; then the server lands our commit
                self.seen = True
                super().commit(*self.pending)
            return h
    store = LateLanding(str(tmp_path / "store"))
    store.create()
    parent = store.head()[0]
    sha, rel = relay.commit_cas(store, parent, {"x": b"1"}, [], "m", {"holder": "alice"})
    assert sha == store.head()[0] and store.read(sha, "x") == b"1"
    assert json.loads(store.read(sha, "RELAY.json"))["write_id"] == rel["write_id"]
    # someone else's commit landing in that gap is still a conflict
    other = LateLanding(str(tmp_path / "store"))
    other.pending = (sha, {"RELAY.json": b'{"write_id": "theirs"}'}, [], "theirs")
    real_commit = relay_store.FileStore.commit
    first = [True]

    def lost_reply(self, parent, adds, deletes, message):
        if first[0]:
            first[0] = False
            raise relay.Transient("HTTP 504 (a test)")  # ours never landed
        return real_commit(self, parent, adds, deletes, message)
    other.commit = lost_reply.__get__(other)
    with pytest.raises(relay.Conflict):
        relay.commit_cas(other, sha, {"z": b"3"}, [], "m", {"holder": "bob"})
    assert json.loads(other.read(other.head()[0], "RELAY.json"))["write_id"] == "theirs"


def test_real_train_py_init_decay_and_leg(tmp_path, rl, local_corpus, monkeypatch):
    """The real train.py under relay (and under the guardian, --supervise): init writes the step-0 checkpoint, a decay
    request reaches the next leg through control.json, the leg's checkpoint is pushed, pulled, verified and loads
    with model.load_checkpoint."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RELAY_WHO", "tester")
    url = f"file://{tmp_path}/store"
    tiny = ["--vocab_size=320", "--n_layer=3", "--d_model=32", "--n_head=4", "--n_kv_head=1", "--dense_ffn=64",
            "--n_experts=8", "--expert_ffn=16", "--n_shared=1", "--max_seq_len=64", "--batch_size=4", "--seq_len=32",
            "--log_interval=1", "--eval_iters=2", "--eval_interval=2", "--max_iters=40",
            "--warmup_iters=2", f"--data_root={local_corpus}", "--gpu_hourly_usd=3600.0"]
    # the trainer's own lines (its stdout is relay's) name relay.py's next step, not a train.py resume of a dir
    # relay deletes or pushes; init's step-0 model prints no sample (noise), a leg's does
    r = relay_cli(["init", url, os.path.join(ROOT, "config", "tiny.py"), *tiny, "--workdir", tmp_path / "w0"], base_env())
    assert r.returncode == 0, r.stderr
    assert "relay.py init commits this checkpoint as the run's start" in r.stdout and "sample:" not in r.stdout
    assert f"`python relay.py run {url} --hours H`" in r.stdout and "--init_from=resume" not in r.stdout + r.stderr
    assert rl(["decay", url]).returncode == 0
    r = relay_cli(["run", url, "--steps", "3", "--workdir", tmp_path / "wa", "--device=cpu", "--supervise"], base_env())
    assert r.returncode == 0, r.stderr
    assert f"a leg of the relay run {url}: relay.py pushes it" in r.stdout, r.stdout
    assert "sample:" in r.stdout and "--init_from=resume" not in r.stdout + r.stderr
    g = json.load(open(tmp_path / "wa" / "leg-0001-gen1" / "guardian.json"))  # the leg ran under the guardian
    assert g["status"] == "done (the leg's limit)" and len(g["starts"]) == 1 and g["starts"][0]["checkpoint_step_at_end"] == 3
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert [(x["leg"], x["step_range"], x["steps"], x["tokens"]) for x in rows] == [(1, "0-3", 3, 3 * 4 * 32)]
    assert rows[0]["loss_start"] > rows[0]["loss_end"] > 0 and rows[0]["usd"] > 0 and rows[0]["gpu"] == "cpu"
    assert snap.state["step"] == 3 and snap.state["decay_requested"] is False
    assert snap.state["decay_started_at_tokens"] is not None  # the trainer took the flag from control.json
    assert snap.state["plan"][-1]["lr_phase"] == "decay"
    # status names the stage (state.json holds no "stage": it always said None)
    assert relay.status_dict(store)["stage"] == relay.schedule.stage_at(snap.state["plan"], 3 * 4 * 32)[1]["name"]
    assert relay.stage_name({"plan": snap.state["plan"], "tokens": 10 ** 12}) == "finished"
    assert snap.state["stage"] == relay.status_dict(store)["stage"]  # training_state.json names it too (DESIGN.md)
    ck = relay.pull(store, str(tmp_path / "pulled"))
    man = checkpoint.verify(ck)
    assert {"model.safetensors", "state.json", "tokenizer.json"} <= set(man["files"])
    from model import load_checkpoint
    model = load_checkpoint(ck)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_manual_claim_pull_train_push_release(tmp_path, hub, rl):
    """The step-by-step commands: claim, pull (into a leg dir), train by hand, push, release."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    wd = tmp_path / "wm"
    assert rl(["claim", url, "--workdir", wd, "--ttl", "60", "--heartbeat", "20"]).returncode == 0
    r = rl(["claim", url, "--workdir", tmp_path / "other"], dict(env, RELAY_WHO="eve"))
    assert r.returncode == 3 and "tester holds the baton" in r.stderr
    r = rl(["pull", url, "--workdir", wd])
    assert r.returncode == 0, r.stderr
    leg = wd / "leg-0001-gen1"
    assert (leg / "step_0000000" / "MANIFEST.json").is_file() and (leg / "relay_config.py").is_file()
    t = subprocess.run([sys.executable, fake, str(leg / "relay_config.py"), f"--out_dir={leg}", "--init_from=resume",
                        "--stop_after_steps=6"], env=env, capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    before_push = time.time()
    r = rl(["push", url, "--workdir", wd, "--gpu-hourly-usd", "1.5"])
    assert r.returncode == 0, r.stderr
    # the push says its ledger row in words (it printed the raw markdown row)
    said = [x for x in r.stdout.splitlines() if x.startswith("relay: pushed ")]
    assert len(said) == 1 and "|" not in said[0] and ": leg 1 by tester on " in said[0], r.stdout
    assert ", steps 0-6 (6 steps, " in said[0] and " tokens) in 0h" in said[0] and "; loss " in said[0], said
    # a second push in the same lease bills its own time, not the pull's again (the ledger's wall and $ doubled)
    assert json.load(open(wd / "LEASE.json"))["pulled_at"] >= before_push
    assert rl(["release", url, "--workdir", wd]).returncode == 0
    r = rl(["release", url, "--workdir", wd])
    assert r.returncode == 3 and "no lease held" in r.stderr
    rows, snap = ledger_rows(relay.open_store(url))
    assert [(x["leg"], x["who"], x["step_range"]) for x in rows] == [(1, "tester", "0-6")]
    assert snap.relay["holder"] is None and snap.relay["leg"] == 2 and snap.state["step"] == 6


def solo_run(tmp_path, env, steps):
    """The stand-in trainer's own run (no relay) of `steps` steps in tmp_path/solo: (fake trainer, run dir)."""
    fake = write_fake_train(tmp_path)
    out = tmp_path / "solo"
    t = subprocess.run([sys.executable, fake, "cfg.py", f"--out_dir={out}", "--init_from=scratch",
                        f"--stop_after_steps={steps}"], env=env, capture_output=True, text=True, timeout=60)
    assert t.returncode == 0, t.stderr
    return fake, out


def saved_with_config(out, step, config, **state):
    """Step `step` of run dir `out` saved again with `config` as its state.json's "config" (and the `state` fields
    given); its path."""
    d = out / checkpoint.step_dir_name(step)
    st = dict(json.load(open(d / "state.json")), config=config, **state)
    blobs = {n: open(d / n, "rb").read() for n in ("model.safetensors", "optimizer.pt", "tokenizer.json")}
    return save_fake_checkpoint(out, step, blobs.pop("model.safetensors"), state=st, more=blobs)


def test_init_from_existing_checkpoint(tmp_path, hub, rl, monkeypatch):
    env = base_env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake, out = solo_run(tmp_path, env, 5)
    url = f"file://{tmp_path}/store"
    r = rl(["init", url, "--from-checkpoint", out, "--workdir", tmp_path / "w0"])
    assert r.returncode == 3 and "has no \"config\"" in r.stderr and not os.path.exists(tmp_path / "store")
    ck = saved_with_config(out, 5, {"n_layer": 3, "out_dir": "elsewhere", "learning_rate": 0.003, "stages": []})
    r = rl(["init", url, "--from-checkpoint", ck, "--workdir", tmp_path / "w0"])
    assert r.returncode == 0, r.stderr
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    cfg = store.read(snap.sha, "config.py").decode()
    assert "n_layer = 3" in cfg and "learning_rate = 0.003" in cfg and "out_dir" not in cfg
    assert snap.state["step"] == 5 and snap.state["legs"] == 0
    r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wa"])
    assert r.returncode == 0, r.stderr
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["5-7"]


TINY_RELAY = ["--device=cpu", "--dtype=float32", "--compile=False", "--vocab_size=320", "--n_layer=3", "--d_model=32",
              "--n_head=4", "--n_kv_head=1", "--dense_ffn=64", "--n_experts=8", "--expert_ffn=16", "--n_shared=1",
              "--max_seq_len=64", "--batch_size=4", "--seq_len=32", "--sample_tokens=0", "--log_interval=1",
              "--eval_iters=2"]


@pytest.fixture(scope="module")
def local_corpus(tmp_path_factory):
    """data_root of a tiny offline corpus (the stdlib's json package, vocab 320) for the real train.py."""
    import sysconfig
    root = tmp_path_factory.mktemp("data")
    r = subprocess.run([sys.executable, "data/local/prepare.py", "--src", os.path.join(sysconfig.get_paths()["stdlib"], "json"),
                        "--out", str(root / "local"), "--vocab-size", "320", "--val-percent", "20"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return root


def test_init_from_an_sft_checkpoint_trains_its_legs(tmp_path, rl, local_corpus, monkeypatch):
    """config/sft.py's relay recipe: its step-0 checkpoint, then `init --from-checkpoint`. The config.py made from
    the checkpoint set max_iters, warmup_iters and decay_frac beside the stages, which train.py refuses: every leg
    exited 1."""
    import torch
    from model import ModelConfig, Picaflor, save_checkpoint
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RELAY_WHO", "tester")
    torch.manual_seed(0)
    save_checkpoint(Picaflor(ModelConfig(vocab_size=320, n_layer=3, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=1,
                                         dense_ffn=64, n_experts=8, expert_ffn=16, n_shared=1, max_seq_len=64)),
                    str(tmp_path / "src"), 10)
    sft = tmp_path / "sft"
    t = forkserver.run(["train.py", "config/sft.py", *TINY_RELAY, f"--data_root={local_corpus}", "--dataset=local",
                        f"--finetune_from={tmp_path / 'src'}", f"--out_dir={sft}", "--stop_after_steps=0"], cwd=ROOT)
    assert t.returncode == 0, t.stderr
    url = f"file://{tmp_path}/store"
    assert rl(["init", url, "--from-checkpoint", sft, "--workdir", tmp_path / "w0"]).returncode == 0
    r = rl(["run", url, "--steps", "1", "--workdir", tmp_path / "wa"])
    assert r.returncode == 0, r.stderr
    assert relay.Snapshot(relay.open_store(url)).state["step"] == 1


@pytest.mark.parametrize("mode", ["grow", "finetune"])
def test_init_grows_or_finetunes_the_configs_source(mode, tmp_path, rl, local_corpus, monkeypatch):
    """`relay init` with config/grow.py or config/sft.py: the run's first checkpoint is the grown / fine-tuned source
    (init always ran train.py --init_from=scratch, which refused grow_from with advice init could not take), and a leg
    resumes it."""
    import torch
    from model import ModelConfig, Picaflor, load_checkpoint, save_checkpoint
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RELAY_WHO", "tester")
    torch.manual_seed(0)
    src = Picaflor(ModelConfig(vocab_size=320, n_layer=3, n_dense_layers=1, d_model=32, n_head=4, n_kv_head=1,
                               dense_ffn=64, n_experts=8, expert_ffn=16, n_shared=1, max_seq_len=64, tie_embeddings=True))
    save_checkpoint(src, str(tmp_path / "src"), 10)
    url = f"file://{tmp_path}/store"
    cfg, flags = (("grow.py", ["--init_from=grow", f"--grow_from={tmp_path / 'src'}", "--grow_layers=2"]) if mode == "grow" else
                  ("sft.py", [f"--finetune_from={tmp_path / 'src'}", "--dataset=local"]))
    r = rl(["init", url, os.path.join(ROOT, "config", cfg), *TINY_RELAY, f"--data_root={local_corpus}", *flags,
            "--workdir", tmp_path / "w0"])
    assert r.returncode == 0, r.stderr
    store = relay.open_store(url)
    got = load_checkpoint(relay.pull(store, str(tmp_path / "pulled")))
    assert got.cfg.n_layer == (5 if mode == "grow" else 3)
    idx = torch.randint(1, 320, (2, 16))
    with torch.no_grad():  # grown blocks start as identity; a fine-tune starts from the source's weights
        assert torch.equal(src.eval()(idx), got.eval()(idx))
    assert relay.Snapshot(store).state["step"] == 0
    r = rl(["run", url, "--steps", "1", "--workdir", tmp_path / "wa"])
    assert r.returncode == 0, r.stderr
    assert load_checkpoint(relay.pull(store, str(tmp_path / "pulled2"))).cfg.n_layer == got.cfg.n_layer


KILLED_TRAINER = r'''
import os, signal, subprocess, sys, time
# the real train.py, stalled after step SLEEP_AT (its row logged), then it and this script are SIGKILLed
p = subprocess.Popen([sys.executable, os.path.join(os.environ["PICAFLOR_ROOT"], "train.py")] + sys.argv[1:],
                     env=dict(os.environ, PICAFLOR_INJECT_SLEEP_AT_STEP=os.environ["SLEEP_AT"]))
rows = os.path.join(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir=")), "metrics.jsonl")
row = '{"step": %s,' % os.environ["SLEEP_AT"]
try:  # (a stalled train.py left behind slept for 11 days)
    while p.poll() is None and not (os.path.exists(rows) and any(x.startswith(row) for x in open(rows))):
        time.sleep(0.02)
finally:
    p.kill()
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_relay_legs_train_exactly_as_one_run(tmp_path, rl, local_corpus, monkeypatch):
    """A run trained as relay legs (one killed after a checkpoint, its lost steps redone; a leg boundary on an
    evaluation step, one on a stage boundary where seq_len changes; evaluations inside legs; keep_last=1 pruning the
    pulled step) ends bit for bit as the same config trained by train.py in one go: weights, optimizer, tokenizer,
    state.json (data positions, rng, log window, best val loss) and the metrics rows in the store's leg logs."""
    import torch
    from safetensors.torch import load_file
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RELAY_WHO", "tester")
    cfg = tmp_path / "cfg.py"
    cfg.write_text("dataset = 'local'\nstages = [dict(name='warmup', steps=2, lr_phase='warmup'), dict(name='stable', "
                   "steps=5, lr_phase='stable'), dict(name='decay', steps=5, lr_phase='decay', seq_len=16)]\n")
    flags = [*TINY_RELAY, f"--data_root={local_corpus}", "--log_interval=3", "--eval_interval=4",
             "--ckpt_interval=100", "--keep_last=1"]
    solo = subprocess.Popen([sys.executable, "train.py", str(cfg), *flags, f"--out_dir={tmp_path / 'solo'}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # beside the legs: 2 cores
    url = f"file://{tmp_path}/store"
    r = rl(["init", url, cfg, *flags, "--workdir", tmp_path / "w0"])
    assert r.returncode == 0, r.stderr
    killed = tmp_path / "killed_trainer.py"
    killed.write_text(KILLED_TRAINER)
    # leg 1 trains 0..6 and is killed at step 6: its newest checkpoint, step 4 (the evaluation's best), is pushed
    r = rl(["run", url, "--steps", "8", "--workdir", tmp_path / "w1", "--train-script", killed],
           {"SLEEP_AT": 6, "PICAFLOR_ROOT": ROOT})
    assert r.returncode == 3 and "its newest checkpoint (step 4) was pushed" in r.stderr, r.stderr
    for n, steps in ((2, 3), (3, 9)):  # 4..7 (the stable stage's end), 7..12 (the plan's end)
        r = rl(["run", url, "--steps", steps, "--workdir", tmp_path / f"w{n}"])
        assert r.returncode == 0, r.stderr
    store = relay.open_store(url)
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["0-4", "4-7", "7-12"]
    assert solo.wait(timeout=120) == 0, solo.stderr.read()
    one, legs = checkpoint.resolve(str(tmp_path / "solo")), relay.pull(store, str(tmp_path / "pulled"))
    assert os.path.basename(one) == os.path.basename(legs) == "step_0000012"
    a, b = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(legs, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the router biases too (buffers)
    for name in ("optimizer.pt", "tokenizer.json"):
        assert open(os.path.join(one, name), "rb").read() == open(os.path.join(legs, name), "rb").read(), name
    sa, sb = (json.load(open(os.path.join(d, "state.json"))) for d in (one, legs))
    wall = {"created_at", "elapsed_seconds", "save_seconds", "config"}  # config: out_dir, init_from, stop_after_steps
    assert {k for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k)} <= wall
    assert sb["data_position"] and sb["rng"] and sb["log_window"]["log_interval"] == 3 and sb["best_step"] is not None
    assert {k for k in sa["config"] if sa["config"][k] != sb["config"][k]} == {"out_dir", "init_from",
                                                                               "stop_after_steps"}
    head = store.head()[0]
    logged = [json.loads(x) for p in store.list(head, "logs/") for x in store.read(head, p).decode().splitlines()]
    one_go = {m["step"]: m for m in map(json.loads, open(tmp_path / "solo" / "metrics.jsonl"))}
    clock = ("elapsed_s", "time", "tok_per_s", "mfu")
    for m in logged:  # each step logged once; a leg's first step (5, 8) is logged only because a leg starts there
        if m["step"] in one_go:
            assert {k: v for k, v in m.items() if k not in clock} == {
                k: v for k, v in one_go[m["step"]].items() if k not in clock}, m["step"]
    assert [m["step"] for m in logged] == sorted(set(one_go) | {5, 8})
    assert [m["step"] for m in logged if "val_loss" in m] == [4, 8, 12]


def test_init_start_refusals_are_followable(tmp_path, rl):
    """A grow / finetune source is checked before the store is touched; init_from=resume names --from-checkpoint;
    a leg's run refuses the start keys and names init, which takes them (train.py's advice: add --init_from=grow)."""
    env = base_env()
    fake = write_fake_train(tmp_path)
    url = f"file://{tmp_path}/store"
    cases = [("init_from = 'grow'\ngrow_from = 'nowhere'\ngrow_layers = 2\n", "grow_from=nowhere: "),
             ("init_from = 'finetune'\n", "needs finetune_from=CHECKPOINT"),
             ("init_from = 'resume'\n", "use --from-checkpoint DIR")]
    for text, said in cases:
        r = rl(["init", url, write_config(tmp_path, text), "--train-script", fake, "--workdir", tmp_path / "w0"], env)
        assert r.returncode == 3 and said in r.stderr and not os.path.exists(tmp_path / "store"), r.stderr
    _, out = solo_run(tmp_path, env, 0)  # a source to grow (the stand-in trainer: only the source's check is real)
    r = rl(["init", url, write_config(tmp_path), "--from-checkpoint", out, "--workdir", tmp_path / "w0",
            f"--grow_from={out}"], env)
    assert r.returncode == 3 and "--grow_from with --from-checkpoint" in r.stderr, r.stderr
    # so does a config file that grows or fine-tunes, given with a checkpoint of a base run: the run started from it as
    # it was, and each leg refused the config's plan with advice (--replan) that would fine-tune on the pretraining's
    # step, tokens and AdamW moments
    base = saved_with_config(out, 0, {"init_from": "scratch", "finetune_from": ""}, layer_origin=["new"] * 3)
    for text, mode in (("init_from = 'finetune'\nfinetune_from = 'out/nano'\n", "fine-tune"),
                       ("init_from = 'grow'\ngrow_from = 'out/nano'\ngrow_layers = 2\n", "grow")):
        r = rl(["init", url, write_config(tmp_path, text), "--from-checkpoint", base, "--workdir", tmp_path / "w0"], env)
        assert r.returncode == 3 and f"drop --from-checkpoint to {mode} it" in r.stderr, r.stderr
        assert not os.path.exists(tmp_path / "store")
    # a checkpoint of the fine-tuned (grown) run itself is what --from-checkpoint is for (config/sft.py's recipe)
    for text, st in (("init_from = 'finetune'\nfinetune_from = 'out/nano'\n",
                      ({"init_from": "resume", "finetune_from": "out/nano"}, ["new"] * 3)),
                     ("init_from = 'grow'\ngrow_from = 'out/nano'\ngrow_layers = 1\n",
                      ({"init_from": "resume"}, ["old", "new", "old"]))):
        tuned = saved_with_config(out, 0, st[0], layer_origin=st[1])
        r = rl(["init", url, write_config(tmp_path, text), "--from-checkpoint", tuned, "--workdir", tmp_path / "w0"],
               env)
        assert r.returncode == 0, r.stderr
        shutil.rmtree(tmp_path / "store")
    r = rl(["init", url, write_config(tmp_path, f"init_from = 'grow'\ngrow_from = '{out}'\ngrow_layers = 1\n"),
            "--train-script", fake, "--workdir", tmp_path / "w0"], env)
    assert r.returncode == 0, r.stderr
    r = rl(["run", url, "--steps", "1", "--train-script", fake, "--workdir", tmp_path / "wa", "--grow_from=x"], env)
    assert r.returncode == 2 and "given to `relay.py init` only" in r.stderr


def test_ctrl_c_ends_the_leg_cleanly(tmp_path, hub):
    """SIGINT to `relay run` (a volunteer's Ctrl-C): the trainer checkpoints, the leg is pushed, the baton released."""
    url = store_url("file", tmp_path, hub)
    env = base_env({"FAKE_STEP_S": "0.03"})
    fake = init_run(url, tmp_path, env)
    p = start_run(url, tmp_path, env, tmp_path / "wa", fake, 100000, 30, 10)
    leg = tmp_path / "wa" / "leg-0001-gen1"
    wait_for(lambda: checkpoint.latest_valid(str(leg)) and checkpoint.latest_valid(str(leg)).endswith("0000005"), 20, "training")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert "released the baton (SIGINT)" in out
    rows, snap = ledger_rows(relay.open_store(url))
    assert len(rows) == 1 and rows[0]["steps"] >= 5 and snap.relay["holder"] is None
    assert snap.state["step"] == rows[0]["steps"]


def test_a_hangup_with_its_terminal_gone_ends_the_leg_cleanly(tmp_path, hub):
    """SIGHUP to `relay run` (an ssh session without tmux dropped) killed relay: nothing pushed, the lease left to
    expire. Now as SIGTERM: the trainer checkpoints, the leg is pushed, the baton released; its terminal gone (here
    pipes nobody reads), relay's lines go to relay.log in the workdir instead of failing (EPIPE / EIO)."""
    url = store_url("file", tmp_path, hub)
    env = base_env({"FAKE_STEP_S": "0.03"})
    fake = init_run(url, tmp_path, env)
    p = start_run(url, tmp_path, env, tmp_path / "wa", fake, 100000, 30, 10)
    leg = tmp_path / "wa" / "leg-0001-gen1"
    wait_for(lambda: ckpt_step(leg) >= 5, 20, "training")
    p.stdout.close()
    p.stderr.close()
    p.send_signal(signal.SIGHUP)
    rc, log = p.wait(timeout=30), tmp_path / "wa" / "relay.log"
    assert rc == 0 and "released the baton (SIGHUP)" in log.read_text(), (rc, log.is_file() and log.read_text())
    rows, snap = ledger_rows(relay.open_store(url))
    assert len(rows) == 1 and rows[0]["steps"] >= 5 and snap.relay["holder"] is None
    assert snap.state["step"] == rows[0]["steps"]


def test_a_pipe_that_died_without_a_hangup_ends_no_release(tmp_path, hub):
    """`ssh host relay.py run ... | tee log` and tee died (no SIGHUP): relay's "pushed" line, printed before the
    release, raised EPIPE and ended relay with the lease left to expire for a ttl. (Unbuffered, as `python -u`: lines
    show live.)"""
    url = store_url("file", tmp_path, hub)
    env = base_env({"FAKE_STEP_S": "0.03", "PYTHONUNBUFFERED": "1"})
    fake = init_run(url, tmp_path, env)
    p = start_run(url, tmp_path, env, tmp_path / "wa", fake, 20, 30, 10)
    wait_for(lambda: ckpt_step(tmp_path / "wa" / "leg-0001-gen1") >= 5, 20, "training")  # before the leg ends
    p.stdout.close()
    rc, err = p.wait(timeout=30), p.stderr.read()
    p.stderr.close()
    rows, snap = ledger_rows(relay.open_store(url))
    assert rc == 0 and len(rows) == 1 and rows[0]["steps"] == 20 and snap.relay["holder"] is None, (rc, err)


def lost_answers_store(path):
    """A file store whose next commit with drop_answer_of in its message lands but answers 504, and whose next 20
    head reads then answer 503: the store went dark right after our commit (its outcome unknown to relay)."""
    import relay_store

    class LostAnswers(relay_store.FileStore):
        dark_heads, drop_answer_of = 0, None

        def commit(self, parent, adds, deletes, message):
            sha = super().commit(parent, adds, deletes, message)
            if self.drop_answer_of and self.drop_answer_of in message:
                self.drop_answer_of, self.dark_heads = None, 20
                raise relay.Transient("HTTP 504 (a test)")
            return sha

        def head(self):
            if self.dark_heads > 0:
                self.dark_heads -= 1
                raise relay.Transient("HTTP 503 (a test)")
            return super().head()
    return LostAnswers(path)


def test_a_renewal_whose_answer_was_lost_is_ours_not_a_fence(tmp_path, no_backoff):
    """A heartbeat lands, then the store answers nothing long enough that relay cannot tell: the next renewal was
    refused (the head moved: by that heartbeat) and taken for another contributor's claim, which stopped the leg
    and left a ghost holder. Its write_id, recorded first, says it was ours; `claim` from the same workdir finds
    its own landed renewal or push too (it was "busy" against itself), and renews its own lease after the ttl
    when nobody took the baton meanwhile (the leg's work was dropped for a new generation)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    store.drop_answer_of = "heartbeat"
    with pytest.raises(relay.Transient, match="unknown whether the commit landed"):
        relay.renew(store, lease)
    store.dark_heads = 0
    relay.renew(store, lease)  # was: Fenced ("another contributor took the baton")
    assert lease.sha == store.head()[0] and lease.generation == relay.Snapshot(store).relay["generation"]
    store.drop_answer_of = "heartbeat"
    with pytest.raises(relay.Transient):
        relay.renew(store, lease)
    store.dark_heads = 0
    again = relay.claim(store, work, "alice", ttl=60, heartbeat=20)  # was: Busy, "alice holds the baton"
    assert (again.generation, again.leg) == (lease.generation, lease.leg) and again.sha == store.head()[0]
    # a push that landed unseen (LEASE.json still names it pending): claim moves on to it, not "busy"
    back = again
    run_dir = relay.prepare_leg(store, back, work)
    save_fake_checkpoint(run_dir, 3, "w")
    plan = relay.prepare_push(store, back, run_dir, wall_s=1)
    saved, leg = dict(json.load(open(back.path))), back.leg
    relay.commit_push(store, back, plan, run_dir)
    pending_id = json.loads(store.read(store.head()[0], "RELAY.json"))["write_id"]
    json.dump(dict(saved, pending_push={"write_id": pending_id, "step": 3}), open(back.path, "w"))  # crashed then
    after = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    assert after.leg == leg + 1 and after.base_step == 3 and after.sha == store.head()[0]
    # past the ttl, nobody else took it: the same workdir renews its own lease (same generation and leg)
    relay.release(store, after)
    short = relay.claim(store, work, "alice", ttl=1.0, heartbeat=0.25)
    time.sleep(2.2)  # expired (the store's clock has 1 s resolution)
    assert not relay.Snapshot(store).held
    resumed = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    assert (resumed.generation, resumed.leg) == (short.generation, short.leg)


def test_the_heartbeat_deadline_counts_from_the_request(tmp_path, monkeypatch):
    """A renewal that lands but whose answer takes seconds: the lease's clock (the store's) started when it landed,
    not when the answer came back; counting from the answer, a holder trained on while another could claim."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=6, heartbeat=0.5)
    real = relay.renew

    def slow_answer(store_, lease_, **kw):
        real(store_, lease_, **kw)
        time.sleep(1.0)
    monkeypatch.setattr(relay, "renew", slow_answer)
    hb = relay.Heartbeat(store, lease, lambda: None)
    t0 = relay.lease_clock()
    hb.start()
    wait_for(lambda: hb.last_ok > t0, 10, "a renewal")
    hb.stop.set()
    hb.join()
    assert relay.lease_clock() - hb.last_ok >= 0.9 and not hb.failed


def test_an_overdue_heartbeat_stops_the_trainer_but_still_pushes(tmp_path, rl, monkeypatch):
    """The store was slow (a renewal took longer than the lease's deadline) but nobody took the baton: the trainer
    is stopped (it may not train on an expired lease), and its checkpoint is still pushed, by compare-and-swap, and
    the baton released; it was thrown away with the baton left held."""
    url = store_url("file", tmp_path, None)
    env = base_env({"FAKE_STEP_S": "0.05"})
    fake = init_run(url, tmp_path, env, cli=rl)
    real, slow = relay.renew, [True]

    def renew_once_slow(store_, lease_, **kw):
        real(store_, lease_, **kw)
        if slow and lease_.run_dir:  # the trainer's heartbeat, not the pull's
            slow.clear()
            time.sleep(3.0)  # past ttl - ttl/5 of the 3 s lease
    monkeypatch.setattr(relay, "renew", renew_once_slow)
    r = rl(["run", url, "--steps", "100000", "--train-script", fake, "--workdir", tmp_path / "wa"], env)
    assert r.returncode == 0 and "lease not renewed" in r.stderr and "its checkpoint was pushed" in r.stderr, r.stderr
    rows, snap = ledger_rows(relay.open_store(url))
    assert len(rows) == 1 and snap.state["step"] > 0 and snap.relay["holder"] is None


def test_hand_edited_state_and_small_relay_faults_are_one_line(tmp_path, rl, monkeypatch):
    """A training_state.json or RELAY.json number edited into a string or null: one line naming the file (a
    traceback, once after a whole leg had trained); init --ttl / --heartbeat checked and kept as the run's default;
    init with a CONFIG that does not exist (it silently took the checkpoint's config); decay once the trainer decays;
    a dashboard port in use; gpu_hourly_usd's last assignment, as train.py's exec keeps it."""
    import socket
    url = store_url("file", tmp_path, None)
    env = base_env()
    r = rl(["init", url, write_config(tmp_path), "--train-script", write_fake_train(tmp_path), "--workdir",
            tmp_path / "wi", "--ttl", "1", "--heartbeat", "50"], env)
    assert r.returncode == 3 and "at least 3x" in r.stderr and not (tmp_path / "store").exists(), r.stderr
    init_run(url, tmp_path, env, extra=("--ttl", "40", "--heartbeat", "10"), cli=rl)
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice")
    assert (lease.ttl_s, lease.heartbeat_s) == (40.0, 10.0)
    relay.release(store, lease)
    snap = relay.Snapshot(store)
    for name, edit in (("training_state.json", {"tokens": "1e6"}), ("training_state.json", {"legs": None}),
                       ("RELAY.json", {"ttl_s": "20m"})):
        doc = dict(snap.state if name == "training_state.json" else snap.relay, **edit)
        sha = store.commit(store.head()[0], {name: json.dumps(doc).encode()}, [], "a hand edit")
        for cmd in (["status", url], ["claim", url, "--workdir", tmp_path / "wb"]):
            r = rl(cmd, env)
            assert r.returncode == 3 and name in r.stderr and "restore it" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1
        store.commit(sha, {name: json.dumps(snap.state if name == "training_state.json" else snap.relay).encode()},
                     [], "restored")
    # RELAY.json without ttl_s (the lease takes the default) and a LEDGER.md that is not UTF-8: tracebacks from status
    no_ttl = {k: v for k, v in dict(snap.relay, holder="carol", leg=9, claimed_at=time.time()).items() if k != "ttl_s"}
    sha = store.commit(store.head()[0], {"RELAY.json": json.dumps(no_ttl).encode()}, [], "a hand edit")
    r = rl(["status", url], env)
    assert r.returncode == 0 and "baton: carol (leg 9" in r.stdout and f"ttl {relay.DEFAULT_TTL:.0f}s" in r.stdout, r.stderr
    ledger = relay.Snapshot(store).ledger().encode()
    sha = store.commit(sha, {"LEDGER.md": ledger + b"| caf\xe9 |\n"}, [], "a hand edit")
    for cmd in (["status", url], ["claim", url, "--workdir", tmp_path / "wb"]):
        r = rl(cmd, env)
        assert r.returncode == 3 and "LEDGER.md at" in r.stderr and "not UTF-8" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    store.commit(sha, {"LEDGER.md": ledger, "RELAY.json": json.dumps(snap.relay).encode()}, [], "restored")
    ck = relay.pull(store, str(tmp_path / "pulled"))
    r = rl(["init", f"file://{tmp_path}/store2", tmp_path / "typo.py", "--from-checkpoint", ck], env)
    assert r.returncode == 3 and "typo.py: config file not found" in r.stderr, r.stderr
    state = dict(relay.Snapshot(store).state, decay_started_at_tokens=4096)
    store.commit(store.head()[0], {"training_state.json": json.dumps(state).encode()}, [], "a leg that decays")
    r = rl(["decay", url], env)
    assert r.returncode == 0 and "already" in r.stdout and not relay.Snapshot(store).state.get("decay_requested")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = rl(["dashboard", url, "--port", s.getsockname()[1]], env)
    assert r.returncode == 3 and "another --port" in r.stderr and "Traceback" not in r.stderr, r.stderr
    cfg = write_config(tmp_path, "gpu_hourly_usd = 2.0\n# relay.py init overrides\ngpu_hourly_usd = 10\n")
    assert relay.config_usd_per_hour(cfg, []) == 10.0
    assert relay.config_usd_per_hour(cfg, ["--gpu_hourly_usd=1", "--gpu_hourly_usd=2.5"]) == 2.5  # the last, as train.py
    with pytest.raises(relay.RelayError, match="abc: not a number; pass --gpu_hourly_usd=DOLLARS"):
        relay.config_usd_per_hour(cfg, ["--gpu_hourly_usd=abc"])
    with pytest.raises(relay.RelayError, match="TypeError: .*; fix the config"):
        relay.config_values("x = {[1]}\n")


def test_the_ledger_price_is_the_one_train_py_computes_from_the_config(tmp_path):
    """config_usd_per_hour read gpu_hourly_usd with ast.literal_eval, which takes no arithmetic: a config.py that
    not_data accepts (`gpu_hourly_usd = 2.5 * 8`, or a name assigned above) trained at $20/h and the ledger said $0."""
    for text in ("gpu_hourly_usd = 2.5 * 8\n", "_per_gpu = 2.5\n_n = 8\ngpu_hourly_usd = _per_gpu * _n\n"):
        assert relay.config_usd_per_hour(write_config(tmp_path, text), []) == 20.0, text
    assert relay.config_usd_per_hour(write_config(tmp_path, "gpu_hourly_usd = 'x'\n"), []) == 0.0


def test_ctrl_c_while_waiting_or_pulling_is_one_line_and_releases(tmp_path, rl, monkeypatch):
    """Ctrl-C in `run --wait` (a traceback) or during the pull (a traceback, and the baton stayed held until the ttl)."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    other = relay.claim(store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=20)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(relay.time, "sleep", interrupted)
    r = rl(["run", url, "--steps", "2", "--wait", "--poll", "5", "--train-script", fake, "--workdir", tmp_path / "wa"],
           env)
    assert r.returncode == 3 and "interrupted while waiting" in r.stderr and "Traceback" not in r.stderr, r.stderr
    monkeypatch.undo()
    relay.release(store, other)
    monkeypatch.setattr(relay, "pull", interrupted)
    r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wa"], env)
    assert r.returncode == 3 and "interrupted; lease released" in r.stderr, r.stderr
    assert relay.Snapshot(store).relay["holder"] is None


def test_lost_answers_shared_workdirs_malformed_files_and_a_re_pulled_leg(tmp_path, monkeypatch):
    """Review findings, each a lease or a leg lost to our own or a neighbour's file:
    - a heartbeat that landed unseen, then the leg ended: our push and release were fenced by our own renewal (and
      release deleted LEASE.json while the store still named us);
    - a claim that landed unseen left no LEASE.json: its claimer was told it was busy against itself for a ttl;
    - a shared --workdir: claiming another run overwrote the first run's live LEASE.json; a malformed one was a
      traceback;
    - a crashed leg pulled again after retention removed its base step pointed LATEST back at the base;
    - a LEDGER.md without its final newline got the next row glued onto its last one;
    - a default_ttl_s that is not a number was a ValueError traceback in claim."""
    import relay_store
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    work = str(tmp_path / "wa")
    monkeypatch.setattr(relay.time, "sleep", lambda s: None)  # commit_cas's backoff while the store is dark
    # the claim's answer lost
    store.drop_answer_of = "claim"
    with pytest.raises(relay.Transient, match="unknown whether"):
        relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    store.dark_heads = 0
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)  # was: Busy, against itself
    assert lease.generation == relay.Snapshot(store).relay["generation"] == 1
    # a crashed leg's dir pulled again: LATEST stays on its newest step
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, 5)
    save_fake_checkpoint(run_dir, 10)
    import shutil
    shutil.rmtree(os.path.join(run_dir, "step_0000000"))  # what retention does
    assert relay.prepare_leg(store, lease, work) == run_dir
    assert open(os.path.join(run_dir, "LATEST")).read().strip() == "step_0000010"
    # the heartbeat's answer lost, then the leg ends: push and release go through
    store.drop_answer_of = "heartbeat"
    with pytest.raises(relay.Transient):
        relay.renew(store, lease)
    store.dark_heads = 0
    plan = relay.prepare_push(store, lease, run_dir, wall_s=1)
    relay.commit_push(store, lease, plan, run_dir)  # was: Fenced by our own renewal
    assert relay.Snapshot(store).state["step"] == 10
    # a hand-edited ledger without its final newline, then another push: both rows read back
    snap = relay.Snapshot(store)
    lease.sha, _ = relay.commit_cas(store, snap.sha, {"LEDGER.md": snap.ledger().rstrip("\n").encode()}, [],
                                    "an edit", snap.relay)
    lease.save()
    save_fake_checkpoint(run_dir, 12)
    relay.commit_push(store, lease, relay.prepare_push(store, lease, run_dir, wall_s=1), run_dir)
    assert [r["step_range"] for r in relay.parse_ledger(relay.Snapshot(store).ledger())] == ["0-10", "10-12"]
    # a shared workdir: another run's claim is refused and this lease stays; a malformed LEASE.json is one line
    init_run("file://" + str(tmp_path / "other"), tmp_path, base_env())
    other = relay_store.FileStore(str(tmp_path / "other"))
    kept = open(lease.path).read()
    with pytest.raises(relay.RelayError, match="lease is for .*pass another --workdir"):
        relay.claim(other, work, "alice", ttl=60, heartbeat=20)
    assert open(lease.path).read() == kept
    relay.release(store, lease)
    for bad in ("[]", '{"store": "%s"}' % store.url):
        open(lease.path, "w").write(bad)
        with pytest.raises(relay.RelayError, match="malformed"):
            relay.Lease.load(work, store)
    os.remove(lease.path)
    # RELAY.json's run defaults are checked like its lease times
    snap = relay.Snapshot(store)
    relay.commit_cas(store, snap.sha, {}, [], "an edit", dict(snap.relay, default_ttl_s="20m"))
    with pytest.raises(relay.RelayError, match="default_ttl_s '20m' is not a finite number"):
        relay.claim(store, work, "alice")
    # ... and Infinity (JSON's extension Python writes): a lease that never expired; a step of it, int(inf)'s
    # OverflowError traceback in every command
    good_relay, good_state = snap.relay, snap.state  # (the snapshot before the '20m' edit)
    relay.commit_cas(store, store.head()[0], {}, [], "an edit", dict(good_relay, ttl_s=float("inf")))
    with pytest.raises(relay.RelayError, match="ttl_s inf is not a finite number"):
        relay.Snapshot(store)
    relay.commit_cas(store, store.head()[0], {"training_state.json": json.dumps(dict(good_state, step=float("inf")))
                                              .encode()}, [], "an edit", good_relay)
    with pytest.raises(relay.RelayError, match="step inf is not a finite number"):
        relay.Snapshot(store)


def test_review_round_leases_survive_outages_card_edits_and_manual_steps(tmp_path, rl, monkeypatch, capsys):
    """Review findings, each a leg lost or misbilled:
    - an outage longer than the lease's deadline stopped the heartbeat for good: the store came back, nothing renewed
      the lease, and the finished leg was fenced by the next claimer;
    - a commit that touched none of the run's files (the model card edited in the Hub's web editor) fenced the
      holder for good, and its own claim was then "busy" against itself;
    - steps trained after a manual push were deleted with the pushed leg dir at the next pull;
    - `release` of a leg trained and never pushed said "released" and dropped the work;
    - a leg dir of the same name from another lease (a shared --workdir, a run re-made at the URL) was resumed and
      pushed into this run;
    - a release whose answer was lost was retried into "lease already lost", exit 4."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=3, heartbeat=1)
    # an outage past the deadline (ttl 3 - 0.6 s): the trainer stops, and the renewals resume with the store
    real, dark, stopped = relay.renew, [True], []

    def flaky(store_, lease_, **kw):
        if dark:
            raise relay.Transient("HTTP 503 (a test)")
        real(store_, lease_, **kw)
    monkeypatch.setattr(relay, "renew", flaky)
    hb = relay.Heartbeat(store, lease, lambda: stopped.append(1))
    hb.start()
    wait_for(lambda: hb.failed, 10, "the lease to be overdue")
    sha0 = lease.sha
    dark.clear()
    wait_for(lambda: lease.sha != sha0, 10, "a renewal once the store is back")
    relay.stop_heartbeat(hb, work)
    monkeypatch.setattr(relay, "renew", real)
    assert stopped == [1] and not hb.fenced and relay.Snapshot(store).relay["nonce"] == lease.nonce
    # the model card edited twice while the leg trains: renewal, claim and push chain from those commits
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, 5)
    store.commit(store.head()[0], {"README.md": b"# a model card\n"}, [], "Update README.md")
    relay.renew(store, lease)  # was: Fenced
    store.commit(store.head()[0], {"README.md": b"# a model card, v2\n"}, [], "Update README.md")
    assert relay.claim(store, work, "alice", ttl=3, heartbeat=1).nonce == lease.nonce  # was: Busy, against itself
    lease = relay.Lease.load(work, store)
    store.commit(store.head()[0], {"README.md": b"# a model card, v3\n"}, [], "Update README.md")
    relay.commit_push(store, lease, relay.prepare_push(store, lease, run_dir, wall_s=1), run_dir)  # was: rejected
    head = store.head()[0]
    assert relay.Snapshot(store).state["step"] == 5 and store.read(head, "README.md") == b"# a model card, v3\n"
    # trained on after the push, then released: refused until pushed (or --discard)
    save_fake_checkpoint(run_dir, 10)
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 3 and "holds step 10, past the pulled step 5, never pushed" in r.stderr, r.stderr
    assert relay.Snapshot(store).relay["nonce"] == lease.nonce  # still held
    assert rl(["release", url, "--workdir", work, "--discard"]).returncode == 0
    # the next lease's pull keeps that dir (step 10 is nowhere else), and sets aside a same-named dir of another lease
    lease2 = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    foreign = os.path.join(work, f"leg-{lease2.leg:04d}-gen{lease2.generation}")
    save_fake_checkpoint(foreign, 30)  # another run's leg 2, generation 2 (no LEG.json of this lease)
    capsys.readouterr()
    run2 = relay.prepare_leg(store, lease2, work)
    err = capsys.readouterr().err
    assert os.path.isdir(run_dir) and f"{run_dir} holds step 10, trained after its push; kept" in err, err
    assert run2 == foreign and "was another lease's leg" in err
    assert open(os.path.join(run2, "LATEST")).read().strip() == "step_0000005"  # the run's step, not 30
    asides = [d for d in os.listdir(work) if d.startswith(os.path.basename(foreign) + ".other-")]
    assert len(asides) == 1 and checkpoint.is_valid(os.path.join(work, asides[0], "step_0000030"))
    # a release whose answer was lost: the retry finds it landed (was: "lease already lost", exit 4)
    real_sleep = time.sleep
    monkeypatch.setattr(relay.time, "sleep", lambda s: None)  # commit_cas's backoff while the store is dark
    store.drop_answer_of = "release"
    with pytest.raises(relay.Transient, match="unknown whether"):
        relay.release(store, lease2)
    store.dark_heads = 0
    relay.release(store, relay.Lease.load(work, store))
    assert relay.Snapshot(store).relay["holder"] is None
    # a card edit after a holder's last renewal does not keep a dead lease alive (the age counted from the head)
    dead = relay.claim(store, str(tmp_path / "wd"), "dora", ttl=1.0, heartbeat=0.25)
    real_sleep(0.7)
    store.commit(store.head()[0], {"README.md": b"# edited while dora's lease ran out\n"}, [], "Update README.md")
    real_sleep(0.5)
    assert not relay.Snapshot(store).held  # 1.2 s after dora's claim, 0.5 s after the edit
    relay.release(store, dead)
    # a run's own file changed by someone else is still a fence
    lease3 = relay.claim(store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=20)
    snap = relay.Snapshot(store)
    store.commit(snap.sha, {"training_state.json": (json.dumps(dict(snap.state, step=99)) + "\n").encode()}, [],
                 "a hand edit")
    with pytest.raises(relay.Fenced):
        relay.renew(store, lease3)


def test_manual_push_renews_during_its_upload_and_a_resumed_leg_bills_all_its_time(tmp_path, rl, monkeypatch):
    """`relay.py push` (the retry `run` names when its upload fails) renewed nothing: an upload longer than the ttl
    let another contributor claim, and the push was rejected. A leg resumed after a crash billed only the time after
    the restart (and said it pulled step 0 while it resumed its own step 7)."""
    import relay_store
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    work = str(tmp_path / "wa")
    store = relay.open_store(url)
    lease = relay.claim(store, work, "alice", ttl=3, heartbeat=1)
    run_dir = relay.prepare_leg(store, lease, work)
    train_leg(fake, run_dir, 7, env)
    real_stage, claims = relay_store.FileStore.stage, []

    def slow_stage(self, adds):  # an upload of 4 s against a 3 s lease, while bob tries to claim
        time.sleep(4.0)
        return real_stage(self, adds)
    monkeypatch.setattr(relay_store.FileStore, "stage", slow_stage)

    def bob():
        time.sleep(3.5)
        try:
            relay.claim(relay.open_store(url), str(tmp_path / "wb"), "bob", ttl=3, heartbeat=1)
            claims.append("claimed")
        except relay.Busy:
            claims.append("busy")
    import threading
    th = threading.Thread(target=bob)
    th.start()
    r = rl(["push", url, "--workdir", work])
    th.join()
    assert r.returncode == 0 and claims == ["busy"], (r.stderr, claims)
    monkeypatch.setattr(relay_store.FileStore, "stage", real_stage)
    assert relay.Snapshot(store).state["step"] == 7
    # leg 2 crashes at step 12 after 100 s of trainer time (as LEG.json counts it); `run` resumes it and bills both
    lease = relay.Lease.load(work, store)
    run_dir = relay.prepare_leg(store, lease, work)
    train_leg(fake, run_dir, 5, env)
    relay.leg_wall(run_dir, 100.0)
    r = rl(["run", url, "--steps", "3", "--train-script", fake, "--workdir", work])
    assert r.returncode == 0, r.stderr
    assert "pulled step 7" in r.stdout and "resuming this leg's own step 12" in r.stdout, r.stdout
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["0-7", "7-15"] and rows[1]["wall"].startswith("0h01m4"), rows


def test_a_newer_format_is_refused_and_ctrl_c_is_one_line(tmp_path, rl, monkeypatch):
    """RELAY.json's version was never read: a run made by a later relay.py (other rules) would be joined. Ctrl-C in a
    push or release (not `run`, which ends its leg cleanly) was a traceback."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env(), cli=rl)
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    assert snap.relay["version"] == relay.RELAY_VERSION
    relay.commit_cas(store, snap.sha, {}, [], "a later relay.py", dict(snap.relay, version=relay.RELAY_VERSION + 1))
    r = rl(["claim", url, "--workdir", tmp_path / "wa"])
    assert r.returncode == 3 and "newer than this relay.py's" in r.stderr and "update picaflor" in r.stderr, r.stderr
    r = rl(["status", url])  # (the refusal is in reading it: status, pull, decay alike)
    assert r.returncode == 3 and "newer than" in r.stderr

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(relay, "cmd_status", interrupted)
    r = rl(["status", url])
    assert r.returncode == 130 and "interrupted; local files are kept" in r.stderr and "Traceback" not in r.stderr


def test_overrides_are_parsed_as_train_py_parses_them_and_refused_before_anything_is_claimed(tmp_path, rl, monkeypatch):
    """init wrote --dataset=2024 as the int 2024 (every later leg refused the config), wrote a key with a newline
    and code after it into config.py, and run let --stop_after_steps=4 override the leg's own --steps 1."""
    env = base_env()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, out = solo_run(tmp_path, env, 2)
    ck = saved_with_config(out, 2, {"n_layer": 3, "learning_rate": 0.003})
    url = f"file://{tmp_path}/store"
    for bad, rc, words in ((["--seed=7\nimport os"], 3, "not a valid Python literal"),
                           (["--se\ned=7"], 3, "unknown config key"), (["--out_dir=elsewhere"], 2, "a leg's setting"),
                           (["--learning_rate=fast"], 3, "learning_rate")):
        r = rl(["init", url, "--from-checkpoint", ck, "--workdir", tmp_path / "w0", *bad])
        assert r.returncode == rc and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not os.path.exists(tmp_path / "store")
    r = rl(["init", url, "--from-checkpoint", ck, "--workdir", tmp_path / "w0", "--dataset=2024", "--learning_rate=1e-2"])
    assert r.returncode == 0, r.stderr
    store = relay.open_store(url)
    cfg = store.read(relay.Snapshot(store).sha, "config.py").decode()
    assert "dataset = '2024'" in cfg and "learning_rate = 0.01" in cfg and relay.configurator.not_data(cfg) is None
    head = store.head()[0]
    for bad, rc, words in ((["--stop_after_steps=4"], 2, "--steps"), (["--max_itres=4"], 3, "did you mean 'max_iters'")):
        r = rl(["run", url, "--steps", "1", "--workdir", tmp_path / "wa", *bad])
        assert r.returncode == rc and words in r.stderr, r.stderr
        assert store.head()[0] == head  # no lease claimed, nothing pulled


def test_hub_errors_are_judged_by_what_happened(tmp_path, hub, hf_env, monkeypatch, capsys):
    """Review findings against the Hub's semantics:
    - a 412 before the commit (on the upload check) with the head where the lease left it fenced the holder; only a
      moved head is a fence, so the renewal is retried;
    - a 403 on a download was called a connection problem (Transient) and retried as one;
    - a commit deleting a file the repo lacks: the Hub answers 404, which escaped as a raw huggingface_hub error (the
      fake Hub and the file store took it silently);
    - an error the heartbeat did not expect (a proxy's HTML page) killed its thread: nothing renewed, no one told;
    - a foreign commit that replaced a checkpoint file's bytes under the same name was adopted as harmless."""
    url = "hf://alice/run"
    init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=10)
    before = lease.sha
    hub.status_override, hub.fail_left = 412, 1
    relay.renew(store, lease)  # was: Fenced
    assert lease.sha != before and relay.Snapshot(store).relay["nonce"] == lease.nonce
    sha = store.head()[0]
    hub.status_override, hub.fail_left = 403, 1
    with pytest.raises(relay.StoreError, match="HTTP 403") as e:
        store.download(sha, ["checkpoint/MANIFEST.json"], str(tmp_path / "dl"))
    assert not isinstance(e.value, relay.Transient)
    with pytest.raises(relay.StoreError, match="not in the repo") as e:
        store.commit(sha, {}, ["no/such/file.txt"], "a test")
    assert not isinstance(e.value, relay.Transient) and store.head()[0] == sha
    # the heartbeat outlives an unexpected error and renews once the store answers again
    real, calls = relay.renew, []

    def html_once(store_, lease_, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("Expecting value: line 1 column 1 (char 0)")
        real(store_, lease_, **kw)
    monkeypatch.setattr(relay, "renew", html_once)
    lease.heartbeat_s = 0.2
    hb = relay.Heartbeat(store, lease, lambda: None)
    hb.start()
    wait_for(lambda: len(calls) >= 2 and lease.sha != sha, 20, "a renewal after the unexpected error")
    relay.stop_heartbeat(hb, "wa")
    assert hb.failed is None and "heartbeat failed, retrying: ValueError" in capsys.readouterr().err
    monkeypatch.setattr(relay, "renew", real)
    # a checkpoint file replaced under its own name is someone else's write: a fence, not a card edit
    store.commit(store.head()[0], {"checkpoint/model.safetensors": b"someone else's weights"}, [], "Upload file")
    with pytest.raises(relay.Fenced):
        relay.renew(store, lease)


def test_a_file_store_refuses_to_delete_what_it_lacks(tmp_path):
    """As the Hub does (404): a delete list computed at another commit is an error, not a silent no-op."""
    import relay_store
    store = relay_store.FileStore(str(tmp_path / "store"))
    store.create()
    head = store.commit(store.head()[0], {"a.txt": b"1"}, [], "a test")
    with pytest.raises(relay.StoreError, match="deletes b.txt, which is not in the store"):
        store.commit(head, {}, ["b.txt"], "a test")
    assert store.head()[0] == head and store.file_ids(head) == {"a.txt": store.file_ids(head)["a.txt"]}


def test_train_defaults_are_read_not_run(tmp_path):
    """relay imported --train-script to learn its keys: a fork without a __main__ guard trained on import. The keys
    are now read from the source, exactly train.py's (its exit codes after _CONFIG_KEYS were taken as keys)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("_train_keys", os.path.join(ROOT, "train.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert sorted(relay.train_defaults(os.path.join(ROOT, "train.py"))) == mod._CONFIG_KEYS
    with pytest.raises(relay.RelayError, match="unknown config key"):
        relay.train_overrides(os.path.join(ROOT, "train.py"), ["--EXIT_OK=3"])
    fork = tmp_path / "train.py"
    ran = tmp_path / "ran"
    fork.write_text(f"learning_rate = 3e-4\ndataset = 'local'\nstem = 'x' * 2\nopen({str(ran)!r}, 'w').write('trained')\n")
    assert relay.train_overrides(str(fork), ["--dataset=2024"]) == {"dataset": "2024"} and not ran.exists()
    with pytest.raises(relay.RelayError, match="unknown config key"):  # computed at run time: not a key here
        relay.train_overrides(str(fork), ["--stem=y"])
    fork.write_text("def broken(:\n")
    with pytest.raises(relay.RelayError, match="pass --train-script"):
        relay.train_defaults(str(fork))


# ---------------------------------------------------------------------------------------------------------------
# The holder's own commits whose answers were lost (the fake Hub applies them, answers 500, then goes dark), met
# later by the same holder: never someone else's, never a fence.


def lose_answer_of_commit(hub, monkeypatch, n=1):
    """The n-th commit the Hub handles from now lands and answers 500 (hub.fail_after_commit), then the Hub answers
    503 to every request until hub.status_override is cleared: relay cannot learn whether it landed."""
    real, seen = hub.handle_commit, []

    def handle(req, key, query, rev):
        seen.append(1)
        if len(seen) == n:
            hub.fail_after_commit = 1
        real(req, key, query, rev)
        if len(seen) == n:
            hub.status_override = 503
    monkeypatch.setattr(hub, "handle_commit", handle)


def claim_of_unknown_outcome(url, tmp_path, hub, rl, fault):
    """A new run, then alice's `claim` under `fault` (a Hub fault injection): exit 3, "unknown whether the commit
    landed"; the Hub answers again afterwards. Returns (the fake trainer script, the store, alice's workdir)."""
    fake = init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    fault()
    r = rl(["claim", url, "--workdir", work, "--ttl", "60", "--heartbeat", "20", "--who", "alice"])
    assert r.returncode == 3 and "unknown whether the commit landed" in r.stderr, r.stderr
    hub.status_override = None
    return fake, store, work


@pytest.fixture
def no_backoff(monkeypatch):
    """commit_cas's backoff while the Hub is dark, skipped (relay_lease's clock only, not the trainer's or the Hub's)."""
    import relay_lease
    monkeypatch.setattr(relay_lease, "time", SimpleNamespace(time=time.time, sleep=lambda s: None))


def hub_leg(tmp_path, hub, step=5):
    """A claimed hf:// lease with a leg dir holding `step`, its push prepared (uploaded, not committed)."""
    url = "hf://alice/run"
    init_run(url, tmp_path, base_env(hub.client_env(tmp_path / "hf_home")))
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, step, "w")
    return url, store, work, lease, run_dir, relay.prepare_push(store, lease, run_dir, wall_s=1)


@pytest.mark.parametrize("then", ["push", "release"])
def test_own_renewal_landed_unseen_then_a_failed_look_does_not_fence_the_push(then, tmp_path, hub, hf_env, monkeypatch,
                                                                              no_backoff):
    """A heartbeat lands, its answer is lost and the Hub stays dark past commit_cas's checks; the leg ends and
    the push's (or release's) own look at the head fails once more (adopt_own_renewal gives up quietly), then the
    Hub answers the commit with 412: that moved head is our renewal, found by its write_id. It was "push rejected"
    (exit 4, the leg lost) and "release: lease already lost" (LEASE.json dropped while RELAY.json still named us)."""
    url, store, work, lease, run_dir, plan = hub_leg(tmp_path, hub)
    lose_answer_of_commit(hub, monkeypatch)
    with pytest.raises(relay.Transient, match="unknown whether the commit landed"):
        relay.renew(store, lease)
    hub.status_override, hub.fail_left = 503, 1  # still dark for one more request: the push's own look
    if then == "push":
        relay.commit_push(store, lease, plan, run_dir)  # was: Fenced, by our own renewal
        snap = relay.Snapshot(store)
        assert snap.state["step"] == 5 and snap.relay["nonce"] == lease.nonce and lease.sha == snap.sha
        relay.release(store, lease)
    else:
        relay.release(store, lease)  # was: Fenced, "lease already lost"
    snap = relay.Snapshot(store)
    assert snap.relay["holder"] is None and not os.path.exists(lease.path)
    assert snap.state["step"] == (5 if then == "push" else 0) and snap.relay["generation"] == 1


@pytest.mark.parametrize("then", ["pull", "push", "release", "run"])
def test_own_claim_landed_unseen_is_the_lease_of_the_next_command(then, tmp_path, hub, hf_env, rl, monkeypatch,
                                                                   no_backoff):
    """`claim` lands, its answer is lost and the Hub stays dark: LEASE.json names the claim's write_id. The next
    `pull`, `push`, `release` or `run` from that workdir chains from the claim; all but `run` took it for another
    contributor's (pull and push: "lease lost", exit 4; release: "lease already lost", exit 4, LEASE.json dropped,
    the baton held by a ghost for a ttl)."""
    url = "hf://alice/run"
    fake, store, work = claim_of_unknown_outcome(url, tmp_path, hub, rl, lambda: lose_answer_of_commit(hub, monkeypatch))
    if then == "push":  # a leg trained in the claim's dir (as `pull` would make it), pushed with --run-dir
        run_dir = str(tmp_path / "leg")
        save_fake_checkpoint(run_dir, 4, "w")
        base = relay.manifest_id(store.read(store.head()[0], "checkpoint/MANIFEST.json"))  # what pull records
        open(os.path.join(run_dir, "LEG.json"), "w").write(json.dumps({"store": url, "base_manifest": base}))
        r = rl(["push", url, "--workdir", work, "--run-dir", run_dir])
    elif then == "run":  # trains 4 steps, pushes, releases
        r = rl(["run", url, "--workdir", work, "--steps", "4", "--train-script", fake], base_env())
    else:
        r = rl([then, url, "--workdir", work])
    assert r.returncode == 0, r.stderr  # was: 4, fenced by our own claim
    snap = relay.Snapshot(store)
    assert snap.relay["generation"] == 1 and snap.relay["holder"] == (None if then in ("release", "run") else "alice")
    if then not in ("release", "run"):
        assert snap.relay["nonce"] == relay.Lease.load(work, store).nonce
        assert rl(["release", url, "--workdir", work]).returncode == 0
    assert relay.Snapshot(store).state["step"] == (4 if then in ("push", "run") else 0)


@pytest.mark.parametrize("then", ["pull", "push", "release"])
def test_a_push_landed_unseen_is_found_by_the_next_command(then, tmp_path, hub, hf_env, rl, monkeypatch, no_backoff):
    """The manual steps: `push` lands, its answer is lost and the Hub stays dark (exit 3, "unknown whether"). The
    next `push` or `release` from that workdir finds it by its write_id; `pull` (the lease's next leg) renewed from
    the commit before the push and was refused by our own push: "lease lost ... another contributor took the
    baton", exit 4. It now pulls the pushed step into the next leg's dir."""
    url, store, work, lease, run_dir, _ = hub_leg(tmp_path, hub)
    lose_answer_of_commit(hub, monkeypatch)
    r = rl(["push", url, "--workdir", work])
    assert r.returncode == 3 and "unknown whether the commit landed" in r.stderr, r.stderr
    hub.status_override = None
    r = rl([then, url, "--workdir", work])
    assert r.returncode == 0, r.stderr  # pull: was 4, fenced by our own push
    snap = relay.Snapshot(store)
    if then == "pull":
        assert "pulled step 5 into" in r.stdout and "leg-0002-gen1" in r.stdout, r.stdout
        back = relay.Lease.load(work, store)
        assert (back.leg, back.base_step, back.sha) == (2, 5, snap.sha) and snap.relay["nonce"] == back.nonce
    if then == "push":
        assert "the earlier push had landed" in r.stdout, r.stdout
    if then != "release":
        assert rl(["release", url, "--workdir", work]).returncode == 0
    rows, snap = ledger_rows(store)
    assert len(rows) == 1 and snap.state["step"] == 5 and snap.relay["holder"] is None and snap.relay["generation"] == 1


def test_every_answer_lost_after_it_landed_still_makes_one_clean_leg(tmp_path, hub, rl):
    """Every commit of a `run` (claim, each heartbeat of a 0.5 s beat, push, release) lands and answers 500: each is
    found at the head by its write_id, none is taken for someone else's (no fence, one generation, one ledger row,
    one commit per write)."""
    url = "hf://alice/run"
    env = base_env(hub.client_env(tmp_path / "hf_home"))
    fake = init_run(url, tmp_path, env, cli=rl)
    n0 = len(hub.vrepos[("models", "alice/run")]["commits"])
    hub.fail_after_commit = 10 ** 6
    r = rl(["run", url, "--steps", "40", "--train-script", fake, "--workdir", tmp_path / "wa", "--ttl", "3",
            "--heartbeat", "0.5"], dict(env, FAKE_STEP_S="0.05"))
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    msgs = [c["message"] for c in hub.vrepos[("models", "alice/run")]["commits"].values()][n0:]
    assert 10 ** 6 - hub.fail_after_commit == len(msgs)  # every one answered 500
    hub.fail_after_commit = 0
    rows, snap = ledger_rows(relay.open_store(url))
    assert len(rows) == 1 and snap.state["step"] == 40 and snap.relay["holder"] is None and snap.relay["generation"] == 1
    assert sum("heartbeat" in m for m in msgs) >= 2 and sum("steps 0-40" in m for m in msgs) == 1, msgs
    once = [m for m in msgs if "heartbeat" not in m]
    assert len(once) == len(set(once)) == 3, msgs  # claim, push, release: none made twice


def test_a_run_given_up_after_its_write_landed_is_resumed_by_running_again(tmp_path, hub, rl, monkeypatch, no_backoff):
    """`run` gives up (the Hub dark) right after a write of its own landed: the push (exit 3, "it may have landed"),
    or a heartbeat (the process died there). `relay run` again from that workdir goes on from it: the push is
    adopted (the next leg trains from its step), the renewal is ours (same generation, the leg's own steps
    resumed), never a fence or a second claim. A release whose answer was lost is found by `release` again."""
    url = "hf://alice/run"
    env = base_env(hub.client_env(tmp_path / "hf_home"))
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    args = ["run", url, "--train-script", fake, "--workdir", work, "--ttl", "60", "--heartbeat", "20"]
    lose_answer_of_commit(hub, monkeypatch, n=2)  # claim, then the push
    r = rl(args + ["--steps", "3"], env)
    assert r.returncode == 3 and "it may have landed" in r.stderr, r.stderr
    hub.status_override = None
    r = rl(args + ["--steps", "2"], env)  # as if the first had died after its push: LEASE.json names it pending
    assert r.returncode == 0 and "pulled step 3" in r.stdout, (r.stdout, r.stderr)
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["0-3", "3-5"] and snap.relay["generation"] == 1  # the same lease
    # the next lease: its heartbeat lands unseen, the Hub goes dark, the process is gone (nothing retries it)
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, 7)
    lose_answer_of_commit(hub, monkeypatch)
    with pytest.raises(relay.Transient, match="unknown whether"):
        relay.renew(store, lease)
    hub.status_override = None
    r = rl(args + ["--steps", "1"], env)
    assert r.returncode == 0 and "resuming this leg's own step 7" in r.stdout, (r.stdout, r.stderr)
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["0-3", "3-5", "5-8"] and snap.relay["generation"] == 2
    # a release whose answer is lost, found by `release` again (it was "lease already lost", exit 4)
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    lose_answer_of_commit(hub, monkeypatch)
    r = rl(["release", url, "--workdir", work], env)
    assert r.returncode == 3 and "unknown whether" in r.stderr, r.stderr
    hub.status_override = None
    r = rl(["release", url, "--workdir", work], env)
    assert r.returncode == 0 and relay.Snapshot(store).relay["holder"] is None, r.stderr


def drop_commit_then_go_dark(hub, monkeypatch):
    """The next commit is not applied and answers 503, and so does every request after it until hub.status_override
    is cleared: relay cannot learn that its commit never landed."""
    real = hub.handle_commit

    def handle(req, key, query, rev):
        monkeypatch.setattr(hub, "handle_commit", real)
        hub.status_override = 503
        return hub.send_json(req, {"error": "Service Unavailable (injected: the commit was dropped)"}, 503)
    monkeypatch.setattr(hub, "handle_commit", handle)


@pytest.mark.parametrize("then", ["pull", "release"])
def test_a_claim_that_never_landed_is_not_taken_for_a_lease(then, tmp_path, hub, hf_env, rl, monkeypatch, no_backoff):
    """`claim`'s commit is dropped and the Hub goes dark (exit 3, "unknown whether"). LEASE.json still names the
    claim; `pull` "renewed" the head before it (RELAY.json with nobody holding the baton) and said "train", and the
    leg's push failed hours later. Now pull and release say the claim did not land (exit 4); claim again works."""
    url = "hf://alice/run"
    _, store, work = claim_of_unknown_outcome(url, tmp_path, hub, rl, lambda: drop_commit_then_go_dark(hub, monkeypatch))
    head = store.head()[0]
    r = rl([then, url, "--workdir", work])
    assert r.returncode == 4 and "did not land" in r.stderr and "relay.py claim" in r.stderr, r.stderr
    assert store.head()[0] == head and relay.Snapshot(store).relay["holder"] is None  # nothing committed
    assert os.path.exists(os.path.join(work, "LEASE.json")) == (then == "pull")  # release: nothing to hand back
    r = rl(["claim", url, "--workdir", work, "--ttl", "60", "--heartbeat", "20", "--who", "alice"])
    assert r.returncode == 0, r.stderr
    assert relay.Snapshot(store).relay["holder"] == "alice"


@pytest.mark.parametrize("failing_start", [1, 2])
def test_a_heartbeat_that_cannot_start_stops_the_leg_and_releases(failing_start, tmp_path, rl, monkeypatch):
    """No thread for the heartbeat (a process or memory limit): before the pull the lease stayed held until its ttl
    with a traceback; after the trainer's start the trainer ran unleased and relay's Ctrl-C handlers stayed installed.
    Now one line, the trainer stopped, the handlers put back and the lease released."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    starts, real_start = [], relay.Heartbeat.start

    def start(self):
        starts.append(self)
        if len(starts) == failing_start:
            raise RuntimeError("can't start new thread")
        real_start(self)
    monkeypatch.setattr(relay.Heartbeat, "start", start)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    r = rl(["run", url, "--steps", "1000000", "--train-script", fake, "--workdir", tmp_path / "wa"],
           dict(env, FAKE_STEP_S="0.05"))
    assert r.returncode == 3 and "cannot start the lease's heartbeat thread (can't start new thread)" in r.stderr
    assert "lease released" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(starts) == failing_start and {s: signal.getsignal(s) for s in handlers} == handlers
    assert relay.Snapshot(relay.open_store(url)).relay["holder"] is None
    if failing_start == 2:  # the trainer checkpointed on its SIGTERM and exited; its files stay here
        assert "the trainer was stopped" in r.stderr and "local files kept in" in r.stderr


def alices_push_lands_unseen_then_bob_claims(tmp_path):
    """alice trains step 3 and pushes: it lands, its answer is lost; bob claims a ttl later (the store's clock moved
    on). (url, alice's workdir, her leg dir, bob's store, bob's lease)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, 3, "alice")
    store.drop_answer_of = "leg 1 by alice"
    with pytest.raises(relay.Transient, match="unknown whether the commit landed"):
        push(store, lease, run_dir, wall_s=1)
    bob_store = relay.open_store(url)
    head = bob_store.head
    bob_store.head = lambda: (lambda sha, t, now: (sha, t, now + 61))(*head())  # the store's clock a ttl later
    return url, work, run_dir, bob_store, relay.claim(bob_store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=20)


def test_a_push_landed_unseen_then_overtaken_is_said_pushed_not_rejected(tmp_path, rl, no_backoff):
    """alice's push lands but its answer is lost (the store dark after it); her lease then expires and bob claims.
    `push` again uploaded the leg and said "push rejected", and `release` said her step was "never pushed (the run
    went on without it)": it is in the run, its ledger row too. Both now say it was pushed; no second row."""
    url, work, run_dir, bob_store, _ = alices_push_lands_unseen_then_bob_claims(tmp_path)
    taken = bob_store.head()[0]
    r = rl(["push", url, "--workdir", work])
    assert r.returncode == 4 and "leg 1 was pushed already" in r.stderr and "steps 0-3" in r.stderr, r.stderr
    assert f"relay.py release {url} --workdir {work}`" in r.stderr, r.stderr  # (the default workdir is not hers)
    assert relay.open_store(url).head()[0] == taken
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 4 and f"{run_dir}'s step 3 is in the run: pushed as leg 1" in r.stderr, r.stderr
    assert "never pushed" not in r.stderr and not os.path.exists(os.path.join(work, "LEASE.json"))
    rows, snap = ledger_rows(relay.open_store(url))
    assert [(x["leg"], x["who"], x["step_range"]) for x in rows] == [(1, "alice", "0-3")]
    assert snap.relay["holder"] == "bob" and snap.state["step"] == 3


def test_a_leg_dir_whose_push_landed_unseen_is_said_in_the_run_not_never_pushed(tmp_path, no_backoff, capsys):
    """alice's push lands but its answer is lost; bob claims after her ttl and releases; alice claims again from the
    same workdir. Her next leg's note named the old leg dir's step "never pushed": LEDGER.md at the head holds it."""
    url, work, run_dir, bob_store, bob_lease = alices_push_lands_unseen_then_bob_claims(tmp_path)
    relay.release(bob_store, bob_lease)
    store = relay.open_store(url)
    again = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    capsys.readouterr()
    assert relay.prepare_leg(store, again, work) != run_dir
    err = capsys.readouterr().err
    assert "leg-0001-gen1 (step 3 in the run: pushed as leg 1," in err and "never pushed" not in err, err


def test_a_lease_age_is_never_negative(tmp_path, rl, monkeypatch):
    """The Hub's Date header has 1 s resolution: its "now" can be a fraction before the commit it answers with.
    A busy claim and `status` said "last renewed -0s ago"; the age is 0 (the dashboard's too: status_dict)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    head = store.head
    store.head = lambda: (lambda sha, t, now: (sha, t, t - 0.4))(*head())  # "now" 0.4 s before the commit
    with pytest.raises(relay.Busy) as busy:
        relay.claim(store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=20)
    assert "last renewed 0s ago" in str(busy.value), busy.value
    assert relay.status_dict(store)["lease_age_s"] == 0.0
    monkeypatch.setattr(relay, "open_store", lambda u: store)
    r = rl(["status", url])
    assert r.returncode == 0 and "renewed 0s ago" in r.stdout and "-0s" not in r.stdout, r.stdout


def test_a_fenced_holder_is_told_who_took_the_baton(tmp_path, monkeypatch):
    """alice's lease expires and bob claims: her heartbeat, push and release were told only that "another
    contributor" took it. They name bob, his leg and generation and when he claimed (from the head's RELAY.json);
    a head that cannot be read keeps the old words."""
    import relay_lease
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    save_fake_checkpoint(run_dir, 3, "alice")
    plan = relay.prepare_push(store, lease, run_dir, wall_s=1)
    bob_store = relay.open_store(url)
    head = bob_store.head
    bob_store.head = lambda: (lambda sha, t, now: (sha, t, now + 61))(*head())  # the store's clock a ttl later
    bob = relay.claim(bob_store, str(tmp_path / "wb"), "bob", ttl=60, heartbeat=20)
    by = (f"bob (leg {bob.leg}, generation {bob.generation}, claimed "
          f"{relay.now_iso(bob.relay['claimed_at'])} UTC) took the baton")
    with monkeypatch.context() as m:
        m.setattr(relay_lease, "Snapshot", lambda s: (_ for _ in ()).throw(relay.Transient("HTTP 503 (a test)")))
        with pytest.raises(relay.Fenced, match="another contributor took the baton"):
            relay.renew(store, lease)
    with pytest.raises(relay.Fenced, match=re.escape(f"; {by} (our lease had expired")):
        relay.renew(store, lease)
    with pytest.raises(relay.Fenced, match=re.escape(f"; {by}; your checkpoint is kept at")):
        relay.commit_push(store, lease, plan, run_dir)
    with pytest.raises(relay.Fenced, match=re.escape(f"; {by}); nothing to hand back")):
        relay.release(store, lease)


def test_a_leg_dir_the_run_moved_past_is_not_pushed_over_others_work(tmp_path, rl):
    """A leg dir trained on a checkpoint the store has since moved past (someone else pushed after it: our lease
    expired, or the dir was pushed from and trained on) was pushed by `push --run-dir` as its "kept" messages and
    prepare_leg's warning advise: its step only had to exceed the store's, so the other contributor's steps were
    silently replaced by a checkpoint that never contained them (and the ledger still counted them)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env(), cli=rl)
    store = relay.open_store(url)
    wa, wb = tmp_path / "wa", tmp_path / "wb"
    # alice: a leg pushed at step 5, trained on to step 9 in the same dir, then her lease expires
    assert rl(["claim", url, "--workdir", wa, "--ttl", "0.9", "--heartbeat", "0.3", "--who", "alice"]).returncode == 0
    assert rl(["pull", url, "--workdir", wa]).returncode == 0
    leg_a = wa / "leg-0001-gen1"
    save_fake_checkpoint(leg_a, 5)
    assert rl(["push", url, "--workdir", wa]).returncode == 0
    save_fake_checkpoint(leg_a, 9)
    time.sleep(1.5)
    # bob takes the baton and pushes 5 -> 7
    for cmd in (["claim", url, "--ttl", "60", "--heartbeat", "20"], ["pull", url]):
        r = rl(cmd + ["--workdir", wb, "--who", "bob"])
        assert r.returncode == 0, r.stderr
    save_fake_checkpoint(wb / "leg-0002-gen2", 7)
    for cmd in (["push", url], ["release", url]):
        assert rl(cmd + ["--workdir", wb, "--who", "bob"]).returncode == 0
    assert relay.Snapshot(store).state["step"] == 7
    # alice again: the warning names her dir; pushing it would drop bob's steps 5-7
    assert rl(["claim", url, "--workdir", wa, "--ttl", "60", "--heartbeat", "20", "--who", "alice"]).returncode == 0
    r = rl(["pull", url, "--workdir", wa])
    assert r.returncode == 0 and str(leg_a) in r.stderr, r.stderr
    r = rl(["push", url, "--workdir", wa, "--run-dir", leg_a])
    assert r.returncode == 3 and "moved past" in r.stderr and "Traceback" not in r.stderr, r.stderr
    snap = relay.Snapshot(store)
    assert snap.state["step"] == 7 and snap.relay["holder"] == "alice"
    # her own fresh leg dir (pulled at step 7) still pushes, and so would the old one had nobody pushed after it
    leg_new = wa / "leg-0003-gen3"
    save_fake_checkpoint(leg_new, 8)
    r = rl(["push", url, "--workdir", wa])
    assert r.returncode == 0, r.stderr
    save_fake_checkpoint(leg_new, 10)
    assert rl(["push", url, "--workdir", wa, "--run-dir", leg_new]).returncode == 0
    assert [x["step_range"] for x in relay.parse_ledger(relay.Snapshot(store).ledger())] == ["0-5", "5-7", "7-8", "8-10"]


def test_a_dir_from_pull_out_is_not_pushed_over_others_work(tmp_path, rl):
    """`pull --out DIR` (no lease, no LEG.json), trained on after someone else pushed, then `push --run-dir DIR`:
    push checked the moved-past rule only for dirs with a LEG.json, so DIR's steps replaced bob's."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env(), cli=rl)
    store = relay.open_store(url)
    out, wa, wb = tmp_path / "out", tmp_path / "wa", tmp_path / "wb"
    assert rl(["pull", url, "--out", out]).returncode == 0  # step 0
    for cmd in (["claim", url, "--ttl", "60", "--heartbeat", "20"], ["pull", url]):
        assert rl(cmd + ["--workdir", wb, "--who", "bob"]).returncode == 0
    save_fake_checkpoint(wb / "leg-0001-gen1", 3, "bob")
    for cmd in (["push", url], ["release", url]):
        assert rl(cmd + ["--workdir", wb, "--who", "bob"]).returncode == 0
    assert rl(["claim", url, "--workdir", wa, "--ttl", "60", "--heartbeat", "20"]).returncode == 0
    save_fake_checkpoint(out, 5, "stale")
    head = store.head()[0]
    r = rl(["push", url, "--workdir", wa, "--run-dir", out])
    assert r.returncode == 3 and "no LEG.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert store.head()[0] == head and relay.Snapshot(store).state["step"] == 3  # nothing pushed


def test_a_push_landed_unseen_is_recorded_in_the_dir_it_pushed(tmp_path, hub, hf_env, rl, monkeypatch, no_backoff):
    """`push --run-dir OTHER` lands, its answer lost; the retry adopts it by its write_id but wrote PUSHED and LEG.json's
    base into the leg dir pull had recorded, not OTHER: OTHER's next push was refused as "moved past" (its own push)."""
    import shutil
    url, store, work, lease, leg, _ = hub_leg(tmp_path, hub)
    other = str(tmp_path / "other")
    shutil.copytree(leg, other)  # a second leg dir of this lease, standing on the store's checkpoint too
    save_fake_checkpoint(other, 7)
    lose_answer_of_commit(hub, monkeypatch)
    r = rl(["push", url, "--workdir", work, "--run-dir", other])
    assert r.returncode == 3 and "unknown whether the commit landed" in r.stderr, r.stderr
    hub.status_override = None
    r = rl(["push", url, "--workdir", work, "--run-dir", other])
    assert r.returncode == 0 and "the earlier push had landed" in r.stdout, r.stderr
    assert open(os.path.join(other, "PUSHED")).read().split()[1] == "7" and not os.path.exists(os.path.join(leg, "PUSHED"))
    save_fake_checkpoint(other, 9)
    r = rl(["push", url, "--workdir", work, "--run-dir", other])
    assert r.returncode == 0, r.stderr  # was: "moved past"
    assert relay.Snapshot(store).state["step"] == 9


def test_lease_saves_from_two_threads_keep_the_newest(tmp_path, monkeypatch):
    """The heartbeat thread's save (a snapshot taken, its write slow) and the main thread's (leg_wall_s) ran
    interleaved: the older snapshot, written last, dropped the main thread's field from LEASE.json."""
    import threading
    import relay_lease
    lease = relay.Lease(str(tmp_path / "LEASE.json"), store="file:///x", sha="a")
    entered, go, real = threading.Event(), threading.Event(), relay_lease.write_atomic

    def slow(path, text):
        if threading.current_thread().name == "beat":
            entered.set()
            go.wait(5)
        real(path, text)
    monkeypatch.setattr(relay_lease, "write_atomic", slow)
    beat = threading.Thread(target=lease.save, name="beat")
    beat.start()
    assert entered.wait(5)
    lease.leg_wall_s = 7.0
    main = threading.Thread(target=lease.save)
    main.start()
    main.join(0.3)
    go.set()
    beat.join()
    main.join()
    assert json.load(open(lease.path)).get("leg_wall_s") == 7.0


def test_release_checks_the_dir_push_run_dir_pushed_from(tmp_path, rl, monkeypatch):
    """`release` looked for unpushed steps only in the leg dir `pull` recorded: steps trained in a dir after
    `push --run-dir DIR` (or in DIR whose upload failed) were dropped with "released", exit 0."""
    import shutil
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env(), cli=rl)
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    for cmd in (["claim", url, "--ttl", "60", "--heartbeat", "20"], ["pull", url]):
        assert rl(cmd + ["--workdir", work]).returncode == 0
    other = str(tmp_path / "other")
    shutil.copytree(os.path.join(work, "leg-0001-gen1"), other)  # a second leg dir of this lease
    save_fake_checkpoint(other, 5)
    assert rl(["push", url, "--workdir", work, "--run-dir", other]).returncode == 0
    save_fake_checkpoint(other, 9)  # trained on after the push
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 3 and f"{other} holds step 9" in r.stderr and "--run-dir" in r.stderr, r.stderr
    assert relay.Snapshot(store).relay["holder"] == "tester"  # still held
    # a push of DIR whose upload failed, then release
    save_fake_checkpoint(other, 12)
    with monkeypatch.context() as m:
        m.setattr(type(store), "stage", lambda self, adds: (_ for _ in ()).throw(relay.StoreError("disk full")))
        assert rl(["push", url, "--workdir", work, "--run-dir", other]).returncode == 3
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 3 and f"{other} holds step 12" in r.stderr, r.stderr
    assert rl(["push", url, "--workdir", work, "--run-dir", other]).returncode == 0
    assert rl(["release", url, "--workdir", work]).returncode == 0
    snap = relay.Snapshot(store)
    assert snap.state["step"] == 12 and snap.relay["holder"] is None


def test_release_after_the_lease_was_taken_says_so_not_push_first(tmp_path, rl):
    """A paused holder's lease taken by the next contributor: `release` said "holds step 3 ... never pushed:
    `relay.py push` first, or release with --discard" (exit 3), though the push can only be fenced and --discard
    then said "lease already lost". It now says the lease is lost (exit 4), drops LEASE.json and names the kept
    steps."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    a = relay.claim(store, work, "alice", ttl=1.5, heartbeat=0.5)
    a_dir = relay.prepare_leg(store, a, work)
    save_fake_checkpoint(a_dir, 3, "alice")
    time.sleep(2.8)  # alice is paused past her ttl (+1 s: the store's clock has 1 s resolution on the Hub)
    relay.claim(store, str(tmp_path / "wb"), "bob", ttl=1.5, heartbeat=0.5)
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 4 and "lease already lost" in r.stderr and "push` first" not in r.stderr, r.stderr
    assert f"{a_dir} keeps step 3, never pushed" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(os.path.join(work, "LEASE.json"))
    assert checkpoint.verify(os.path.join(a_dir, "step_0000003"))
    assert relay.Snapshot(store).relay["holder"] == "bob"  # bob's lease untouched


def test_a_push_or_pull_fenced_while_renewing_does_not_say_training_stopped(tmp_path, monkeypatch):
    """`relay.py push` whose upload's heartbeat found the lease taken said "Training stopped; nothing pushed" (no
    trainer runs there); `run`'s trainer heartbeat still says it."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=3, heartbeat=1)

    def taken(store_, lease_, **kw):
        raise relay.Fenced("lease lost: someone else's commit (a test)")
    monkeypatch.setattr(relay, "renew", taken)
    with pytest.raises(relay.Fenced) as e:
        with relay.renewing(store, lease, "/kept/here") as hb:
            wait_for(lambda: hb.fenced, 10, "the renewal to be fenced")
    assert "Training stopped" not in str(e.value), e.value
    assert "Nothing pushed; local checkpoints are kept in /kept/here" in str(e.value), e.value
    hb = relay.Heartbeat(store, lease, lambda: None)
    hb.fenced, hb.failed = True, "lease lost: a test"
    with pytest.raises(relay.Fenced, match="Training stopped; nothing pushed"):
        relay.stop_heartbeat(hb, "/kept/here", training=True)


def test_a_corrupt_checkpoint_in_the_store_names_the_store_file_and_its_fix(tmp_path, rl):
    """A damaged checkpoint/ in the store: pull named a temporary dir it had already removed
    (.../.pull-1a2b3c4d/checkpoint/model.safetensors) and said "use an earlier step_* dir", which a puller has not."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    sha = store.head()[0]
    oid = store.file_ids(sha, "checkpoint/")["checkpoint/model.safetensors"]
    with open(tmp_path / "store" / "objects" / oid[:2] / oid, "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(relay.RelayError) as e:
        relay.pull(store, str(tmp_path / "pulled"))
    msg = str(e.value)
    assert "checkpoint/model.safetensors: sha256 does not match" in msg and ".pull-" not in msg, msg
    assert "step_* dir" not in msg and "revert the push that wrote it" in msg, msg
    assert not os.path.exists(tmp_path / "pulled" / "LATEST")
    # `run` said the same and nothing of the baton it had claimed (and released)
    r = rl(["run", url, "--steps", "2", "--train-script", write_fake_train(tmp_path), "--workdir", tmp_path / "wa"])
    assert r.returncode == 3 and "sha256 does not match" in r.stderr and r.stderr.strip().endswith("lease released")
    assert relay.Snapshot(store).relay["holder"] is None


def test_status_prints_the_ledgers_dollars_and_losses_as_the_ledger_writes_them(tmp_path, rl):
    """`relay.py status` printed a leg's $ as parsed floats ("$1.0", "$0.0" beside the total's "$1.00") and a leg with
    no logged loss as "loss None -> None"."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=3, heartbeat=1)
    run_dir = relay.prepare_leg(store, lease, str(tmp_path / "wa"))
    save_fake_checkpoint(run_dir, 3, "w")
    push(store, lease, run_dir, wall_s=1800, usd_per_hour=2.0)  # no metrics.jsonl: no loss logged
    relay.release(store, lease)
    r = rl(["status", url])
    assert r.returncode == 0 and ", $1.00 so far" in r.stdout, r.stdout
    assert r.stdout.splitlines()[-1].endswith("0h30m00s, loss - -> -, $1.00"), r.stdout
    # `relay.py status STORE | head -1`: a BrokenPipeError traceback once the reader had left
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader already gone: the first write fails (EPIPE)
    p = subprocess.run([sys.executable, "relay.py", "status", url], cwd=ROOT, env=base_env(), stdout=write_end,
                       stderr=subprocess.PIPE, text=True, timeout=60)
    os.close(write_end)
    assert "Traceback" not in p.stderr and "Broken" not in p.stderr, p.stderr


def test_status_says_an_expert_load_collapse_the_pushed_checkpoint_warned_of(tmp_path, rl):
    """A trainer's expert-load collapse warning was said once, in the log of whoever trained that leg: `relay.py
    status` said nothing of it. The push copies state.json's load_collapse into training_state.json (no download
    more for status), which says it while the newest pushed checkpoint's warning stands; a push that cleared it
    ends it."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)

    def leg(step, warned):
        lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=90, heartbeat=30)
        run_dir = relay.prepare_leg(store, lease, str(tmp_path / "wa"))
        st = {"step": step, "tokens": 100 * step, "load_collapse": {"streak": [4], "since": [101], "warned": warned}}
        save_fake_checkpoint(run_dir, step, "w", state=st)
        push(store, lease, run_dir, wall_s=1, usd_per_hour=0.0)
        relay.release(store, lease)
        return rl(["status", url])
    r = leg(140, 130)
    said = [ln for ln in r.stdout.splitlines() if "expert load" in ln]
    assert r.returncode == 0 and said == [
        f"  WARNING: expert load collapsed since step 130 (the pushed checkpoint's state; its leg's trainer log names "
        f"the layers): dead_frac_layers in logs/, or `relay.py dashboard {url}`"], r.stdout
    assert json.loads(rl(["status", url, "--json"]).stdout)["load_collapsed_since"] == 130
    r = leg(160, None)  # the next leg's trainer said it recovered
    assert r.returncode == 0 and "expert load" not in r.stdout, r.stdout


def test_a_pull_names_earlier_leg_dirs_that_nothing_resumes(tmp_path, capsys):
    """A fenced or failed leg's dir (a checkpoint or more, GBs on a real run) stayed in the workdir for good, never
    named again, until a pull ran out of disk; the next pull names it (whether steps were trained there), keeps it,
    and says nothing of pushed ones or of ones without a checkpoint."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    work = str(tmp_path / "wa")
    lost = os.path.join(work, "leg-0007-gen9")  # an earlier lease's leg, fenced before its push
    save_fake_checkpoint(lost, 5, "w")
    os.makedirs(os.path.join(work, "leg-0008-gen10"))  # a pull that failed before any checkpoint: nothing to name
    failed = relay.claim(store, work, "alice", ttl=3, heartbeat=1)  # a leg whose trainer failed before its first step
    failed_dir = relay.prepare_leg(store, failed, work)
    relay.release(store, failed)
    lease = relay.claim(store, work, "alice", ttl=3, heartbeat=1)
    capsys.readouterr()
    relay.prepare_leg(store, lease, work)
    err = capsys.readouterr().err
    assert f"{work} holds earlier leg dirs that nothing resumes" in err, err
    assert "leg-0007-gen9 (step 5 never pushed" in err, err
    assert f"{os.path.basename(failed_dir)} (only the pulled step 0," in err, err
    assert "leg-0008-gen10" not in err and len(err.strip().splitlines()) == 1, err
    assert checkpoint.verify(os.path.join(lost, "step_0000005"))  # kept
    relay.release(store, lease)


def test_a_leg_of_a_finished_run_is_refused_before_anything_is_claimed(tmp_path, rl):
    """`relay.py run` on a run whose plan is done (status: FINISHED) claimed the baton, downloaded the checkpoint,
    started the trainer, which made no step, and then failed "push refused: ... is the plan finished?"."""
    url = store_url("file", tmp_path, None)
    fake = init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    store.commit(snap.sha, {"training_state.json": json.dumps(dict(snap.state, finished=True)).encode()}, [],
                 "relay: a finished run (a test)")
    head = store.head()[0]
    r = rl(["run", url, "--steps", "2", "--wait", "--train-script", fake, "--workdir", tmp_path / "wa"], base_env())
    assert r.returncode == 3 and "the run is finished" in r.stderr and "nothing claimed" in r.stderr, r.stderr
    assert f"relay.py pull {url} --out DIR" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert store.head()[0] == head and not os.path.exists(tmp_path / "wa" / "LEASE.json")


def test_commands_that_only_read_or_write_the_store_offer_no_workdir_or_who():
    """status, decay and dashboard listed --workdir and --who in their --help, and ignored both."""
    subs = next(a for a in relay.build_parser()._actions if a.dest == "cmd").choices
    for cmd, sp in subs.items():
        opts = {o for a in sp._actions for o in a.option_strings}
        assert ("--workdir" in opts and "--who" in opts) == (cmd not in ("status", "decay", "dashboard")), cmd


def test_a_renewal_found_landed_later_counts_from_when_it_was_sent(tmp_path, no_backoff, monkeypatch):
    """A heartbeat lands, its answer is lost and the store stays dark for a few retries; a later retry (of this
    thread, or of the next heartbeat: the trainer's after the pull's) finds it landed by its write_id. The store's
    lease clock started when it landed, but the holder counted from the retry that found it: its self-stop deadline
    then lay past the lease's expiry (another could claim while it trained)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=30, heartbeat=0.4)
    plain_commit, landed_at = store.commit, []

    def commit(parent, adds, deletes, message):
        if store.drop_answer_of and store.drop_answer_of in message:
            landed_at.append(relay.lease_clock())
            try:
                return plain_commit(parent, adds, deletes, message)
            finally:
                store.dark_heads = 8  # dark past the try's own look (5 reads), then for a few retries
        return plain_commit(parent, adds, deletes, message)
    store.commit = commit
    real = relay.renew

    def one_heartbeat():
        hb = relay.Heartbeat(store, lease, lambda: None)

        def renew_once(store_, lease_, **kw):  # the first renewal that succeeds ends the heartbeat (the next is new)
            real(store_, lease_, **kw)
            hb.stop.set()
        monkeypatch.setattr(relay, "renew", renew_once)
        hb.start()
        hb.join(10)
        assert not hb.is_alive() and not hb.failed and not getattr(lease, "pending_renewal", None)
        assert lease.sha == store.head()[0]
        return hb
    store.drop_answer_of = "heartbeat"  # lost in this heartbeat's own first renewal
    hb = one_heartbeat()
    assert hb.last_ok <= landed_at[-1] + 0.05  # was: the time of the retry that found it, ~1 s later
    store.drop_answer_of = "heartbeat"  # lost in a renewal before this heartbeat started
    with pytest.raises(relay.Transient):
        real(store, lease)
    time.sleep(0.3)
    hb = one_heartbeat()
    assert hb.last_ok <= landed_at[-1] + 0.05  # was: this heartbeat's first try, 0.3 s and more later


def test_a_claim_landed_unseen_is_not_released_as_lost_on_one_failed_look(tmp_path, no_backoff):
    """A claim lands, its answer is lost; at `release` the store failed the one read that would have found it, so
    the release's commit was refused by our own claim and taken for someone else's: "lease already lost", LEASE.json
    deleted, and the claim held the baton as a ghost for a whole ttl (`claim` from the same workdir: busy)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = lost_answers_store(str(tmp_path / "store"))
    work = str(tmp_path / "wa")
    store.drop_answer_of = "claim"
    with pytest.raises(relay.Transient):
        relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    store.dark_heads = 1  # the store still flaky: one more read fails
    lease = relay.Lease.load(work, store)
    with pytest.raises(relay.Transient):  # was: Fenced, "release: lease already lost"
        relay.release(store, lease)
    relay.release(store, relay.Lease.load(work, store))  # the store back: the claim is found and handed back
    assert not relay.Snapshot(store).held and not os.path.exists(os.path.join(work, "LEASE.json"))


def test_a_machine_suspended_past_the_ttl_finds_its_lease_overdue(tmp_path, monkeypatch):
    """A laptop or VM suspended mid-leg for longer than the ttl: time.monotonic (CLOCK_MONOTONIC) does not count the
    suspend, so on resume the holder was not overdue and trained on while another contributor could claim. The
    kernel's CLOCK_BOOTTIME does count it (simulated here: it runs ahead of CLOCK_MONOTONIC by the suspend)."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=20)
    hb = relay.Heartbeat(store, lease, lambda: None)
    assert not hb.overdue()
    real, suspended_s = time.clock_gettime, 120.0
    monkeypatch.setattr(time, "clock_gettime", lambda c: real(c) + (suspended_s if c == time.CLOCK_BOOTTIME else 0))
    assert hb.overdue()  # was: not overdue for another 120 s of training


def test_a_heartbeat_whose_stderr_is_gone_keeps_renewing(tmp_path, monkeypatch):
    """relay's stderr piped into a `tee` that died: the heartbeat's note about one failed renewal raised
    BrokenPipeError, which ended the thread; nothing renewed the lease for the rest of the leg."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=3, heartbeat=0.2)
    real, calls = relay.renew, []

    def flaky(store_, lease_, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise relay.Transient("HTTP 503 (a test)")
        real(store_, lease_, **kw)

    class DeadPipe:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(relay, "renew", flaky)
    monkeypatch.setattr(sys, "stderr", DeadPipe())
    hb = relay.Heartbeat(store, lease, lambda: None)
    first = lease.sha
    hb.start()
    wait_for(lambda: lease.sha != first or not hb.is_alive(), 5, "a renewal or the thread's end")
    alive = hb.is_alive()
    hb.stop.set()
    hb.join()
    assert alive and lease.sha != first  # was: the thread dead after the first failed renewal


def test_a_push_after_a_killed_run_bills_the_trainers_time_not_the_hours_since_the_pull(tmp_path, rl):
    """`run` killed mid-leg (relay SIGKILLed, the machine rebooted) never saved the leg's wall time in LEASE.json, only
    in LEG.json (every 30 s); the `relay.py push` that finishes the leg billed the hours from the pull to the push
    instead, idle time after the crash included."""
    url = store_url("file", tmp_path, None)
    fake = init_run(url, tmp_path, base_env(), cli=rl)
    work = str(tmp_path / "wa")
    store = relay.open_store(url)
    lease = relay.claim(store, work, "alice", ttl=3, heartbeat=1)
    run_dir = relay.prepare_leg(store, lease, work)
    train_leg(fake, run_dir, 5)
    relay.leg_wall(run_dir, 100.0)  # what `run` had saved of its trainer's time before it was killed
    lease = relay.Lease.load(work, store)
    lease.pulled_at -= 2 * 3600  # the push comes two hours after the pull
    lease.save()
    r = rl(["push", url, "--workdir", work])
    assert r.returncode == 0, r.stderr
    rows, snap = ledger_rows(store)
    assert [(x["step_range"], x["wall"], x["usd"]) for x in rows] == [("0-5", "0h01m40s", round(100 / 3600 * 2, 2))]
    assert abs(snap.state["usd_total"] - 100 / 3600 * 2) < 1e-9
    # steps trained by hand in the same dir after that push, pushed too: billed from the first push, not 100 s again
    train_leg(fake, run_dir, 2)
    r = rl(["push", url, "--workdir", work, "--run-dir", run_dir])
    assert r.returncode == 0, r.stderr
    rows, snap = ledger_rows(store)
    assert [x["step_range"] for x in rows] == ["0-5", "5-7"] and rows[1]["wall"].startswith("0h00m0"), rows


def test_a_pull_killed_mid_download_leaves_no_partial_copy_behind(tmp_path):
    """A pull killed mid-download (SIGKILL, a reboot) left its temporary folder, a partial copy of a checkpoint of
    many GB, in the leg dir, and every `run` resuming that leg downloaded into a new one beside it."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    init_run(url, tmp_path, env)
    store = relay.open_store(url)
    dest = tmp_path / "pulled"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = dest / f".pull-{dead.pid}-0123abcd" / "checkpoint"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"w" * 10)
    live = dest / f".pull-{os.getppid()}-4567abcd"  # a pull of a live process (another `pull --out` here): kept
    live.mkdir()
    relay.pull(store, str(dest))
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith(".pull-")) == [live.name]


def test_the_push_that_finishes_a_run_bills_the_runs_hourly_rate(tmp_path, rl, monkeypatch):
    """`run --gpu_hourly_usd=36` (this contributor's GPU) whose commit failed: the `relay.py push` its error names
    billed the leg at the config's rate (2.0), the run's override forgotten."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    with open(fake) as f:  # a trainer with train.py's gpu_hourly_usd key, which a run's override may set
        src = f.read()
    with open(fake, "w") as f:
        f.write("gpu_hourly_usd = 0.0\n" + src)
    real = relay.commit_push

    def refused(*a, **k):
        raise relay.Transient("the store timed out (a test)")
    monkeypatch.setattr(relay, "commit_push", refused)
    work = tmp_path / "wa"
    r = rl(["run", url, "--steps", "4", "--train-script", fake, "--workdir", work, "--gpu_hourly_usd=36"], env)
    assert r.returncode == 3 and f"relay.py push {url} --workdir {work}" in r.stderr, r.stderr
    monkeypatch.setattr(relay, "commit_push", real)
    wall = relay.Lease.load(str(work), relay.open_store(url)).leg_wall_s
    assert rl(["push", url, "--workdir", work], env).returncode == 0
    rows, snap = ledger_rows(relay.open_store(url))
    assert abs(snap.state["usd_total"] - wall / 3600 * 36) < 1e-9, (snap.state["usd_total"], wall)


def test_a_push_after_a_re_save_killed_between_its_renames_pushes_the_newest_step(tmp_path, rl, monkeypatch):
    """A trainer killed between a re-save's two renames leaves step_N.old-PID and no step_N (checkpoint.recover puts it
    back, as train.py's next resume does): `relay.py push` pushed the step before it, the leg's newest step left out.
    Put back under the trainer's lock (rundir.recover_for_reader); refused while a trainer holds it."""
    import fcntl
    import rundir
    url = store_url("file", tmp_path, None)
    fake = init_run(url, tmp_path, base_env(), cli=rl)
    work = str(tmp_path / "wa")
    store = relay.open_store(url)
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    train_leg(fake, run_dir, 10)
    newest = os.path.join(run_dir, checkpoint.step_dir_name(10))
    os.replace(newest, newest + f".old-{os.getpid()}")  # the re-save's first rename, by a trainer still running
    monkeypatch.setattr(rundir, "RESAVE_WAIT_S", 0.3)
    with open(os.path.join(run_dir, ".trainer.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = rl(["push", url, "--workdir", work])
    assert r.returncode == 3, r.stderr
    assert "push refused:" in r.stderr and "is being re-saved by the trainer holding" in r.stderr, r.stderr
    assert relay.Snapshot(store).state["step"] == 0 and not os.path.isdir(newest)
    r = rl(["push", url, "--workdir", work])  # ... whose trainer was killed: no one holds the lock
    assert r.returncode == 0 and f"{newest}: put back" in r.stderr, r.stderr
    assert relay.Snapshot(store).state["step"] == 10 and os.path.isdir(newest)


def test_a_store_config_cannot_set_a_legs_resume_path_or_length(tmp_path, rl):
    """resume_from (a local step dir: every leg resumed there, not from its own leg dir) and stop_after_steps /
    stop_after_hours (a leg's length, set by `run --steps / --hours`; the other one applied to every leg) in the run's
    shared config.py: refused by pull and by init, one line naming the key, the file and the fix; -1 (off) is not."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    store = relay.open_store(url)
    for i, line in enumerate(["resume_from = '/home/me/out/step_0000005'", "stop_after_steps = 3",
                              "stop_after_hours = 0.5"]):
        snap = relay.Snapshot(store)
        relay.commit_cas(store, snap.sha, {"config.py": f"gpu_hourly_usd = 2.0\n{line}\n".encode()}, [], "a test",
                         snap.relay)
        r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / f"wb{i}"], env)
        key = line.split()[0]
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"sets {key}, which relay takes from no store" in r.stderr and "remove it from config.py" in r.stderr
        assert relay.Snapshot(store).relay["holder"] is None and relay.Snapshot(store).state["step"] == 0
    (tmp_path / "x").mkdir()
    for text in ("resume_from = 'out/step_0000005'\n", "stop_after_hours = 2\n"):
        cfg = write_config(tmp_path / "x", text)
        r = rl(["init", f"file://{tmp_path}/store2", cfg, "--train-script", fake, "--workdir", tmp_path / "wi"], env)
        assert r.returncode == 3 and f"init refused: {cfg} sets {text.split()[0]}" in r.stderr, r.stderr
        assert not (tmp_path / "store2").exists()
    cfg = write_config(tmp_path / "x", "gpu_hourly_usd = 2.0\nstop_after_steps = -1\nstop_after_hours = -1.0\n")
    r = rl(["init", f"file://{tmp_path}/store2", cfg, "--train-script", fake, "--workdir", tmp_path / "wi"], env)
    assert r.returncode == 0, r.stderr


def test_a_killed_inits_temp_dir_is_removed_by_the_next_init_or_run_a_live_ones_kept(tmp_path, rl):
    """A `relay.py init` killed while train.py wrote its step-0 checkpoint left WORKDIR/init-* (GBs at nano size) for
    good; the next init or run removes those whose process on this host is gone, never a live one's or another
    host's."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    work = tmp_path / "w-init"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = checkpoint.host_tag()
    stale, live, other = (work / f"init-{host}-{dead.pid}-0123abcd", work / f"init-{host}-{os.getpid()}-4567abcd",
                          work / f"init-elsewhere-{dead.pid}-89abcdef")
    for d in (stale, live, other):
        (d / "step_0000000").mkdir(parents=True)
    fake = init_run(url, tmp_path, env, cli=rl)  # (its workdir: w-init)
    assert sorted(p.name for p in work.iterdir() if p.name.startswith("init-")) == sorted([live.name, other.name])
    stale.mkdir()
    r = rl(["run", url, "--steps", "1", "--train-script", fake, "--workdir", work], env)
    assert r.returncode == 0 and f"removed {stale}, left by a killed `relay.py init`" in r.stderr, r.stderr
    assert not stale.exists() and live.is_dir() and other.is_dir()


def test_pull_without_out_keeps_only_the_newest_step_it_pulled(tmp_path, rl):
    """`relay.py pull STORE` (no lease, no --out) pulls into WORKDIR/pulled and kept every step it ever pulled there,
    GBs each leg; now the earlier steps it pulled there are removed once a newer one is in. A step written there by
    hand (a trainer run in that folder) stays, and so does everything in a --out DIR, the user's own."""
    url = store_url("file", tmp_path, None)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    common = ["--train-script", fake, "--workdir", tmp_path / "wa"]
    pulled = tmp_path / "wp" / "pulled"
    assert rl(["pull", url, "--workdir", tmp_path / "wp"]).returncode == 0
    assert rl(["pull", url, "--out", tmp_path / "mine"]).returncode == 0
    assert rl(["run", url, "--steps", "3", *common], env).returncode == 0
    save_fake_checkpoint(pulled, 1, "mine", state={"step": 1})  # trained by hand
    r = rl(["pull", url, "--workdir", tmp_path / "wp"])
    assert r.returncode == 0 and f"removed {pulled / 'step_0000000'}, an earlier pull" in r.stdout, r.stdout
    assert sorted(p.name for p in pulled.glob("step_*")) == ["step_0000001", "step_0000003"]
    assert checkpoint.resolve(str(pulled)).endswith("step_0000003")
    assert rl(["run", url, "--steps", "2", *common], env).returncode == 0
    assert rl(["pull", url, "--workdir", tmp_path / "wp"]).returncode == 0
    assert rl(["pull", url, "--out", tmp_path / "mine"]).returncode == 0
    assert sorted(p.name for p in pulled.glob("step_*")) == ["step_0000001", "step_0000005"]
    assert sorted(p.name for p in (tmp_path / "mine").glob("step_*")) == ["step_0000000", "step_0000005"]


def test_stopping_the_heartbeat_does_not_wait_out_a_renewals_retries(tmp_path):
    """The store failing every renewal (HTTP 503s): stop_heartbeat (the leg is over, its push waits) joined the thread
    only after the renewal's whole retry loop (backoff 0.2 s doubling to 10 s, 5 tries: seconds to minutes, the lease
    running out meanwhile); the heartbeat now ends between two tries, its write id kept for the push to look for."""
    url = store_url("file", tmp_path, None)
    init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    lease = relay.claim(store, str(tmp_path / "wa"), "alice", ttl=60, heartbeat=0.1)
    tries = []

    def unavailable(*a, **k):
        tries.append(time.time())
        raise relay.Transient("HTTP 503 (a test)")
    store.commit = unavailable
    hb = relay.Heartbeat(store, lease, lambda: None)
    relay.start_heartbeat(hb)
    wait_for(lambda: tries, 10, "a renewal's first try")
    t0 = time.time()
    relay.stop_heartbeat(hb, str(tmp_path / "wa"))
    assert time.time() - t0 < 0.5 and len(tries) == 1 and not hb.failed
    assert json.load(open(tmp_path / "wa" / "LEASE.json"))["pending_renewal"]


def test_a_dict_override_at_init_updates_the_configs_dict(tmp_path, rl):
    """`relay.py init CONFIG --lr_mult="{'new': 2.0}"` baked the override parsed over train.py's defaults: the run's
    config then set lr_mult to the defaults plus 'new', and every leg trained the config's 'old' layers at 1.0 instead
    of its 0.1. It updates the config's dict now, as train.py's configurator does."""
    fake = tmp_path / "fake_train.py"
    fake.write_text('lr_mult = {"embedding": 1.0, "old": 1.0, "new": 1.0}\n' + FAKE_TRAIN)
    cfg = write_config(tmp_path, "gpu_hourly_usd = 2.0\nlr_mult = {'embedding': 0.3, 'old': 0.1, 'new': 1.0}\n")
    url = f"file://{tmp_path}/store"
    r = rl(["init", url, cfg, "--train-script", fake, "--workdir", tmp_path / "w0", "--lr_mult={'new': 2.0}"],
           base_env())
    assert r.returncode == 0, r.stderr
    store = relay.open_store(url)
    baked = relay.config_values(store.read(relay.Snapshot(store).sha, "config.py").decode())["lr_mult"]
    assert baked == {"embedding": 0.3, "old": 0.1, "new": 2.0}, baked


# ----------------------------------------------------------------------------------------------------------------
# A hostile contributor: the store is shared, and whatever it holds was written by someone else


@pytest.fixture(scope="module")
def hostile_base(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    init_run(f"file://{d}/store", d, base_env())
    return d


@pytest.fixture
def hostile(hostile_base, tmp_path):
    """(url, store, head) of a fresh copy of one run initialised once per module: the hostile edits go on top."""
    shutil.copytree(hostile_base / "store", tmp_path / "store")
    url = f"file://{tmp_path}/store"
    store = relay.open_store(url)
    return url, store, store.head()[0]


def one_line_error(r):
    return r.returncode == 3 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_pull_writes_nothing_outside_its_dir_for_a_store_path_naming_dotdot(tmp_path, hostile, rl):
    """A store listing checkpoint/../../../evil.txt (a hand-made commit) made `pull --out OUT/a/b` write evil.txt in
    OUT/a: with more ../ anywhere the user can write (~/.bashrc). The checkpoint is flat: a path under checkpoint/
    that is not one plain file name is refused before anything is downloaded."""
    url, store, head = hostile
    for i, bad in enumerate(["checkpoint/../../../evil.txt", "checkpoint/sub/../../../../evil.txt",
                             "checkpoint/evil\n.txt", "checkpoint/..", "checkpoint/evil\x1b[2J.txt"]):
        sha = store.commit(head, {bad: b"pwned"}, [], "relay: a hostile commit")
        r = rl(["pull", url, "--out", tmp_path / f"out{i}" / "a" / "b"])
        assert one_line_error(r) and "not a plain file name" in r.stderr and "\x1b" not in r.stderr, (bad, r.stderr)
        found = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs if "evil" in f]
        assert not found, (bad, found)
        head = store.commit(sha, {}, [bad], "relay: undo")


def test_verify_refuses_manifest_names_that_are_not_plain_file_names(tmp_path):
    """A MANIFEST.json naming ../../secret or /abs/path (with its true sha256 and size) verified: checkpoint.verify
    hashed a file outside the checkpoint, and whatever then read or uploaded the manifest's files took it along."""
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    ck = checkpoint.save(str(tmp_path / "run"), 3, {"state.json": lambda p: open(p, "w").write("{}")})
    good = json.load(open(os.path.join(ck, "MANIFEST.json")))
    meta = {"sha256": checkpoint.sha256_file(str(secret)), "bytes": 6}
    for name in ["../../secret.txt", str(secret), "sub/../../../secret.txt", "", ".", "a\x00b"]:
        json.dump({**good, "files": {**good["files"], name: meta}}, open(os.path.join(ck, "MANIFEST.json"), "w"))
        with pytest.raises(checkpoint.CheckpointError, match="not a plain file name"):
            checkpoint.verify(ck)
    json.dump(good, open(os.path.join(ck, "MANIFEST.json"), "w"))
    checkpoint.verify(ck)


def test_a_pull_refuses_a_manifest_step_that_is_not_a_step_number(tmp_path, hostile, rl):
    """MANIFEST.json's step "x" or null stopped `pull` with a ValueError / TypeError traceback; -5 installed
    step_-000005, 1.5 and true installed step_0000001 (another step's name)."""
    url, store, head = hostile
    manifest = json.loads(store.read(head, "checkpoint/MANIFEST.json"))
    for i, bad in enumerate(["x", None, -5, 1.5, True]):
        store.commit(store.head()[0], {"checkpoint/MANIFEST.json": json.dumps({**manifest, "step": bad}).encode()}, [],
                     "relay: a hostile commit")
        out = tmp_path / f"out{i}"
        r = rl(["pull", url, "--out", out])
        assert one_line_error(r) and "step" in r.stderr, (bad, r.stderr)
        assert not [n for n in os.listdir(out) if n.startswith("step_")], (bad, os.listdir(out))


def test_a_json_nesting_bomb_in_the_lease_file_is_a_one_line_error(hostile, rl):
    """RELAY.json (or training_state.json) of 100,000 nested [ stopped every command with a RecursionError
    traceback."""
    url, store, head = hostile
    for name in ("RELAY.json", "training_state.json"):
        sha = store.commit(store.head()[0], {name: b"[" * 100000 + b"]" * 100000}, [], "relay: a hostile commit")
        r = rl(["status", url])
        assert one_line_error(r) and f"{name} at {sha[:10]} is malformed" in r.stderr, r.stderr
        store.commit(sha, {name: store.read(head, name)}, [], "relay: restored")


def test_status_prints_no_terminal_escapes_from_the_store(hostile, rl):
    """A holder or ledger row named with ESC sequences (clear the screen, set the title, recolour) reached
    the contributor's terminal as written through `relay.py status`; now shown escaped."""
    url, store, head = hostile
    lease = json.loads(store.read(head, "RELAY.json"))
    row = "| 9 | ev\x1b[31mil | g\x1b]0;title\x07pu | 1 | 1 | 0h00m01s | 0.00 | 1 | 1 | 0-1 | 1 | x\x1b[0m |\n"
    hostile_lease = {**lease, "holder": "mal\x1b[2Jlory\r", "claimed_at": time.time()}
    store.commit(head, {"RELAY.json": json.dumps(hostile_lease).encode(),
                        "LEDGER.md": store.read(head, "LEDGER.md") + row.encode()}, [], "relay: a hostile commit")
    r = rl(["status", url])
    assert r.returncode == 0 and not {"\x1b", "\x07", "\r"} & set(r.stdout), repr(r.stdout)
    assert "mal\\x1b[2Jlory" in r.stdout and "ev\\x1b[31mil" in r.stdout, r.stdout
    r = rl(["claim", url, "--workdir", "wa"])  # the holder named in claim's error too
    assert r.returncode == 3 and "\x1b" not in r.stderr and "mal\\x1b[2Jlory" in r.stderr, repr(r.stderr)


def test_a_pull_refuses_a_manifest_or_state_json_that_is_not_what_it_says(tmp_path, hostile, rl):
    """A checkpoint whose MANIFEST.json nests 100,000 [ stopped `pull` with a RecursionError traceback; one whose
    state.json (listed in the manifest, hashes right) was such a bomb, not JSON, a list or named step "x" passed the
    pull and stopped `run` with a traceback after the claim, the baton held till its ttl ran out."""
    url, store, head = hostile
    bomb = b"[" * 100000 + b"]" * 100000
    sha = store.commit(head, {"checkpoint/MANIFEST.json": bomb}, [], "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out"])
    assert one_line_error(r) and "MANIFEST.json" in r.stderr, r.stderr
    manifest = json.loads(store.read(head, "checkpoint/MANIFEST.json"))
    for i, state in enumerate([bomb, b"{not json", b"[]", json.dumps({"step": "x", "tokens": 0}).encode()]):
        files = {**manifest["files"], "state.json": {"sha256": hashlib.sha256(state).hexdigest(), "bytes": len(state)}}
        sha = store.commit(sha, {"checkpoint/MANIFEST.json": json.dumps({**manifest, "files": files}).encode(),
                                 "checkpoint/state.json": state}, [], "relay: a hostile commit")
        r = rl(["pull", url, "--out", tmp_path / f"out{i}"])
        assert one_line_error(r) and "state.json" in r.stderr, (state[:20], r.stderr)
        assert not [n for n in os.listdir(tmp_path / f"out{i}") if n.startswith("step_")]
    r = rl(["run", url, "--steps", "2", "--train-script", write_fake_train(tmp_path), "--workdir", tmp_path / "wa"])
    assert one_line_error(r) and "state.json" in r.stderr, r.stderr
    assert relay.Snapshot(store).relay["holder"] is None


def test_a_file_store_reads_no_file_outside_it_for_a_commit_record_naming_one(tmp_path, hostile, rl):
    """A file:// store shared by several users: a commit record whose tree mapped LEDGER.md to /home/alice/.ssh/id_rsa
    (or ../../x) had every reader read that file of their own as the ledger, and a push append its row to it and commit
    it to the store for all to read. A HEAD or parent naming ../x read any .json as a commit. Object and commit ids are
    hex digests, nothing else."""
    url, store, head = hostile
    secret = tmp_path / "id_rsa"
    secret.write_text("| 1 | PRIVATE KEY | g | 1 | 1 | 0h00m01s | 0.00 | 1 | 1 | 0-1 | 1 | now |\n")
    record = json.load(open(tmp_path / "store" / "commits" / f"{head}.json"))
    for oid in (str(secret), "../" * 8 + str(secret)[1:]):
        record["tree"]["LEDGER.md"] = oid
        json.dump(record, open(tmp_path / "store" / "commits" / f"{head}.json", "w"))
        with pytest.raises(relay.StoreError, match="damaged"):
            store.read(head, "LEDGER.md")
        r = rl(["status", url])
        assert one_line_error(r) and "PRIVATE" not in r.stdout + r.stderr, (r.stdout, r.stderr)
        with pytest.raises(relay.StoreError, match="damaged"):
            store.download(head, ["LEDGER.md"], str(tmp_path / "dl"))
    shutil.copy(tmp_path / "store" / "commits" / f"{head}.json", tmp_path / "elsewhere.json")
    (tmp_path / "store" / "HEAD").write_text("../../elsewhere\n")
    r = rl(["status", url])
    assert one_line_error(r) and "damaged" in r.stderr, r.stderr


def test_store_files_past_their_read_cap_are_one_line_errors_never_read_whole(tmp_path, hostile, rl, monkeypatch):
    """A contributor who pushed a multi-GB RELAY.json, LEDGER.md or leg log (valid, only big) had every volunteer's
    `relay.py run / status / dashboard` read it whole into memory. Each kind of file has a cap (generous: MBs) checked
    before reading (fstat for file://); past it, one line naming the file, its size, the cap and the fix."""
    import relay_store
    url, store, head = hostile
    ledger = store.read(head, "LEDGER.md")  # (padded with JSON whitespace: still valid, only too big)
    sha = store.commit(head, {"RELAY.json": store.read(head, "RELAY.json") + b" " * (4 << 20)}, [],
                       "relay: a hostile commit")
    r = rl(["status", url])
    assert one_line_error(r), r.stderr
    assert f"RELAY.json at {sha[:10]} is 4.0 MiB, more than the 4.0 MiB" in r.stderr, r.stderr
    assert "restore it from the previous commit (git revert" in r.stderr, r.stderr
    cap = 32 << 20
    sha = store.commit(sha, {"RELAY.json": store.read(head, "RELAY.json"), "LEDGER.md": ledger + b"\n" * cap}, [],
                       "relay: a hostile commit")
    r = rl(["claim", url, "--workdir", tmp_path / "wa"])
    assert one_line_error(r) and f"LEDGER.md at {sha[:10]} is 32.0 MiB, more than the 32.0 MiB" in r.stderr, r.stderr
    assert json.loads(store.read(store.head()[0], "RELAY.json"))["holder"] is None
    cap = 64 << 20
    sha = store.commit(sha, {"LEDGER.md": ledger, "logs/leg-0001.jsonl": b'{"step": 1, "tokens": 1, "loss": 1}\n' +
                             b"\n" * cap}, [], "relay: a hostile commit")
    with pytest.raises(relay.RelayError, match=rf"logs/leg-0001.jsonl at {sha[:10]} is 64.0 MiB, more than the 64.0"):
        relay_dashboard.dashboard_data(url)
    head_file, sha = tmp_path / "store" / "HEAD", store.head()[0]  # the file:// store's own HEAD and commit records
    head_file.write_text(sha + " " * 4096 + "\n")
    r = rl(["status", url])
    assert one_line_error(r) and f"{head_file} is 4137 bytes, more than the 4096 bytes" in r.stderr, r.stderr
    head_file.write_text(sha + "\n")
    record = tmp_path / "store" / "commits" / f"{sha}.json"
    monkeypatch.setattr(relay_store, "COMMIT_RECORD_CAP", 1 << 20, raising=False)  # (64 MiB: a second to write)
    record.write_bytes(record.read_bytes() + b" " * (1 << 20))
    r = rl(["status", url])
    assert one_line_error(r) and f"{record} is 1.0 MiB, more than the 1.0 MiB" in r.stderr, r.stderr
    record.write_bytes(b"{not json")  # it said the store is damaged, not what to do
    with pytest.raises(relay_store.StoreError, match="unreadable commit record .*: restore that commit record"):
        relay.open_store(url)._load_commit(sha)
    with open(tmp_path / "sparse", "wb") as f:  # 8 GiB that take no disk: refused on its size, nothing read
        f.truncate(8 << 30)
    with open(tmp_path / "sparse", "rb") as f:
        with pytest.raises(relay_store.TooBig, match="x is 8.0 GiB, more than the 100 bytes relay reads of it"):
            relay_store.read_capped(f, 100, "x", "fix it")
        assert f.tell() == 0
    chunks = iter([b"x" * 3, b"y" * 3, b"z" * 3])  # an HTTP body without a Content-Length: read to the cap, no further
    with pytest.raises(relay_store.TooBig, match="a.json is more than the 4 bytes relay reads of it"):
        relay_store.read_capped(chunks, 4, "a.json", "fix it")
    assert next(chunks) == b"z" * 3


def test_an_hf_store_file_past_its_read_cap_is_refused_without_reading_it(tmp_path, hub, hf_env, rl):
    """The same on the Hub: read streams the body, refused on its Content-Length (or past the cap) before it is
    held whole in memory."""
    store = relay.open_store("hf://alice/big")
    store.create()
    sha = store.commit(store.head()[0], {"RELAY.json": b"{}" + b" " * (4 << 20)}, [], "relay: big")
    with pytest.raises(relay.StoreError, match=rf"hf://alice/big: RELAY.json at {sha[:10]} is 4.0 MiB, more than"):
        store.read(sha, "RELAY.json")
    sha = store.commit(sha, {"RELAY.json": b"{}"}, [], "relay: small")
    assert store.read(sha, "RELAY.json") == b"{}"


def test_an_hf_store_keeps_at_most_read_cache_bytes_of_files_and_never_one_past_a_quarter_of_it(tmp_path, hub, hf_env,
                                                                                                 monkeypatch):
    """HfStore kept its last 64 files read, whatever their size: 64 leg logs of up to 64 MiB each, 4 GiB held by a
    dashboard left running. Bounded by bytes too (oldest out first); a file past a quarter of it is not kept (it
    pushed all the small ones out), and is read again when asked for again."""
    import relay_store
    monkeypatch.setattr(relay_store, "READ_CACHE_BYTES", 4000, raising=False)
    store = relay.open_store("hf://alice/cache")
    store.create()
    files = {f"logs/leg-{i:04d}.jsonl": bytes([65 + i]) * 900 for i in range(6)}
    sha = store.commit(store.head()[0], {**files, "big.json": b"{}" + b" " * 1100}, [], "relay: logs")
    for p in files:
        assert store.read(sha, p) == files[p]
    assert sorted(p for _, p in store.cache) == sorted(files)[-4:]  # 4 x 900 bytes: the newest within 4000
    assert sum(len(v) for v in store.cache.values()) <= 4000
    n = len(hub.requests)
    assert store.read(sha, "big.json") == b"{}" + b" " * 1100 and store.read(sha, "big.json") is not None
    assert sorted(p for _, p in store.cache) == sorted(files)[-4:]
    assert sum(p.endswith("/big.json") for _, p in hub.requests[n:]) == 2  # not kept: read again


def test_listings_past_list_cap_are_one_line_errors_and_the_hub_lists_only_the_folder_asked_for(tmp_path, hub, hf_env,
                                                                                                hostile, monkeypatch):
    """A repo holding millions of files (by hand, or a hostile contributor's push) was listed whole, into memory, by
    every contributor's pull, push, lease check and dashboard: the Hub's listing was the whole repo even for
    checkpoint/ (filtered after). Each listing stops past LIST_CAP files, one line naming it and the fix; the Hub
    lists only the folder asked for, so files elsewhere do not count (nor are fetched)."""
    import relay_store
    url, fstore, head = hostile
    cap = len(fstore.list(head, "checkpoint/")) + 1
    monkeypatch.setattr(relay_store, "LIST_CAP", cap, raising=False)
    hstore = relay.open_store("hf://alice/many")
    hstore.create()
    for store in (fstore, hstore):
        junk = {f"logs/leg-{i:04d}.jsonl": f"{{}}\n{i}".encode() for i in range(cap + 1)}
        sha = store.commit(store.head()[0], {**junk, "checkpoint/a.bin": b"a", "notes.txt": b"hi"}, [], "relay: junk")
        with pytest.raises(relay_store.TooBig, match=rf"{store.url}: logs/ at {sha[:10]} holds more than the {cap} "
                                                     rf"files relay lists .* revert the commit that added them"):
            store.file_ids(sha, "logs/")
        assert "checkpoint/a.bin" in store.list(sha, "checkpoint/") and store.list(sha, "nothing/") == []
        assert store.sizes(sha, "checkpoint/")["checkpoint/a.bin"] == 1 and store.sizes(sha, "nothing/") == {}
    with pytest.raises(relay.RelayError, match=f"holds more than the {cap} files"):  # one line on the dashboard's page
        relay_dashboard.dashboard_data(url)
    n = len(hub.requests)
    hstore.list(sha, "checkpoint/")
    assert [p for _, p in hub.requests[n:] if "/tree/" in p] == [f"/api/models/alice/many/tree/{sha}/checkpoint"]


def test_a_pull_refuses_a_checkpoint_manifest_or_state_json_past_its_read_cap(tmp_path, hostile, rl):
    """A checkpoint's MANIFEST.json and state.json (its hash right, any size) are read whole by the pull (verify,
    the leg's base step): GBs of either filled the volunteer's memory. The payload itself is not capped."""
    url, store, head = hostile
    manifest = json.loads(store.read(head, "checkpoint/MANIFEST.json"))
    pad = {"pad": " " * (4 << 20)}
    sha = store.commit(head, {"checkpoint/MANIFEST.json": json.dumps({**manifest, **pad}).encode()}, [],
                       "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out0"])
    assert one_line_error(r) and f"checkpoint/MANIFEST.json at {sha[:10]} is 4.0 MiB, more than" in r.stderr, r.stderr
    assert "Revert the push that wrote it" in r.stderr and not os.path.exists(tmp_path / "out0" / "LATEST")
    state = json.dumps({"step": 0, "tokens": 0, **pad}).encode()
    files = {**manifest["files"], "state.json": {"sha256": hashlib.sha256(state).hexdigest(), "bytes": len(state)}}
    sha = store.commit(sha, {"checkpoint/MANIFEST.json": json.dumps({**manifest, "files": files}).encode(),
                             "checkpoint/state.json": state}, [], "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out1"])
    assert one_line_error(r) and f"checkpoint/state.json at {sha[:10]} is 4.0 MiB, more than" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "out1" / "LATEST")


def test_a_pull_downloads_only_the_files_its_manifest_lists_each_checked_against_its_size_first(tmp_path, hostile, rl,
                                                                                               monkeypatch):
    """pull downloaded everything under checkpoint/, then verified: a file the manifest does not list (a hand-added or
    hostile 100 GB checkpoint/x) was downloaded by every contributor and installed, unchecked, in the step dir; a listed
    file of another size than the manifest's was downloaded whole before verify refused it. Now the manifest comes
    first; unlisted files are skipped (said); a listed file whose size in the store is not the manifest's is refused
    before anything else is downloaded."""
    import relay_store
    url, store, head = hostile
    fetched, real = [], relay_store.FileStore.download
    monkeypatch.setattr(relay_store.FileStore, "download",
                        lambda self, sha, paths, dest: fetched.extend(paths) or real(self, sha, paths, dest))
    sha = store.commit(head, {"checkpoint/junk.bin": b"x" * 1000}, [], "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out0"])
    assert r.returncode == 0, r.stderr
    assert f"relay: checkpoint/junk.bin at {sha[:10]} is not in its MANIFEST.json: not downloaded" in r.stderr, r.stderr
    assert "checkpoint/junk.bin" not in fetched and "checkpoint/model.safetensors" in fetched
    assert not os.path.exists(os.path.join(checkpoint.resolve(str(tmp_path / "out0")), "junk.bin"))
    fetched.clear()
    size = json.loads(store.read(sha, "checkpoint/MANIFEST.json"))["files"]["model.safetensors"]["bytes"]
    sha = store.commit(sha, {"checkpoint/model.safetensors": b"w" * (size + 1)}, [], "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out1"])
    assert one_line_error(r), r.stderr
    assert (f"checkpoint at {sha[:10]} fails verification before download: checkpoint/model.safetensors is {size + 1} "
            f"bytes in the store, its MANIFEST.json says {size}; nothing installed locally") in r.stderr, r.stderr
    assert fetched == [] and not os.path.exists(tmp_path / "out1" / "LATEST")  # (the manifest: read in memory)
    fetched.clear()  # a manifest past its read cap: refused on the store's size, not downloaded (GBs to disk) first
    monkeypatch.setattr(relay, "SMALL_FILE_CAP", 1000)
    sha = store.commit(sha, {"checkpoint/MANIFEST.json": store.read(head, "checkpoint/MANIFEST.json") + b" " * 2000},
                       [], "relay: a hostile commit")
    r = rl(["pull", url, "--out", tmp_path / "out2"])
    assert one_line_error(r) and "checkpoint/MANIFEST.json at " in r.stderr and "more than the 1000 bytes" in r.stderr
    assert fetched == [], fetched


def test_a_pull_refuses_in_one_line_before_writing_anything_when_the_disk_lacks_the_checkpoints_size(tmp_path, hostile,
                                                                                                  rl, monkeypatch):
    """pull sized the checkpoint from the store but never the free space: a disk too small filled mid-download (GBs
    written for nothing, a trainer's next save on that disk failing). Now it is refused first, one line naming the
    folder, the bytes needed and free, and the fix; nothing written. Exactly enough space pulls."""
    import relay_store
    url, store, head = hostile
    need = sum(store.sizes(head, "checkpoint/").values())
    fetched, real = [], relay_store.FileStore.download
    monkeypatch.setattr(relay_store.FileStore, "download",
                        lambda self, sha, paths, dest: fetched.extend(paths) or real(self, sha, paths, dest))
    monkeypatch.setattr(relay, "disk_free", lambda path: need - 1, raising=False)
    out = tmp_path / "out"
    r = rl(["pull", url, "--out", out])
    assert one_line_error(r), r.stderr
    assert (f"{out}: the checkpoint at {head[:10]} needs {need} bytes and its disk has {need - 1} bytes free; nothing "
            f"downloaded. Free 1 bytes there") in r.stderr and "--out DIR" in r.stderr, r.stderr
    assert fetched == [] and [f for _, _, fs in os.walk(out) for f in fs] == []
    monkeypatch.setattr(relay, "disk_free", lambda path: need)
    assert rl(["pull", url, "--out", out]).returncode == 0 and checkpoint.resolve(str(out))


def test_a_disk_filling_mid_pull_installs_nothing_and_leaves_the_earlier_local_step_as_it_was(tmp_path, hostile, rl,
                                                                                              monkeypatch):
    """The disk filling during the download (the space taken meanwhile by something else): a traceback for `pull --out`
    (the file store's OSError), a Transient 'retry' for the Hub's. Now one line naming the folder and the fix; the
    partial copy removed; the step pulled before and LATEST as they were."""
    import errno
    import relay_store
    url, store, head = hostile
    out = tmp_path / "out"
    assert rl(["pull", url, "--out", out]).returncode == 0
    before = (out / "LATEST").read_text()
    manifest = json.loads(store.read(head, "checkpoint/MANIFEST.json"))
    store.commit(head, {"checkpoint/MANIFEST.json": json.dumps(dict(manifest, step=5)).encode()}, [],
                   "relay: a later step")
    real = relay_store.FileStore.download

    def fills_the_disk(self, sha, paths, dest):
        real(self, sha, paths[:1], dest)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(relay_store.FileStore, "download", fills_the_disk)
    r = rl(["pull", url, "--out", out])
    assert one_line_error(r), r.stderr
    assert (f"{out}: writing the pulled checkpoint failed (No space left on device); nothing installed locally" in
            r.stderr), r.stderr
    assert (out / "LATEST").read_text() == before and checkpoint.is_valid(str(out / before.strip()))
    assert sorted(os.listdir(out)) == ["LATEST", before.strip()]  # no step_0000005, no .pull-* copy
    monkeypatch.setattr(relay_store.FileStore, "download", real)
    assert rl(["pull", url, "--out", out]).returncode == 0 and (out / "LATEST").read_text() == "step_0000005\n"


def test_an_hf_store_call_failing_on_this_machines_full_disk_is_not_a_transient_store_error():
    """The Hub client's download writing into a full local disk raised OSError(ENOSPC), taken for a network error:
    Transient ('retry'), though a retry fills the same disk. It goes up as the OSError it is (pull says what to free);
    a connection error is still Transient."""
    import errno
    import relay_store
    store = relay_store.HfStore("alice/run")

    def fails(err):
        raise err
    with pytest.raises(OSError) as e:
        store._call("download checkpoint/model.safetensors", fails, OSError(errno.ENOSPC, "No space left on device"))
    assert not isinstance(e.value, relay_store.StoreError) and e.value.errno == errno.ENOSPC
    with pytest.raises(relay_store.Transient):
        store._call("download checkpoint/model.safetensors", fails, ConnectionResetError(errno.ECONNRESET, "reset"))


def test_release_puts_back_a_step_a_killed_re_save_left_aside_and_counts_it_unpushed(tmp_path, hostile, rl,
                                                                                    monkeypatch):
    """A trainer killed between a re-save's two renames leaves its newest step only as step_N.old-PID: `release` saw
    just the pulled step, said "released the baton" (exit 0) and the leg's steps were never pushed nor named. It puts
    the step back as push does (rundir.recover_for_reader), so it refuses as for any unpushed step; refused while a
    trainer holds the lock."""
    import fcntl
    import rundir
    url, store, head = hostile
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    train_leg(write_fake_train(tmp_path), run_dir, 5)  # step 5: saved at 5, then re-saved at the leg's end
    newest = os.path.join(run_dir, checkpoint.step_dir_name(5))
    os.replace(newest, newest + f".old-{os.getpid()}")
    monkeypatch.setattr(rundir, "RESAVE_WAIT_S", 0.2)
    with open(os.path.join(run_dir, ".trainer.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        r = rl(["release", url, "--workdir", work])
    assert one_line_error(r) and "release refused:" in r.stderr and "being re-saved" in r.stderr, r.stderr
    r = rl(["release", url, "--workdir", work])
    assert r.returncode == 3 and f"{newest}: put back" in r.stderr, r.stderr
    assert "holds step 5, past the pulled step 0, never pushed" in r.stderr and os.path.isdir(newest), r.stderr
    assert relay.Snapshot(store).relay["holder"] == "alice"
    assert rl(["release", url, "--workdir", work, "--discard"]).returncode == 0


def test_the_next_leg_puts_back_a_pushed_legs_newer_step_a_killed_re_save_left_aside_and_keeps_the_dir(
        tmp_path, hostile, rl, capsys):
    """A pushed leg trained on past its push, its newest step left as step_N.old-PID by a killed re-save: the next
    leg's prepare_leg saw only the pushed step and deleted the dir with the step that was nowhere else."""
    url, store, head = hostile
    work = str(tmp_path / "wa")
    lease = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    run_dir = relay.prepare_leg(store, lease, work)
    fake = write_fake_train(tmp_path)
    train_leg(fake, run_dir, 2)
    relay.commit_push(store, lease, relay.prepare_push(store, lease, run_dir, wall_s=1), run_dir)
    train_leg(fake, run_dir, 2)  # step 4, after the push
    newest = os.path.join(run_dir, checkpoint.step_dir_name(4))
    os.replace(newest, newest + f".old-{os.getpid()}")
    assert rl(["release", url, "--workdir", work, "--discard"]).returncode == 0
    lease2 = relay.claim(store, work, "alice", ttl=60, heartbeat=20)
    capsys.readouterr()
    relay.prepare_leg(store, lease2, work)
    err = capsys.readouterr().err
    assert checkpoint.is_valid(newest) and f"{newest}: put back" in err, err
    assert f"{run_dir} holds step 4, trained after its push; kept" in err, err


def test_a_pull_of_a_step_already_on_disk_counts_and_downloads_only_the_files_not_matching_its_manifest(
        tmp_path, hostile, rl, monkeypatch):
    """A re-pull (a pull run twice, a crashed leg's dir) counted the checkpoint's full size against the free space and
    refused, though nothing or little was to be downloaded. Now a local file of the manifest's size and sha256 is
    neither downloaded nor counted; one of the right size but other bytes is (never trusted unverified)."""
    import relay_store
    url, store, head = hostile
    sizes = store.sizes(head, "checkpoint/")
    fetched, real = [], relay_store.FileStore.download
    monkeypatch.setattr(relay_store.FileStore, "download",
                        lambda self, sha, paths, dest: fetched.extend(paths) or real(self, sha, paths, dest))
    out = tmp_path / "out"
    assert rl(["pull", url, "--out", out]).returncode == 0
    step_dir = checkpoint.resolve(str(out))
    fetched.clear()
    monkeypatch.setattr(relay, "disk_free", lambda path: 0)  # a full disk: the complete step needs no byte
    r = rl(["pull", url, "--out", out])
    assert r.returncode == 0 and "already holds the checkpoint" in r.stderr, r.stderr
    assert "nothing downloaded" in r.stderr, r.stderr
    assert fetched == [] and checkpoint.resolve(str(out)) == step_dir
    big = max((p for p in sizes if p != "checkpoint/MANIFEST.json"), key=sizes.get)
    local = os.path.join(step_dir, big.split("/", 1)[1])
    os.remove(local)  # (a pull links its files: the step dir's copy is replaced, never written into)
    with open(local, "wb") as f:
        f.write(b"\0" * sizes[big])  # the manifest's size, not its sha256
    need = sizes["checkpoint/MANIFEST.json"] + sizes[big]
    monkeypatch.setattr(relay, "disk_free", lambda path: need - 1)
    r = rl(["pull", url, "--out", out])
    assert one_line_error(r) and f"needs {need} bytes and its disk has {need - 1} bytes free" in r.stderr, r.stderr
    assert fetched == []
    monkeypatch.setattr(relay, "disk_free", lambda path: need)
    assert rl(["pull", url, "--out", out]).returncode == 0
    assert fetched == [big] and checkpoint.is_valid(checkpoint.resolve(str(out)))


def test_a_re_pull_hashes_each_file_once(tmp_path, hostile, rl, monkeypatch):
    """A re-pull hashed the local step's files that matched the manifest (to reuse them), then again in the
    downloaded copy's verify, then a third time checking whether the local step was the same checkpoint; where hard
    links fail, all was downloaded again. Now each file (each inode: a corrupt local copy and the downloaded one are
    two) is read once per pull, and a local step that matches is kept, hard links or not."""
    url, store, head = hostile
    out = tmp_path / "out"
    assert rl(["pull", url, "--out", out]).returncode == 0
    step_dir = checkpoint.resolve(str(out))
    hashed, real = [], checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path, *a, **k: hashed.append(
        (os.path.basename(path), os.stat(path).st_ino)) or real(path, *a, **k))
    names = sorted(json.load(open(os.path.join(step_dir, "MANIFEST.json")))["files"])
    local = os.path.join(step_dir, "model.safetensors")
    size = os.path.getsize(local)
    os.remove(local)  # (a pull links its files: the step dir's copy is replaced, never written into)
    with open(local, "wb") as f:
        f.write(b"\0" * size)  # the manifest's size, not its sha256: downloaded again
    assert rl(["pull", url, "--out", out]).returncode == 0
    assert len(hashed) == len(set(hashed)) == len(names) + 1, hashed  # (the corrupt copy and the downloaded one)
    assert checkpoint.is_valid(step_dir)
    hashed.clear()

    def no_hard_links(src, dst):
        raise OSError(1, "Operation not permitted")
    monkeypatch.setattr(relay.os, "link", no_hard_links)  # (it downloaded every file again, then kept the local step)
    monkeypatch.setattr(relay, "disk_free", lambda path: 0)
    before = sorted(os.listdir(out))
    r = rl(["pull", url, "--out", out])
    assert r.returncode == 0 and "already holds the checkpoint" in r.stderr, r.stderr
    assert sorted(os.listdir(out)) == before and len(hashed) == len(set(hashed)) == len(names), (before, hashed)


def test_a_file_store_missing_a_checkpoint_object_is_a_one_line_error_naming_the_store_not_this_disk(tmp_path, hostile,
                                                                                                     rl):
    """pull now sizes each file first (FileStore.sizes): an object missing from a damaged file:// store raised a
    traceback (FileNotFoundError) there, and in the download was said as this machine's disk ('free space there')."""
    url, store, head = hostile
    oid = store.file_ids(head, "checkpoint/")["checkpoint/model.safetensors"]
    os.remove(store._object(head, "checkpoint/model.safetensors", oid))
    r = rl(["pull", url, "--out", tmp_path / "out"])
    assert one_line_error(r), r.stderr
    assert "checkpoint/model.safetensors" in r.stderr and "Free space" not in r.stderr, r.stderr


def test_a_finished_runs_cut_last_evaluation_is_measured_by_one_more_leg(tmp_path, rl, monkeypatch):
    """A relay run whose final leg had its last evaluation cut short by a stop signal (its checkpoint: finished, with
    eval_due for its step) was refused as finished, so that val loss (maybe the best) was never measured and a solo
    guardian never recorded it done. Now status says so and one more leg measures it and pushes; then it is refused."""
    url = store_url("file", tmp_path, None)
    fake = init_run(url, tmp_path, base_env())
    store = relay.open_store(url)
    run = ["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wa"]
    assert rl(run, base_env({"FAKE_FINISH_CUT_EVAL": "1"})).returncode == 0
    monkeypatch.delenv("FAKE_FINISH_CUT_EVAL")
    r = rl(["status", url], base_env())
    assert "FINISHED but its last step 2's evaluation was cut short" in r.stdout, r.stdout
    import relay_dashboard
    assert relay.status_dict(store)["last_eval_due"] == 2
    assert relay_dashboard.dashboard_data(url)["state"]["last_eval_due"] == 2
    r = rl(run, base_env())
    assert r.returncode == 0 and "relay: pushed" in r.stdout, r.stdout + r.stderr
    snap = relay.Snapshot(store)
    ck_state = json.loads(store.read(snap.sha, relay.CKPT_PREFIX + "/state.json"))
    assert snap.state["step"] == 2 and snap.state["finished"] and snap.state["best_val_loss"] == 0.9375
    assert ck_state["step"] == 2 and "eval_due" not in ck_state and relay.status_dict(store)["last_eval_due"] is None
    r = rl(run, base_env())
    assert r.returncode == 3 and "the run is finished" in r.stderr and "nothing claimed" in r.stderr, r.stderr


def finished_with_its_last_evaluation_cut(tmp_path, rl, monkeypatch):
    """(url, store, run args) of a relay run whose one leg finished its plan at step 2, that step's evaluation cut
    short by a stop signal (its checkpoint holds eval_due for step 2)."""
    url = store_url("file", tmp_path, None)
    fake = init_run(url, tmp_path, base_env())
    run = ["run", url, "--steps", "2", "--train-script", fake, "--workdir", tmp_path / "wa"]
    assert rl(run, base_env({"FAKE_FINISH_CUT_EVAL": "1"})).returncode == 0
    monkeypatch.delenv("FAKE_FINISH_CUT_EVAL")
    return url, relay.open_store(url), run


def test_a_measuring_legs_ledger_row_and_leg_log_say_what_it_measured(tmp_path, rl, monkeypatch):
    """The leg that measures a finished run's last val loss (its evaluation cut short) showed 0 steps and no loss in
    the ledger, and its leg log left out the re-measured row (only rows past the pulled step were read). Now its row
    says it measured step N's val loss, and what it was, and its log holds that row; its GPU is this machine's."""
    url, store, run = finished_with_its_last_evaluation_cut(tmp_path, rl, monkeypatch)
    trained = [json.loads(line) for line in store.read(store.head()[0], "logs/leg-0001.jsonl").splitlines()]
    real_run = subprocess.run
    monkeypatch.setattr(relay.subprocess, "run", lambda cmd, *a, **k: SimpleNamespace(
        returncode=0, stdout="MeasuringGPU\n") if cmd[0] == "nvidia-smi" else real_run(cmd, *a, **k))
    r = rl(run, base_env())
    assert r.returncode == 0, r.stdout + r.stderr
    head = store.head()[0]
    said = "measured the val loss of step 2: 0.9375"
    assert f"steps 2-2 ({said}, 0 tokens)" in r.stdout, r.stdout
    row = relay.parse_ledger(store.read(head, "LEDGER.md").decode())[-1]
    assert (row["leg"], row["steps"], row["step_range"], row["gpu"]) == (2, said, "2-2", "MeasuringGPU"), row
    assert row["tokens"] == 0 and row["loss_start"] is None and row["loss_end"] is None, row
    log = [json.loads(line) for line in store.read(head, "logs/leg-0002.jsonl").splitlines()]
    assert log == [dict(trained[-1], val_loss=0.9375)], log
    assert f"steps 2-2 ({said})" in rl(["status", url]).stdout
    shown = relay_dashboard.dashboard_data(url)["metrics"]  # (step 2 was drawn twice: leg 1's row, without val loss)
    assert [(m["step"], m.get("val_loss")) for m in shown] == [(1, None), (2, 0.9375)], shown


def test_a_measuring_leg_cut_short_again_says_the_next_leg_measures_it(tmp_path, rl, monkeypatch):
    """A leg measuring a finished run's last val loss, itself cut short (a stop signal, or a crash), said 'not past
    the pulled step, so the trainer made no step (is the plan finished?)' or 'no checkpoint past the pulled step':
    true, but not what happened. Now it says the measuring was cut short and the next leg measures it."""
    url, store, run = finished_with_its_last_evaluation_cut(tmp_path, rl, monkeypatch)
    head = store.head()[0]
    r = rl(run, base_env({"FAKE_MEASURE_CUT": "0"}))  # train.py's exit after a stop signal
    assert r.returncode == 3 and "not past the pulled step" not in r.stderr, r.stderr
    assert ("that measuring was cut short too" in r.stderr and f"The next `relay.py run {url} --steps 1` measures it"
            in r.stderr and "lease released" in r.stderr), r.stderr
    r = rl(run, base_env({"FAKE_MEASURE_CUT": "1"}))  # a crash
    assert r.returncode == 3 and "trainer exited with status 1" in r.stderr, r.stderr
    assert "no checkpoint past" not in r.stderr and ("nothing pushed (the measuring of step 2's val loss was cut "
                                                     "short; the next leg measures it)") in r.stderr, r.stderr
    assert relay.status_dict(store)["last_eval_due"] == 2 and store.read(store.head()[0], "LEDGER.md") == store.read(
        head, "LEDGER.md")
    monkeypatch.delenv("FAKE_MEASURE_CUT")
    assert rl(run, base_env()).returncode == 0 and relay.status_dict(store)["last_eval_due"] is None


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_a_heartbeat_of_seconds_on_the_hub_is_warned_about(kind, tmp_path, hub, rl, request):
    """Each beat is a commit and the Hub rate-limits commits (429): a --heartbeat of seconds on hf:// went unsaid until
    the 429s came. init and every claim say it; a file:// store (no rate limit) and the Hub at minutes say nothing."""
    url, env = store_url(kind, tmp_path, hub), env_for(kind, tmp_path, hub)
    if kind == "hf":
        request.getfixturevalue("hf_env")
    r = rl(["init", url, write_config(tmp_path), "--train-script", write_fake_train(tmp_path), "--workdir",
            tmp_path / "w-init", "--ttl", "3", "--heartbeat", "1"], env)
    assert r.returncode == 0, r.stderr
    said = [ln for ln in r.stderr.splitlines() if "WARNING: --heartbeat 1s" in ln]
    assert len(said) == (kind == "hf") and all("429" in ln and url in ln for ln in said), r.stderr
    r = rl(["claim", url, "--workdir", tmp_path / "wa", "--who", "alice"], env)  # the run's heartbeat: said again
    assert r.returncode == 0 and ("WARNING: --heartbeat 1s" in r.stderr) == (kind == "hf"), r.stderr
    rl(["release", url, "--workdir", tmp_path / "wa"], env)
    r = rl(["claim", url, "--workdir", tmp_path / "wb", "--who", "bob", "--ttl", "600", "--heartbeat", "120"], env)
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr


@pytest.mark.parametrize("leg_json, then", [("none", "run"), ("no_base_manifest", "push")])
def test_a_leg_dir_of_an_older_relay_is_resumed_or_pushed_after_an_upgrade(leg_json, then, tmp_path, hub, rl):
    """A leg trained by an older relay.py (no LEG.json before 2026-12-04, no base_manifest before 12-06) whose push
    failed: after an upgrade, `push` refused it and `run` set it aside as another lease's and retrained the leg."""
    url = store_url("file", tmp_path, hub)
    env = base_env()
    fake = init_run(url, tmp_path, env, cli=rl)
    wd = tmp_path / "wm"
    assert rl(["claim", url, "--workdir", wd, "--ttl", "60", "--heartbeat", "20"]).returncode == 0
    assert rl(["pull", url, "--workdir", wd]).returncode == 0
    leg = wd / "leg-0001-gen1"
    train_leg(fake, str(leg), 6, env)
    rec = json.load(open(leg / "LEG.json"))
    if leg_json == "none":
        os.remove(leg / "LEG.json")
    else:
        json.dump({k: v for k, v in rec.items() if k != "base_manifest"}, open(leg / "LEG.json", "w"))
    if then == "run":  # resumes the leg's own step 6
        r = rl(["run", url, "--steps", "2", "--train-script", fake, "--workdir", wd])
        assert r.returncode == 0 and "resuming this leg's own step 6" in r.stdout and "other-" not in r.stderr, r.stderr
    else:
        r = rl(["push", url, "--workdir", wd])
        assert r.returncode == 0 and "from an older relay.py" in r.stderr, r.stderr
    rows, _ = ledger_rows(relay.open_store(url))
    assert [x["step_range"] for x in rows] == ["0-8" if then == "run" else "0-6"], rows
