"""relay.py dashboard: served read-only on 127.0.0.1, rendered by headless Chromium (Debian `chromium`, installed
by .ci/run) against a fixture run; the checks read the DOM after the page's own JavaScript drew it."""

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from relay_fixtures import ROOT, base_env, write_config, write_fake_train

import relay  # noqa: E402
import relay_dashboard  # noqa: E402
import relay_store  # noqa: E402


def serve(target, env):
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "relay.py"), "dashboard", str(target), "--port", "0"],
                         env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    m = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
    if not m:
        p.kill()
        raise AssertionError(f"dashboard did not start: {line!r} {p.stderr.read()}")
    return p, m.group(1)


def rendered_dom(url):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium not installed (apt-get install chromium; .ci/run does it)"
    r = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000",
                        "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0 and "<html" in r.stdout, r.stderr[-2000:]
    return r.stdout


def new_run(tmp_path, monkeypatch, config="gpu_hourly_usd = 2.0\n"):
    """A relay run on a file store under tmp_path, made by `relay.py init` with the stand-in trainer: (url, fake)."""
    for k, v in base_env().items():
        monkeypatch.setenv(k, v)
    url = f"file://{tmp_path}/store"
    fake, cfg = write_fake_train(tmp_path), write_config(tmp_path, config)
    assert relay.main(["init", url, cfg, "--train-script", fake, "--workdir", str(tmp_path / "w0")]) == 0
    return url, fake


@pytest.fixture
def fixture_run(tmp_path, monkeypatch):
    """A file:// run with two legs (tester, bob) of the stand-in trainer, and carol holding the baton now."""
    url, fake = new_run(tmp_path, monkeypatch, "gpu_hourly_usd = 3600.0\n")  # $1 per second of leg: in the ledger
    monkeypatch.setenv("FAKE_STEP_S", "0.02")
    assert relay.main(["run", url, "--steps", "10", "--train-script", fake, "--workdir", str(tmp_path / "wa")]) == 0
    monkeypatch.setenv("RELAY_WHO", "bob")
    assert relay.main(["run", url, "--steps", "6", "--train-script", fake, "--workdir", str(tmp_path / "wb")]) == 0
    # escaped, not executed; "<!--<script>" in the inline JSON put the parser past the page's own </script> (blank page)
    monkeypatch.setenv("RELAY_WHO", "carol <!--<script>")
    assert relay.main(["claim", url, "--workdir", str(tmp_path / "wc")]) == 0
    return url


def test_dashboard_renders_run_in_chromium(fixture_run, tmp_path):
    # any repo writer can edit LEDGER.md: a row whose cells are markup is shown as text, not rendered
    store = relay.open_store(fixture_run)
    snap = relay.Snapshot(store)
    # (and a tokens cell that is not a number: the table's number format threw, and the table stayed empty)
    row = "| 3 | mallory | x | <b>9</b> | n/a | 1s | 0.00 | 1 | 1 | 0-9 | <i>3</i> | now |\n"
    decaying = json.dumps(dict(snap.state, decay_started_at_tokens=1024)).encode()  # the trainer took the decay flag
    # the newest leg log's rows say the trainer warned of an expert-load collapse at step 18 (its log said so, once)
    collapsed = "".join(json.dumps({"step": s, "tokens": 4096 * s, "load_collapsed": s >= 18}) + "\n"
                        for s in (17, 18, 19))
    relay.commit_cas(store, snap.sha, {"LEDGER.md": (snap.ledger() + row).encode(), "training_state.json": decaying,
                                       "logs/leg-0003.jsonl": collapsed.encode()}, [], "a test", snap.relay)
    p, url = serve(fixture_run, base_env())
    try:
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "<script src" not in page and "https://" not in page  # works offline: nothing loaded from elsewhere
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, data=b"x", method="POST"), timeout=10)
        assert e.value.code == 405  # read-only
        dom = rendered_dom(url)
    finally:
        p.kill()
        p.wait()
    assert re.search(r'id="holder">carol &lt;!--&lt;script&gt;</b> since \d{4}-\d\d-\d\d', dom)
    assert "mallory" in dom and "&lt;b&gt;9&lt;/b&gt;" in dom  # the hand-edited row, as text
    assert "(leg 3, generation 3" in dom and "legs <b>2</b>" in dom and "step <b>16</b>" in dom
    assert "<b>decaying</b>" in dom  # (once the trainer took the flag, nothing said the run was decaying)
    banner = re.search(r'<div class="card warn" id="collapse">([^<]*)</div>', dom)
    assert banner and banner.group(1).startswith("WARNING: expert load collapsed at logged step 19 (every row since "
                                                 "step 18 says so)"), dom[:3000]
    # the charts drew one series each (loss, val loss, tok/s, MFU, lr, dead frac) and the per-layer heatmap 3 x 16
    for name in ("loss", "val loss", "tok/s", "MFU", "lr", "dead frac"):
        assert f'data-name="{name}"' in dom, name
    assert dom.count('class="cell"') == 3 * 16
    assert 'class="nodata"' not in dom
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td>", dom)
    assert rows == [("1", "tester", "FakeGPU 80GB"), ("2", "bob", "FakeGPU 80GB"), ("3", "mallory", "x")]
    assert "<td>&lt;b&gt;9&lt;/b&gt;</td>" in dom
    spent = float(re.search(r'id="usd">\$([\d.]+)', dom).group(1))
    assert spent > 0.1  # 16 steps x 20 ms at $1/s


