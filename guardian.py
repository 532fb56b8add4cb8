"""
The guardian: keeps a training run alive without looping on the same fault.

    python train.py config/nano.py --supervise        (or: python guardian.py config/nano.py ...)

It runs train.py as a child (resuming the run's newest valid checkpoint whenever out_dir holds one, so the same
command continues a run; a first start given --init_from=resume --resume_from=OUT_DIR/step_N, a rollback, resumes
exactly that), restarts it on failure, and keeps out_dir/guardian.json: each start (the newest 1000), the checkpoint
step at its start and end, its exit code and cause (train.py's exit codes; its crash-*.json report). What it does per
cause:
- corrupt data (3): re-verify the named shard; re-fetch it from its recorded source if it is corrupt on disk;
  quarantine it (skipped with a loud warning, counted in metrics) if it cannot be re-fetched or the crash
  repeats at the same place; then restart.
- storage denied (4), out of disk (6), non-finite loss (7), config or checkpoint errors (1, 2): restarting cannot
  help; stop with a report naming the cause (an exit 1 of a trainer locked out by another, a killed guardian's
  still saving, which out_dir/guardian/locked-out says: wait for that one to exit, then restart).
  storage unreachable (5), from the trainer or while re-fetching or verifying a shard (a mount that dropped; never
  quarantined for it): retry with backoff (unreachable_backoff_s x 2, 4, 8, ..., at most 60 s apart, each try
  said) until one outage's waits would pass unreachable_give_up_s (30 min), then stop; a shard's read failing
  otherwise (EIO: the disk itself) stops at once with 5, naming the file.
- a quarantined shard whose files changed since (replaced, or the corpus prepared again) and now verify against
  index.json, or that index.json no longer lists, is released before the next start, in one loud line (one that
  verified when quarantined is released only when index.json's hashes for it changed: the same bytes crash again).
- a trainer that ends other than 0 leaves the tail of its stdout / stderr in out_dir/guardian/crash-NNNN.log (the
  newest CRASH_LOGS_KEPT are kept; guardian.json names each start's).
- hang (8), a signal (OOM kill), anything else: restart.
- stop_after_steps / stop_after_hours (a relay leg, a rented GPU's hours) hold across restarts: a restart gets
  what is left of them (from this invocation's first start), and none is made once they are used up.
- Field report this answers: systemd restarted onto the same bad page 13 times while the log looked healthy;
  the only true signal was that the newest checkpoint stopped advancing. So: when max_stuck_starts (3)
  consecutive starts produced no new checkpoint, run `on_stuck` (e.g. remount / re-sync the data; killed after
  an hour or at a stop signal), re-verify every shard, repair what it finds and go on, or stop with exit 9 and a
  report. More than max_restarts starts with no new checkpoint in one invocation also stop with 9 and their causes
  (a start whose named shard was repaired for the first time in this invocation is not counted).
SIGTERM or Ctrl-C to the guardian is passed to the trainer (which checkpoints and exits 0) and ends supervision; if the
trainer dies instead (a hang while saving), the guardian exits with its code and says which steps are lost (one not out
stop_grace_s after the signal is SIGKILLed: stuck where not even its watchdog runs, it held the guardian forever); if the
guardian itself is killed, Linux sends the trainer SIGTERM (PR_SET_PDEATHSIG). guardian.json says "done" only when
the plan is finished or the leg's limit reached (a trainer stopped by a signal to it alone is not restarted).
A guardian.json that cannot be written (a full disk) warns once; supervision goes on. It ends with one summary line:
this invocation's starts and their causes, the newest checkpoint step at the first start and at the last, the exit.
"""

import json
import os
import signal
import subprocess
import threading
import sys
import time

import checkpoint
import configurator
import faults
import rundir
import shards
import train
from relay import pdeathsig_setter  # the trainer gets SIGTERM when its parent (here the guardian) dies

EXIT_STUCK = 9
ON_STUCK_TIMEOUT_S = 3600.0  # an on_stuck command (a remount, a re-sync) running longer is killed: not a fix
CRASH_LOGS_KEPT = 20  # out_dir/guardian/crash-*.log: the newest are kept
TAIL_BYTES = 64 << 10  # of each of the trainer's stdout and stderr, kept for its crash log
QUARANTINED_BY_HAND = "quarantined (--quarantine_shards)"  # a repair log entry: a release before it no longer holds
STARTS_KEPT = 1000  # guardian.json keeps the newest starts (it grew ~300 bytes a start); starts_dropped: the rest
PUMP_DRAIN_S = 5.0  # after the trainer exits, how long its pipes may take to end (a grandchild may hold them open)
NO_RESTART = {1: "error", 2: "config error", faults.EXIT_DENIED: "storage denied", faults.EXIT_DISK: "out of disk",
              faults.EXIT_NONFINITE: "non-finite loss"}


_VERIFIED = {}  # step dir -> its files' (name, size, mtime, inode) when its hashes last verified


def files_signature(path):
    try:
        return tuple(sorted((os.path.relpath(os.path.join(d, n), path), st.st_size, st.st_mtime_ns, st.st_ino)
                            for d, _, names in os.walk(path) for n in names
                            for st in [os.stat(os.path.join(d, n))]))
    except OSError:
        return None


def latest_valid(out_dir):
    """checkpoint.latest_valid, re-hashing a step only when its files changed: it hashed the newest checkpoint (tens
    of GB for nano) 4-5 times per restart while the GPU stood idle (the trainer verifies what it resumes anyway).
    A step a killed re-save left only as step_N.old-PID is put back first: unseen, a run with no other step was
    restarted as a fresh start, which the trainer refused (exit 1, supervision over)."""
    if checkpoint.stranded(out_dir):
        try:
            rundir.recover_for_reader(out_dir)
        except checkpoint.CheckpointError:  # (a trainer of a killed guardian still re-saving it; it puts it back)
            pass
    for _, path in reversed(checkpoint.list_checkpoints(out_dir)):
        sig = files_signature(path)
        if sig is not None and _VERIFIED.get(path) == sig:
            return path
        if checkpoint.is_valid(path):
            _VERIFIED[path] = sig
            return path
    return None


def latest_step(out_dir):
    p = latest_valid(out_dir)
    return int(os.path.basename(p).split("_")[1]) if p else None


