"""
How train.py fails: its exit code per cause (the guardian restarts or stops on them), the crash-<ms>.json report each
fault leaves in the run dir, and the hang watchdog (exit 8 with every thread's stack in hang-*.txt). train.py fills
RUN_INFO as it goes (out_dir, state, streams) so that a report written from anywhere says where the run was.
TrainError and die: the one-line refusals of train.py and run_status.py (train.py's main catches a TrainError).
"""

import json
import os
import sys
import time

EXIT_OK, EXIT_ERROR, EXIT_DATA, EXIT_DENIED, EXIT_UNREACHABLE, EXIT_DISK, EXIT_NONFINITE = 0, 1, 3, 4, 5, 6, 7
EXIT_HANG = 8  # no step progress for hang_timeout s (Watchdog)
EXIT_CRASH = 10  # anything unforeseen (a CUDA or NCCL error; EIO or a dropped mount is 5): the guardian restarts
CAUSES = {EXIT_ERROR: "error", EXIT_DATA: "corrupt data", EXIT_DENIED: "storage denied",
          EXIT_UNREACHABLE: "storage unreachable", EXIT_DISK: "out of disk", EXIT_NONFINITE: "non-finite loss",
          EXIT_HANG: "hang", EXIT_CRASH: "crash"}
RUN_INFO = {}  # what a crash report needs: out_dir, state, streams (train.py fills it)


class TrainError(Exception):
    """A refused start or a fault train.py names: its main() catches it and exits with code (one line, a report)."""

    def __init__(self, msg, code=EXIT_ERROR):
        super().__init__(msg)
        self.code = code


def die(msg, code=EXIT_ERROR):
    print(f"train.py: error: {msg}", file=sys.stderr)
    sys.exit(code)


def write_crash_report(cause, code, message, **extra):
    """crash-<time>.json in the run dir: what the guardian and a person read first. Under torchrun every rank writes
    its own (crash-<time>-rank<r>.json): a fault in one rank's rows (a corrupt batch) left only rank 0's report, a
    "crash" of the collective that rank's exit broke. Before the loop a rank's error is rank 0's too (one config, the
    same files): rank 0 alone reports it (and may remove an out_dir its refused start made)."""
    out, master = RUN_INFO.get("out_dir"), RUN_INFO.get("master", True)
    if not out or (not master and "state" not in RUN_INFO):
        return
    st = RUN_INFO.get("state") or {}
    rep = {"cause": cause, "exit_code": code, "message": message, "time": time.time(), "step": st.get("step"),
           "tokens": st.get("tokens"), **({} if master else {"rank": int(os.environ.get("RANK", -1))}), **extra}
    try:
        rep["data_position"] = {c: s.position for c, s in (RUN_INFO.get("streams") or {}).items()}
        if master:
            os.makedirs(out, exist_ok=True)
        rank = "" if master else f"-rank{os.environ.get('RANK', '?')}"
        with open(os.path.join(out, f"crash-{int(time.time() * 1000)}{rank}.json"), "w") as f:
            json.dump(rep, f, indent=1)
    except Exception:
        pass  # the report must never hide the error it reports


class Watchdog:
    """Exit 8 when no step progress for `timeout` s (3x that before the first step: compile, data warm-up),
    after dumping every thread's stack to out_dir/hang-<time>.txt."""

    def __init__(self, timeout, out_dir, master):
        import threading
        self.timeout, self.out_dir, self.last, self.ticks = timeout, out_dir, time.monotonic(), 0
        self.done = threading.Event()
        if timeout > 0:
            threading.Thread(target=self.watch, daemon=True, name="hang-watchdog").start()

    def tick(self):
        self.last, self.ticks = time.monotonic(), self.ticks + 1

    def alive(self):
        """Progress that is not a step (an evaluation batch): a long evaluation is not a hang, one stuck batch is."""
        self.last = time.monotonic()

    def stop(self):
        self.done.set()

    def watch(self):
        while not self.done.wait(min(5.0, self.timeout / 4)):
            limit = self.timeout * (3 if self.ticks == 0 else 1)
            if time.monotonic() - self.last > limit:
                try:
                    self.report(limit)
                finally:  # the exit, whatever the report met: this thread dying on its error left the hang for ever
                    os._exit(EXIT_HANG)

    def report(self, limit):
        """hang-*.txt, the crash report and a line on stderr, each on its own: the hang-*.txt on the stalled (or full)
        mount the main thread hangs on, or stderr a dead pipe, took the rest with it; a write blocked there: 60 s."""
        import faulthandler
        import threading
        self.backstop = threading.Timer(60.0, os._exit, (EXIT_HANG,))
        self.backstop.daemon = True
        self.backstop.start()
        path = os.path.join(self.out_dir, f"hang-{int(time.time())}-rank{os.environ.get('RANK', '0')}.txt")
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"no step progress for {limit:.0f} s; stacks of all threads:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"thread stacks in {path}"
        except OSError as e:
            where = f"thread stacks not written ({path}: {e.strerror or e})"
        msg = f"hang: no step progress for {limit:.0f} s (hang_timeout); {where}"
        write_crash_report("hang", EXIT_HANG, msg)
        try:
            print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # (a dead pipe, a hung-up terminal; a closed stderr)
            pass
