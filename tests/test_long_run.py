"""What a long run (100k+ steps, hundreds of starts) must not pay for its history: a start reading every metrics row,
a mirror copying every log whole at every log row."""
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import rundir  # noqa: E402
import train  # noqa: E402

ROW_PAD = "x" * 180  # a nano row is ~700 bytes (23 layers' load figures)


def write_rows(path, steps, mode="w"):
    with open(path, mode) as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 3.0, "pad": ROW_PAD}) + "\n")


def counting_open(counter):
    """open() whose files count the bytes read from them in counter[0] (read() and line iteration)."""
    class Counted:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def __iter__(self):
            for line in self.f:
                counter[0] += len(line)
                yield line

        def read(self, *a):
            data = self.f.read(*a)
            counter[0] += len(data)
            return data
    return lambda *a, **kw: Counted(open(*a, **kw))


def test_a_start_reads_only_the_tail_of_a_long_runs_metrics(tmp_path, monkeypatch):
    """open_metrics parsed every row at every start: 1M rows (~700 MB) took a minute and 800 MB of RAM."""
    path = str(tmp_path / "metrics.jsonl")
    write_rows(path, range(1, 20001))  # ~4 MB
    size = os.path.getsize(path)
    read = [0]
    monkeypatch.setattr(train, "open", counting_open(read), raising=False)
    train.open_metrics(path, 20000).close()
    assert read[0] < 256 << 10, (read[0], size)
    assert os.path.getsize(path) == size and not os.path.exists(tmp_path / "metrics.abandoned.jsonl")


def test_rows_past_the_resumed_step_still_move_aside(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    write_rows(path, range(1, 3001))
    with open(path, "a") as f:
        f.write('{"step": 3001, "lo')  # a row cut by a kill
    f = train.open_metrics(path, 2990)
    f.write(json.dumps({"step": 2991}) + "\n")
    f.close()
    steps = [json.loads(x)["step"] for x in open(path)]
    assert steps == list(range(1, 2992)), steps[-5:]
    gone = open(tmp_path / "metrics.abandoned.jsonl").read().splitlines()
    assert [json.loads(x)["step"] for x in gone[:-1]] == list(range(2991, 3001)) and gone[-1] == '{"step": 3001, "lo'
    train.open_metrics(path, 0).close()  # a fresh start over an old run's log: every row moves
    assert os.path.getsize(path) == 0 and len(open(tmp_path / "metrics.abandoned.jsonl").readlines()) == 11 + 2991


def test_the_mirror_copies_only_what_changed_at_each_log_row(tmp_path, monkeypatch):
    """mirror() copied metrics.jsonl and every crash report whole at each log row: O(rows^2) over a run, and 300
    crash reports of a run restarted that often took 0.5 s a row."""
    out, dest = tmp_path / "out", tmp_path / "mirror"
    out.mkdir()
    write_rows(out / "metrics.jsonl", range(1, 5001))
    for i in range(30):
        (out / f"crash-{1000 + i}.json").write_text(json.dumps({"cause": "crash", "i": i}))
    assert rundir.mirror(str(out), str(dest), checkpoints=False)
    whole = []
    real_copyfile = shutil.copyfile
    monkeypatch.setattr(shutil, "copyfile", lambda s, d: whole.append(os.path.basename(s)) or real_copyfile(s, d))
    write_rows(out / "metrics.jsonl", [5001], mode="a")  # a log row
    assert rundir.mirror(str(out), str(dest), checkpoints=False)
    assert whole == [], whole
    for name in os.listdir(out):
        assert (dest / name).read_bytes() == (out / name).read_bytes(), name
    # a resume moved rows past its step aside, then logged others: the copy is whole again, not appended to
    train.open_metrics(str(out / "metrics.jsonl"), 4990).close()
    write_rows(out / "metrics.jsonl", range(4991, 5003), mode="a")
    (out / "crash-1000.json").write_text(json.dumps({"cause": "CRASH", "i": 0}))  # (same size, rewritten)
    assert rundir.mirror(str(out), str(dest), checkpoints=False)
    for name in os.listdir(out):
        assert (dest / name).read_bytes() == (out / name).read_bytes(), name


def test_a_late_val_loss_parses_only_the_rows_from_its_step_on(tmp_path, monkeypatch):
    """add_to_metrics_row (a resume measuring the val loss a stop signal cut short) parsed every row of the log."""
    path = str(tmp_path / "metrics.jsonl")
    write_rows(path, range(1, 20001))
    before = open(path, "rb").read()
    parsed, real_loads = [], train.json.loads
    monkeypatch.setattr(train.json, "loads", lambda s, **kw: parsed.append(1) or real_loads(s, **kw))
    train.add_to_metrics_row(path, 20000, {"val_loss": 2.5})
    monkeypatch.undo()
    assert len(parsed) < 1000, len(parsed)
    after = open(path, "rb").read()
    cut = before.rindex(b"\n", 0, len(before) - 1) + 1
    assert after[:cut] == before[:cut] and json.loads(after[cut:]) == {**json.loads(before[cut:]), "val_loss": 2.5}
    train.add_to_metrics_row(path, 20001, {"val_loss": 2.4}, {"step": 20001, "loss": 3.0})  # no row of it: appended
    assert open(path, "rb").read() == after + b'{"step": 20001, "loss": 3.0, "val_loss": 2.4}\n'