def crash_reports(out_dir):
    """{name: mtime_ns} of out_dir's crash-*.json."""
    reps = {}
    for n in (os.listdir(out_dir) if os.path.isdir(out_dir) else []):
        if n.startswith("crash-") and n.endswith(".json"):
            try:
                reps[n] = os.stat(os.path.join(out_dir, n)).st_mtime_ns
            except OSError:
                pass
    return reps


def newest_crash_report(out_dir, before):
    """(name, report) of the newest crash report not in `before` (crash_reports() at the start), else (None, None):
    new by name, not by mtime >= the start's time.time() (a clock stepped back mid-start lost the report)."""
    reps = {n: t for n, t in crash_reports(out_dir).items() if before.get(n) != t}
    if not reps:
        return None, None
    name = max(reps, key=lambda n: (reps[n], n))
    try:
        return name, json.load(open(os.path.join(out_dir, name)))
    except (OSError, ValueError):
        return name, None


_LOCKS = {}  # out_dir -> this process's guardian lock


class Guardian:
    def __init__(self, argv):
        self.argv = argv
        g = {k: getattr(train, k) for k in train._CONFIG_KEYS}
        configurator.configure(g, train.split_flags(argv)[1])  # --replan, --mirror DIR go to the trainer as given
        for k in ("unreachable_backoff_s", "unreachable_give_up_s", "stop_grace_s"):  # (a 0 backoff never gave up)
            if isinstance(g[k], bool) or not isinstance(g[k], (int, float)) or not g[k] > 0:
                raise configurator.ConfigError(f"--{k}={g[k]!r}: must be a number of seconds > 0")
        self.cfg = g
        self.out = g["out_dir"]
        self.path = os.path.join(self.out, "guardian.json")
        in_the_way = rundir.file_in_the_way(self.out)
        if in_the_way:  # (a FileExistsError traceback)
            raise configurator.ConfigError(f"--out_dir={self.out}: {in_the_way} is a file, not a folder; pass a run "
                                           f"directory")
        # one guardian per run, before guardian.json is touched (a second one rewrote the first's as stopped);
        # hold_run_lock makes out_dir (one that cannot be made, /proc/x: one line, not a traceback)
        key = os.path.realpath(self.out)
        if key in _LOCKS:  # an earlier Guardian of this process (a test, a notebook) is over
            os.close(_LOCKS.pop(key))
        self.lock = _LOCKS[key] = rundir.hold_run_lock(self.out, self.cfg["lock_wait_s"], self.say, who="guardian")
        try:
            self.log = train.read_json(self.path, None) or {"starts": [], "quarantined": [], "repairs": []}
        except train.TrainError as e:  # a torn guardian.json (a full disk): kept aside, a fresh log begins
            os.replace(self.path, self.path + f".corrupt-{int(time.time())}")
            self.say(f"warning: {e}; kept as {os.path.basename(self.path)}.corrupt-*, starting a fresh log")
            self.log = {"starts": [], "quarantined": [], "repairs": []}
        check_log(self.log, self.path)  # (a hand edit: before anything reads it)
        remove_stale_temps(self.path)
        released = [q for q in self.log["quarantined"] if q["shard"] in self.cfg["release_shards"]]
        for q in released:  # --release_shards: the operator fixed them; the next fault may quarantine them again
            self.log["quarantined"].remove(q)
            self.log["repairs"].append({"shard": q["shard"], "action": "released (--release_shards)", "at": time.time()})
        # one quarantined by hand (in a checkpoint, not here) too: a later invocation without the flag resuming a
        # checkpoint saved before the release quarantined it again
        for shard in sorted(set(self.cfg["release_shards"]) - released_shards(self.log["repairs"])):
            self.log["repairs"].append({"shard": shard, "action": "released (--release_shards)", "at": time.time()})
        for shard in set(self.cfg["quarantine_shards"]) & released_shards(self.log["repairs"]):  # (later releases:
            self.log["repairs"].append({"shard": shard, "action": QUARANTINED_BY_HAND, "at": time.time()})  # not it)
        self.log["status"] = "running"
        self.child = None
        self.stopping = False
        self.t_stop = None  # when the first stop signal came (the trainer's stop_grace_s counts from it)
        self.save_failed = False
        self.woken = threading.Event()  # set by a signal: cuts a backoff or a re-fetch wait short
        self.unrepaired = []  # (corpus dir, problem) the last on_stuck verify left
        # this invocation's first start; t_first on time.monotonic (a wall-clock step ended or stretched the leg)
        self.n_started, self.first_step, self.t_first = 0, None, None
        self.saw_checkpoint = False  # a start of this invocation began or ended with one (see child_argv)
        # a rollback's old timeline (out_dir's steps past the one gone back to) until a start sets it aside: a first
        # start that died before (storage unreachable mid-verify) had its restart resume the old timeline's newest
        m = self.rollback() and checkpoint.STEP_RE.match(os.path.basename(os.path.normpath(self.cfg["resume_from"])))
        self.old_timeline = {p: sig for s, p in checkpoint.list_checkpoints(self.out)
                             if m and s > int(m.group(1)) and (sig := files_signature(p)) is not None}

    def save(self):
        """A log that cannot be written (a full disk) warns and supervision goes on: the trainer meets the same disk
        and exits with its own cause (the guardian's traceback left the trainer unsupervised)."""
        try:
            checkpoint.write_atomic_text(self.path, json.dumps(self.log, indent=1))
        except OSError as e:
            if not self.save_failed:
                self.say(f"warning: cannot write {self.path} ({e.strerror or e}); supervising on, the log is kept in "
                         f"memory and written when it can be")
            self.save_failed = True
            return
        if self.save_failed:
            self.say(f"{self.path} written again")
        self.save_failed = False
        if self.cfg["mirror_dir"]:
            rundir.mirror(self.out, self.cfg["mirror_dir"], checkpoints=False)

    def say(self, msg):
        print(f"guardian: {msg}", file=sys.stderr, flush=True)

    def corpora(self):
        names = {self.cfg["dataset"]} | {c for s in self.cfg["stages"] for c in (s.get("mix") or {})}
        return {n: os.path.join(self.cfg["data_root"], n) for n in sorted(names)}

    def quarantine(self, shard_path, offset, reason):
        """Whether it is newly quarantined. A loss mask's file quarantines its shard (train.py skips shards by name)."""
        corpus = os.path.basename(os.path.dirname(os.path.abspath(shard_path)))
        name = os.path.basename(shard_path)
        if name.endswith(".mask.bin"):
            name = name[:-len(".mask.bin")] + ".bin"
        key = f"{corpus}/{name}"
        if key in [q["shard"] for q in self.log["quarantined"]]:
            return False
        corpus_dir = os.path.dirname(os.path.abspath(shard_path))
        try:
            fingerprint = shard_fingerprint(corpus_dir, shards.index_entry(shards.load_index(corpus_dir), name)
                                            or {"file": name})
        except (shards.DataError, shards.StorageError):  # no index to compare with: released only as corrupt on disk
            fingerprint = None
        self.log["quarantined"].append({"shard": key, "offset": offset, "reason": reason, "at": time.time(),
                                        "fingerprint": fingerprint})
        self.say(f"QUARANTINED {key} ({reason}); training goes on without it")
        return True

    def release_fixed(self):
        """Release quarantined shards the operator fixed: their files changed since (by the fingerprint kept at
        quarantine) and verify against index.json, or index.json no longer lists them (the corpus prepared again).
        They stayed skipped forever, and a vanished name refused every resume."""
        corpora = self.corpora()
        for q in list(self.log["quarantined"]):
            c, _, f = q["shard"].partition("/")
            if c not in corpora:  # a corpus outside this plan: kept for when it comes back
                continue
            try:
                index = shards.load_index(corpora[c])
            except (shards.DataError, shards.StorageError, OSError):  # the trainer names what is wrong, in one line
                continue
            entry = shards.index_entry(index, f)
            if entry is None:
                why = f"{c}'s index.json no longer lists it (the corpus was prepared again)"
            else:
                now, had = shard_fingerprint(corpora[c], entry), q.get("fingerprint")
                if had is not None:  # (a fingerprint of the first release-aware guardian held inodes too)
                    had = dict(had, files=[x[:2] if x else x for x in had.get("files", [])])
                if now == had:  # unchanged: not hashed again
                    continue
                corrupt_on_disk = q.get("reason", "").startswith("corrupt on disk")
                # a log from before fingerprints: only a shard that was corrupt on disk is known to have changed
                known = q.get("fingerprint") is not None or corrupt_on_disk
                # one that verified when quarantined and verifies against the same hashes now holds the same bytes
                # (copied, touched, a corpus moved to another disk): the crash it caused would come back
                same_bytes = (not corrupt_on_disk and had is not None and
                              (now["sha256"], now["mask_sha256"]) == (had.get("sha256"), had.get("mask_sha256")))
                try:
                    held = not known or same_bytes or shards.verify_shard(corpora[c], entry, index["vocab_size"],
                                                                          self.should_stop)
                except shards.HashStopped:  # a stop signal mid-hash: no verdict, nothing released (the caller stops)
                    return
                except shards.StorageError as e:  # (a traceback that ended the guardian); verified again next start
                    self.say(f"{q['shard']} stays quarantined: {e}")
                    continue
                if held:
                    q["fingerprint"] = now  # still corrupt (or verified when quarantined): hashed again when it changes
                    continue
                why = "its files changed since it was quarantined and verify against index.json"
            self.log["quarantined"].remove(q)
            self.log["repairs"].append({"shard": q["shard"], "action": f"released: {why}", "at": time.time()})
            self.say(f"RELEASED {q['shard']} from quarantine: {why}; it is read again")

    def repair_shard(self, path, offset, repeated):
        """A shard named by a corrupt-data exit: refetch if corrupt on disk, else quarantine on a repeat.
        Returns None to go on, or (exit code, message) to stop."""
        corpus_dir, file = os.path.dirname(path), os.path.basename(path)
        problems, verdict = self.verify_corpus(corpus_dir)
        if verdict is not None:
            return verdict
        if any(file in p for p in problems):
            try:
                _, verdict = self.storage_retries(f"re-fetching {path}", lambda: shards.refetch_shard(corpus_dir, file),
                                                  record={"shard": path, "action": "re-fetch retry"})
            except shards.DataError as e:
                self.quarantine(path, offset, f"corrupt on disk and not re-fetchable: {e}")
                return None
            if verdict is not None:
                return verdict
            self.log["repairs"].append({"shard": path, "action": "refetched", "at": time.time()})
            self.say(f"re-fetched {path} from its source; it verifies again")
            return None
        if repeated:
            self.quarantine(path, offset, "the crash repeated at the same place though the file verifies")
        return None

    def verify_corpus(self, corpus_dir):
        """shards.verify_corpus, a shard that cannot be read not taken for a corrupt one (an OSError was a traceback
        that ended the guardian): a mount that dropped is waited for as a trainer's outage is, up to
        unreachable_give_up_s. Returns (problems, None), or (None, (exit code, message)) to stop."""
        return self.storage_retries(f"verifying {corpus_dir}",
                                    lambda: shards.verify_corpus(corpus_dir, self.should_stop))

    def should_stop(self):
        """Asked between a re-hash's chunks: a stop signal ends a corpus' hashing (minutes for GBs) there."""
        return bool(self.stopping)

    def storage_retries(self, doing, fn, record=None):
        """(fn(), None), its StorageError 'unreachable' retried with the backoff (a Hub blip or an hour's outage must
        not end the run; each retry logged as `record` when given), or (None, (exit code, message)) to stop: given
        up, denied, out of disk, a failing disk, or a stop signal."""
        attempt, waited = 0, 0.0
        while True:
            try:
                return fn(), None
            except shards.HashStopped:  # a partial hash: nothing is re-fetched or quarantined on it
                return None, (faults.EXIT_OK, f"stopped by {self.stopping} while {doing}")
            except shards.StorageError as e:
                wait = self.retry_wait(attempt + 1, waited) if e.kind == "unreachable" else None
                if wait is None:
                    code = {"denied": faults.EXIT_DENIED,
                            "disk": faults.EXIT_DISK}.get(e.kind, faults.EXIT_UNREACHABLE)
                    tries = f" ({attempt + 1} tries)" if e.kind == "unreachable" else ""
                    return None, (code, f"{faults.CAUSES[code]} while {doing}{tries}: {e}")
                attempt, waited = attempt + 1, waited + wait
                if record is not None:
                    self.log["repairs"].append(dict(record, error=str(e), wait_s=wait, at=time.time()))
                    self.save()
                self.say(f"storage unreachable while {doing}; retrying in {wait:g} s "
                         f"({self.retry_said(attempt, waited)})")
                if self.wait(wait):
                    return None, (faults.EXIT_OK, f"stopped by {self.stopping} while {doing}")

    def actions(self):
        """Entries of the repair log and the quarantine: a start or an on_stuck pass that grew them handled a shard."""
        return len(self.log["repairs"]) + len(self.log["quarantined"])

    def wait(self, seconds):
        """Sleep, cut short by SIGTERM / Ctrl-C (a plain sleep resumed after the handler: the signal waited out the
        backoff, or every re-fetch try). Whether a signal came."""
        self.woken.wait(seconds)
        return bool(self.stopping)

    def backoff(self, tries):
        """Seconds to wait before retry number `tries` (1, 2, 3, ...) of unreachable storage."""
        return min(60.0, float(self.cfg["unreachable_backoff_s"]) * 2 ** min(tries, 30))

    def retry_wait(self, tries, waited):
        """The wait before retry `tries` of one outage that has waited `waited` s, or None once it would pass
        unreachable_give_up_s (it once gave up after 3 retries, ~70 s: outages a network blip outlasts)."""
        wait = self.backoff(tries)
        return None if waited + wait > float(self.cfg["unreachable_give_up_s"]) else wait

    def retry_said(self, tries, waited):
        return f"retry {tries}; {waited:g} s of unreachable_give_up_s={float(self.cfg['unreachable_give_up_s']):g} waited"

    def on_stuck(self, causes):
        """Whether the on_stuck command or a repair helped; or (exit code, message) to stop (storage gone)."""
        cmd, helped = self.cfg["on_stuck"], False
        if cmd:
            self.say(f"no new checkpoint in {len(causes)} starts; running on_stuck: {cmd}")
            rc, why = self.run_on_stuck(cmd)
            self.log["repairs"].append({"action": "on_stuck", "command": cmd, "exit_code": rc, "at": time.time()})
            helped = rc == 0  # a failing command fixed nothing (it counted as a fix: ~10 GPU-hours of hangs)
            if self.stopping:
                return False
            if not helped:
                self.say(f"on_stuck {why}: not counted as a fix")
        fixed = 0
        self.unrepaired = []  # (corpus dir, problem) found by this pass: what the stuck report says of the data
        for name, cdir in self.corpora().items():
            if self.stopping:  # a stop signal during a corpus' hashing: the rest are not hashed first
                return False
            problems, verdict = self.verify_corpus(cdir)
            if verdict is not None:  # (exit code, message): the caller stops with it
                return verdict
            self.unrepaired += [(cdir, p) for p in problems]
            for problem in problems:
                # "CORPUS_DIR/FILE: ..." or "CORPUS_DIR/FILE offset ...": FILE has no space, CORPUS_DIR may ("My Drive")
                rest = problem[len(cdir) + 1:] if problem.startswith(cdir + os.sep) else problem
                bad = os.path.join(cdir, rest.split(" ", 1)[0].rstrip(":"))
                acted = self.actions()
                if os.path.isfile(bad) and (verdict := self.repair_shard(bad, None, repeated=True)) is not None:
                    return verdict
                # a shard quarantined before is still corrupt on disk: not a fix (else every restart is burnt on it)
                fixed += self.actions() > acted
        return helped or fixed > 0

    def data_said(self):
        """What on_stuck's verify found, for the stuck report ("data verifies" was said of corrupt, quarantined shards)."""
        q = len(self.log["quarantined"])
        held = f"{q} shard{'s' * (q != 1)} quarantined" if q else ""
        if not self.unrepaired:
            return "data verifies" + (f" ({held})" if held else "")
        n, verify = len(self.unrepaired), ", ".join(f"python shards.py verify {c}"
                                                    for c in dict.fromkeys(c for c, _ in self.unrepaired))
        return f"data does not verify: {n} problem{'s' * (n != 1)}{', ' + held if held else ''} ({verify})"

    def run_on_stuck(self, cmd):
        """(exit code, what happened). In its own session, so a remount hung on a dead mount is killed, group and all,
        after ON_STUCK_TIMEOUT_S or at a stop signal (the guardian waited on it forever, deaf to SIGTERM)."""
        proc = subprocess.Popen(cmd, shell=True, start_new_session=True)
        deadline = time.monotonic() + ON_STUCK_TIMEOUT_S
        while proc.poll() is None:
            if self.stopping or time.monotonic() > deadline:
                why = f"stopped by {self.stopping}" if self.stopping else f"ran past {ON_STUCK_TIMEOUT_S:g} s and was killed"
                for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
                    try:
                        os.killpg(proc.pid, sig)
                        proc.wait(grace)
                        break
                    except ProcessLookupError:
                        break
                    except subprocess.TimeoutExpired:
                        continue
                proc.wait()
                return proc.returncode, why
            self.woken.wait(0.2)
        return proc.returncode, f"exited {proc.returncode}"

    def leg_left(self):
        """What is left of stop_after_steps / stop_after_hours, counted from this invocation's first start: train.py
        counts both from its own start, so a restart with the same arguments would begin them again (a 6-hour leg
        that crashed at hour 5 would run 11 on a rented GPU). {key: remaining} for the keys set; <= 0: the leg is done
        (steps by the newest checkpoint, so steps lost in a crash are trained again)."""
        left = {}
        if self.cfg["stop_after_steps"] >= 0:
            newest = self.newest_step()  # none yet: nothing done (a leg begun from another run's step 40 got 40 more)
            done = 0 if newest is None else newest - (self.first_step or 0)
            left["stop_after_steps"] = self.cfg["stop_after_steps"] - done
        if self.cfg["stop_after_hours"] >= 0:
            # to the 6 decimals child_argv passes (3.6 ms): a few ms left would otherwise start a trainer for nothing
            left["stop_after_hours"] = round(self.cfg["stop_after_hours"] - (time.monotonic() - self.t_first) / 3600, 6)
        return left

    def rollback(self):
        """--init_from=resume --resume_from=a checkpoint of this out_dir: the run goes back to it (train.py sets the
        later steps aside). A resume_from elsewhere only starts a run: once out_dir holds checkpoints of its own,
        rerunning the same command continues those."""
        rf = self.cfg["resume_from"]
        return self.cfg["init_from"] == "resume" and bool(rf) and checkpoint.in_run_dir(rf, self.out)

    def rollback_pending(self):
        """Whether the rollback asked for still has its old timeline in out_dir (no start has set it aside yet)."""
        return any(files_signature(p) == sig for p, sig in self.old_timeline.items() if os.path.isdir(p))

    def newest_step(self):
        """out_dir's newest checkpoint step, or, while a rollback is pending, the step it goes back to."""
        return self.first_step if self.rollback_pending() else latest_step(self.out)

    def child_argv(self, left=None, first=False):
        """first: this invocation's first start, which honours an explicit --resume_from; every other start resumes
        the run's own newest checkpoint (after a rollback, the new timeline's: train.py set the later ones aside; until
        a start has, the rollback again)."""
        args = list(self.argv)
        for k, v in (left or {}).items():  # after the invocation's own: the later value wins
            args.append(f"--{k}={v}" if k == "stop_after_steps" else f"--{k}={v:.6f}")
        # or a checkpoint an earlier start of this invocation saw: out_dir on a mount still down reads as empty, and
        # a fresh start's trainer, reaching it once back, refused the run's checkpoints (exit 1, supervision over)
        if ((latest_step(self.out) is not None or self.saw_checkpoint)
                and not ((first or self.rollback_pending()) and self.rollback())):
            args += ["--init_from=resume", "--resume_from="]
        mine = {x["shard"] for x in self.log["quarantined"]}
        q = sorted(set(self.cfg["quarantine_shards"]) | mine)
        if q:
            args.append(f"--quarantine_shards={q!r}")
        # and the shards released (by release_fixed or --release_shards) in this invocation or an earlier one (the
        # checkpoint saved before the release still lists them, and its quarantine held them until --release_shards
        # said otherwise), unless quarantined by hand since
        released = set(self.cfg["release_shards"]) | released_shards(self.log["repairs"])
        if released:  # not one quarantined again since (a fix that did not hold), by this guardian or by hand
            args.append(f"--release_shards={sorted(released - set(q))!r}")
        return [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), *args]

    def on_signal(self, signum, frame):
        """SIGTERM, or SIGINT (Ctrl-C, which the trainer got too): the trainer checkpoints and exits; so does this."""
        self.stopping = signal.Signals(signum).name
        self.t_stop = self.t_stop or time.monotonic()
        if signum == signal.SIGHUP:
            checkpoint.detach_from_lost_terminal()
        self.woken.set()
        if self.child and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self):
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            code = self.supervise_starts()
        finally:  # (in-process use, a test or a notebook: its Ctrl-C went to this guardian's on_signal for good)
            for s, h in handlers.items():
                signal.signal(s, h)
        mine = self.log["starts"][max(0, len(self.log["starts"]) - self.n_started):] if self.n_started else []
        at = lambda step: "none" if step is None else step  # noqa: E731  (a first start: "step None -> 20")
        steps = (f"; newest checkpoint step {at(mine[0]['checkpoint_step_at_start'])} -> "
                 f"{at(mine[-1].get('checkpoint_step_at_end'))}" if mine else "")
        # one line a field report can quote (the starts were scattered through hours of trainer output)
        self.say(f"summary: {self.n_started} start{'s' * (self.n_started != 1)}"
                 f"{' (' + summarize([m.get('cause', 'unknown') for m in mine]) + ')' if mine else ''}{steps}; "
                 f"exit {code} ({self.log['status']})")
        return code

    def supervise_starts(self):
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        signal.signal(signal.SIGHUP, self.on_signal)  # an ssh drop: the trainer checkpoints (it died with none)
        no_progress, last_data_fault, fruitless, fruitless_causes = [], None, 0, []
        repaired_shards = set()  # shards this invocation re-fetched or quarantined after a start named them
        unreachable_tries, unreachable_waited = 0, 0.0
        while True:
            if self.stopping:  # a SIGTERM while no trainer ran (a backoff, a repair): start none
                self.log["status"] = f"stopped ({self.stopping})"
                self.save()
                self.say(f"stopped by {self.stopping} between starts")
                return 0
            before = latest_step(self.out) if self.n_started == 0 else self.newest_step()
            t0, reports_before = time.time(), crash_reports(self.out)
            left = None
            if self.n_started == 0:
                self.first_step, self.t_first = before, time.monotonic()
                if self.rollback() or (before is None and self.cfg["init_from"] == "resume" and self.cfg["resume_from"]):
                    # the leg starts where its first start resumes (a run dir: its newest; a run dir's own state.json
                    # does not exist, so step 0 made the whole run count as the leg's steps)
                    try:
                        ck = checkpoint.resolve(self.cfg["resume_from"])
                        self.first_step = train.read_json(os.path.join(ck, "state.json"), {}).get("step")
                    except (checkpoint.CheckpointError, train.TrainError, AttributeError):
                        self.first_step = None  # train.py names what is wrong with it, in one line, and stops
                    if self.rollback() and self.first_step is not None:  # progress is past the step gone back to,
                        before = self.first_step                          # not past the old timeline's newest
            else:
                left = self.leg_left()
                if any(v <= 0 for v in left.values()):  # the leg's steps or hours are used up: nothing to restart
                    self.log["status"] = "done (the leg's limit was reached before a restart)"
                    self.save()
                    self.say(f"the leg's {' / '.join(left)} are used up; not restarting")
                    return 0
                self.say("restarting")  # said here, once nothing stops it (it came before "not restarting")
            self.release_fixed()
            if self.stopping:  # came during release_fixed's hashing: no trainer started only to be stopped
                continue  # (the loop's top says it stopped, and starts none)
            start = {"started_at": t0, "checkpoint_step_at_start": before}
            if left:
                start["leg_left"] = left
            self.log["starts"].append(start)
            extra = len(self.log["starts"]) - STARTS_KEPT
            if extra > 0:  # the oldest go (numbering goes on: start_number counts the dropped)
                del self.log["starts"][:extra]
                self.log["starts_dropped"] = self.log.get("starts_dropped", 0) + extra
            n_start = self.start_number()
            self.save()
            self.say(f"start {n_start} (checkpoint step {'none' if before is None else before})")
            argv = self.child_argv(left, first=self.n_started == 0)
            self.n_started += 1
            locked_out = self.locked_out_file()
            # its output through pipes, passed on as it comes, the tail kept for a crash log (unbuffered: live)
            self.child = subprocess.Popen(argv, preexec_fn=pdeathsig_setter(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1",
                                                                           **{rundir.LOCKED_OUT_ENV: locked_out}))
            tails = {"stdout": bytearray(), "stderr": bytearray()}
            pumps = [threading.Thread(target=pump, args=(getattr(self.child, n), n, tails[n]), daemon=True)
                     for n in tails]
            for t in pumps:
                t.start()
            if self.stopping:  # the SIGTERM came while it started (on_sigterm saw the previous child)
                self.child.send_signal(signal.SIGTERM)
            rc, killed = self.wait_child()
            drained_by = time.monotonic() + PUMP_DRAIN_S  # one wait for both pipes (each its own 5 s: 10 s a restart)
            for t in pumps:  # (a grandchild holding a pipe open does not hold the guardian)
                t.join(max(0.0, drained_by - time.monotonic()))
            after = self.newest_step()  # (a rollback not yet done: its old timeline's newest is no progress)
            self.saw_checkpoint = self.saw_checkpoint or before is not None or after is not None
            rep_name, rep = newest_crash_report(self.out, reports_before)
            cause = "ok" if rc == 0 else killed or (faults.CAUSES.get(rc) or NO_RESTART.get(rc) or
                                                    (killed_by(-rc) if rc < 0 else f"exit {rc}"))
            start.update(ended_at=time.time(), exit_code=rc, cause=cause, checkpoint_step_at_end=after,
                         crash_report=rep_name, message=(rep or {}).get("message"))
            if rc != 0:
                start["output_tail"] = self.keep_crash_log(n_start, rc, cause, tails)
            self.save()
            if rc == 0:
                # a signal after the trainer's work was done (Ctrl-C during its end-of-run sample) stopped nothing
                done = self.why_done(after)
                stopped = self.stopping and not done.startswith("done")
                self.log["status"] = f"stopped ({self.stopping})" if stopped else done
                self.save()
                if not self.stopping and self.log["status"] != "done":
                    self.say(self.log["status"])
                return 0
            # what it trained and saved, said as it was: a second Ctrl-C (exit 130) was "before it trained" whenever
            # no new checkpoint came (steps trained since were lost), and "not a checkpoint" when it came after one
            trained_to = logged_since(self.out, t0)  # (the first step of a start is always logged)
            progressed = after is not None and (before is None or after > before)
            all_saved = progressed and (trained_to is None or trained_to <= after)
            interrupted = rc in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP, 130)
            # a trainer killed by the signal before its handler was set (rc -15, was exit 241) had trained nothing
            if self.stopping and interrupted and (all_saved or (trained_to is None and not progressed)):
                self.log["status"] = f"stopped ({self.stopping})"
                self.save()
                self.say(f"stopped by {self.stopping} (the trainer's {cause}, " + (
                    f"after its checkpoint of every step it trained: step {after})" if all_saved else
                    "before it trained)"))
                return 0
            if self.stopping:  # it died instead of saving (a hang while stopping, a crash in the save): not a clean stop
                lost = (f"the steps after it (logged to step {trained_to}) are lost" if trained_to is not None
                        and (after is None or trained_to > after) else "the steps after it are lost")
                return self.stop(rc if rc > 0 else 128 - rc,
                                 f"stopped by {self.stopping}, but the trainer ended with {cause}"
                                 + (" (a second Ctrl-C)" if rc == 130 else "")
                                 + f", not a checkpoint: the newest is step {after if after is not None else 'none'} "
                                 f"and {lost}",
                                 status=f"stopped ({self.stopping}), trainer {cause}")
            if rc == faults.EXIT_ERROR and self.wait_for_lock_holder(os.path.exists(locked_out)):
                if self.stopping:  # (while waiting: the loop's top says it stopped, and starts none)
                    continue  # else locked out, not a fault of the run: restarted (a start with no new checkpoint)
            elif rc in NO_RESTART:
                return self.stop(rc, f"{cause}: {(rep or {}).get('message') or 'see the trainer output'}; "
                                     f"restarting cannot fix this")
            # why it ended, on the console too (it was in guardian.json only); "restarting" only once it is decided
            self.say(f"start {n_start} ended: {cause}"
                     + (f" ({(rep or {}).get('message')})" if (rep or {}).get("message") else "")
                     + f"; newest checkpoint {after if after is not None else 'none'}")
            if progressed or rc != faults.EXIT_UNREACHABLE:  # the retries are per outage: a run that trains between
                unreachable_tries, unreachable_waited = 0, 0.0  # short outages hours apart is not stopped by them
            if rc == faults.EXIT_UNREACHABLE:
                wait = self.retry_wait(unreachable_tries + 1, unreachable_waited)
                if wait is None:
                    return self.stop(rc, f"storage unreachable {unreachable_tries + 1} times, {unreachable_waited:g} s "
                                         f"of waits (unreachable_give_up_s="
                                         f"{float(self.cfg['unreachable_give_up_s']):g}): {(rep or {}).get('message')}")
                unreachable_tries, unreachable_waited = unreachable_tries + 1, unreachable_waited + wait
                self.say(f"storage unreachable: restarting in {wait:g} s "
                         f"({self.retry_said(unreachable_tries, unreachable_waited)})")
                if self.wait(wait):
                    continue  # (the loop's top says it stopped, and starts none)
            # no shard to fix (a missing index.json, kind "missing", was quarantined as shard "local/index.json")
            if rc == faults.EXIT_DATA and rep and (rep.get("kind") in ("index", "tokenizer") or
                                                  os.path.basename(str(rep.get("path"))) == "index.json"):
                return self.stop(rc, f"{cause}: {rep.get('message')}; restarting cannot fix this")
            repaired = first_repair = False
            if rc == faults.EXIT_DATA and rep and rep.get("path"):
                fault = (rep["path"], rep.get("offset"))
                acted = self.actions()
                verdict = self.repair_shard(rep["path"], rep.get("offset"), repeated=fault == last_data_fault)
                repaired = verdict is None and self.actions() > acted
                # a shard's first repair frees its restart (30 bad shards, each fixed, gave up at max_restarts=20);
                # its repeat counts (the repair did not hold): free restarts are bounded by the corpus's shards
                first_repair = repaired and os.path.abspath(rep["path"]) not in repaired_shards
                if repaired:
                    repaired_shards.add(os.path.abspath(rep["path"]))
                last_data_fault = fault
                self.save()
                if verdict is not None and self.stopping:
                    continue  # (stopped by a signal while re-fetching: the loop's top says so)
                if verdict is not None:
                    return self.stop(*verdict)
            if not progressed and rc != faults.EXIT_UNREACHABLE and not first_repair:  # (outages: their own retries)
                fruitless += 1
                fruitless_causes.append(cause)
            # restarts after starts that made no new checkpoint, in this invocation (guardian.json keeps every one):
            # a week-long run with a fault a day is not ended by its 21st; decided before "restarting" is said
            if fruitless > self.cfg["max_restarts"]:
                return self.stop(EXIT_STUCK, f"gave up: {fruitless} starts made no new checkpoint, more than "
                                             f"max_restarts={self.cfg['max_restarts']} (causes: "
                                             f"{summarize(fruitless_causes)}); look at {self.out}/crash-*.json")
            # unreachable storage has its own retries above (counted as stuck, its give-up never came); a start whose
            # named shard was re-fetched or newly quarantined is not stuck (3 bad shards, each fixed, ended in exit 9)
            no_progress = ([] if progressed else no_progress if rc == faults.EXIT_UNREACHABLE or repaired
                           else no_progress + [cause])
            if len(no_progress) >= self.cfg["max_stuck_starts"]:
                helped = self.on_stuck(no_progress)
                if self.stopping:
                    continue  # (the loop's top says it stopped, and starts none)
                if isinstance(helped, tuple):  # storage unreachable / failing while verifying or re-fetching
                    return self.stop(*helped)
                if not helped:
                    return self.stop(EXIT_STUCK, f"stuck: {len(no_progress)} consecutive starts produced no new "
                                                 f"checkpoint (causes: {', '.join(no_progress)}); {self.data_said()}; "
                                                 f"set on_stuck or look at {self.out}/crash-*.json")
                no_progress = []
                self.save()

    def start_number(self):
        """The newest start's number (1, 2, ...; its crash log's), counting those dropped past STARTS_KEPT."""
        return self.log.get("starts_dropped", 0) + len(self.log["starts"])

    def locked_out_file(self):
        """out_dir/guardian/locked-out, cleared: the trainer writes it when out_dir's lock refuses it
        (rundir.LOCKED_OUT_ENV), in the guardian's own folder (a crash report would be the holder's run's)."""
        path = os.path.join(self.out, "guardian", "locked-out")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.remove(path)
        except OSError:  # none left by an earlier start; or not writable (then a holder still there is looked for)
            pass
        return path

    def wait_for_lock_holder(self, locked_out=False):
        """Whether the trainer was locked out: its exit 1 came with the locked-out file, or another trainer holds
        out_dir's lock (a killed guardian's, still writing and mirroring its SIGTERM checkpoint past lock_wait_s: this
        start exited 1, and supervision stopped for good); if so, wait until that one is out (or a stop signal
        comes). The file: a holder that exited between the refusal and this look stopped supervision for good."""
        holder = rundir.lock_holder(self.out)
        if holder is None:
            if locked_out:
                self.say(f"the trainer was locked out of {self.out} by another trainer, out since; restarting")
            return locked_out
        self.say(f"the trainer was locked out: another trainer (pid {holder}) holds {self.out}; restarting once it "
                 f"exits")
        while rundir.lock_holder(self.out) is not None and not self.wait(1.0):
            pass
        return True

    def wait_child(self):
        """(exit code, cause if the guardian killed it). After a stop signal the trainer has stop_grace_s to save and
        exit, then SIGKILL: one stuck where not even its watchdog runs ignored the SIGTERM and held the guardian."""
        while True:
            try:
                return self.child.wait(0.5), None
            except subprocess.TimeoutExpired:
                pass
            grace = float(self.cfg["stop_grace_s"])
            self.t_stop = self.t_stop or (time.monotonic() if self.stopping else None)
            if self.stopping and time.monotonic() - self.t_stop > grace:
                self.say(f"the trainer (pid {self.child.pid}) is not out {grace:g} s after the {self.stopping} "
                         f"(stop_grace_s); killing it (SIGKILL)")
                self.child.kill()
                return self.child.wait(), f"killed by the guardian (SIGKILL) {grace:g} s after the {self.stopping}"

    def keep_crash_log(self, n, rc, cause, tails):
        """out_dir/guardian/crash-NNNN.log: the tail of start n's stdout and stderr (they were only on a console that
        may be gone), the newest CRASH_LOGS_KEPT kept. Its name relative to out_dir, or None if it cannot be written."""
        d = os.path.join(self.out, "guardian")
        name = os.path.join("guardian", f"crash-{n:04d}.log")
        try:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(self.out, name), "wb") as f:
                f.write(f"start {n}: exit {rc} ({cause}) at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
                for stream, tail in tails.items():
                    f.write(f"--- {stream}, its last {len(tail)} bytes ---\n".encode() + bytes(tail) + b"\n")
            # the oldest by time, not by name: numbering restarts with a fresh guardian.json (crash-0001 sorted first)
            old = sorted((os.stat(os.path.join(d, x)).st_mtime_ns, x) for x in os.listdir(d)
                         if x.startswith("crash-") and x.endswith(".log") and x != os.path.basename(name))
            for _, x in old[:max(0, len(old) - (CRASH_LOGS_KEPT - 1))]:
                os.remove(os.path.join(d, x))
        except OSError as e:  # (a full disk: the trainer's own crash report says the cause)
            self.say(f"warning: cannot write {os.path.join(self.out, name)} ({e.strerror or e})")
            return None
        return name

    def why_done(self, step):
        """guardian.json's status after a trainer's exit 0 with no signal to the guardian: "done" only when the plan is
        finished or the leg's limit reached (a SIGTERM to the trainer alone also ends it with 0 and a checkpoint)."""
        ck = latest_valid(self.out)
        try:
            st = (train.read_json(os.path.join(ck, "state.json"), {}) if ck else None) or {}
        except train.TrainError:
            st = {}
        # a stop signal cut the last step's evaluation short: its val loss (maybe the best) waits for a resume
        due = isinstance(st.get("eval_due"), dict) and st["eval_due"].get("step") == st.get("step")
        if st.get("finished") and due:
            return (f"stopped: the plan is finished, but a stop signal cut its last step {st.get('step')}'s evaluation "
                    f"short; not restarting (a resume measures it: run the guardian again)")
        if st.get("finished"):
            return "done"
        left = self.leg_left()
        if any(v <= 0 for v in left.values()):  # (the guardian's hours began before the trainer's: reached here too)
            return "done (the leg's limit)"
        at = f"at step {step}" if step is not None else "with no checkpoint"  # (it said "at step None")
        return (f"stopped: the trainer alone was stopped (a signal to it, not to the guardian) {at}; "
                f"the plan is not finished, not restarting")

    def stop(self, code, message, status="stopped"):
        self.log["status"] = status
        self.log["report"] = {"exit_code": code, "cause": faults.CAUSES.get(code) or NO_RESTART.get(code) or
                              ("stuck" if code == EXIT_STUCK else "interrupted" if code == 130 else "error"),
                              "message": message, "at": time.time()}
        self.save()
        self.say(f"stopped: {message}")
        return code


STALE_TEMP_S = 3600.0  # a guardian.json.tmp-PID-* this old is a dead writer's even if its PID was reused


def check_log(log, path):
    """A hand-edited guardian.json: a missing list is filled empty (the same as an empty one: nothing recorded of it),
    one of the wrong type is one line naming the file (it was a KeyError / TypeError traceback); the file is kept."""
    if not isinstance(log, dict):
        raise configurator.ConfigError(f"{path}: not a JSON object; fix it by hand, or move it aside to start a "
                                       f"fresh guardian log")
    for key in ("starts", "quarantined", "repairs"):
        log.setdefault(key, [])
        if not isinstance(log[key], list) or not all(isinstance(x, dict) for x in log[key]):
            raise configurator.ConfigError(f"{path}: \"{key}\" must be a list of objects; fix it by hand, or move "
                                           f"the file aside to start a fresh guardian log")
    dropped = log.get("starts_dropped", 0)
    if isinstance(dropped, bool) or not isinstance(dropped, int) or dropped < 0:
        raise configurator.ConfigError(f"{path}: \"starts_dropped\" must be a count >= 0; fix it by hand, or move "
                                       f"the file aside to start a fresh guardian log")
    if not all(isinstance(q.get("shard"), str) for q in log["quarantined"]):
        raise configurator.ConfigError(f"{path}: each \"quarantined\" entry needs a \"shard\" (\"CORPUS/FILE\"); "
                                       f"fix it by hand, or move the file aside to start a fresh guardian log")


def remove_stale_temps(path):
    """Remove path's write_atomic temp files (PATH.tmp-PID-THREAD) a writer killed mid-write left: those whose PID
    is not alive, or older than STALE_TEMP_S (a reused PID); a live writer's is left alone."""
    d, base = os.path.dirname(os.path.abspath(path)), os.path.basename(path) + ".tmp-"
    try:
        names = [n for n in os.listdir(d) if n.startswith(base)]
    except OSError:
        return
    for n in names:
        pid = n[len(base):].split("-", 1)[0]
        try:
            alive = pid.isdigit() and int(pid) > 0 and checkpoint.pid_alive(int(pid))
            if not alive or time.time() - os.stat(os.path.join(d, n)).st_mtime > STALE_TEMP_S:
                os.remove(os.path.join(d, n))
        except OSError:  # gone already (its writer finished), or not ours to remove
            pass


def released_shards(repairs):
    """The shards the repair log released and did not quarantine by hand again since."""
    released = set()
    for r in repairs:
        if str(r.get("action", "")).startswith("released"):
            released.add(r.get("shard"))
        elif r.get("action") == QUARANTINED_BY_HAND:
            released.discard(r.get("shard"))
    return released


def shard_fingerprint(corpus_dir, entry):
    """What a shard is on disk and in index.json (its entry there): a quarantined one whose fingerprint changed was
    replaced or prepared again, and is verified again (one that did not is not hashed again)."""
    fp = {"sha256": entry.get("sha256"), "mask_sha256": entry.get("mask_sha256"), "files": []}
    for name in (entry["file"], entry.get("mask")):
        try:
            st = os.stat(os.path.join(corpus_dir, name)) if name else None
        except OSError:
            st = None
        fp["files"].append([st.st_size, st.st_mtime_ns] if st else None)  # (no inode: a FUSE remount renumbers)
    return fp


def pump(src, stream, tail):
    """Pass the trainer's output to ours as it comes, keeping its last TAIL_BYTES. It reads on whatever happens to
    the writes (a terminal gone): a full pipe would block the trainer."""
    while True:
        chunk = os.read(src.fileno(), 1 << 16)
        if not chunk:
            break
        tail += chunk
        del tail[:-TAIL_BYTES]
        out = getattr(sys, stream)  # (looked up each time: a test, or detach_from_lost_terminal, may swap it)
        try:
            if hasattr(out, "buffer"):
                out.buffer.write(chunk)
            else:
                out.write(chunk.decode(errors="replace"))
            out.flush()
        except (OSError, ValueError, AttributeError):  # (a closed stdout is None: the pipe is still drained)
            pass
    src.close()


def logged_since(out_dir, t0):
    """The newest step metrics.jsonl logged at or after time t0 (a trainer started then), or None."""
    row = train.last_metrics_row(os.path.join(out_dir, "metrics.jsonl"))
    when, step = (row or {}).get("time"), (row or {}).get("step")
    ok = isinstance(when, (int, float)) and when >= t0 and isinstance(step, int) and not isinstance(step, bool)
    return step if ok else None


def killed_by(signum):
    """'killed by signal 9 (SIGKILL: the kernel's OOM killer? dmesg | grep -i oom)': the field report's most common
    silent death, a host RAM spike (a dataloader, a checkpoint copy), said where the operator looks."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"killed by signal {signum}"
    hint = ": the kernel's OOM killer? dmesg | grep -i oom" if signum == signal.SIGKILL else ""
    return f"killed by signal {signum} ({name}{hint})"


def summarize(causes):
    """'hang x3, crash x1' in the order first seen."""
    return ", ".join(f"{c} x{causes.count(c)}" for c in dict.fromkeys(causes))


def supervise(argv):
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        return Guardian(argv).run()
    except configurator.ConfigError as e:
        print(f"guardian: error: {e}", file=sys.stderr)
        return 2
    except rundir.RunDirError as e:  # locked by another guardian; an out_dir that cannot be made (/proc/x)
        print(f"guardian: error: {e}", file=sys.stderr)
        return faults.EXIT_ERROR
    except OSError as e:  # an out_dir it may not write, as train.py says it (a traceback)
        if e.errno not in checkpoint.DENIED_ERRNOS:
            raise
        print(f"guardian: error: {faults.CAUSES[faults.EXIT_DENIED]}: {rundir.denied_line(e, '.')}", file=sys.stderr)
        return faults.EXIT_DENIED


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1:]))