def test_dashboard_local_run_dir_and_bad_target(tmp_path):
    env = base_env({"FAKE_STEP_S": "0"})
    fake = write_fake_train(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, fake, "cfg.py", f"--out_dir={out}", "--init_from=scratch", "--stop_after_steps=8"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    p, url = serve(out, env)
    try:
        dom = rendered_dom(url)
    finally:
        p.kill()
        p.wait()
    assert "local run dir (no relay)" in dom and "step <b>8</b>" in dom
    assert '<div class="card warn" id="collapse" hidden=""></div>' in dom  # (no row says its expert load collapsed)
    assert 'data-name="loss"' in dom and dom.count('class="cell"') == 3 * 8 and "no legs yet" in dom
    r = subprocess.run([sys.executable, os.path.join(ROOT, "relay.py"), "dashboard", str(tmp_path / "nope")],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1 and "not a store URL" in r.stderr
    # a NaN in a row froze the page (json.dumps wrote NaN; the refresh could not parse it, silently) and a string
    # step crashed the server's sort; both rows as the page can show them, or left out
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "tokens": 36864, "loss": NaN, "load_cv_layers": [Infinity, 0.5]}\n')
        f.write('{"step": "10", "tokens": "40960", "loss": 7.0}\n')
    d = relay_dashboard.dashboard_data(str(out))
    json.dumps(d, allow_nan=False)  # (raised ValueError: a NaN the browser's JSON.parse refuses)
    last = d["metrics"][-1]
    assert last["step"] == 9 and last["loss"] is None and last["load_cv_layers"] == [None, 0.5] and len(d["metrics"]) == 9


def test_dashboard_says_an_expert_load_collapse_the_newest_row_says(tmp_path):
    """A collapse was said once, in the trainer's log: the page, where a relay run is watched, showed only the
    dead-expert curve. When the newest row says load_collapsed, the page's data names it (its banner): that row's step
    and the first of the rows before it that all say so; a row that says it cleared ends it. Only true is kept."""
    out = tmp_path / "out"
    out.mkdir()
    rows = [{"step": s, "tokens": 10 * s, "loss": 5.0, "load_collapsed": s in (2, 4, 5, 6), "dead_frac_layers": [0.9]}
            for s in range(1, 7)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    d = relay_dashboard.dashboard_data(str(out))
    assert d["load_collapse"] == {"step": 6, "since": 4}
    assert [m.get("load_collapsed") for m in d["metrics"]] == [None, True, None, True, True, True]
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "tokens": 70, "loss": 5.0, "load_collapsed": False}) + "\n")
    assert relay_dashboard.dashboard_data(str(out))["load_collapse"] is None


