"""The run directory train.py writes (out_dir) and its mirror: one trainer at a time (an flock), what a resume starts
from (a rollback's or a corrupt step's later steps set aside, a mirror copy of the very checkpoint brought back),
which checkpoints are kept (retention), and the copy of logs and the newest checkpoint kept elsewhere (mirror_dir).
Used by train.py (rank 0) and guardian.py, and by a reader of a run dir (checkpoint.resolve: chat, eval, export) for a
step a killed re-save left aside; errors are RunDirError, one line each."""
import errno
import json
import os
import re
import shutil
import time

import checkpoint


class RunDirError(Exception):
    """A run dir that cannot be used as asked (train.py: one line, exit 1)."""


class RunLocked(RunDirError):
    """Another trainer holds the run dir: no crash report (it would land in that trainer's run dir, as its cause)."""


# a file the guardian names for its trainer: written when the run's lock refuses it, so the guardian restarts it even
# if the holder is gone by the time it looks (it stopped for good, taking the exit 1 for a config error)
LOCKED_OUT_ENV = "PICAFLOR_LOCKED_OUT_FILE"


def read_json(path, default=None, error=RunDirError):
    """The file's JSON; default if it does not exist; `error` (one line naming the file) if it is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default
    except ValueError as e:
        raise error(f"{path}: not valid JSON ({e}); fix or delete it")


def set_aside_after(run_dir, step, tag):
    """Move run_dir's checkpoints past `step` to run_dir/abandoned/TAG/ (a rollback's old timeline); how many."""
    later = [p for s, p in checkpoint.list_checkpoints(run_dir) if s > step]
    for p in later:
        os.makedirs(os.path.join(run_dir, "abandoned", tag), exist_ok=True)
        os.replace(p, os.path.join(run_dir, "abandoned", tag, os.path.basename(p)))
    return len(later)


def remove_step(p):
    """Delete a step dir as one rename then a delete: a kill mid-delete leaves a .trash-* dir (cleared at the next
    start, clear_leftovers) instead of a half-deleted step that no retention ever looks at again."""
    trash = os.path.join(os.path.dirname(p), f".trash-{os.path.basename(p)}-{os.getpid()}")
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


def clear_leftovers(out_dir, log=None):
    """Under the run's lock: what a killed process left in out_dir (a delete's .trash-*, a pointer file's
    NAME.tmp-PID-TID; checkpoint.save clears its own .tmp-step_*)."""
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        path = os.path.join(out_dir, name)
        if name.startswith(".trash-step_"):
            shutil.rmtree(path, ignore_errors=True)
        elif re.match(r"^[A-Za-z_.]+\.tmp-\d+-\d+$", name) and os.path.isfile(path):
            os.remove(path)
        else:
            continue
        if log:
            log(f"removed {path}, left by a process that was killed")


def retain(out_dir, keep, saved=None):
    """Prune out_dir's checkpoints to keep_last permanent ones, every stage final and finished plan, the best (BEST,
    and the newest state's best_step) and `saved`, the step just written (the newest otherwise). Steps newer than
    `saved` are not this run's (a corrupt leftover of an earlier one): never protected on its behalf."""
    ckpts = checkpoint.list_checkpoints(out_dir)
    if saved is not None:
        limit = int(checkpoint.STEP_RE.match(os.path.basename(str(saved).rstrip("/"))).group(1))
        ckpts = [(s, p) for s, p in ckpts if s <= limit]
    valid = [(s, p) for s, p in ckpts if checkpoint.is_valid(p, check_hashes=False)]
    if not valid:
        return []
    states = {}
    for _, p in valid:
        try:
            with open(os.path.join(p, "state.json")) as f:
                states[p] = json.load(f)
        except (OSError, ValueError):  # a corrupt one (its hash fails on resume) is neither kept nor removed here
            continue
        if not isinstance(states[p], dict):
            del states[p]
    readable = [(s, p) for s, p in valid if p in states]
    kinds = {p: states[p].get("kind", "periodic") for _, p in readable}
    best = (open(os.path.join(out_dir, "BEST")).read().strip() if os.path.exists(os.path.join(out_dir, "BEST")) else None)
    permanent = [p for _, p in readable if kinds[p] in ("periodic", "final", "preempt")]
    # every stage's end stays, the end of a finished plan too (saved again as "final"; a --replan extends the plan)
    protect = (set(permanent[-max(1, keep):]) | {valid[-1][1]}
               | {p for _, p in readable if kinds[p] == "stage_final" or states[p].get("finished")})
    if best:
        protect.add(os.path.join(out_dir, best))
    if readable:  # the newest state names its best: BEST may lag it (a kill between a save and BEST's write)
        best_step = states[readable[-1][1]].get("best_step")
        if isinstance(best_step, int):
            protect.add(os.path.join(out_dir, checkpoint.step_dir_name(best_step)))
    removed = []
    for _, p in readable:
        if p not in protect:
            remove_step(p)
            removed.append(os.path.basename(p))
    return removed


