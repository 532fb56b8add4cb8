"""
Checkpoint directories on disk: atomic writes, manifests, LATEST (retention is rundir.py's `retain`). Format (DESIGN.md):

    out_dir/step_NNNNNNN/model.safetensors   weights (+ the router bias buffers)
                         optimizer.pt        tensors only, loads with torch.load(weights_only=True)
                         state.json          step, tokens, data position, RNG, best val loss, config, plan (no stage
                                             field: the stage is the plan's at those tokens, schedule.stage_at)
                         MANIFEST.json       {"files": {name: {"sha256", "bytes"}}, "step": N, "written_at": T}
    out_dir/LATEST                           name of the newest valid checkpoint dir

A checkpoint without a valid manifest does not exist. A save writes into a hidden temp dir, fsyncs every file
and the dir, then renames it into place; a crash (or a full disk) at any moment leaves the previous checkpoint
untouched and, at worst, a `.tmp-*` dir that the next save removes (or a step moved aside for its re-save,
`step_N.old-PID`, which the next save or resume puts back: `recover`; a reader of the run dir too, when no trainer
holds it: rundir.recover_for_reader).
"""

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time

STEP_RE = re.compile(r"^step_(\d{7,})$")
ASIDE_RE = re.compile(r"^(step_\d{7,})\.old-\d+$")  # a step save() moved aside to re-save it
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for lack of space (or a size limit)
DENIED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)  # a path this user may not write (or read): permissions, ro mount
# a read of a network or bucket mount that dropped: storage to wait for, not corrupt data
UNREACHABLE_ERRNOS = (errno.ENOTCONN, errno.ETIMEDOUT, errno.ESTALE, errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN,
                      errno.ENETUNREACH, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED)


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and the fix."""


class CheckpointUnreachable(CheckpointError):
    """A checkpoint whose storage dropped while it was read (no verdict on it: not skipped as corrupt, not set aside;
    train.py exits 5, storage unreachable)."""


def unreachable(e, path):
    return CheckpointUnreachable(f"{path}: cannot be read ({e.strerror}): its network or bucket mount dropped? check "
                                 f"it and retry")


def chat_tuned(state):
    """From a checkpoint's state.json: True when train.py fine-tuned it (config/sft.py), False for a base model, None
    when it does not say (no saved config)."""
    try:
        cfg = state["config"]
        return cfg["init_from"] == "finetune" or bool(cfg["finetune_from"])  # (a resumed SFT run keeps finetune_from)
    except (KeyError, TypeError):
        return None


def dir_size(path):
    """Bytes of the files under path (one gone meanwhile counts 0: the size is only said, never acted on)."""
    n = 0
    for d, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.lstat(os.path.join(d, f)).st_size
    return n


def fmt_size(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def warn(msg):
    """A library warning on stderr that cannot end the run: a hung-up terminal (EIO) or a dead pipe (EPIPE) would
    raise into training from a mirror or a batch read, and train.py would take it for a storage error or a crash."""
    try:
        print(msg, file=sys.stderr)
    except (OSError, ValueError):  # (ValueError: stderr closed)
        pass


def print_or_detach(*args, **kwargs):
    """print for a process that must outlive its output (train.py's log; relay.py run's lines from the push to the
    release): the stream a print fails on (a dead pipe, a terminal that hung up, a full disk's file) goes to /dev/null
    with pipes nobody reads, so later lines and the exit's flush fail no more. A BrokenPipeError ended the trainer
    before the checkpoint a killed guardian's SIGTERM asked for, and relay before its release. (checkpoint.warn, for
    library code, leaves the host's streams alone: a command piped into `head` should still end.)"""
    try:
        print(*args, **kwargs)
    except BlockingIOError:  # a live non-blocking stream, full for now (a slow reader): this line lost, not the rest
        pass
    except (OSError, ValueError):  # (ValueError: the stream was closed)
        detach_from_lost_terminal(tty=False, failed=kwargs.get("file") or sys.stdout)
    except RuntimeError:  # a signal handler's line (Ctrl-C's) run inside an interrupted print: "reentrant call", raised
        # into the main thread wherever it was (exit 10, no checkpoint); the line goes out unbuffered instead
        sep, end = kwargs.get("sep"), kwargs.get("end")
        text = (" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end)
        try:
            os.write((kwargs.get("file") or sys.stdout).fileno(), text.encode(errors="replace"))
        except (OSError, ValueError, AttributeError):
            pass


def detach_from_lost_terminal(tty=True, failed=None):
    """After SIGHUP: stdout / stderr on the terminal that hung up fail every write (EIO), which would end the
    checkpoint the hangup asks for; they go to /dev/null (out_dir keeps metrics.jsonl and the crash reports). So do
    pipes nobody reads any more (the guardian's, when it was killed: its death's SIGTERM asks for a checkpoint that
    the first print would end with EPIPE); tty=False: those only (a SIGTERM leaves a live terminal as it is).
    failed: a stream a write just failed on, which goes too (whatever it is), with stdout or stderr on the same file."""
    import select
    import stat
    try:
        gone = os.fstat(failed.fileno()) if failed is not None else None
    except (OSError, ValueError, AttributeError):  # (closed, or no file behind it: nothing of it to detach)
        gone = None
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            st = os.fstat(fd)
            if gone is not None and os.path.samestat(st, gone):
                os.dup2(null, fd)
            elif stat.S_ISFIFO(st.st_mode):
                p = select.poll()
                p.register(fd, select.POLLOUT)
                if any(ev & select.POLLERR for _, ev in p.poll(0)):  # (Linux: its reading end is closed)
                    os.dup2(null, fd)
            elif tty and os.isatty(fd):
                os.dup2(null, fd)
        except OSError:
            pass
    os.close(null)


def pid_alive(pid):
    """Whether process pid (of this machine) still runs: another user's counts as alive, a number past any pid not."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (a number past any pid: OUT.tmp-99999999999999999999)
        return False
    except PermissionError:  # another user's process
        pass
    return True


def host_tag():
    """This machine's name as a file name part: a temp output named HOST-PID is judged by its own host alone (another
    machine's live export on a shared filesystem looked dead here and was deleted)."""
    import socket
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


HASH_CHUNK = 64 << 20  # bytes save() hashes, and copy_saying copies, between two ticks (~1 s of a 50 MB/s network disk)
GROW_POLL_S = 1.0  # seconds between two looks at the size of the file a save's writer is writing
PROGRESS_S = 15.0  # a save's write or a hash pass running longer says how far it is, a stderr line this often


def progress_lines(what, total=None):
    """report(done_bytes): at most once each PROGRESS_S, 'checkpoint: WHAT: X of TOTAL (P%), ~Ns left' on stderr. A
    30 GB save, or the verify of one at a resume or pull, was minutes without a word; lines, not a bar, for logs."""
    t0 = last = time.monotonic()

    def report(done):
        nonlocal last
        now = time.monotonic()
        if now - last < PROGRESS_S:
            return
        last = now
        if total:
            left = (now - t0) * (total - done) / done if done else float("nan")
            warn(f"checkpoint: {what}: {fmt_size(done)} of {fmt_size(total)} ({100 * done / total:.0f}%), "
                 f"~{left:.0f}s left")
        else:
            warn(f"checkpoint: {what}: {fmt_size(done)} so far")
    return report


def copy_saying(src, dst, what, tick=None):
    """Copy src's bytes to dst in HASH_CHUNK pieces, tick() after each, saying how far a long copy is
    (progress_lines): a mirror's or a file:// store's 30 GB copy was minutes without a word."""
    report, done = progress_lines(what, os.path.getsize(src)), 0
    with open(src, "rb") as f, open(dst, "wb") as g:
        while chunk := f.read(HASH_CHUNK):
            g.write(chunk)
            if tick:
                tick()
            done += len(chunk)
            report(done)


@contextlib.contextmanager
def ticking_while_it_grows(path, tick, grew=None):
    """Ticks (and calls grew(size)) each time the file at path has grown since the last look (every GROW_POLL_S),
    until the block ends."""
    # a writer (torch.save of a 20 GB optimizer.pt) cannot tick from inside; a stalled one stops growing: still a hang
    done = threading.Event()

    def watch():
        seen = 0
        while not done.wait(GROW_POLL_S):
            try:
                size = os.path.getsize(path)
            except OSError:  # not created yet
                continue
            if size > seen:
                seen = size
                tick()
                if grew:
                    grew(size)
    watcher = threading.Thread(target=watch, daemon=True, name="save-growth-ticks")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def sha256_file(path, bufsize=1 << 20, tick=None, what=None):
    """what: said in progress_lines while a long hash runs (none: silent)."""
    h = hashlib.sha256()
    report = progress_lines(what, os.path.getsize(path)) if what else None
    done = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
            done += len(b)
            if tick:
                tick()
            if report:
                report(done)
    return h.hexdigest()


def os_error_line(e, path):
    """'FILE: cause' for an OSError of an export or other writer (a library's short write carries no strerror: it
    printed 'FILE: None'), with the free space when the disk holding FILE is (nearly) full."""
    where = e.filename or path
    why = e.strerror or str(e) or type(e).__name__
    disk = os.path.dirname(os.path.abspath(where))
    while not os.path.isdir(disk) and disk != os.path.dirname(disk):  # FILE's folder removed since (a staging folder)
        disk = os.path.dirname(disk)
    try:
        free = shutil.disk_usage(disk).free
        if e.errno in DISK_ERRNOS or free < 64 << 20:
            why += f" ({free / 1e6:.0f} MB free on its disk: free space, or write elsewhere)"
    except OSError:
        pass
    return f"{where}: {why}"


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path):
    """Every file of a flat dir on disk, then the dir's own entries (before the dir is renamed into place)."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb+") as f:
            os.fsync(f.fileno())
    fsync_dir(path)


def step_dir_name(step):
    return f"step_{step:07d}"


PAYLOAD_FILES = ("model.safetensors", "optimizer.pt", "state.json", "tokenizer.json")  # what readers load from a step


def plain_file_name(name):
    """A name a checkpoint (a flat folder) may hold: no folder part, no .., no control characters (a manifest or a
    store listing from another machine names what is read, hashed and uploaded)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name
            and "\\" not in name and name.isprintable())