def test_dashboard_data_of_a_run_with_no_legs_then_hand_edited_ledger_and_log(tmp_path, monkeypatch):
    """A run with zero legs shows empty charts and ledger. A ledger cell "nan" / "inf" (a fork's trainer that logged a
    NaN loss, a hand edit) reached data.json and `status --json` as NaN, which the page's refresh cannot parse (it froze,
    silently); a leg log with a byte that is not UTF-8 (a hand edit) crashed the dashboard with a traceback."""
    url, _ = new_run(tmp_path, monkeypatch)
    d = relay_dashboard.dashboard_data(url)
    assert d["metrics"] == [] and d["ledger"] == [] and d["state"]["legs"] == 0
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    rows = ("| 1 | x | g | 5 | 100 | 0h00m01s | nan | nan | inf | 0-5 | 1 | now |\n"
            "| 2 | a row of another shape | g |\n")
    log = b'{"step": 3, "tokens": 300, "loss": 5.0}\n{"step": 4, "tokens": 400, "note": "\xff"}\n'
    relay.commit_cas(store, snap.sha, {"LEDGER.md": (snap.ledger() + rows).encode(), "logs/leg-0001.jsonl": log}, [],
                     "a hand edit", snap.relay)
    d = relay_dashboard.dashboard_data(url)
    json.dumps(d, allow_nan=False)
    json.dumps(relay.status_dict(store), allow_nan=False)
    assert [(r["leg"], r["usd"], r["loss_start"], r["loss_end"]) for r in d["ledger"]] == [(1, None, None, None)]
    assert [m["step"] for m in d["metrics"]] == [3, 4]


def test_dashboard_refresh_shows_a_leg_log_rewritten_under_the_same_name(tmp_path, monkeypatch):
    """The parsed leg logs were cached by path alone ("a pushed leg's log never changes"), but a push reverted on the
    Hub (what a damaged checkpoint's error tells the user to do) gives the next leg the same number, so the same
    logs/leg-NNNN.jsonl name: a running dashboard showed the reverted leg's metrics until it was restarted."""
    url, _ = new_run(tmp_path, monkeypatch)
    store = relay.open_store(url)
    cache = {}
    for steps in ([1, 2], [1, 2, 3]):  # leg 1 pushed, reverted, then pushed again by someone else
        snap = relay.Snapshot(store)
        log = "".join(json.dumps({"step": s, "tokens": 100 * s, "loss": 5.0}) + "\n" for s in steps).encode()
        relay.commit_cas(store, snap.sha, {"logs/leg-0001.jsonl": log}, [], "relay: a leg", snap.relay)
        d = relay_dashboard.dashboard_data(url, cache)
        assert [m["step"] for m in d["metrics"]] == steps


def test_dashboard_of_a_workdir_plots_only_the_runs_history(tmp_path):
    """`relay.py dashboard WORKDIR` read the metrics of every leg-* dir there: a fenced leg's (never pushed, its steps
    trained again by whoever took the baton), a set-aside one's (another lease's) and steps trained after a push were
    drawn as the run's own curve. Now: pushed legs up to their pushed step; this workdir's lease's leg in progress
    marked not_pushed (its own series); the rest left out, and named."""
    def leg(name, steps, pushed=None, nonce="n-old"):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "tokens": 10 * s, "loss": 5.0}) + "\n"
                                                 for s in steps))
        (d / "LEG.json").write_text(json.dumps({"store": "file:///s", "nonce": nonce}))
        if pushed is not None:
            (d / "PUSHED").write_text(f"abc123 {pushed}\n")
        return d
    leg("leg-0001-gen1", [1, 2, 3, 4], pushed=3)  # step 4 trained after the push
    leg("leg-0002-gen2", [4, 5, 6])  # fenced: never pushed, its lease gone
    leg("leg-0002-gen2.other-20260101-000000", [4, 5])  # set aside: another lease's
    leg("leg-0002-gen3", [4, 5, 6], pushed=6)
    current = leg("leg-0003-gen4", [7, 8], nonce="n-now")
    (tmp_path / "LEASE.json").write_text(json.dumps({"nonce": "n-now", "run_dir": str(current)}))
    d = relay_dashboard.dashboard_data(str(tmp_path))
    json.dumps(d, allow_nan=False)
    assert [(m["step"], bool(m.get("not_pushed"))) for m in d["metrics"]] == [
        (1, False), (2, False), (3, False), (4, False), (5, False), (6, False), (7, True), (8, True)]
    assert d["left_out"] == ["leg-0001-gen1 (steps after its push, never pushed)",
                             "leg-0002-gen2 (never pushed: a lost lease's or a failed leg's)",
                             "leg-0002-gen2.other-20260101-000000 (set aside: another lease's leg)"]
    (tmp_path / "LEASE.json").unlink()  # the lease is gone (lost): its leg is no longer shown either
    assert [m["step"] for m in relay_dashboard.dashboard_data(str(tmp_path))["metrics"]] == [1, 2, 3, 4, 5, 6]