def same_dir(a, b):
    return os.path.realpath(str(a).rstrip("/") or "/") == os.path.realpath(str(b).rstrip("/") or "/")


def restore_from_mirror(out, mirror_dir, newer, log):
    """For out_dir's newer steps that do not verify (newest first): the mirror's copy of the same step whose
    MANIFEST.json is byte for byte out_dir's (the same checkpoint: not another timeline's step of that number, nor
    another run's sharing the mirror), copied to a temp dir in out_dir, fsynced and verified. (temp dir, the step's
    path) or None; a copy that fails is said and removed, and the resume goes on from the older step."""
    for _, p in reversed(newer):
        name = os.path.basename(p)
        cand = os.path.join(mirror_dir, name)
        try:
            same = open(os.path.join(p, "MANIFEST.json"), "rb").read() == open(os.path.join(cand, "MANIFEST.json"), "rb").read()
        except OSError:  # no manifest here or there (a rotted manifest cannot say which checkpoint it was)
            continue
        if not same:
            continue
        tmp = os.path.join(out, ".tmp-restore-" + name)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(cand, tmp)
            checkpoint.fsync_tree(tmp)
            checkpoint.verify(tmp)
            return tmp, p
        except (OSError, shutil.Error, checkpoint.CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log(f"WARNING: could not copy {cand} back ({str(e).splitlines()[0][:200]}); resuming an older step")
    return None


def prepare_run_dir(cfg, out, log):
    """Rank 0, before anything is loaded: put back a step a dying re-save left aside, refuse a fresh start over a run's
    checkpoints, and for a resume pick the checkpoint (resume_from, else the newest that verifies) and set aside every
    later step, out_dir's and the mirror's: a rollback's old timeline, or newer steps that do not verify (left in
    place, the newest, protected by retention, made it prune every step this start saved). A newer step that fails
    here but verifies in the mirror is copied back and resumed. Returns the checkpoint to resume (None: no resume)."""
    for back in checkpoint.recover(out):  # a re-save that died between its renames: the step it had moved aside
        log(f"WARNING: {back} was left aside by a save that died; put back")
    for name in os.listdir(out) if os.path.isdir(out) else []:  # a copy from the mirror cut short (this run's lock held)
        if name.startswith(".tmp-restore-"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    clear_leftovers(out, log)
    existing = checkpoint.list_checkpoints(out)
    if cfg["init_from"] != "resume":  # it would overwrite that run's steps (and retention the rest); corrupt ones: go on
        newest_valid = checkpoint.latest_valid(out)
        if newest_valid:
            raise RunDirError(f"{out} already holds a run's checkpoints (newest {os.path.basename(newest_valid)}); "
                             f"continue it with --init_from=resume, or pass another --out_dir")
        if existing:  # every one corrupt: set aside, not left to be taken for this run's newest (or overwritten)
            aside = os.path.join(out, "abandoned", f"corrupt_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}")
            os.makedirs(aside, exist_ok=True)
            for _, p in existing:
                os.replace(p, os.path.join(aside, os.path.basename(p)))
            log(f"WARNING: {len(existing)} checkpoint(s) in {out} do not verify; moved to {aside} "
                f"(--init_from={cfg['init_from']} starts a new run here)")
        stale = os.path.join(out, "control.json")
        if os.path.exists(stale):  # an earlier run's: a fresh run read it at step 0 and trained only a decay
            aside = os.path.join(out, "abandoned", f"before_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}")
            os.makedirs(aside, exist_ok=True)
            os.replace(stale, os.path.join(aside, "control.json"))
            log(f"WARNING: {stale} is from before this start (--init_from={cfg['init_from']}): moved to {aside}; "
                f"write it again to start this run's decay")
        return None
    mirror_dir = cfg["mirror_dir"]
    # an explicit rollback; resume_from=out_dir itself is a plain resume (its LATEST may lag its newest valid step)
    explicit = bool(cfg["resume_from"]) and not same_dir(cfg["resume_from"], out)
    if explicit:
        ck = checkpoint.resolve(cfg["resume_from"])  # a step dir, or a run dir (its newest) as grow_from takes
        checkpoint.verify(ck)
    else:
        ck = checkpoint.latest_valid(out)
        if ck is None:
            raise RunDirError(f"{out}: no valid checkpoint to resume from; start with --init_from=scratch"
                             + (f" (found {len(existing)} invalid step_* dirs)" if existing else ""))
    state = read_json(os.path.join(ck, "state.json"))
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):  # (a TypeError traceback, exit 10)
        raise RunDirError(f"{ck}: verifies but holds no training state.json (its manifest lacks one, or it has no "
                          f"step); resume an earlier step with --resume_from=STEP_DIR, or move {ck} aside")
    if explicit and not checkpoint.in_run_dir(ck, out):  # another dir's step: a branch, unless out_dir holds a run
        own = checkpoint.latest_valid(out)
        own_state = read_json(os.path.join(own, "state.json"), None) if own else None
        if own and (not isinstance(own_state, dict) or own_state.get("created_at") != state.get("created_at")):
            # (it set that run's later steps aside and resumed another run, maybe another model, in its place)
            raise RunDirError(f"{ck} is a checkpoint of another run than the one in {out} (newest "
                              f"{os.path.basename(own)}); resume {out}'s own with --resume_from= (empty), or pass an "
                              f"empty --out_dir to continue {ck}'s run there")
    step = state["step"]
    tag = f"after_step_{step:07d}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
    newer = [(s_, p) for s_, p in existing if s_ > step]  # none of them verifies (ck is the newest that does)
    restored = restore_from_mirror(out, mirror_dir, newer, log) if newer and mirror_dir and not explicit else None
    if newer and not restored and not explicit:  # (said before the copy-back was tried, it contradicted it)
        log(f"WARNING: newest checkpoint {newer[-1][1]} is invalid (it does not verify); resuming from {ck}")
    n_moved = set_aside_after(out, step, tag) if newer else 0

    def fix_best(state):  # BEST may name a step just set aside: the resumed state's best, else none
        best = os.path.join(out, "BEST")
        if os.path.exists(best) and not os.path.isdir(os.path.join(out, open(best).read().strip())):
            kept = state.get("best_step") is not None and os.path.join(out, checkpoint.step_dir_name(state["best_step"]))
            if kept and os.path.isdir(kept):
                checkpoint.write_atomic_text(best, os.path.basename(kept) + "\n")
            else:
                os.remove(best)
    if restored:
        tmp, final = restored
        os.replace(tmp, final)
        checkpoint.fsync_dir(out)
        checkpoint.write_atomic_text(os.path.join(out, "LATEST"), os.path.basename(final) + "\n")
        fix_best(read_json(os.path.join(final, "state.json")))
        log(f"WARNING: {final} did not verify; its copy in the mirror (the same manifest) does: copied back and resumed "
            f"({n_moved} step(s) that did not verify moved to {os.path.join(out, 'abandoned', tag)})")
        return final
    m_moved = 0
    if mirror_dir and explicit:  # (its later steps: whether or not out_dir had any, e.g. a rollback into a fresh out_dir)
        try:
            m_moved = set_aside_after(mirror_dir, step, tag)
        except OSError as e:  # a read-only or unmounted mirror: out_dir's timeline is right; the mirror's is said
            log(f"WARNING: could not set aside the mirror's steps after {step} ({e}); a resume from {mirror_dir} would "
                f"take the old timeline's newest: move them to {os.path.join(mirror_dir, 'abandoned', tag)} by hand")
    if not (n_moved or m_moved):
        return ck
    if checkpoint.in_run_dir(ck, out):
        checkpoint.write_atomic_text(os.path.join(out, "LATEST"), os.path.basename(os.path.normpath(ck)) + "\n")
    fix_best(state)
    log(f"WARNING: resuming an earlier step: moved {n_moved} later checkpoint(s) of {out}"
        + (f" and {m_moved} of {mirror_dir}" if m_moved else "") + f" to abandoned/{tag}, so they are neither resumed "
        f"nor pruned")
    try:  # a decay control.json asked for in the timeline set aside is not this one's
        ctl = read_json(os.path.join(out, "control.json"), {})
    except RunDirError:
        ctl = {}
    taken = ctl.get("start_decay_taken_at_step") if isinstance(ctl, dict) else None
    # taken at step N: checkpoint N was saved before it was read (each step saves, then reads control.json)
    if explicit and isinstance(taken, int) and taken >= step and state.get("decay_started_at_tokens") is None:
        os.makedirs(os.path.join(out, "abandoned", tag), exist_ok=True)
        os.replace(os.path.join(out, "control.json"), os.path.join(out, "abandoned", tag, "control.json"))
        log(f"control.json: its start_decay was taken at step {taken}, not before step {step}: moved to "
            f"{os.path.join(out, 'abandoned', tag)}; this timeline trains without it")
    return ck


def file_in_the_way(out_dir):
    """The file that out_dir is, or lies under (it cannot be made a folder), else None: makedirs' FileExistsError
    or NotADirectoryError was a traceback, exit 10, which the guardian restarted as a crash."""
    path = os.path.abspath(out_dir)
    while not os.path.exists(path) and path != os.path.dirname(path):  # the nearest part of it that exists
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else path


def denied_line(e, out_dir):
    """'PATH: cause; the fix' for a run dir it may not write (EACCES, EPERM, EROFS): train.py's and the guardian's."""
    fix = "remount it read-write" if e.errno == errno.EROFS else "fix its permissions"
    return f"{e.filename or out_dir}: {e.strerror}; {fix}, or pass another --out_dir"


def hold_run_lock(out_dir, wait_s, log, who="trainer", alive=None):
    """One trainer per out_dir (an flock on out_dir/.trainer.lock, held until exit): a second one deleted the first's
    checkpoint temp dir mid-save. It waits up to wait_s for the first to exit (a relaunched guardian's trainer,
    while the killed guardian's finishes its SIGTERM checkpoint), then errors; a lock file deleted while it waited
    (a refused start's cleanup) is opened again, so two trainers never hold two files. Returns the open lock file.
    who="guardian": the same for guardians (.guardian.lock; a second one rewrote the first's guardian.json).
    alive: called as it waits (the trainer's watchdog: a wait bounded by wait_s is no hang)."""
    import fcntl
    path = os.path.join(out_dir, f".{who}.lock")
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except (FileNotFoundError, NotADirectoryError) as e:  # (/proc/x: a traceback, exit 10, "checkpoints are intact")
        raise RunDirError(f"--out_dir={out_dir}: cannot create {e.filename or path} ({e.strerror}: no folder files can "
                          f"be made in, as /proc or /sys); pass a run directory on a disk it can write") from None
    deadline, said, reopened = time.monotonic() + wait_s, False, 0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if time.monotonic() >= deadline:
                os.close(fd)
                doing = "is training" if who == "trainer" else "supervises"
                locked = RunLocked(f"{out_dir}: another {who} (pid {holder}) {doing} this run ({path}); stop it "
                                   f"or wait for it, or pass another --out_dir")
                if who == "trainer" and os.environ.get(LOCKED_OUT_ENV):
                    try:
                        with open(os.environ[LOCKED_OUT_ENV], "w") as f:
                            f.write(str(locked))
                    except OSError:  # (the guardian still looks for a holder)
                        pass
                raise locked
            if not said:
                log(f"waiting up to {wait_s:g} s for the {who} holding {path} (pid {holder}) to exit")
                said = True
            if alive:
                alive()
            time.sleep(0.5)
            continue
        except OSError as e:  # a filesystem without locks (some network mounts): as before, unguarded
            log(f"WARNING: {path}: cannot lock ({e.strerror}); make sure only one trainer writes {out_dir}")
            return fd
        try:  # the file locked is still the one at path (a refused start's undo_fresh_run_dir deletes it)
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same or reopened >= 3:  # (a filesystem whose inode numbers are not stable: taken after a few tries)
            break
        # a deleted lock file: holding it, a next trainer created a new one and held that too
        os.close(fd)
        reopened += 1
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd



def lock_holder(out_dir, who="trainer"):
    """The pid (as written) of the process holding out_dir's .{who}.lock now, or None when none holds it (or the
    filesystem has no locks): train.py --status says whether the run is being trained."""
    import fcntl
    try:
        fd = os.open(os.path.join(out_dir, f".{who}.lock"), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (released at once: a trainer starting now waits lock_wait_s)
        return None
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    except OSError:
        return None
    finally:
        os.close(fd)


RESAVE_WAIT_S = 10.0  # how long a reader waits for a live trainer's re-save to do its second rename


def recover_for_reader(run_dir):
    """checkpoint.recover for a reader of run_dir (chat, eval, export, train.py --status) that finds a step there only
    as step_N.old-PID: put back under the trainer's lock, taken for that moment (a trainer starting meanwhile waits,
    as for another trainer), never while a trainer holds it (its own re-save between its renames: waited for up to
    RESAVE_WAIT_S, then refused). Returns the steps put back; raises checkpoint.CheckpointError, one line."""
    import fcntl
    deadline = time.monotonic() + RESAVE_WAIT_S
    path = os.path.join(run_dir, ".trainer.lock")
    while True:
        left = checkpoint.stranded(run_dir)
        if not left:
            return []
        step, aside = left[-1]
        what = f"{run_dir}: {step} is there only as {aside} (a save killed between its renames)"
        by_hand = (f"once no trainer writes {run_dir}, rename {aside} back to {step} (or resume the run: train.py "
                   f"puts it back)")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # (a read-only copy of the run)
            raise checkpoint.CheckpointError(f"{what}, and {path} cannot be opened ({e.strerror}); {by_hand}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live trainer: read nothing of its run until its save is whole
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                    raise checkpoint.CheckpointError(f"{run_dir}: {step} is being re-saved by the trainer holding "
                                                     f"{path} (pid {holder}); retry once its save is done") from None
                time.sleep(0.1)
                continue
            except OSError as e:  # a filesystem without locks: whether a trainer runs cannot be told
                raise checkpoint.CheckpointError(f"{what}, and {path} cannot be locked ({e.strerror}); "
                                                 f"{by_hand}") from None
            try:
                return checkpoint.recover(run_dir)
            except OSError as e:
                why = checkpoint.os_error_line(e, os.path.join(run_dir, aside))
                raise checkpoint.CheckpointError(f"{what}: {why}; {by_hand}") from None
        finally:
            os.close(fd)  # (the lock goes with it)


def copy_ticking(tick):
    """shutil.copytree's copy_function that calls tick() every 64 MB: a 31 GB checkpoint copied to a slow bucket
    outlasted hang_timeout, and the watchdog took the copy for a hang at every checkpoint (a stalled write still
    stops the ticks)."""
    def copy(src, dst):
        checkpoint.copy_saying(src, dst, f"mirroring {src}", tick)
        shutil.copystat(src, dst)
        return dst
    return copy


MIRROR_MARKER = "MIRROR_OF.json"  # in a mirror_dir: the run it mirrors (two runs sharing one pruned each other's steps)


def mirror_owner_error(mirror_dir, out, created_at):
    """Why this start may not mirror into mirror_dir (one line), or None. created_at: the run's identity as its
    checkpoints carry it (state.json), None for a new run (scratch, grow, finetune)."""
    marker = read_json(os.path.join(mirror_dir, MIRROR_MARKER), None)
    steps = checkpoint.list_checkpoints(mirror_dir) if os.path.isdir(mirror_dir) else []
    fix = f"pass another --mirror_dir, or delete {mirror_dir}'s contents if that run is gone"
    if isinstance(marker, dict):
        if created_at is not None and marker.get("created_at") == created_at:
            return None  # this run again: a resume, a restart, a rollback
        if created_at is None and not steps and same_dir(marker.get("out_dir", ""), out):
            return None  # a new start in the same out_dir before any step was mirrored: nothing of the old run lost
        return (f"mirror_dir {mirror_dir} mirrors another run (out_dir {marker.get('out_dir')}, created_at "
                f"{marker.get('created_at')}); {fix}")
    if not steps:
        return None
    if created_at is None:
        return f"mirror_dir {mirror_dir} holds another run's checkpoints ({os.path.basename(steps[-1][1])}); {fix}"
    theirs = set()
    for _, p in steps:
        try:
            st = read_json(os.path.join(p, "state.json"), None)
        except RunDirError:
            continue
        if isinstance(st, dict) and "created_at" in st:
            theirs.add(st["created_at"])
    # a mirror from before the marker: its steps' run; none readable: cannot say, accepted (the marker is written)
    if theirs and created_at not in theirs:
        return (f"mirror_dir {mirror_dir} holds another run's checkpoints ({os.path.basename(steps[-1][1])}, "
                f"created_at {sorted(theirs)[0]}); {fix}")
    return None


def claim_mirror(mirror_dir, out, created_at):
    """Write mirror_dir's marker naming this run (before its first copy), unless it already does."""
    path = os.path.join(mirror_dir, MIRROR_MARKER)
    try:
        marker = read_json(path, None)
    except RunDirError:
        marker = None
    if isinstance(marker, dict) and marker.get("created_at") == created_at:
        return
    os.makedirs(mirror_dir, exist_ok=True)
    checkpoint.write_atomic_text(path, json.dumps({"created_at": created_at, "out_dir": os.path.realpath(out)}) + "\n")


def fsync_dir_if_it_can(path):
    """checkpoint.fsync_dir on a mirror, whose mount may refuse a directory's fsync (EINVAL on some network
    filesystems): that is no failed copy."""
    try:
        checkpoint.fsync_dir(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def mirror_log(src, dst):
    """One log file to the mirror, at every log row: a crash report or hang dump (written once) left alone when its
    copy there has its size and mtime (300 of them copied at each row took 0.5 s); metrics*.jsonl's new rows appended
    when the copy there is what the file began with (copied whole at each row, a long run's cost grew as rows^2)."""
    s = os.stat(src)
    d = os.stat(dst) if os.path.isfile(dst) else None
    name = os.path.basename(src)
    same = d is not None and (d.st_size, d.st_mtime_ns) == (s.st_size, s.st_mtime_ns)
    if same and name.startswith(("crash-", "hang-")):
        return
    if d is not None and name.endswith(".jsonl") and 0 < d.st_size <= s.st_size:
        n = min(d.st_size, 1 << 16)  # its last rows: where a resume's cut or a rewritten row shows
        with open(src, "rb") as r, open(dst, "r+b") as w:
            w.seek(d.st_size - n)
            r.seek(d.st_size - n)
            if w.read(n) == r.read(n):
                shutil.copyfileobj(r, w)
                return
    shutil.copyfile(src, dst + ".tmp")
    os.utime(dst + ".tmp", ns=(s.st_atime_ns, s.st_mtime_ns))
    os.replace(dst + ".tmp", dst)


def mirror(out_dir, dest, checkpoints=True, keep=1, tick=None):
    """Copy logs (and the newest checkpoint, atomically: fsynced before it replaces the old copy) to dest, so they
    outlive the machine's disk; retention as in out_dir (keep_last). A failure (a bucket mount's hiccup, a full
    mirror disk) warns and training goes on: out_dir still holds everything. Returns whether it worked. tick: called
    as the copy goes (the hang watchdog)."""
    try:
        os.makedirs(dest, exist_ok=True)
        for name in os.listdir(out_dir):
            if name in ("metrics.jsonl", "metrics.abandoned.jsonl", "guardian.json", "LATEST", "BEST") or name.startswith(("crash-", "hang-")):
                mirror_log(os.path.join(out_dir, name), os.path.join(dest, name))
        if checkpoints:
            newest = checkpoint.latest_valid(out_dir)
            there = newest and os.path.join(dest, os.path.basename(newest))
            manifest = lambda d: open(os.path.join(d, "MANIFEST.json"), "rb").read()
            # a step saved again (stage_final, then final) has another manifest: copied again
            for name in os.listdir(dest):  # copies a kill or a failure left: each one a checkpoint's space
                if name.startswith((".tmp-step_", ".trash-step_")):
                    shutil.rmtree(os.path.join(dest, name), ignore_errors=True)
            if newest and not (checkpoint.is_valid(there) and manifest(there) == manifest(newest)):
                tmp = os.path.join(dest, ".tmp-" + os.path.basename(newest))
                try:
                    shutil.copytree(newest, tmp, copy_function=copy_ticking(tick) if tick else shutil.copy2)
                    # on disk before it replaces the old copy (a power loss left the mirror with no valid step)
                    for root, _, names in os.walk(tmp):  # (read-only fds: copy2 keeps a read-only file's mode)
                        for name in names:
                            fd = os.open(os.path.join(root, name), os.O_RDONLY)
                            try:
                                os.fsync(fd)
                            finally:
                                os.close(fd)
                            if tick:  # (GBs flushed to a slow mount are no hang)
                                tick()
                        fsync_dir_if_it_can(root)
                    if os.path.exists(there):  # the old copy goes only once the new one is in place
                        os.replace(there, os.path.join(dest, f".trash-{os.path.basename(there)}"))
                    os.replace(tmp, there)
                    fsync_dir_if_it_can(dest)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                    shutil.rmtree(os.path.join(dest, f".trash-{os.path.basename(there)}"), ignore_errors=True)
            # else every checkpoint ever made piles up there; a newer step there is another timeline's (out_dir set it
            # aside): protected as the newest, it had each copy deleted as soon as it landed
            retain(dest, keep, saved=there or None)
    except Exception as e:  # OSError mostly; a mirror must never end the run
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        said = _MIRROR_SAID.get(dest)
        if said is None or said[0] != why or time.time() - said[1] > 600:  # (it was said at every log step)
            again = " (said again in 10 min if it goes on failing so)" if said is None else ""
            checkpoint.warn(f"WARNING: mirror to {dest} failed ({why}); training goes on, {out_dir} holds every "
                            f"checkpoint{again}")
            _MIRROR_SAID[dest] = (why, time.time())
        return False
    if _MIRROR_SAID.pop(dest, None) is not None:
        checkpoint.warn(f"mirror to {dest} works again")
    return True


_MIRROR_SAID = {}  # mirror dest -> (its last failure's message, when it was said)
