"""train.py's stop and hang machinery, called directly (no train.py start): the watchdog (faults.py), the lock wait,
printing that a lost terminal cannot end (checkpoint.py)."""
import os
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
import checkpoint  # noqa: E402
import faults  # noqa: E402
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

    monkeypatch.setattr(faults.os, "_exit", fake_exit)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (the thread ended by Exited, or by the bug)
    dog = faults.Watchdog(timeout, out_dir, True)
    exited.wait(5)
    dog.stop()
    if getattr(dog, "backstop", None):
        dog.backstop.cancel()
    return codes[0] if codes else None


def test_a_hang_exits_8_even_when_its_report_cannot_be_written(tmp_path, monkeypatch):
    """The watchdog's thread died on the first error of its report (a hang-*.txt on the stalled or full mount the main
    thread hung on; stderr a dead pipe or a hung-up terminal) and never reached os._exit: the hung run hung for ever."""
    (tmp_path / "file").write_text("")
    assert watch_until_exit(monkeypatch, str(tmp_path / "file" / "run")) == faults.EXIT_HANG  # out_dir unwritable

    class DeadPipe:
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stderr", DeadPipe())
    assert watch_until_exit(monkeypatch, str(tmp_path / "run")) == faults.EXIT_HANG
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("hang-")]  # the stacks still written


def test_a_wait_for_the_runs_lock_is_not_a_hang(data_root, tmp_path):
    """The watchdog started before the wait for the run's lock (up to lock_wait_s: the killed guardian's trainer
    finishing its SIGTERM checkpoint) and counted it: a wait past 3x hang_timeout ended the healthy start with exit 8.
    Here the lock is never given up: the trainer's own clock times its whole wait (3.5 s, past 3x hang_timeout: 2.4 s),
    and it ends with the lock's error, not exit 8. (A lock given up by a timer after 5 s: a start slowed by a loaded
    CI waited less, and the steps after it had 3x hang_timeout from the wait's end, which a load of 6 outlasted.)"""
    import fcntl
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".trainer.lock", "a+") as lock:
        lock.write(str(os.getpid()))
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX)  # another trainer's, for the whole wait
        r = train([f"--data_root={data_root}", f"--out_dir={out}", "--max_iters=3", "--lock_wait_s=3.5",
                   "--hang_timeout=0.8", "--sample_tokens=0"], env=ENV, timeout=120)
    assert r.returncode == faults.EXIT_ERROR, (r.returncode, r.stderr[-2000:])
    assert "waiting up to 3.5 s for the trainer" in r.stdout, r.stdout[-2000:]
    assert f"another trainer (pid {os.getpid()}) is training this run" in r.stderr, r.stderr[-2000:]
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
                checkpoint.print_or_detach("Ctrl-C: saving a checkpoint")
            return os.write(w, bytes(b))

    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(SlowTerminal()), line_buffering=True))
    checkpoint.print_or_detach("step 1 | loss 3.0")
    sys.stdout.flush()
    os.close(w)
    got = os.read(r, 1000).decode()
    os.close(r)
    assert got == "Ctrl-C: saving a checkpoint\nstep 1 | loss 3.0\n"


def test_a_print_that_fails_detaches_its_own_stream_and_leaves_a_live_terminal(monkeypatch):
    """One print_or_detach for train.py's log and relay.py run's lines up to its release (relay had its own copy,
    relay.say). The stream whose write failed goes to /dev/null whatever it is, as relay's copy did: train's left a
    full disk's log file attached, every later line failing on it again. The other stream stays where it is when it is
    a live terminal, as relay's copy did: train's sent it to /dev/null too (a dead stdout pipe took the terminal's
    error lines with it). A stream closed under the print (ValueError) raises nothing (train's copy raised)."""
    import io
    saved = os.dup(1), os.dup(2)
    tty, terminal = os.openpty()
    full = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    try:
        os.dup2(full, 1)
        os.dup2(terminal, 2)
        out = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        monkeypatch.setattr(sys, "stdout", out)
        checkpoint.print_or_detach("step 1 | loss 3.0")
        assert os.path.samestat(os.fstat(1), os.stat(os.devnull))
        assert os.isatty(2) and os.path.samestat(os.fstat(2), os.fstat(terminal))
        checkpoint.print_or_detach("step 2 | loss 2.9")  # into /dev/null: no error
        out.flush()
        closed = io.StringIO()
        closed.close()
        checkpoint.print_or_detach("relay: released the baton", file=closed)
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, tty, terminal, full):
            os.close(fd)


def test_a_full_non_blocking_pipe_is_not_a_dead_one(monkeypatch):
    """stdout as a non-blocking pipe (a parent that set O_NONBLOCK on it) full for a moment raises BlockingIOError:
    print_or_detach took it for a lost stream and sent every later log line to /dev/null, the reader alive."""
    import fcntl
    import io
    saved = os.dup(1)
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    try:
        os.dup2(w, 1)
        out = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), line_buffering=True)  # as sys.stdout
        monkeypatch.setattr(sys, "stdout", out)
        checkpoint.print_or_detach("x" * (1 << 20))  # past any pipe's buffer: full
        assert not os.path.samestat(os.fstat(1), os.stat(os.devnull))
        os.set_blocking(r, False)
        while True:  # the reader catches up
            try:
                if not os.read(r, 1 << 16):
                    break
            except BlockingIOError:
                break
        try:
            out.flush()
        except BlockingIOError:
            pass
        checkpoint.print_or_detach("step 2 | loss 2.9")
        out.flush()
        got = b""
        while True:
            try:
                got += os.read(r, 1 << 16)
            except BlockingIOError:
                break
        assert b"step 2 | loss 2.9" in got
    finally:
        os.dup2(saved, 1)
        for fd in (saved, r, w):
            os.close(fd)