def test_dashboard_shows_a_step_a_later_leg_re_measured_once_with_its_val_loss(tmp_path, monkeypatch):
    """A leg that measures the val loss of the step it pulled (a finished run's last evaluation, cut short by a stop
    signal) logs that step again, with its val loss; the leg before logged it without. The page drew both rows (two
    points at one step in every curve). Each step is shown once, as the newest leg logged it: in a store, and in a
    workdir that kept both leg dirs (newest by leg number: leg-10000 sorts before leg-9999 by name)."""
    url, _ = new_run(tmp_path, monkeypatch)
    store = relay.open_store(url)
    row = lambda step, **k: dict({"step": step, "tokens": 100 * step, "loss": 5.0 - step}, **k)  # noqa: E731
    jsonl = lambda rows: "".join(json.dumps(m) + "\n" for m in rows)  # noqa: E731
    trained, measured = [row(1), row(2, val_loss=4.5), row(3)], [row(3, val_loss=4.25)]
    snap = relay.Snapshot(store)
    relay.commit_cas(store, snap.sha, {"logs/leg-0001.jsonl": jsonl(trained).encode(),
                                       "logs/leg-0002.jsonl": jsonl(measured).encode()}, [], "relay: legs", snap.relay)
    want = [(1, None), (2, 4.5), (3, 4.25)]
    assert [(m["step"], m.get("val_loss")) for m in relay_dashboard.dashboard_data(url)["metrics"]] == want
    workdir = tmp_path / "work"
    for name, rows in (("leg-9999-gen1", trained + [row(4)]), ("leg-10000-gen2", measured)):  # (step 4: not pushed)
        (workdir / name).mkdir(parents=True)
        (workdir / name / "metrics.jsonl").write_text(jsonl(rows))
        (workdir / name / "PUSHED").write_text("abc123 3\n")
    d = relay_dashboard.dashboard_data(str(workdir))
    assert [(m["step"], m.get("val_loss")) for m in d["metrics"]] == want
    assert d["left_out"] == ["leg-9999-gen1 (steps after its push, never pushed)"]
    assert (d["state"]["step"], d["state"]["tokens"]) == (3, 300)  # the newest row's (it took the oldest leg's)


def test_dashboard_skips_a_leg_log_line_nested_past_the_json_decoders_depth(tmp_path, monkeypatch):
    """A leg log line of 100,000 nested [ (any contributor can push one) stopped the dashboard with a RecursionError
    traceback, at start and at every refresh; it is skipped as a line cut by a kill is."""
    url, _ = new_run(tmp_path, monkeypatch)
    store = relay.open_store(url)
    snap = relay.Snapshot(store)
    log = b'{"step": 3, "tokens": 300, "loss": 5.0}\n' + b"[" * 100000 + b"]" * 100000 + b"\n"
    relay.commit_cas(store, snap.sha, {"logs/leg-0001.jsonl": log}, [], "relay: a hostile leg", snap.relay)
    assert [m["step"] for m in relay_dashboard.dashboard_data(url)["metrics"]] == [3]