def verify(ckpt_dir, check_hashes=True, hashed=()):
    """Raise CheckpointError unless ckpt_dir holds a manifest whose every file is present and intact. hashed: names
    whose sha256 the caller has just checked against this manifest (a pull's files reused from a local copy): their
    size is checked, their bytes not read again."""
    man_path = os.path.join(ckpt_dir, "MANIFEST.json")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory; check the path")
    try:
        with open(man_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{man_path}: missing, so this checkpoint is incomplete; use an earlier step_* dir")
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # (RecursionError: [[[[... a hand-made one)
        raise CheckpointError(f"{man_path}: unreadable manifest ({e}); use an earlier step_* dir")
    except OSError as e:  # (permissions, EIO, a directory): a traceback from is_valid, so from resume's search too
        if e.errno in UNREACHABLE_ERRNOS:
            raise unreachable(e, man_path) from None
        raise CheckpointError(f"{os_error_line(e, man_path)}; fix its permissions or use an earlier step_* dir")
    if not (isinstance(files, dict) and files and all(  # valid JSON of another shape: a KeyError stopped the resume
            isinstance(name, str) and isinstance(meta, dict) and isinstance(meta.get("sha256"), str)
            and isinstance(meta.get("bytes"), int) for name, meta in files.items())):
        raise CheckpointError(f"{man_path}: not a picaflor manifest (files must map each name to its sha256 and "
                              f"bytes); use an earlier step_* dir")
    bad = next((name for name in files if not plain_file_name(name)), None)
    if bad is not None:  # ../../secret or /abs/path: a file outside the checkpoint, hashed and taken for part of it
        raise CheckpointError(f"{man_path}: names {bad!r}, not a plain file name in the checkpoint's folder; "
                              f"use an earlier step_* dir")
    m = STEP_RE.match(os.path.basename(os.path.normpath(ckpt_dir)))
    step = manifest.get("step")
    # a step dir renamed or copied under another step's name: resume would take it for that step, retention too
    if m and isinstance(step, int) and step != int(m.group(1)):
        raise CheckpointError(f"{ckpt_dir}: its MANIFEST.json is step {step}'s (renamed or copied under another "
                              f"name); rename it back to {step_dir_name(step)}")
    # a file a reader loads that the manifest leaves out was loaded unchecked (a hand-edited MANIFEST.json)
    unlisted = [n for n in PAYLOAD_FILES if n not in files and os.path.lexists(os.path.join(ckpt_dir, n))]
    if unlisted:
        raise CheckpointError(f"{os.path.join(ckpt_dir, unlisted[0])}: not listed in MANIFEST.json, so unchecked; "
                              f"use an earlier step_* dir (or one as train.py wrote it)")
    for name, meta in files.items():
        p = os.path.join(ckpt_dir, name)
        if not os.path.isfile(p):
            raise CheckpointError(f"{p}: listed in MANIFEST.json but missing; use an earlier step_* dir")
        try:
            size = os.path.getsize(p)
            if size != meta["bytes"]:
                raise CheckpointError(f"{p}: {size} bytes, manifest says {meta['bytes']} (truncated?); "
                                      f"use an earlier step_* dir")
            intact = not check_hashes or name in hashed or sha256_file(p, what=f"verifying {p}") == meta["sha256"]
        except OSError as e:  # an unreadable file (EIO of a failing disk, permissions) is not a valid checkpoint
            if e.errno in UNREACHABLE_ERRNOS:  # ... but one on a mount that dropped mid-hash is not a corrupt one
                raise unreachable(e, p) from None
            raise CheckpointError(f"{os_error_line(e, p)}; use an earlier step_* dir") from None
        if not intact:
            raise CheckpointError(f"{p}: sha256 does not match MANIFEST.json (corrupt); use an earlier step_* dir")
    return manifest


def is_valid(ckpt_dir, check_hashes=True):
    try:
        verify(ckpt_dir, check_hashes)
        return True
    except CheckpointError:
        return False


def list_checkpoints(out_dir):
    """(step, path) of every step_* dir in out_dir, oldest first (valid or not)."""
    if not os.path.isdir(out_dir):
        return []
    out = []
    for name in os.listdir(out_dir):
        m = STEP_RE.match(name)
        if m:
            out.append((int(m.group(1)), os.path.join(out_dir, name)))
    return sorted(out)


def latest_valid(out_dir, steps=None, whys=None):
    """Path of the newest checkpoint in out_dir (or of steps, list_checkpoints' list) that verifies, or None. Corrupt
    newer ones are skipped, each one's error appended to whys when given; one whose mount dropped mid-read raises
    CheckpointUnreachable (taken for corrupt, resume set it aside and trained an older step)."""
    for _, path in reversed(list_checkpoints(out_dir) if steps is None else steps):
        try:
            verify(path)
            return path
        except CheckpointUnreachable:
            raise
        except CheckpointError as e:
            if whys is not None:
                whys.append(str(e).removesuffix("; use an earlier step_* dir"))
    return None


def in_run_dir(ckpt_dir, run_dir):
    """Whether ckpt_dir is one of run_dir's own step dirs (symlinks and a trailing slash resolved)."""
    return os.path.realpath(os.path.dirname(os.path.abspath(str(ckpt_dir).rstrip("/")))) == os.path.realpath(run_dir)


def resolve(path):
    """A checkpoint dir from either a checkpoint dir or a run dir (LATEST, else the newest valid)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or directory; pass a run dir or a step_NNNNNNN dir")
    if os.path.isfile(os.path.join(path, "MANIFEST.json")) or STEP_RE.match(os.path.basename(os.path.normpath(path))):
        return path
    if stranded(path):  # its newest step may be there only as step_N.old-PID: back in place before one is picked
        import rundir  # (the trainer's lock is rundir's; rundir imports this module)
        rundir.recover_for_reader(path)
    try:
        steps = list_checkpoints(path)
    except OSError as e:  # a run dir it may not read: a traceback out of chat.py and eval.py
        if e.errno in UNREACHABLE_ERRNOS:
            raise unreachable(e, path) from None
        raise CheckpointError(f"{os_error_line(e, path)}; fix its permissions, or pass a step_NNNNNNN dir") from None
    latest = os.path.join(path, "LATEST")
    named = None
    if os.path.isfile(latest):
        try:
            named = os.path.join(path, open(latest).read().strip())
        except (OSError, UnicodeDecodeError):  # overwritten by something else: the newest valid step decides
            named = None
        if named and is_valid(named):
            # a save killed between its step's rename and LATEST's write: the newer step is whole, and the run's
            m = STEP_RE.match(os.path.basename(named))
            newer = [p for s, p in steps if m and s > int(m.group(1))]
            for p in reversed(newer):
                if is_valid(p):
                    import rundir  # (another live trainer's save is between the two: nothing died, nothing to say)
                    if rundir.lock_holder(path) not in (None, str(os.getpid())):
                        return p
                    print(f"warning: {latest} names {os.path.basename(named)}, but the newer {os.path.basename(p)} "
                          f"verifies (a save died before updating LATEST); using it", file=sys.stderr)
                    return p
            return named
    whys = []  # why each newer step failed (the error named no step, no cause)
    cand = latest_valid(path, steps, whys)
    if cand is None:
        if not steps:
            raise CheckpointError(f"{path}: holds no valid checkpoint (no step_* dir in it); pass a run dir train.py "
                                  f"wrote, or a step_NNNNNNN dir")
        more = f"; {len(whys) - 3} older step(s) do not verify either" if len(whys) > 3 else ""
        raise CheckpointError(f"{path}: holds no valid checkpoint ({'; '.join(whys[:3])}{more}); re-copy it from "
                              f"where it was saved (or its mirror_dir), or pass another checkpoint")
    skipped = named if named and os.path.isdir(named) else (steps[-1][1] if steps and steps[-1][1] != cand else None)
    if skipped:  # an export or eval of "the run" said nothing of using an older step
        print(f"warning: {skipped} does not verify; using {cand}, the newest step that does", file=sys.stderr)
    elif (m := named and STEP_RE.match(os.path.basename(named))) and int(m.group(1)) > steps[-1][0]:
        # LATEST names a newer step that is not there (deleted, or a mirror whose copy of it never landed): as silent
        print(f"warning: {latest} names {os.path.basename(named)}, which is not there; using {cand}, the newest "
              f"step that verifies", file=sys.stderr)
    return cand


def write_atomic(path, data):
    """Write bytes to path so a reader sees the old file or the whole new one, never a part."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"  # two threads of one process (relay's heartbeat)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no partial temp file left behind on it
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_atomic_text(path, text):
    write_atomic(path, text.encode())


def check_writable(folder):
    """Raises the OSError a write into folder meets, before hours of work whose result goes there (a probe file,
    written and removed; a process doing the same at once may remove it first)."""
    probe = os.path.join(folder, ".writable")
    write_atomic_text(probe, "")
    with contextlib.suppress(FileNotFoundError):
        os.remove(probe)


def stranded(out_dir):
    """(step dir name, aside name) of each step in out_dir left only as step_N.old-PID: a re-save killed between its
    two renames (save() below), or one between them now. Nothing is changed."""
    try:
        names = os.listdir(out_dir)
    except OSError:  # (resolve says why it cannot read the dir)
        return []
    return sorted((m.group(1), name) for name in names
                  if (m := ASIDE_RE.match(name)) and not os.path.exists(os.path.join(out_dir, m.group(1))))


def recover(out_dir):
    """Finish a re-save that died between its two renames (save() below): a step moved aside as step_N.old-PID with
    no step_N goes back in place; one whose replacement landed is removed. Returns the steps put back. Only with
    the run's lock held (train.py; a reader: rundir.recover_for_reader)."""
    back = []
    if not os.path.isdir(out_dir):
        return back
    for name in sorted(os.listdir(out_dir)):
        m = ASIDE_RE.match(name)
        if not m:
            continue
        aside, final = os.path.join(out_dir, name), os.path.join(out_dir, m.group(1))
        if os.path.exists(final):
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
            back.append(final)
    if back:
        fsync_dir(out_dir)
    return back


def save(out_dir, step, writers, tick=None):
    """Write a checkpoint atomically. writers: {filename: fn(path)} each writing one file. Returns its path.
    On any failure (disk full included) the temp dir is removed and the error re-raised; nothing older is
    touched. tick: called as the save goes (the hang watchdog: a 31 GB save to a slow disk is no hang)."""
    tick = tick or (lambda: None)
    os.makedirs(out_dir, exist_ok=True)
    recover(out_dir)
    for name in os.listdir(out_dir):  # leftovers of a save that died
        if name.startswith(".tmp-step_"):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    final = os.path.join(out_dir, step_dir_name(step))
    tmp = os.path.join(out_dir, f".tmp-{step_dir_name(step)}-{os.getpid()}")
    try:
        os.makedirs(tmp)
        files = {}
        for name, write in writers.items():
            p = os.path.join(tmp, name)
            # ticks between writers, while one's file grows, and per HASH_CHUNK hashed (not while one fsync flushes)
            tick()
            shown = f"{step_dir_name(step)}/{name}"
            with ticking_while_it_grows(p, tick, progress_lines(f"writing {shown}")):
                write(p)
                tick()
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
            tick()
            files[name] = {"sha256": sha256_file(p, HASH_CHUNK, tick, f"hashing {shown}"), "bytes": os.path.getsize(p)}
        manifest = {"step": step, "written_at": time.time(), "files": files}
        with open(os.path.join(tmp, "MANIFEST.json"), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        tick()
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): move the old one aside first
            old = final + f".old-{os.getpid()}"
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:  # (a Ctrl-C between the renames) the old step goes back, not hidden until recover()
                if not os.path.exists(final):
                    os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(out_dir)
        write_atomic_text(os.path.join(out_dir, "LATEST"), step_dir_name(step) + "\n")
    except BaseException as e:
        # torch.save reports a full disk as a RuntimeError, safetensors as a SafetensorError: probe while the temp
        # files still take their space (probed after removing them, the disk had room again: a "crash", exit 10)
        full = None
        if isinstance(e, Exception) and not (isinstance(e, OSError) and e.errno in DISK_ERRNOS):
            text = str(e)
            # (not miniz's "file write failed": any short write says that; the probe decides then)
            full = ("No space left on device" if any(m in text for m in ("No space left", "os error 28", "Disk quota"))
                    else disk_full(out_dir))
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, f"{full} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})",
                          out_dir) from e
        raise
    return final


def disk_full(directory, probe_bytes=1 << 20):
    """Why a write in directory fails for lack of space (a probe write), or None if it has room."""
    path = os.path.join(directory, f".disk-probe-{os.getpid()}")
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * probe_bytes)
            f.flush()
            os.fsync(f.fileno())
        return None
    except OSError as e:
        return e.strerror if e.errno in DISK_ERRNOS else None
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
