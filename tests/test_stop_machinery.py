"""train.py's stop and hang machinery, called directly (no train.py start): the watchdog, the lock wait."""
import os
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
import train as train_py  # noqa: E402
from test_faults import ENV, make_corpus, train  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data"))


class Exited(Exception):
    pass


def watch_until_exit(monkeypatch, out_dir, timeout=0.08):
    """A Watchdog that is never ticked: the code it would exit with (None: it never exited within 5 s)."""
    codes, exited = [], threading.Event()

    def fake_exit(code):
        codes.append(code)
        exited.set()
        raise Exited  # ends the watch thread as os._exit would have ended the process

    monkeypatch.setattr(train_py.os, "_exit", fake_exit)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (the thread ended by Exited, or by the bug)
    dog = train_py.Watchdog(timeout, out_dir, True)
    exited.wait(5)
    dog.stop()
    if getattr(dog, "backstop", None):
        dog.backstop.cancel()
    return codes[0] if codes else None


def test_a_hang_exits_8_even_when_its_report_cannot_be_written(tmp_path, monkeypatch):
    """The watchdog's thread died on the first error of its report (a hang-*.txt on the stalled or full mount the main
    thread hung on; stderr a dead pipe or a hung-up terminal) and never reached os._exit: the hung run hung for ever."""
    (tmp_path / "file").write_text("")
    assert watch_until_exit(monkeypatch, str(tmp_path / "file" / "run")) == train_py.EXIT_HANG  # out_dir unwritable

    class DeadPipe:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", DeadPipe())
    assert watch_until_exit(monkeypatch, str(tmp_path / "run")) == train_py.EXIT_HANG
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("hang-")]  # the stacks still written


def test_a_wait_for_the_runs_lock_is_not_a_hang(data_root, tmp_path):
    """The watchdog started before the wait for the run's lock (up to lock_wait_s: the killed guardian's trainer
    finishing its SIGTERM checkpoint) and counted it: a wait past 3x hang_timeout ended the healthy start with exit 8."""
    import fcntl
    out = tmp_path / "run"
    out.mkdir()
    lock = open(out / ".trainer.lock", "a+")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another trainer's, for 5 s: past 3x hang_timeout
    threading.Timer(5.0, lock.close).start()  # (the start after the wait has 3x hang_timeout, 4.5 s: a loaded CI)
    r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=3", "--warmup_iters=1",
               "--eval_interval=1000", "--lock_wait_s=60", "--hang_timeout=1.5", "--sample_tokens=0"], env=ENV,
              timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not [n for n in os.listdir(out) if n.startswith("hang-")]


def test_a_control_file_that_cannot_be_read_is_a_warning_not_a_crash(data_root, tmp_path):
    """control.json that cannot be read (here a folder; a file another user wrote, a mount's EIO) ended the run with a
    traceback, exit 10, at every restart: a bad control.json is said and read again at the next check."""
    out = tmp_path / "run"
    base = [f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=3", "--warmup_iters=1", "--eval_interval=1000",
            "--log_interval=1", "--sample_tokens=0"]
    assert train(base + ["--stop_after_steps=1"], env=ENV, timeout=120).returncode == 0
    (out / "control.json").mkdir()  # (a fresh start sets a control.json aside: this run's resume reads it)
    r = train(base + ["--init_from=resume"], env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("control.json: cannot read it") == 1 and "Traceback" not in r.stderr  # said once, not each check


def test_a_line_from_a_signal_handler_inside_a_print_is_no_crash(monkeypatch):
    """Ctrl-C's handler logs a line; a SIGINT that interrupts a log line's blocked write runs it inside that print
    (EINTR, then the handler): its print raised RuntimeError "reentrant call" into the main thread wherever it was, and
    the run ended with exit 10 and no checkpoint instead of saving one."""
    import io
    r, w = os.pipe()

    class SlowTerminal(io.RawIOBase):
        handled = False

        def writable(self):
            return True

        def fileno(self):
            return w

        def write(self, b):
            if not SlowTerminal.handled:  # the signal arrives during this write
                SlowTerminal.handled = True
                train_py.print_or_detach("Ctrl-C: saving a checkpoint")
            return os.write(w, bytes(b))

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(SlowTerminal()), line_buffering=True))
    train_py.print_or_detach("step 1 | loss 3.0")
    sys.stdout.flush()
    os.close(w)
    got = os.read(r, 1000).decode()
    os.close(r)
    assert got == "Ctrl-C: saving a checkpoint\nstep 1 | loss 3.0\n"