def test_dashboard_reads_leg_logs_newest_first_up_to_a_total_budget_and_names_the_rest(tmp_path, monkeypatch):
    """Each leg log is capped on its own, but the dashboard read every leg's log and kept them all: a run's logs add up,
    one per leg, without bound. It reads the newest first up to LOG_BUDGET bytes; the older ones are named in one
    line, not read again at each refresh, and their parsed rows not kept."""
    url, _ = new_run(tmp_path, monkeypatch)
    store = relay.open_store(url)
    log = lambda leg: b"".join(json.dumps({"step": 10 * leg + s, "tokens": 100 * (10 * leg + s), "loss": 5.0}).encode()
                               + b"\n" for s in range(3))
    size = len(log(1))
    monkeypatch.setattr(relay_dashboard, "LOG_BUDGET", 2 * size + size // 2, raising=False)  # 2.5 logs
    snap = relay.Snapshot(store)
    relay.commit_cas(store, snap.sha, {f"logs/leg-{leg:04d}.jsonl": log(leg) for leg in (1, 2, 3)}, [], "relay: legs",
                     snap.relay)
    reads, real_read = [], relay_store.FileStore.read
    monkeypatch.setattr(relay_store.FileStore, "read", lambda self, sha, p: reads.append(p) or real_read(self, sha, p))
    cache = {}
    d = relay_dashboard.dashboard_data(url, cache)
    assert [m["step"] for m in d["metrics"]] == [20, 21, 22, 30, 31, 32]
    budget = relay_store.fmt_bytes(2 * size + size // 2)
    assert d["left_out"] == [f"logs/leg-0001.jsonl (the dashboard reads at most {budget} of leg logs, newest first)"]
    assert [p for p in reads if p.startswith("logs/")] == ["logs/leg-0003.jsonl", "logs/leg-0002.jsonl",
                                                          "logs/leg-0001.jsonl"]
    reads.clear()
    snap = relay.Snapshot(store)  # leg 4 pushed: leg 2's rows go too, nothing read but leg 4's log
    relay.commit_cas(store, snap.sha, {"logs/leg-0004.jsonl": log(4)}, [], "relay: a leg", snap.relay)
    d = relay_dashboard.dashboard_data(url, cache)
    assert [m["step"] for m in d["metrics"]] == [30, 31, 32, 40, 41, 42]
    assert d["left_out"] == [f"2 older leg logs, logs/leg-0001.jsonl to logs/leg-0002.jsonl (the dashboard reads at "
                             f"most {budget} of leg logs, newest first)"]
    assert [p for p in reads if p.startswith("logs/")] == ["logs/leg-0004.jsonl"]
    assert sum(len(rows or []) for _, rows in cache.values()) == 6


def test_dashboard_keeps_only_the_numbers_the_page_shows_of_each_leg_log_row(tmp_path, monkeypatch):
    """Every key of every row was kept, parsed, for the page's life: a train.py row's ~20 keys and two per-layer lists,
    ~1 GiB peak RSS for 120 MiB of train.py rows (~255 MiB now). Only SHOWN_KEYS are kept, numbers only, and a
    per-layer list's equal values are one float object."""
    url, _ = new_run(tmp_path, monkeypatch)
    store = relay.open_store(url)
    row = lambda step: {"step": step, "tokens": 100 * step, "loss": 5.0, "val_loss": 4.5, "lr": "fast", "mfu": None,
                        "load_cv_layers": [0.25, float("nan"), 0.5], "dead_frac_layers": [0.1] * 3, "gpu": "x" * 1000,
                        "time": 1.7e9, "stage": "main", "usd": True}
    snap = relay.Snapshot(store)
    log = "".join(json.dumps(row(step)) + "\n" for step in (1, 2)).encode()
    relay.commit_cas(store, snap.sha, {"logs/leg-0001.jsonl": log}, [], "relay: a leg", snap.relay)
    cache = {}
    d = relay_dashboard.dashboard_data(url, cache)
    shown = {"loss": 5.0, "val_loss": 4.5, "mfu": None, "load_cv_layers": [0.25, None, 0.5]}
    assert d["metrics"] == [dict(shown, step=1, tokens=100), dict(shown, step=2, tokens=200)]
    assert [rows for _, rows in cache.values()] == [d["metrics"]]  # (what the cache holds between refreshes)
    assert d["metrics"][0]["load_cv_layers"][0] is d["metrics"][1]["load_cv_layers"][0]


def test_dashboard_serializes_its_data_once_per_refresh_whatever_the_number_of_requests(tmp_path, monkeypatch):
    """Every request re-serialized the data (the page: ~4 copies of its JSON, 60 MiB for LOG_BUDGET's logs), each
    viewer's every 30 s: memory and CPU grew with the viewers. Serialized once per --refresh; page and /data.json
    serve the same bytes (the page's inline copy escaped for its <script>, which JSON.parse reads back)."""
    import threading
    from types import SimpleNamespace
    url, _ = new_run(tmp_path, monkeypatch)
    made, real = [], relay_dashboard.served_json
    monkeypatch.setattr(relay_dashboard, "served_json", lambda d: made.append(1) or real(d), raising=False)
    srv = relay_dashboard.make_server(SimpleNamespace(store=url, host="127.0.0.1", port=0, refresh=3600))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}/"
        got = [urllib.request.urlopen(base + p, timeout=10).read() for p in ("", "data.json", "", "data.json")]
    finally:
        srv.shutdown()
        srv.server_close()
    assert made == [1] and got[0] == got[2] and got[1] == got[3]
    inline = re.search(rb"\nvar DATA = (.*);\n", got[0]).group(1)
    assert inline == got[1] and json.loads(inline)["source"] == url
