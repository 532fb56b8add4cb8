"""
relay.py: one pretraining run trained in turns by volunteers, living in one store (a Hugging Face Hub model repo
or a local directory), fenced by compare-and-swap commits.

    python relay.py init hf://owner/name config/nano.py [--key=value ...]   # create the run (step-0 checkpoint)
    python relay.py run hf://owner/name --hours 6 [--key=value ...]         # a contributor's whole job
    python relay.py status|claim|pull|push|release|decay STORE
    python relay.py dashboard STORE_OR_RUN_DIR                             # read-only web page on 127.0.0.1

`init` writes the step-0 checkpoint with train.py as the config's init_from says: scratch (the default), grow
(grow_from=CHECKPOINT, grow_layers=N: config/grow.py) or finetune (finetune_from=CHECKPOINT: config/sft.py), the source
a local run or step dir, relative to train.py's folder (`relay.py pull STORE --out DIR` fetches a relay run's latest);
set in the config or as --key=value, e.g. `relay.py init STORE config/sft.py --finetune_from=out/nano`. Or
`init STORE --from-checkpoint DIR` starts the run from a checkpoint as it is (the config's init_from unread; a
config that grows or fine-tunes is refused unless DIR is from that grown / fine-tuned run).

STORE is `hf://owner/name` (huggingface_hub; HF_ENDPOINT and HF_TOKEN as usual) or `file:///abs/path` (a local
directory with the same compare-and-swap semantics, safe across processes; for offline use and tests): relay_store.py.

Files in the store (DESIGN.md, Relay):
    RELAY.json           the lease: holder, nonce, generation, leg, claimed/heartbeat times, ttl, write_id
    training_state.json  step, tokens, stage, plan, decay fields, load_collapse (copied from the checkpoint's
                         state.json), decay_requested, legs (legs pushed so far), checkpoint (folder name)
    config.py            the run's train.py config (init writes it; every leg trains with it); data only:
                         literal assignments (configurator.not_data), since train.py execs it on every
                         contributor's machine, so a config.py holding code is refused before anything runs;
                         init and pull refuse one setting on_stuck or mirror_dir (each contributor's own: a shell
                         command the guardian runs, a local folder), which go on `run`'s command line, or
                         resume_from, stop_after_steps or stop_after_hours (each leg's, which `run` sets)
    checkpoint/          the latest checkpoint dir (MANIFEST.json verified before upload and after download)
    logs/leg-NNNN.jsonl  the metrics.jsonl lines of every leg
    LEDGER.md            one row per leg: who, GPU, steps (a leg that only measured the last step's val loss, cut
                         short by a stop signal: that val loss), tokens, wall time, $, loss at start and end

The lease protocol (claim, renew, release, the compare-and-swap commit, adopting our own commits whose answers
were lost) is relay_lease.py's.

`run` renews the lease from a heartbeat thread during the pull, the training and the upload of the leg's files
(uploaded before the commit that names them: preupload_lfs_files on the Hub), then stops it for the one push
commit. The trainer runs in its own session: Ctrl-C (SIGINT) or SIGTERM to relay ends the leg cleanly (trainer
checkpoints, push, release), and so does SIGHUP (a dropped ssh session: relay's lines then go to WORKDIR/relay.log);
if relay itself dies, the kernel SIGTERMs the trainer (PR_SET_PDEATHSIG).
Exit status: 0 done, 2 usage (a missing or unknown argument), 3 error (one line, nothing overwritten; a malformed
store URL or a bad value is one), 4 lease lost (local checkpoint kept), 130 a claim, pull, push or release cut short
by Ctrl-C (local files kept; run again, its write id finds what landed). A trainer that fails after checkpointing
gets its newest checkpoint pushed (verified as any push) before exit 3; `run --supervise` trains under the guardian
instead, which restarts it within the leg's steps / hours.

Implementer's calls: the repo holds only the latest checkpoint (older ones stay in git history); each leg trains
in its own local folder WORKDIR/leg-NNNN-genG/ (default WORKDIR ./relay-work/<store name>), so a fenced leg's
checkpoint is never touched again (leg dirs are removed only once pushed, and only when nothing was trained there
after the push: PUSHED records the step; LEG.json names the lease a leg dir is for, another lease's same-named dir is
set aside, never resumed); `decay` refuses while someone holds the
baton (its commit would fence them out); `claim` by the current holder renews; $ = the leg's trainer hours x
gpu_hourly_usd (the config's, or --gpu_hourly_usd=; kept in LEG.json, so a `push` that finishes a killed `run` bills
the trainer time and rate LEG.json kept); a pull downloads into .pull-<pid>-*, and removes those whose pid is gone;
`pull STORE` (no lease, no --out) keeps in WORKDIR/pulled only the newest step it pulled there (PULLED.json; steps put
there otherwise stay); init builds in WORKDIR/init-HOST-PID-*, which the next init or run removes once that pid is gone
on this host; a push (and a release, which checks for unpushed steps) first puts back a step a re-save killed
between its renames left as step_N.old-PID;
defaults ttl 1200 s, heartbeat 300 s (Hub rate limits). One relay.py at a time
works in a WORKDIR (flock on WORKDIR/.relay.lock). HTTP requests time out after RELAY_HTTP_TIMEOUT_S (60 s) without
progress (huggingface_hub's client waits forever), as a Transient. A failed upload or commit of a finished leg keeps
the lease and names the `push` / `release` that finish it. A heartbeat that found the lease overdue (the store too
slow, nobody else's commit seen) stops the trainer and still pushes: the compare-and-swap decides. A renewal's
write_id is recorded in LEASE.json before it is sent, as a push's is, so one whose answer was lost is recognised
as ours; `claim`, `pull`, `push` and `release` from the same workdir adopt our own landed commits, and `claim`
renews our lease even past the ttl when the head is still our last commit (nobody claimed), so a crashed
contributor's leg resumes. `init --ttl --heartbeat` are kept in RELAY.json as the run's defaults for `claim` / `run`.
"""

import argparse
import ast
import contextlib
import getpass
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid

import checkpoint
import configurator
import expert_load
import rundir
import schedule
from relay_store import (SMALL_FILE_CAP, Conflict, RelayError, StoreError, Transient, fmt_bytes, open_store,
                         read_capped, write_atomic)
from relay_lease import (CKPT_PREFIX, DEFAULT_HEARTBEAT, DEFAULT_TTL, RELAY_FORMAT, RELAY_VERSION,
                         STATE_FORMAT, Busy, Fenced, Lease, Snapshot, adopt_landed_push, adopt_own_renewal,
                         chain_lease_to, check_lease_times, claim, commit_cas, ledger_text, manifest_id, now_iso, parse_json,
                         release, renew, taken_by, warn_hub_heartbeat, workdir_locked)

LEDGER_HEADER = ("| leg | who | gpu | steps | tokens | wall | $ | loss start | loss end | step range | generation | finished (UTC) |\n"
                 "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
# from state.json (load_collapse: the trainer's expert-load collapse streaks and warning, for `status`)
STATE_KEYS = ("plan", "decay", "decay_started_at_tokens", "finished", "best_val_loss", "best_step", "load_collapse")
HERE = os.path.dirname(os.path.abspath(__file__))


class NothingToPush(RelayError):
    """The leg's newest checkpoint is not past the step it pulled (why: that in a few words, for `run`'s line)."""

    def __init__(self, msg, why):
        super().__init__(msg)
        self.why = why


def default_who():
    return os.environ.get("RELAY_WHO") or f"{getpass.getuser()}@{socket.gethostname()}"


def workdir_for(args):
    if args.workdir:
        return os.path.abspath(args.workdir)
    name = re.sub(r"[^\w.-]+", "_", args.store.split("://", 1)[-1].strip("/"))
    return os.path.abspath(os.path.join("relay-work", name))


# ----------------------------------------------------------------------------------------------------------------
# Pull / push


def pull(store, dest_dir, sha=None, keep_newer=False):
    """Download checkpoint/ at sha into dest_dir/step_NNNNNNN, verify its manifest, write LATEST. Returns the path.
    keep_newer (a crashed leg's dir pulled again): LATEST stays on a newer valid local step, whose work resumes."""
    snap_sha = sha or store.head()[0]
    sizes = store.sizes(snap_sha, CKPT_PREFIX + "/")  # {path: bytes}: what each download is to be
    paths = sorted(sizes)
    if not paths:
        raise RelayError(f"{store.url}: holds no checkpoint/ at {snap_sha[:10]}; nothing to pull")
    bad = next((p for p in paths if not checkpoint.plain_file_name(p[len(CKPT_PREFIX) + 1:])), None)
    if bad is not None:  # checkpoint/../../x was written (joined to the pull's folder) outside it: anywhere at all
        raise RelayError(f"{store.url}: checkpoint at {snap_sha[:10]} holds {bad!r}, not a plain file name (a "
                         f"checkpoint is one flat folder); nothing downloaded. Revert the commit that added it")
    os.makedirs(dest_dir, exist_ok=True)
    remove_dead_pulls(dest_dir)
    tmp = os.path.join(dest_dir, f".pull-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        # the manifest first, then only the files it lists, each its listed size: the store's others (a hand-added or
        # hostile 100 GB checkpoint/x), a file of another size, a GB manifest or state.json were downloaded whole first
        man_path = f"{CKPT_PREFIX}/MANIFEST.json"
        pulled_file = lambda name: f"{store.url}: {CKPT_PREFIX}/{name} at {snap_sha[:10]}"
        not_installed = "nothing installed locally. Revert the push that wrote it"
        # refused on the store's size, before the download (nothing read: an empty body of that size)
        read_capped((), SMALL_FILE_CAP, pulled_file("MANIFEST.json"), not_installed, sizes.get(man_path, 0))
        # read into memory, not downloaded: the free space is checked below before any byte is written
        text = store.read(snap_sha, man_path) if man_path in paths else None
        listed, manifest_doc = {}, None  # parsed once here (malformed or missing: verify says why below)
        if text is not None:
            text = read_capped([text], SMALL_FILE_CAP, pulled_file("MANIFEST.json"), not_installed)  # verify reads it
            with contextlib.suppress(ValueError, RecursionError):
                manifest_doc = json.loads(text)
            with contextlib.suppress(LookupError, AttributeError, TypeError):
                listed = {n: m["bytes"] for n, m in manifest_doc["files"].items()}
        wanted = [p for p in paths if p[len(CKPT_PREFIX) + 1:] in listed]
        for p in wanted:
            if sizes.get(p) != listed[p[len(CKPT_PREFIX) + 1:]]:
                raise RelayError(f"{store.url}: checkpoint at {snap_sha[:10]} fails verification before download: "
                                 f"{printable(p)} is {sizes.get(p)} bytes in the store, its MANIFEST.json says "
                                 f"{printable(str(listed[p[len(CKPT_PREFIX) + 1:]]))[:40]}; {not_installed}")
        if f"{CKPT_PREFIX}/state.json" in wanted:  # read whole below (its hash is right: any size passes)
            read_capped((), SMALL_FILE_CAP, pulled_file("state.json"), not_installed, listed["state.json"])
        for p in paths if listed else []:
            if p != man_path and p not in wanted:
                print(f"relay: {printable(p)} at {snap_sha[:10]} is not in its MANIFEST.json: not downloaded (the "
                      f"next push removes it)", file=sys.stderr)
        got = os.path.join(tmp, CKPT_PREFIX)
        os.makedirs(got, exist_ok=True)
        # a step already on disk (a pull run twice, a crashed leg's dir): its files that match the manifest's size and
        # sha256 are linked in, not downloaded nor counted against the free space (nothing local is taken unverified);
        # all of them matching (linked or not: a filesystem without hard links downloaded them all again), it is kept
        final, reused, checked = local_step_files(dest_dir, manifest_doc, wanted, got)
        if final and checked and all(checked.values()) and local_manifest_files(final) == manifest_files(manifest_doc):
            print(f"relay: {final} already holds the checkpoint at {snap_sha[:10]} (each file checked against its "
                  f"sha256); nothing downloaded", file=sys.stderr)
            return final
        wanted = [p for p in wanted if p not in reused]
        need = len(text or b"") + sum(sizes[p] for p in wanted)
        free = disk_free(dest_dir)
        if need > free:  # (refused now: a disk filled mid-download left the pull, and a trainer's next save, failing)
            raise RelayError(f"{dest_dir}: the checkpoint at {snap_sha[:10]} needs {fmt_bytes(need)} and "
                             f"its disk has {fmt_bytes(free)} free; nothing downloaded. Free "
                             f"{fmt_bytes(need - free)} there (old step_* or leg dirs), or pull elsewhere "
                             f"(--out DIR, --workdir DIR)")
        try:
            if text is not None:
                with open(os.path.join(got, "MANIFEST.json"), "wb") as f:
                    f.write(text)
            store.download(snap_sha, wanted, tmp)
        except OSError as e:  # this machine's disk (full, or its quota): the partial copy is removed below
            raise RelayError(f"{dest_dir}: writing the pulled checkpoint failed ({e.strerror or e}); nothing installed "
                             f"locally (its earlier steps are as they were). Free space there, or pull elsewhere "
                             f"(--out DIR, --workdir DIR)") from None
        try:  # (the reused files were hashed as they were linked in: only the downloaded ones are read again)
            manifest = checkpoint.verify(got, hashed={p[len(CKPT_PREFIX) + 1:] for p in reused})
        except checkpoint.CheckpointError as e:  # named as the store's files: the temporary dir is removed below
            why = str(e).replace(got + os.sep, CKPT_PREFIX + "/").removesuffix("; use an earlier step_* dir")
            raise RelayError(f"{store.url}: checkpoint at {snap_sha[:10]} fails verification after download: {why}; "
                             f"nothing installed locally. Retry; if it fails again, the store's copy is damaged: "
                             f"revert the push that wrote it (git revert on the Hub repo): the run goes on from the leg "
                             f"before")
        step = manifest.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:  # ("x": a traceback; -5: step_-000005)
            raise RelayError(f"{store.url}: checkpoint at {snap_sha[:10]}: MANIFEST.json's step {step!r} is not a step "
                             f"number; nothing installed locally. Revert the push that wrote it")
        if "state.json" in manifest["files"]:  # read by relay (the leg's base step, its config) and by train.py
            try:
                with open(os.path.join(got, "state.json"), "rb") as f:  # (its hash is right: any size passes)
                    state = json.loads(read_capped(f, SMALL_FILE_CAP, pulled_file("state.json"), not_installed))
                if not isinstance(state, dict):
                    raise ValueError("not a JSON object")
                if isinstance(state.get("step"), bool) or not isinstance(state.get("step", 0), int):
                    raise ValueError(f"step {state['step']!r} is not a step number")
            except (ValueError, RecursionError) as e:  # (RecursionError: [[[[... nested past the decoder's depth)
                raise RelayError(f"{store.url}: checkpoint at {snap_sha[:10]}: its state.json is malformed ({e}); "
                                 f"nothing installed locally. Revert the push that wrote it")
        final = os.path.join(dest_dir, checkpoint.step_dir_name(step))
        if os.path.exists(final):
            # one local_step_files checked is another copy (else it was kept above): not hashed again; one that
            # appeared since (another `pull --out` into the same folder) is kept if it is this checkpoint
            if not checked and local_manifest_files(final) == manifest["files"] and checkpoint.is_valid(final):
                return final
            os.replace(final, final + f".replaced-{int(time.time())}")  # never delete a local checkpoint
        newer = keep_newer and any(s > step and checkpoint.is_valid(p, check_hashes=False)
                                   for s, p in checkpoint.list_checkpoints(dest_dir))
        os.replace(got, final)
        if not newer:  # (retention had removed the pulled step: the re-pull pointed LATEST back at it)
            write_atomic(os.path.join(dest_dir, "LATEST"), os.path.basename(final) + "\n")
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def local_manifest_files(ckpt_dir):
    """The files map of ckpt_dir's MANIFEST.json, None where it is missing or malformed."""
    with contextlib.suppress(OSError, ValueError, RecursionError):
        with open(os.path.join(ckpt_dir, "MANIFEST.json"), "rb") as f:
            return manifest_files(json.loads(read_capped(f, SMALL_FILE_CAP, os.path.join(ckpt_dir, "MANIFEST.json"),
                                                         "")))
    return None


def manifest_files(manifest_doc):
    """A parsed MANIFEST.json's files map, None where it has none."""
    files = manifest_doc.get("files") if isinstance(manifest_doc, dict) else None
    return files if isinstance(files, dict) else None


def local_step_files(dest_dir, manifest_doc, wanted, got):
    """(step dir, reused, checked) for the store's parsed manifest: the wanted files its local step dir already holds,
    each a regular file of the manifest's size and sha256, hard-linked into got (no space taken): reused, their store
    paths; checked maps each wanted path to whether the step dir's file matched (True also where it could not be
    linked: a filesystem without hard links). (None, set(), {}) when the manifest names no step."""
    step = manifest_doc.get("step") if isinstance(manifest_doc, dict) else None
    files = manifest_files(manifest_doc)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0 or files is None:
        return None, set(), {}
    final = os.path.join(dest_dir, checkpoint.step_dir_name(step))
    reused, checked = set(), {}
    for p in wanted if os.path.isdir(final) else []:
        name = p[len(CKPT_PREFIX) + 1:]
        meta, local = files[name], os.path.join(final, name)
        checked[p] = False
        try:
            st = os.lstat(local)
            if (stat.S_ISREG(st.st_mode) and st.st_size == meta["bytes"]
                    and checkpoint.sha256_file(local) == meta.get("sha256")):
                checked[p] = True
                os.link(local, os.path.join(got, name))  # (a pull never writes into a file: a link is safe)
                reused.add(p)
        except OSError:  # missing, unreadable, or a filesystem without hard links: downloaded as before
            pass
    return final, reused, checked


def disk_free(path):
    """Bytes free for this user on path's filesystem (a function: tests give it a small disk)."""
    return shutil.disk_usage(path).free


def recover_killed_resave(run_dir, cmd="push"):
    """A trainer killed between a re-save's two renames left step_N.old-PID and no step_N (checkpoint.recover puts it
    back): a push without it pushed the step before (or nothing), the leg's newest step left out; a release took the
    leg for one with nothing unpushed. Put back under the trainer's lock as any reader of a run dir does
    (rundir.recover_for_reader); refused while a trainer holds it."""
    try:
        put_back_killed_resave(run_dir)
    except checkpoint.CheckpointError as e:
        done = "nothing was uploaded" if cmd == "push" else "the baton is still yours"
        raise RelayError(f"{cmd} refused: {e}; {done}") from None


def put_back_killed_resave(run_dir):
    """rundir.recover_for_reader, each step put back said; CheckpointError while a trainer holds the run dir."""
    for path in rundir.recover_for_reader(run_dir):
        print(f"relay: {path}: put back (a re-save of it was killed between its two renames)", file=sys.stderr)


def remove_dead_inits(workdir):
    """Remove the temp dirs of `init`s killed mid-way (init-HOST-PID-*: train.py's step-0 checkpoint, GBs at nano
    size) whose process on this host is gone; another host's (a shared filesystem) and a live one's are left."""
    try:
        names = os.listdir(workdir)
    except OSError:  # (no workdir yet)
        return
    for name in names:
        m = re.fullmatch(r"init-(.+)-(\d+)-[0-9a-f]{8}", name)
        if m and m.group(1) == checkpoint.host_tag() and not checkpoint.pid_alive(int(m.group(2))):
            shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
            print(f"relay: removed {os.path.join(workdir, name)}, left by a killed `relay.py init`", file=sys.stderr)


def remove_dead_pulls(dest_dir):
    """Remove the temporary folders of pulls killed mid-download (their process is gone): partial checkpoint copies,
    many GB each, that a leg resumed in the same dir never looked at again."""
    for name in os.listdir(dest_dir):
        m = re.fullmatch(r"\.pull-(\d+)-[0-9a-f]+", name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(dest_dir, name), ignore_errors=True)
        except (PermissionError, OverflowError):  # alive (another user's), or no such pid at all
            continue


def read_metrics(path, after_step=None, offset=0, until_step=None):
    """metrics.jsonl's records with after_step < step <= until_step (either bound optional), from byte offset."""
    out = []
    if not os.path.isfile(path):
        return out
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            try:
                m = json.loads(line)
            except ValueError:
                continue  # a line cut by a kill
            if isinstance(m, dict) and (after_step is None or m.get("step", 0) > after_step) and (
                    until_step is None or m.get("step", 0) <= until_step):
                out.append(m)
    return out


def printable(text):
    """Text from the store as a terminal is to show it: control characters (a holder's or ledger row's ESC sequences,
    which cleared the screen or set the title of a contributor's terminal; \\r) written escaped, as \\x1b."""
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def fmt_wall(s):
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def gpu_name(metrics):
    for m in reversed(metrics):
        if m.get("gpu"):
            return str(m["gpu"])
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "cpu"


def ledger_row(leg, who, gpu, steps, tokens, wall_s, usd, loss0, loss1, step0, step1, gen):
    cell = lambda x: str(x).replace("|", "/").replace("\n", " ")
    loss = lambda x: f"{x:.4f}" if isinstance(x, (int, float)) else "-"
    return (f"| {leg} | {cell(who)} | {cell(gpu)} | {steps} | {tokens} | {fmt_wall(wall_s)} | {usd:.2f} | {loss(loss0)} | "
            f"{loss(loss1)} | {step0}-{step1} | {gen} | {now_iso()} |\n")


def pushed_line(sha, row):
    """The push's ledger row said in words (it printed the raw markdown row, its cells unnamed)."""
    r = (parse_ledger(row) or [None])[0]
    if r is None:
        return f"relay: pushed {sha[:10]}: {row.strip()}"
    num = lambda x: f"{x:,}" if isinstance(x, int) else x  # noqa: E731
    loss = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    did = f"{num(r['steps'])} steps" if isinstance(r["steps"], int) else r["steps"]  # (a measuring leg: words)
    return (f"relay: pushed {sha[:10]}: leg {r['leg']} by {r['who']} on {r['gpu']}, steps {r['step_range']} "
            f"({did}, {num(r['tokens'])} tokens) in {r['wall']}, "
            f"${r['usd'] or 0:.2f}; loss {loss(r['loss_start'])} -> {loss(r['loss_end'])}")


def parse_ledger(text):
    rows = []
    keys = ["leg", "who", "gpu", "steps", "tokens", "wall", "usd", "loss_start", "loss_end", "step_range", "generation", "finished"]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(keys) or not cells[0].isdigit():
            continue
        row = dict(zip(keys, cells))
        for k in ("leg", "steps", "tokens", "generation"):
            row[k] = int(row[k]) if row[k].lstrip("-").isdigit() else row[k]
        for k in ("usd", "loss_start", "loss_end"):
            try:
                v = float(row[k])
            except ValueError:
                v = None
            row[k] = v if v is not None and math.isfinite(v) else None  # "nan": JSON has none (the page's refresh froze)
        rows.append(row)
    return rows


def leg_ledger_row(rows, leg, generation, who=None, step=None):
    """The first of parse_ledger's rows (a None skipped) of that leg and generation, and holder where given (as
    ledger_row wrote it): its push landed. None if there is none, or where step is given, if its steps end before it."""
    who = None if who is None else str(who).replace("|", "/").replace("\n", " ").strip()
    row = next((r for r in rows if r and (r["leg"], r["generation"]) == (leg, generation) and who in (None, r["who"])),
               None)
    end = row and row["step_range"].rpartition("-")[2]
    return row if step is None or end and end.isdigit() and int(end) >= step else None


def last_eval_due(store, sha):
    """The step of a finished run whose checkpoint's state.json holds eval_due for its own step (a stop signal cut
    its last evaluation short: a leg's resume measures it), or None."""
    st = parse_json(store.read(sha, CKPT_PREFIX + "/state.json"), f"{CKPT_PREFIX}/state.json", store, sha) or {}
    due, step = st.get("eval_due"), st.get("step")
    return step if st.get("finished") is True and isinstance(due, dict) and due.get("step") == step else None


def prepare_push(store, lease, run_dir, wall_s=None, usd_per_hour=0.0, metrics_offset=0):
    """Everything a push commits, built and verified, with the big files already uploaded (store.stage): that
    can take long, so `run` does it while the heartbeat still renews the lease. Nothing is visible until
    commit_push."""
    recover_killed_resave(run_dir)
    ckpts = checkpoint.list_checkpoints(run_dir)
    if not ckpts:
        raise RelayError(f"push refused: {run_dir} holds no step_* checkpoint dir; nothing was uploaded")
    ck = ckpts[-1][1]  # the newest one, strictly: a corrupt newest checkpoint is an error, not silently skipped
    try:
        manifest = checkpoint.verify(ck)
    except checkpoint.CheckpointError as e:
        raise RelayError(f"push refused: {e}; nothing was uploaded")
    try:
        st = json.load(open(os.path.join(ck, "state.json")))
    except (OSError, ValueError) as e:
        raise RelayError(f"push refused: {ck}/state.json unreadable ({e}); nothing was uploaded")
    step = int(st.get("step", manifest.get("step", 0)))
    base = lease.base_step if lease.base_step is not None else 0
    due = st.get("eval_due")
    # the pulled step again: a finished run's last evaluation, cut short, measured now (its checkpoint re-saved)
    measuring = step == base and st.get("finished") is True and last_eval_due(store, lease.sha) == base
    measured = measuring and not (isinstance(due, dict) and due.get("step") == step)
    if measuring and not measured:  # (a stop signal again, or a crash: "no step past the pulled one" said nothing)
        raise NothingToPush(f"push refused: this leg was to measure the val loss of step {base} (the run's last, whose "
                            f"evaluation a stop signal cut short), and that measuring was cut short too ({ck} still "
                            f"asks for it); nothing to push. The next `relay.py run {store.url} --steps 1` measures it",
                            f"the measuring of step {base}'s val loss was cut short; the next leg measures it")
    if step <= base and not measured:
        raise NothingToPush(f"push refused: {ck} is at step {step}, not past the pulled step {base}, so the trainer "
                            f"made no step (is the plan finished? `python train.py --status {run_dir}`); nothing to "
                            f"push",
                            f"no checkpoint past the pulled step {base}")
    stands_on = leg_base(run_dir)
    if stands_on is None:  # (`pull --out`, a train.py out_dir): nothing says which checkpoint its steps stand on
        raise RelayError(f"push refused: {run_dir} has no LEG.json naming the run's checkpoint it was trained on (not a "
                         f"leg dir of `relay.py pull`, or one of an older relay.py), so its steps may replace others' "
                         f"pushed since; train in the leg dir `relay.py pull {store.url}` makes while you hold the "
                         f"baton; nothing was uploaded")
    if stands_on != manifest_id(store.read(lease.sha, CKPT_PREFIX + "/MANIFEST.json")):
        # its step only had to pass the store's: another contributor's steps since were replaced by ones never on them
        raise RelayError(f"push refused: {run_dir} was trained on a checkpoint the run has moved past (someone pushed "
                         f"after it; the store is at step {base}), so its steps would replace theirs; train a leg from "
                         f"the run's own (`relay.py pull {store.url}`); nothing was uploaded")
    # read the files at our own last commit: if anyone wrote after it, the commit below fails anyway
    prev_state = parse_json(store.read(lease.sha, "training_state.json"), "training_state.json", store, lease.sha) or {}
    ledger = ledger_text(store, lease.sha, LEDGER_HEADER.encode())
    if not ledger.endswith("\n"):  # (an edit in the Hub's web editor): the new row was glued onto the last one
        ledger += "\n"
    # the steps this push carries: a trainer that crashed after its last checkpoint logged steps the next leg redoes;
    # a measuring leg's, the pulled step's row it re-measured (its loss is the training that leg pushed already)
    metrics = read_metrics(os.path.join(run_dir, "metrics.jsonl"), after_step=base - 1 if measured else base,
                           offset=metrics_offset, until_step=step)
    losses = [] if measured else [m["loss"] for m in metrics if isinstance(m.get("loss"), (int, float))]
    steps = step - base
    if measured:  # (0 steps said nothing of what the leg did)
        val = [m["val_loss"] for m in metrics if isinstance(m.get("val_loss"), (int, float))]
        steps = f"measured the val loss of step {step}" + (f": {val[-1]:.4f}" if val else "")
    tokens0 = int(prev_state.get("tokens") or 0)
    tokens1 = int(st.get("tokens", metrics[-1].get("tokens", tokens0) if metrics else tokens0))
    if wall_s is None:
        wall_s = time.time() - (lease.pulled_at or time.time())
    usd = wall_s / 3600.0 * usd_per_hour
    state = dict(prev_state, format=STATE_FORMAT, step=step, tokens=tokens1, legs=lease.leg, checkpoint=CKPT_PREFIX,
                 updated_at=time.time(), usd_total=float(prev_state.get("usd_total", 0.0)) + usd)
    for k in STATE_KEYS:
        if k in st:
            state[k] = st[k]
    if state.get("decay_requested") and (st.get("decay") or st.get("decay_started_at_tokens") is not None):
        state["decay_requested"] = False  # the trainer took the flag (state.json carries the decay fields now)
    state["stage"] = stage_name(state)  # the stage the next leg trains (state.json names none)
    # (a measuring leg's row was logged by the GPU that trained the step: this machine's is asked)
    row = ledger_row(lease.leg, lease.who, gpu_name([] if measured else metrics), steps, tokens1 - tokens0, wall_s, usd,
                     losses[0] if losses else None, losses[-1] if losses else None, base, step, lease.generation)
    adds = {f"{CKPT_PREFIX}/{name}": os.path.join(ck, name) for name in list(manifest["files"]) + ["MANIFEST.json"]}
    adds["training_state.json"] = (json.dumps(state, indent=1) + "\n").encode()
    adds[f"logs/leg-{lease.leg:04d}.jsonl"] = "".join(json.dumps(m) + "\n" for m in metrics).encode()
    adds["LEDGER.md"] = (ledger + row).encode()
    stale = [p for p in store.list(lease.sha, CKPT_PREFIX + "/") if p not in adds]
    lease.push_dir = os.path.abspath(run_dir)  # release checks it too: steps trained there after a push are nowhere else
    lease.save()
    return {"ck": ck, "step": step, "base": base, "row": row, "stale": stale, "adds": store.stage(adds)}


def commit_push(store, lease, plan, run_dir, note=None):
    """The push itself: one commit chained from our last one (note: a word for its message, e.g. that the trainer
    crashed). Raises Fenced if the lease is gone; the local dir is untouched either way."""
    step, base = plan["step"], plan["base"]
    adopt_own_renewal(store, lease)
    new_relay = dict(lease.relay, leg=lease.leg + 1, heartbeat_at=time.time(), last_push_step=step)
    # recorded first: if the store fails so that nobody knows whether the commit landed, a later `push` or
    # `release` finds it by its write_id (adopt_landed_push) instead of being fenced off by our own commit
    lease.pending_push = {"write_id": uuid.uuid4().hex, "step": step, "run_dir": run_dir and os.path.abspath(run_dir)}
    lease.save()
    try:
        sha, new_relay = commit_cas(store, lease.sha, plan["adds"], plan["stale"], f"relay: leg {lease.leg} by "
                                    f"{lease.who}: steps {base}-{step}" + (f" ({note})" if note else ""), new_relay,
                                    write_id=lease.pending_push["write_id"], lease=lease)
    except Conflict as e:
        lease.pending_push = None  # someone else's commit: ours did not land (commit_cas checked)
        lease.save()
        by = taken_by(store, lease)  # who holds the baton now (it said only "rejected")
        raise Fenced(f"push rejected: {e}{'; ' + by + ' took the baton' if by else ''}; your checkpoint is kept at "
                     f"{plan['ck']}, nothing was lost locally")
    chain_lease_to(lease, sha, new_relay, step, run_dir)
    return sha, plan["row"]


# ----------------------------------------------------------------------------------------------------------------
# run: claim -> pull -> train a leg (heartbeat thread) -> push -> release


def lease_clock():
    """Seconds, counting time the machine was suspended (CLOCK_BOOTTIME): time.monotonic (CLOCK_MONOTONIC) stops
    then, and a laptop or VM resumed past the ttl trained on as if renewed while another could claim the baton."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


class Heartbeat(threading.Thread):
    """Renews the lease every heartbeat_s. On a fenced renewal, or no successful renewal for ttl - margin seconds
    (lease_clock), sets `failed` and calls on_fail() (which stops the trainer); overdue, it keeps renewing until
    stopped (a store back after an outage renews the lease the leg's push needs; it stopped for good). Its clock starts at the lease's
    last renewal (heartbeat_at, written just before that commit), not at this thread's start: a second heartbeat
    (the trainer's, after the pull's) would otherwise grant itself up to heartbeat_s past the TTL."""

    def __init__(self, store, lease, on_fail):
        super().__init__(daemon=True)
        self.store, self.lease, self.on_fail = store, lease, on_fail
        self.stop = threading.Event()
        self.failed, self.fenced = None, False  # fenced: someone else's commit landed (else only overdue)
        renewed_age = max(0.0, time.time() - float(lease.relay.get("heartbeat_at") or time.time()))
        self.last_ok = lease_clock() - renewed_age
        self.deadline_s = lease.ttl_s - max(lease.ttl_s / 5, 0.5)  # stop ourselves before anyone may take over

    def fail(self, msg):
        if self.failed is None:
            self.failed = msg
            self.on_fail()

    def overdue(self):
        return lease_clock() - self.last_ok > self.deadline_s

    def run(self):
        wait = max(0.0, self.lease.heartbeat_s - (lease_clock() - self.last_ok))  # the next beat is due then
        while not self.stop.wait(wait):
            if self.overdue():  # the trainer stops; renewals go on (once the store is back, the push still lands)
                self.fail(f"lease not renewed for {lease_clock() - self.last_ok:.0f}s (ttl {self.lease.ttl_s:.0f}s): "
                          f"stopped training before anyone else may take the baton")
            sent = lease_clock()
            try:
                renew(self.store, self.lease, stop=self.stop)  # stopped, it ends between the commit's tries
                # from its request (its answer may come seconds later), or from the first try of it (heartbeat_at):
                # a retry may find a try of an earlier call or thread landed, whose time the store's clock counts from
                age = max(0.0, time.time() - float(self.lease.relay.get("heartbeat_at") or time.time()))
                self.last_ok = min(sent, lease_clock() - age)
                wait = max(0.0, self.lease.heartbeat_s - (lease_clock() - self.last_ok))
            except Fenced as e:
                self.fenced = True
                self.fail(str(e))
                self.failed = str(e)  # (after an overdue stop: the fence is what the caller must say)
                return
            except Exception as e:  # anything else too: a dead thread renewed nothing and told no one
                if self.stop.is_set():  # (a renewal cut short by the stop: nothing to retry or report)
                    return
                with contextlib.suppress(OSError):  # a dead pipe or terminal (tee gone) killed the thread, no renewals
                    print(f"relay: heartbeat failed, retrying: {type(e).__name__}: {e}", file=sys.stderr)
                wait = max(self.lease.heartbeat_s / 4, 0.1)


def start_heartbeat(hb):
    """Start a Heartbeat; RelayError if no thread can be had (a process or memory limit): nothing would renew the lease."""
    try:
        hb.start()
    except RuntimeError as e:
        raise RelayError(f"cannot start the lease's heartbeat thread ({e})") from None


def stop_heartbeat(hb, kept_in, training=False):
    """Stop a Heartbeat (one that never started too); Fenced if someone else's commit landed meanwhile (the local
    files stay in kept_in). training: it renewed a trainer's lease (else a pull's or a push's: no trainer ran)."""
    hb.stop.set()
    if hb.ident is not None:
        hb.join()
    if hb.fenced:
        raise Fenced(f"{hb.failed}. {'Training stopped; n' if training else 'N'}othing pushed; local checkpoints are "
                     f"kept in {kept_in}")


@contextlib.contextmanager
def renewing(store, lease, kept_in):
    """The lease renewed in the background while a long download or upload runs (nothing else renews it then)."""
    hb = Heartbeat(store, lease, lambda: None)
    start_heartbeat(hb)
    try:
        yield hb
    finally:
        stop_heartbeat(hb, kept_in)


def config_usd_per_hour(config_path, overrides):
    for a in reversed(overrides):  # the last one, as train.py's configurator keeps it
        if a.startswith("--gpu_hourly_usd="):
            try:
                return float(a.split("=", 1)[1])
            except ValueError:
                raise RelayError(f"{a}: not a number; pass --gpu_hourly_usd=DOLLARS, e.g. 2.5")
    try:  # its value as train.py's exec leaves it: the last assignment (init appends its overrides after the config's
        # own), arithmetic included (literal_eval took none: `2.5 * 8` trained at $20/h, the ledger said $0)
        text = open(config_path, encoding="utf-8").read()
        # (plain data only: quick to evaluate, nothing run)
        usd = (config_values(text) if configurator.not_data(text) is None else {}).get("gpu_hourly_usd", 0.0)
        return float(usd) if isinstance(usd, (int, float)) and not isinstance(usd, bool) else 0.0
    except Exception:  # (train.py says what is wrong with the file)
        return 0.0


def train_command(args, config_path, run_dir):
    cmd = [args.python, args.train_script, config_path, f"--out_dir={run_dir}", "--init_from=resume"]
    if args.steps is not None:
        cmd.append(f"--stop_after_steps={args.steps}")
    if args.hours is not None:
        cmd.append(f"--stop_after_hours={args.hours}")
    return cmd + args.overrides + (["--supervise"] if args.supervise else [])


def prepare_leg(store, lease, workdir):
    """Pull the run's checkpoint and config into a fresh leg dir. Leg dirs of earlier legs that were pushed are
    removed (their content is in the store); unpushed ones (fenced, crashed) are kept."""
    os.makedirs(workdir, exist_ok=True)
    unsure = set()  # a pushed leg's newer step left as step_N.old-PID by a killed re-save was deleted with its dir
    for name in sorted(os.listdir(workdir)):
        d = os.path.join(workdir, name)
        if name.startswith("leg-") and os.path.isdir(d):
            try:
                put_back_killed_resave(d)
            except checkpoint.CheckpointError as e:
                unsure.add(d)
                print(f"relay: warning: {e}; {d} kept as it is", file=sys.stderr)
    for name in sorted(os.listdir(workdir)):
        d = os.path.join(workdir, name)
        if name.startswith("leg-") and os.path.isfile(os.path.join(d, "PUSHED")) and d not in unsure:
            newer = unpushed_step(d)
            if newer is None:
                shutil.rmtree(d, ignore_errors=True)
            else:
                print(f"relay: warning: {d} holds step {newer}, trained after its push; kept (push it "
                      f"with `relay.py push --run-dir {d}` while holding the baton, if nobody has pushed since; or delete it)",
                      file=sys.stderr)
    run_dir = os.path.join(workdir, f"leg-{lease.leg:04d}-gen{lease.generation}")
    leg_file = os.path.join(run_dir, "LEG.json")
    adopt_older_leg(lease, run_dir)
    if os.path.isdir(run_dir) and leg_owner(run_dir) != (store.url, lease.nonce):
        # the same name from another run (a shared --workdir, a run re-made at this URL): resumed and pushed into
        # this run, its steps were another model's
        aside = f"{run_dir}.other-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(run_dir, aside)
        print(f"relay: warning: {run_dir} was another lease's leg (another run, or one re-made at this URL); moved "
              f"to {aside}, nothing deleted", file=sys.stderr)
    kept = []  # earlier leg dirs nothing resumes: a fenced or failed leg's checkpoints (GBs) were never named again
    rows = []  # the head's LEDGER.md rows, read once (pushed_leg)
    for n in sorted(os.listdir(workdir)):
        d = os.path.join(workdir, n)
        newest = newest_valid_step(d) if n.startswith("leg-") and d != run_dir else None
        if newest is None or os.path.isfile(os.path.join(d, "PUSHED")):
            continue
        try:  # its newest step is the one it pulled (LEG.json): nothing trained there
            as_pulled = manifest_id(open(os.path.join(d, checkpoint.step_dir_name(newest), "MANIFEST.json"), "rb")
                                    .read()) == leg_base(d)
        except OSError:
            as_pulled = False
        leg = None if as_pulled else pushed_leg(store, lease.sha, d, newest, rows)  # a push that landed unseen
        kept.append(f"{n} ({'only the pulled step' if as_pulled else 'step'} {newest}"
                    f"{'' if as_pulled else f' in the run: pushed as leg {leg}' if leg else ' never pushed'}, "
                    f"{checkpoint.fmt_size(checkpoint.dir_size(d))})")
    if kept:
        print(f"relay: note: {workdir} holds earlier leg dirs that nothing resumes (a lease lost, a failed leg): "
              f"{', '.join(kept)}; delete them once you no longer need them", file=sys.stderr)
    if not os.path.isfile(leg_file):
        os.makedirs(run_dir, exist_ok=True)
        write_atomic(leg_file, json.dumps({"store": store.url, "nonce": lease.nonce, "wall_s": 0.0, "base_manifest":
                                           manifest_id(store.read(lease.sha, CKPT_PREFIX + "/MANIFEST.json"))}))
    ck = pull(store, run_dir, lease.sha, keep_newer=True)
    cfg = store.read(lease.sha, "config.py")
    if cfg is None:
        raise RelayError(f"{store.url}: no config.py at {lease.sha[:10]}; the run was not created by `relay.py init`")
    bad = configurator.not_data(cfg.decode("utf-8", errors="replace"))
    if bad:  # train.py execs it: from the store, only data (any repo writer could put code there)
        raise RelayError(f"{store.url}: config.py at {lease.sha[:10]}, line {bad[0]}: `{bad[1]}` is not plain data, "
                         f"and relay runs no code from the store; commit a config.py of literal assignments")
    if own := contributor_keys_set(cfg.decode("utf-8", errors="replace")):
        raise RelayError(f"{store.url}: config.py at {lease.sha[:10]} sets {own[0]}, which relay takes from no "
                         f"store: it is {own_key_fix(own[0], 'config.py (a commit to the store)')}")
    open(os.path.join(run_dir, "relay_config.py"), "wb").write(cfg)
    state = parse_json(store.read(lease.sha, "training_state.json"), "training_state.json", store, lease.sha)
    if state.get("decay_requested"):
        write_atomic(os.path.join(run_dir, "control.json"), json.dumps({"start_decay": True}))
    lease.run_dir, lease.pulled_at = run_dir, time.time()
    lease.base_step = json.load(open(os.path.join(ck, "state.json"))).get("step", lease.base_step)
    lease.save()
    return run_dir


def pushed_leg(store, sha, leg_dir, step, rows):
    """The leg of the LEDGER.md row at sha that holds leg_dir's step (leg-NNNN-genG: its leg and generation), or
    None: its push landed though its answer was lost (no PUSHED marker; it was said "never pushed"). rows: a list,
    filled with the ledger's rows at the first call (a None too, so that a store that cannot say is asked once)."""
    name = re.fullmatch(r"leg-(\d+)-gen(\d+)", os.path.basename(leg_dir))
    if not name or (leg_owner(leg_dir) or ("",))[0] != store.url:  # (another run's dir of the same name)
        return None
    if not rows:
        try:
            rows.extend(parse_ledger(ledger_text(store, sha)) or [None])
        except RelayError:
            rows.append(None)
    row = leg_ledger_row(rows, int(name[1]), int(name[2]), step=step)
    return row["leg"] if row else None


def leg_owner(run_dir):
    """(store url, lease nonce) of the lease a leg dir was made for (LEG.json), or None."""
    try:
        rec = json.load(open(os.path.join(run_dir, "LEG.json")))
        return rec["store"], rec["nonce"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def leg_base(run_dir):
    """manifest_id of the store's checkpoint a leg dir's steps stand on (LEG.json: pulled, or pushed from it), or None
    (not a leg dir, or made by an older relay.py)."""
    try:
        return json.load(open(os.path.join(run_dir, "LEG.json"))).get("base_manifest")
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def adopt_older_leg(lease, run_dir):
    """A leg dir of this very lease (LEASE.json names it) made by an older relay.py, without LEG.json or its
    base_manifest, gets one: its steps stand on the step it pulled (lease.base_step), still in it. `run` had set it
    aside as another lease's and retrained the leg, and `push` refused it, after an upgrade mid-leg."""
    ours = getattr(lease, "run_dir", None)
    if not run_dir or not ours or leg_base(run_dir) is not None or not rundir.same_dir(run_dir, ours):
        return
    path = os.path.join(run_dir, "LEG.json")
    if os.path.exists(path) and leg_owner(run_dir) != (lease.store, lease.nonce):
        return
    rec = json.load(open(path)) if os.path.exists(path) else {}
    try:  # (pruned by the leg's retention: which checkpoint it stands on is unknown, and push refuses it as before)
        pulled = open(os.path.join(run_dir, checkpoint.step_dir_name(int(lease.base_step)), "MANIFEST.json"),
                      "rb").read()
    except (OSError, TypeError, ValueError):
        return
    write_atomic(path, json.dumps({"wall_s": 0.0, **rec, "store": lease.store, "nonce": lease.nonce,
                                   "base_manifest": manifest_id(pulled)}))
    print(f"relay: {run_dir} is this lease's leg dir from an older relay.py; its LEG.json written (its steps stand "
          f"on the pulled step {lease.base_step})", file=sys.stderr)


def leg_wall(run_dir, add_s=None):
    """Seconds this leg's trainer has run, over every start (LEG.json; a leg resumed after a reboot billed only the
    time after it); with add_s, stored as that total first."""
    path = os.path.join(run_dir, "LEG.json")
    try:
        rec = json.load(open(path))
        if add_s is not None:
            write_atomic(path, json.dumps(dict(rec, wall_s=float(add_s))))
            return float(add_s)
        return float(rec.get("wall_s") or 0.0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0


def leg_usd_per_hour(run_dir, set_to=None):
    """The $ per GPU hour `run` trained this leg at (LEG.json: the config's, or the run's --gpu_hourly_usd=), or None
    (a leg trained by hand); with set_to, stored first."""
    path = os.path.join(run_dir, "LEG.json")
    try:
        rec = json.load(open(path))
        if set_to is not None:
            write_atomic(path, json.dumps(dict(rec, usd_per_hour=float(set_to))))
        v = rec.get("usd_per_hour") if set_to is None else set_to
        return float(v) if isinstance(v, (int, float)) else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def unpushed_step(run_dir):
    """The newest valid step of run_dir past what its PUSHED marker says was pushed (None: nothing unpushed). A marker
    without a step (an older relay.py's) counts as nothing pushed."""
    try:
        parts = open(os.path.join(run_dir, "PUSHED")).read().split()
        pushed = int(parts[1]) if len(parts) > 1 else -1
    except (OSError, ValueError):
        pushed = -1
    newest = newest_valid_step(run_dir)
    return newest if newest is not None and newest > pushed else None


def newest_valid_step(run_dir):
    """The step of run_dir's newest checkpoint whose manifest checks out (sizes, not hashes), or None."""
    if not run_dir or not os.path.isdir(run_dir):
        return None
    return next((s_ for s_, p in reversed(checkpoint.list_checkpoints(run_dir))
                 if checkpoint.is_valid(p, check_hashes=False)), None)


def pdeathsig_setter():
    """A preexec_fn asking Linux to SIGTERM the child when its parent (relay, or the guardian) dies (prctl
    PR_SET_PDEATHSIG = 1, linux/prctl.h); everything is looked up here, in the parent, so the child runs no import
    between fork and exec. None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def setter():
        prctl(1, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died between fork and prctl: no signal will come, so end as if it had
            os._exit(128 + int(signal.SIGTERM))
    return setter


def detach_from_lost_terminal(log_path):
    """After SIGHUP (an ssh session dropped): stdout / stderr on the gone terminal fail every write (EIO; EPIPE for
    pipes nobody reads), and relay's next print would end it before its push and release; they go to log_path."""
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:  # (this machine's disk): nowhere to keep them
        log = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(log, fd)  # what Python still buffers for the terminal is written here too
    os.close(log)
    with contextlib.suppress(OSError):  # (a full disk): raised in a signal handler, it would end the push it asks for
        os.write(2, f"relay: {time.strftime('%Y-%m-%d %H:%M:%S')} hangup (SIGHUP): ending the leg; lines from here "
                    f"on go to this file\n".encode())


def release_quietly(store, lease):
    """Release after a failure that is being reported anyway: says whether it worked."""
    try:
        pushed = adopt_landed_push(store, lease)  # a push that failed unseen may have landed: release after it
        release(store, lease)
        return f"the push had landed as {pushed[:10]} after all; lease released" if pushed else "lease released"
    except RelayError as e:
        return f"the lease could not be released ({e}; it expires after its ttl)"


def cmd_run(args):
    store = open_store(args.store)
    workdir = workdir_for(args)
    if args.steps is None and args.hours is None:
        raise RelayError("run: give the leg's length with --steps N or --hours H")
    for flag, v in (("--steps", args.steps), ("--hours", args.hours)):
        if v is not None and not v > 0:
            raise RelayError(f"run: {flag} {v}: the leg's length must be positive")
    if args.poll < 0:
        raise RelayError(f"run: --poll {args.poll}: seconds between tries, 0 or more")
    remove_dead_inits(workdir)
    while True:
        try:
            snap = Snapshot(store)
            state = snap.state
            # a finished run whose last evaluation a stop signal cut short: a leg resumes it to measure it, and pushes
            if state.get("finished") is True and last_eval_due(store, snap.sha) is None:
                # the trainer would make no step: claimed, pulled and refused at the push
                raise RelayError(f"{store.url}: the run is finished (step {state.get('step')}: its plan is trained to "
                                 f"the end); nothing claimed. Its final checkpoint: `python relay.py pull {store.url} "
                                 f"--out DIR`")
            lease = claim(store, workdir, args.who, args.ttl, args.heartbeat)
            break
        except (Busy, Transient) as e:
            if not args.wait:
                raise
            print(printable(f"relay: {e}; waiting {args.poll:.0f}s"), file=sys.stderr)
            try:
                time.sleep(args.poll)
            except KeyboardInterrupt:
                raise RelayError("interrupted while waiting for the baton; nothing claimed") from None
    print(f"relay: claimed leg {lease.leg} (generation {lease.generation}) of {store.url}")

    hb = Heartbeat(store, lease, lambda: None)  # the download of a big checkpoint may outlast the TTL
    try:
        start_heartbeat(hb)
        run_dir = prepare_leg(store, lease, workdir)
    except (RelayError, OSError, KeyboardInterrupt) as e:  # OSError: this machine's disk: the baton goes back
        stop_heartbeat(hb, lease.run_dir or workdir)
        release(store, lease)
        if isinstance(e, RelayError):  # (a damaged store checkpoint, a config.py with code): the baton is free again
            if hb.ident is None:
                raise RelayError(f"{e}; nothing pulled; lease released") from None
            raise (Fenced if isinstance(e, Fenced) else RelayError)(f"{e}; lease released") from None
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed: {e}"
        raise RelayError(f"pulling the run {why}; lease released") from None
    stop_heartbeat(hb, run_dir)
    if hb.failed:  # overdue during a long download, not fenced: one renewal now says whether the lease is still ours
        renew(store, lease)
    resumed = newest_valid_step(run_dir)
    print(f"relay: pulled step {lease.base_step} into {run_dir}" + (
        f"; resuming this leg's own step {resumed} there (trained before a crash)"
        if resumed is not None and resumed > (lease.base_step or 0) else ""))
    proc = None
    stop_reason = []

    def stop_trainer():
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the trainer checkpoints, then exits 0

    def on_signal(signum, frame):  # Ctrl-C, SIGTERM, SIGHUP: end the leg early but cleanly (checkpoint, push, release)
        if signum == signal.SIGHUP and "SIGHUP" not in stop_reason:
            detach_from_lost_terminal(os.path.join(workdir, "relay.log"))
        stop_reason.append(signal.Signals(signum).name)
        stop_trainer()
    cmd = train_command(args, os.path.join(run_dir, "relay_config.py"), run_dir)
    wall_before = leg_wall(run_dir)  # this leg's trainer time before a crash or a reboot (resumed here)
    usd_per_hour = config_usd_per_hour(cmd[2], args.overrides)  # (overrides checked in main: this raises nothing)
    leg_usd_per_hour(run_dir, usd_per_hour)  # the `push` that finishes a failed or killed leg bills this rate too
    t0 = saved_at = time.time()
    # set just before the try that puts them back: an error above left this process's Ctrl-C going to on_signal
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        # own session: a terminal's Ctrl-C reaches only relay, which ends the leg cleanly (SIGTERM -> checkpoint ->
        # push); PR_SET_PDEATHSIG: if relay itself is killed, the trainer gets SIGTERM instead of training on unleased
        proc = subprocess.Popen(cmd, cwd=os.path.dirname(os.path.abspath(args.train_script)), start_new_session=True,
                                preexec_fn=pdeathsig_setter())
    except OSError as e:
        for s, h in old_handlers.items():
            signal.signal(s, h)
        release(store, lease)
        raise RelayError(f"cannot start the trainer {cmd[0]} ({e}); lease released")
    hb = Heartbeat(store, lease, stop_trainer)
    plan, failure = None, None
    try:
        try:
            start_heartbeat(hb)  # after the fork: preexec_fn is unsafe while other threads run
        except RelayError as e:  # the trainer ran unleased: it checkpoints and stops, the baton goes back
            stop_trainer()
            proc.wait()
            raise RelayError(f"{e}: the trainer was stopped; {release_quietly(store, lease)}; local files kept in "
                             f"{run_dir}") from None
        while proc.poll() is None:
            time.sleep(0.05)
            if time.time() - saved_at > 30:
                saved_at = time.time()
                leg_wall(run_dir, wall_before + saved_at - t0)
            if hb.overdue():  # also covers a heartbeat stuck in a hung request, or this process being paused
                hb.fail(f"lease not renewed for {lease_clock() - hb.last_ok:.0f}s (ttl {lease.ttl_s:.0f}s): "
                        f"stopped training before anyone else may take the baton")
        rc = proc.wait()
        wall = leg_wall(run_dir, wall_before + time.time() - t0)
        lease.leg_wall_s = wall  # what a retried `relay.py push` bills (not the hours until the retry)
        lease.save()
        if not hb.fenced:  # an overdue lease stopped the trainer; the push below is a compare-and-swap either way
            try:  # verify and upload while the heartbeat still renews the lease (after a crash too: see below)
                plan = prepare_push(store, lease, run_dir, wall_s=wall, usd_per_hour=usd_per_hour)
            except RelayError as e:
                failure = e
            except OSError as e:  # the store's disk (the checkpoint was verified): kept for a retry, as any upload
                failure = StoreError(f"{e.filename or store.url}: {e.strerror}; local files kept in {run_dir}")
    finally:
        for s, h in old_handlers.items():  # a hangup's second SIGHUP (the shell's, then the kernel's) ends no push
            signal.signal(s, signal.SIG_IGN if s == signal.SIGHUP and "SIGHUP" in stop_reason else h)
        stop_heartbeat(hb, run_dir, training=True)
    crashed = f"trainer exited with status {rc} ({' '.join(cmd[:3])} ...)"
    if rc != 0 and plan is not None:
        # a trainer that failed after checkpointing (an OOM kill, a bad node at hour 5): its newest checkpoint,
        # verified like any push, goes to the store, so the hours before the crash are not lost to the run
        try:
            sha, _ = commit_push(store, lease, plan, run_dir, note=f"trainer exited with status {rc}")
        except Fenced:
            raise
        except RelayError as e:
            raise RelayError(f"{crashed}; pushing its newest checkpoint failed ({e}); {release_quietly(store, lease)}, "
                             f"local files kept in {run_dir}")
        release(store, lease)
        raise RelayError(f"{crashed}; its newest checkpoint (step {plan['step']}) was pushed as {sha[:10]} and the "
                         f"lease released; local files kept in {run_dir}")
    def kept_for_retry(e, ck, committing):  # the leg exists only here: the baton stays ours for `push`, not a redo
        # (an upload that failed before any commit cannot have landed)
        maybe = " (it may have landed: the push below finds out)" if committing and isinstance(e, Transient) else ""
        wd = os.path.dirname(lease.path)
        return RelayError(f"push failed: {e}{maybe}; the checkpoint is kept at {ck} and the lease stays yours until "
                          f"{lease.ttl_s:.0f}s after its last renewal: retry with `python relay.py push {store.url} "
                          f"--workdir {wd}`, then `python relay.py release {store.url} --workdir {wd}`")
    if rc == 0 and isinstance(failure, StoreError):  # the upload failed (the store, not the checkpoint)
        raise kept_for_retry(failure, run_dir, committing=False)
    if rc != 0 or failure:
        release(store, lease)
        why = failure.why if isinstance(failure, NothingToPush) else str(failure)
        raise RelayError(f"{crashed}; lease released, nothing pushed ({why}), local files kept in {run_dir}"
                         if rc != 0 else f"{failure}; lease released")
    try:
        sha, row = commit_push(store, lease, plan, run_dir)
    except Fenced:
        raise
    except (RelayError, OSError) as e:  # the store failed the commit (unreachable, refused, its disk full)
        raise kept_for_retry(e, plan["ck"], committing=True) from None
    # from here to the release, a pipe that died without a hangup (`relay.py run | tee log`, tee killed) ends nothing
    checkpoint.print_or_detach(pushed_line(sha, row))
    release(store, lease)
    checkpoint.print_or_detach(f"relay: released the baton{' (' + stop_reason[0] + ')' if stop_reason else ''}")
    checkpoint.print_or_detach(
        f"relay: {run_dir} ({checkpoint.fmt_size(checkpoint.dir_size(run_dir))}) stays on disk until the next "
        f"`relay.py run` (or `relay.py pull` holding the baton) from this workdir removes it (its checkpoint is in "
        f"the store); to free it now: rm -r {run_dir}")
    if hb.failed:
        checkpoint.print_or_detach(f"relay: warning: {hb.failed}; the leg ended early, its checkpoint was pushed",
                                   file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------------------------
# init / status / decay and the small commands


INVOCATION_KEYS = {"out_dir", "init_from", "resume_from", "grow_from", "grow_layers", "stop_after_steps",
                   "stop_after_hours", "mirror_dir"}  # per-run-of-train.py keys, not part of the run's config
CONTRIBUTOR_KEYS = ("on_stuck", "mirror_dir")  # each contributor's own (--key=value): a shell command the guardian
# runs and a folder the trainer writes into; set in the store's config.py, data ran code on every contributor's machine
LEG_KEYS = {"resume_from": "a local checkpoint path, which `relay.py run` sets for each leg (every leg resumes its own "
                           "leg dir)",
            "stop_after_steps": "a leg's length, which `relay.py run --steps N` sets for each leg",
            "stop_after_hours": "a leg's length, which `relay.py run --hours H` sets for each leg"}
# set in the store's config.py, one (a local path, another leg's length) applied to every contributor's legs
START_KEYS = {"init_from", "grow_from", "grow_layers"}  # how the run's first checkpoint is made: init takes them
SOURCE_KEY = {"grow": "grow_from", "finetune": "finetune_from"}  # init_from -> the key naming its source checkpoint


def read_config_text(path):
    """A config file's text, or one RelayError line (a non-UTF-8 file was a UnicodeDecodeError traceback)."""
    try:
        return open(path, encoding="utf-8").read()
    except UnicodeDecodeError as e:
        raise RelayError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8")
    except OSError as e:
        raise RelayError(f"{path}: cannot read it ({e.strerror or e}); pass a config file you can read")


def contributor_keys_set(text):
    """The CONTRIBUTOR_KEYS and LEG_KEYS a plain-data config (passed configurator.not_data) sets: to a non-empty
    value, or a stop_after_* to one train.py acts on (>= 0; -1 is its default, off)."""
    try:
        scope = config_values(text)
    except RelayError:  # ({[1]}: train.py says what is wrong with it)
        return []

    def acts(key, v):  # a stop_after_* of -1 (train.py's default) is off
        return v >= 0 if key.startswith("stop_after_") and isinstance(v, (int, float)) else bool(v)
    return [k for k in (*CONTRIBUTOR_KEYS, *LEG_KEYS) if acts(k, scope.get(k))]


def own_key_fix(key, source):
    """What a key a run's config may not set is, and the fix (the end of a one-line error)."""
    if key in LEG_KEYS:
        return f"{LEG_KEYS[key]}; remove it from {source}"
    return (f"each contributor's own (a shell command or a local folder); remove it from {source}, and pass "
            f"--{key}=... to your own `relay.py run`")


def config_from_checkpoint(ck):
    """config.py text for a run started from a checkpoint: its state.json "config" (what train.py trained it with)."""
    try:
        cfg = json.load(open(os.path.join(ck, "state.json"))).get("config")
    except (OSError, ValueError):
        cfg = None
    if not isinstance(cfg, dict) or not cfg:
        raise RelayError(f"{ck}/state.json has no \"config\"; pass the train.py CONFIG it was trained with")
    unread = schedule.unused_with_stages(cfg)  # beside stages, train.py refuses them: every leg of an SFT run exited 1
    return "# from the checkpoint's state.json\n" + "".join(
        f"{k} = {v!r}\n" for k, v in sorted(cfg.items())
        if k not in INVOCATION_KEYS and k not in unread and k not in CONTRIBUTOR_KEYS)


def config_values(text):
    """{key: value} a config's text sets; text has passed configurator.not_data (literal assignments only)."""
    scope = {"__builtins__": {}, "dict": dict}
    try:
        exec(compile(text, "config.py", "exec"), scope)
    except Exception as e:  # ({[1]}: data to not_data, a TypeError here, as in train.py)
        raise RelayError(f"init refused: the config raised {type(e).__name__}: {e}; fix the config (or its overrides)")
    return scope


def check_start_done(mode, ck, config):
    """A config that grows or fine-tunes, with --from-checkpoint: DIR must be that grown / fine-tuned run's checkpoint
    (config/sft.py's recipe). A base run's checkpoint started the relay as it was, the growth or fine-tune never done,
    and each leg refused the config's plan with advice (--replan) that trained it on the base run's step, tokens and
    AdamW moments. Only growth makes "old" layers; checkpoint.chat_tuned knows a fine-tune (None: cannot tell)."""
    if mode not in SOURCE_KEY:
        return
    try:
        st = json.load(open(os.path.join(ck, "state.json")))
    except (OSError, ValueError):
        return
    origin = st.get("layer_origin") if isinstance(st, dict) else None
    done = (checkpoint.chat_tuned(st) if mode == "finetune" else
            None if not isinstance(origin, list) else "old" in origin)
    if done is False:
        verb = "fine-tune" if mode == "finetune" else "grow"
        raise RelayError(f"init refused: {config} says init_from={mode!r}, but {ck} is not from a "
                         f"{'fine-tuned' if mode == 'finetune' else 'grown'} run, and --from-checkpoint starts the run "
                         f"from it as it is; drop --from-checkpoint to {verb} it (init runs train.py "
                         f"--init_from={mode} with the config's {SOURCE_KEY[mode]}), or pass that run's checkpoint")


def start_command(args, cfg_text, cfg_path, out_dir, cwd):
    """train.py's command that writes the run's step-0 checkpoint: as the config's init_from says (scratch, or grow /
    finetune from a local checkpoint, resolved and verified here, before the store is touched)."""
    vals = config_values(cfg_text)
    mode = vals.get("init_from", "scratch")
    if mode not in ("scratch", "grow", "finetune"):
        raise RelayError(f"init refused: init_from={mode!r}: a relay run starts from scratch, grow (grow_from=) or "
                         f"finetune (finetune_from=); to start from a run's own checkpoint use --from-checkpoint DIR")
    cmd = [args.python, args.train_script, cfg_path, f"--out_dir={out_dir}", f"--init_from={mode}"]
    key = SOURCE_KEY.get(mode)
    if key:
        src = vals.get(key)
        if not src or not isinstance(src, str):
            raise RelayError(f"init refused: init_from={mode!r} needs {key}=CHECKPOINT (a local run or step dir): set "
                             f"it in the config or pass --{key}=DIR")
        try:  # relative to train.py's folder, where the trainer reads it; the step verified here is the one used
            ck = checkpoint.resolve(os.path.join(cwd, src))
            checkpoint.verify(ck)
        except checkpoint.CheckpointError as e:
            raise RelayError(f"init refused: {key}={src}: {e}")
        cmd.append(f"--{key}={os.path.abspath(ck)}")
    return cmd + ["--stop_after_steps=0"]


def cmd_init(args):
    store = open_store(args.store)
    ttl = DEFAULT_TTL if args.ttl is None else args.ttl  # the run's defaults for every claim
    heartbeat = DEFAULT_HEARTBEAT if args.heartbeat is None else args.heartbeat
    check_lease_times(ttl, heartbeat)
    warn_hub_heartbeat(store, heartbeat)
    ck = None
    if args.from_checkpoint:  # everything is checked before the store is touched
        try:
            ck = checkpoint.resolve(args.from_checkpoint)
            checkpoint.verify(ck)
        except checkpoint.CheckpointError as e:
            raise RelayError(f"init refused: {e}")
        if args.config and not os.path.isfile(args.config):  # a typo silently took the checkpoint's config
            raise RelayError(f"{args.config}: config file not found; pass a file under config/, or leave CONFIG out "
                             f"to use the checkpoint's own")
        cfg_text = read_config_text(args.config) if args.config else config_from_checkpoint(ck)
    elif args.config is None:
        raise RelayError("init: give a train.py CONFIG (with --key=value overrides) or --from-checkpoint DIR")
    elif not os.path.isfile(args.config):
        raise RelayError(f"{args.config}: config file not found; pass a file under config/")
    else:
        cfg_text = read_config_text(args.config)
    bad = configurator.not_data(cfg_text)
    if bad:  # every contributor's train.py would exec it
        raise RelayError(f"init refused: {args.config or 'the config'}, line {bad[0]}: `{bad[1]}` is not plain data; a "
                         f"relay run's config runs on every contributor's machine, so it holds only literal "
                         f"assignments (x = 1, stages = [dict(...)])")
    # (parsed again over the config's values: --lr_mult="{'new': 2.0}" baked over train.py's defaults dropped the
    # config's other lr_mult entries, which every leg then trained without)
    given = getattr(args, "overrides", None)
    run_level = train_overrides(args.train_script, given, config_values(cfg_text)) if given else {}
    if run_level:
        cfg_text += "\n# relay.py init overrides\n" + "".join(f"{k} = {v!r}\n" for k, v in run_level.items())
        bad = configurator.not_data(cfg_text)
        if bad:
            raise RelayError(f"init refused: the overrides, line {bad[0]}: `{bad[1]}` is not plain data")
    if own := contributor_keys_set(cfg_text):
        src = (args.config or f"{ck}/state.json's config") + (" with its --key=value overrides" if run_level else "")
        raise RelayError(f"init refused: {src} sets {own[0]}, which a run's config (used on every machine of the run) "
                         f"may not set: it is {own_key_fix(own[0], 'there')}")
    train_cwd = os.path.dirname(os.path.abspath(args.train_script))
    remove_dead_inits(workdir_for(args))
    tmp = os.path.join(workdir_for(args), f"init-{checkpoint.host_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    cfg_path = os.path.join(tmp, "relay_config.py")
    start = sorted(k for k in run_level if k in START_KEYS | {"finetune_from"})
    if args.from_checkpoint and start:  # (the run would start from DIR as it is, the growth silently not done)
        raise RelayError(f"init refused: --{start[0]} with --from-checkpoint, which starts the run from that checkpoint "
                         f"as it is; drop one")
    if args.from_checkpoint and args.config:
        check_start_done(config_values(cfg_text).get("init_from", "scratch"), ck, args.config)
    cmd = None if args.from_checkpoint else start_command(args, cfg_text, cfg_path, tmp, train_cwd)
    if not store.exists():
        store.create()
    sha, _, _ = store.head()  # checked after a create too: the repo may have been there all along
    files = store.list(sha)
    if "RELAY.json" in files:
        raise RelayError(f"{store.url}: already a relay run; nothing overwritten (use `relay.py status`)")
    if [f for f in files if f not in (".gitattributes", "README.md")]:
        raise RelayError(f"{store.url}: repo is not empty and not a relay run ({len(files)} files); use a new repo")
    os.makedirs(tmp)
    try:
        open(cfg_path, "w").write(cfg_text)
        if cmd:
            r = subprocess.run(cmd, cwd=train_cwd)
            if r.returncode != 0:
                raise RelayError(f"init: {' '.join(cmd[:3])} ... exited {r.returncode}; nothing committed")
            try:
                ck = checkpoint.resolve(tmp)
                checkpoint.verify(ck)
            except checkpoint.CheckpointError as e:
                raise RelayError(f"init: the trainer wrote no valid step-0 checkpoint: {e}")
        st = json.load(open(os.path.join(ck, "state.json")))
        manifest = json.load(open(os.path.join(ck, "MANIFEST.json")))
        state = {"format": STATE_FORMAT, "step": int(st.get("step", manifest.get("step", 0))), "tokens": int(st.get("tokens", 0)),
                 "legs": 0, "checkpoint": CKPT_PREFIX, "decay_requested": False, "usd_total": 0.0, "created_at": time.time()}
        for k in STATE_KEYS:
            if k in st:
                state[k] = st[k]
        state["stage"] = stage_name(state)
        adds = {f"{CKPT_PREFIX}/{n}": os.path.join(ck, n) for n in list(manifest["files"]) + ["MANIFEST.json"]}
        adds["config.py"] = cfg_text.encode()
        adds["training_state.json"] = (json.dumps(state, indent=1) + "\n").encode()
        adds["LEDGER.md"] = ("# Ledger\n\nOne row per leg pushed by `relay.py`.\n\n" + LEDGER_HEADER).encode()
        relay = {"format": RELAY_FORMAT, "version": RELAY_VERSION, "holder": None, "nonce": None, "generation": 0, "leg": 1,
                 "ttl_s": ttl, "heartbeat_s": heartbeat, "default_ttl_s": ttl, "default_heartbeat_s": heartbeat,
                 "created_at": time.time()}
        sha, _ = commit_cas(store, sha, adds, [], f"relay: init at step {state['step']}", relay)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"relay: created run {store.url} at step {state['step']} ({sha[:10]}); each contributor trains a leg with "
          f"`python relay.py run {store.url} --hours H` (or --steps N)")
    return 0


def train_defaults(train_script):
    """train.py's config globals {key: default}, read from its source, not run (a fork without a __main__ guard
    would train on import): the literal assignments above its _CONFIG_KEYS line, of the types train.py counts."""
    try:
        with open(train_script) as f:
            tree = ast.parse(f.read(), train_script)
    except (OSError, SyntaxError, ValueError) as e:
        raise RelayError(f"{train_script}: cannot read train.py's config keys ({e}); pass --train-script PATH")
    defaults = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name == "_CONFIG_KEYS":  # train.py's config ends here (constants after it are not keys)
            break
        try:
            value = ast.literal_eval(node.value)
        except ValueError:
            continue  # computed at run time: not a key train.py's configurator could type-check here either
        if not name.startswith("_") and isinstance(value, (int, float, str, bool, list, dict)):
            defaults[name] = value
    if not defaults:
        raise RelayError(f"{train_script}: holds no config globals (is it train.py?); pass --train-script PATH")
    return defaults


def train_overrides(train_script, overrides, config=None):
    """{key: value} of --key=value overrides, parsed as train.py parses them (by the type of its default), so a
    relay_config.py line holds what train.py would have taken (--mirror_dir=2024 is the string '2024'); over the
    config's values where given (a dict override updates the config's dict, as train.py's configurator does)."""
    g = train_defaults(train_script)
    g.update({k: v for k, v in (config or {}).items() if k in g})
    try:
        given = configurator.configure(g, overrides)
    except configurator.ConfigError as e:
        raise RelayError(f"override refused: {e}") from None
    return {k: g[k] for k, _ in given}


def stage_name(state):
    """The plan's stage that trains the run's next token (state.json keeps the plan and the tokens, not this)."""
    plan, tokens = state.get("plan"), state.get("tokens")
    try:
        _, stage, _ = schedule.stage_at(plan, int(tokens))
    except (TypeError, KeyError, ValueError):  # no plan (an older run), or a malformed one: nothing to name
        return None
    return "finished" if stage is None else stage.get("name")


def status_dict(store):
    snap = Snapshot(store)
    r, s = snap.relay, snap.state
    return {"store": store.url, "head": snap.sha, "holder": r.get("holder") if snap.held else None,
            "expired_holder": r.get("holder") if r.get("holder") and not snap.held else None,
            "generation": r["generation"], "leg": r.get("leg"), "claimed_at": r.get("claimed_at"),
            "lease_age_s": snap.lease_age, "ttl_s": float(r.get("ttl_s", DEFAULT_TTL)), "step": s.get("step"), "tokens": s.get("tokens"),
            "stage": stage_name(s), "legs": s.get("legs"), "decay_requested": s.get("decay_requested"),
            "decay": s.get("decay") or s.get("decay_started_at_tokens"), "finished": s.get("finished"), "usd_total": s.get("usd_total", 0.0),
            "ledger": parse_ledger(snap.ledger()),
            "last_eval_due": last_eval_due(store, snap.sha) if s.get("finished") else None,
            "load_collapsed_since": expert_load.collapsed_since(s)}


def cmd_status(args):
    d = status_dict(open_store(args.store))
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    if d["holder"]:
        who = f"{d['holder']} (leg {d['leg']}, generation {d['generation']}, claimed {now_iso(d['claimed_at'])} UTC, " \
              f"renewed {d['lease_age_s']:.0f}s ago, ttl {d['ttl_s']:.0f}s)"
    elif d["expired_holder"]:
        who = f"free (lease of {d['expired_holder']} expired {d['lease_age_s'] - d['ttl_s']:.0f}s ago)"
    else:
        who = "free"
    decaying = d["decay"] is not None and d["decay"] is not False
    print(printable(f"{d['store']} @ {d['head'][:10]}\n  baton: {who}\n  step {d['step']}, tokens {d['tokens']}, "
                    f"stage {d['stage']}, legs {d['legs']}, ${d['usd_total']:.2f} so far"
                    f"{', decay requested' if d['decay_requested'] else ''}"
                    f"{', FINISHED' if d['finished'] else ', decaying' if decaying else ''}"
                    + (f" but its last step {d['last_eval_due']}'s evaluation was cut short: a leg (`relay.py run "
                       f"{d['store']} --steps 1`) measures it" if d.get("last_eval_due") is not None else "")))
    if d["load_collapsed_since"] is not None:  # (said once, in the log of the leg that trained it: nowhere else)
        print(printable(f"  WARNING: expert load collapsed since step {d['load_collapsed_since']} (the pushed "
                        f"checkpoint's state; its leg's trainer log names the layers): dead_frac_layers in logs/, or "
                        f"`relay.py dashboard {d['store']}`"))
    num = lambda x, spec: "-" if x is None else format(x, spec)  # as the ledger writes them (it said "$0.0", "None")
    for row in d["ledger"][-5:]:
        did = f" ({row['steps']})" if isinstance(row["steps"], str) else ""  # (a measuring leg's words)
        print(printable(f"  leg {row['leg']}: {row['who']} on {row['gpu']}, steps {row['step_range']}{did}, "
                        f"{row['wall']}, loss {num(row['loss_start'], '.4f')} -> {num(row['loss_end'], '.4f')}, "
                        f"${num(row['usd'], '.2f')}"))
    return 0


def cmd_claim(args):
    store = open_store(args.store)
    lease = claim(store, workdir_for(args), args.who, args.ttl, args.heartbeat)
    print(f"relay: claimed leg {lease.leg} (generation {lease.generation}); renew within {lease.ttl_s:.0f}s "
          f"(`relay.py claim` again renews), lease file {lease.path}")
    return 0


def cmd_pull(args):
    store = open_store(args.store)
    workdir = workdir_for(args)
    lease = None
    if os.path.exists(os.path.join(workdir, "LEASE.json")) and not args.out:
        lease = Lease.load(workdir, store)
        adopt_landed_push(store, lease)  # a push whose answer was lost: this pull is the lease's next leg
        adopt_own_renewal(store, lease)  # a claim whose answer was lost: the heartbeat below renews from it
        with renewing(store, lease, workdir):  # a big download may outlast the ttl
            run_dir = prepare_leg(store, lease, workdir)
        renew(store, lease)  # Fenced (exit 4) if the baton went to someone else meanwhile, not "train with ..."
        print(f"relay: pulled step {lease.base_step} into {run_dir}; train with "
              f"`python train.py {run_dir}/relay_config.py --out_dir={run_dir} --init_from=resume`, then `relay.py push`")
        return 0
    dest = os.path.abspath(args.out or os.path.join(workdir, "pulled"))
    try:
        path = pull(store, dest)
    except OSError as e:  # an --out on a read-only mount (or another user's): a traceback
        if e.errno not in checkpoint.DENIED_ERRNOS:
            raise
        root = getattr(store, "root", None)  # a file store's own files denied: another --out is no fix
        if root and os.path.abspath(str(e.filename or "")).startswith(root + os.sep):
            raise RelayError(f"{store.url}: {e.filename}: {e.strerror}; this user cannot read the store's files: fix "
                             f"their permissions") from None
        raise RelayError(f"{'--out' if args.out else '--workdir'} {e.filename or dest}: {e.strerror}; pass a "
                         f"directory this user can write") from None
    print(f"relay: pulled {path} (manifest verified)")
    if not args.out:  # relay's own folder (a --out DIR is the user's: what is in it stays)
        drop_earlier_pulls(dest, path)
    return 0


def drop_earlier_pulls(dest, path):
    """`pull STORE` (no lease, no --out) into WORKDIR/pulled kept every step it ever pulled, GBs each leg: the earlier
    steps it pulled there (PULLED.json: their manifests, still unchanged) are removed once a newer one is in; a step
    trained or copied there by hand is not in PULLED.json and stays."""
    record = os.path.join(dest, "PULLED.json")
    try:
        pulled = json.load(open(record))
        pulled = pulled if isinstance(pulled, dict) else {}
    except (OSError, ValueError):
        pulled = {}
    new_step = int(os.path.basename(path).split("_")[1])
    keep = {}
    for name, mid in pulled.items():
        d = os.path.join(dest, str(name))
        try:
            same = manifest_id(open(os.path.join(d, "MANIFEST.json"), "rb").read()) == mid
        except OSError:
            continue  # gone (removed by hand): forgotten
        m = checkpoint.STEP_RE.match(str(name))
        if same and m and int(m.group(1)) < new_step:
            shutil.rmtree(d, ignore_errors=True)
            print(f"relay: removed {d}, an earlier pull (the store's history keeps it)")
        else:
            keep[name] = mid
    keep[os.path.basename(path)] = manifest_id(open(os.path.join(path, "MANIFEST.json"), "rb").read())
    write_atomic(record, json.dumps(keep, indent=1))


def cmd_push(args):
    store = open_store(args.store)
    lease = Lease.load(workdir_for(args), store)
    run_dir = args.run_dir or lease.run_dir
    if not run_dir:
        raise RelayError("push: no leg dir recorded; run `relay.py pull` and train there, or pass --run-dir DIR (a leg dir)")
    cfg = os.path.join(run_dir, "relay_config.py")
    earlier = adopt_landed_push(store, lease)
    row = landed_row(store, lease) if earlier is None else None
    if row:  # (it uploaded the leg again, then said "push rejected", and release said "never pushed")
        raise Fenced(f"push: leg {lease.leg} was pushed already: LEDGER.md at the head holds its row (steps "
                     f"{row['step_range']}, generation {lease.generation}), though its answer never came back, and "
                     f"the run has moved on since; nothing pushed again. `relay.py release {store.url} --workdir "
                     f"{os.path.dirname(lease.path)}` drops this workdir's lease")
    adopt_own_renewal(store, lease)  # a claim whose answer was lost: the heartbeat below renews from it
    adopt_older_leg(lease, run_dir)
    # a leg `run` trained bills its trainer's time, not the hours until this retry; after a `run` killed mid-leg
    # (nothing in LEASE.json), the trainer time its LEG.json kept (a reboot's idle hours were billed)
    wall_s = getattr(lease, "leg_wall_s", None) or leg_wall(run_dir) or None
    usd_per_hour = args.gpu_hourly_usd if args.gpu_hourly_usd is not None else leg_usd_per_hour(run_dir)
    try:
        with renewing(store, lease, run_dir):  # the upload may outlast the ttl: renewed meanwhile, as `run` does
            plan = prepare_push(store, lease, run_dir, wall_s=wall_s, usd_per_hour=usd_per_hour
                                if usd_per_hour is not None else config_usd_per_hour(cfg, []))
    except NothingToPush:
        if earlier is None:
            raise
        print(f"relay: the earlier push had landed as {earlier[:10]}; nothing newer to push")
        return 0
    sha, row = commit_push(store, lease, plan, run_dir)
    print(pushed_line(sha, row))
    return 0


def landed_row(store, lease, step=None):
    """The head's LEDGER.md row of this lease's leg (its leg, generation and holder; its steps reaching step, where
    given): its push landed though this workdir never learnt it (the answer lost, then the run moved on past it), or
    None (also when the store cannot say)."""
    try:
        head = store.head()[0]
        rows = parse_ledger(ledger_text(store, head))
    except RelayError:
        return None
    return leg_ledger_row(rows, lease.leg, lease.generation, str(lease.who), step)


def lease_taken(store, lease):
    """Whether the head's RELAY.json names another lease (someone claimed after ours expired): False when the store
    cannot say (the compare-and-swap of what follows decides)."""
    try:
        adopt_own_renewal(store, lease)  # our own claim or renewal landed unseen is still ours
        head = store.head()[0]
        relay_json = parse_json(store.read(head, "RELAY.json"), "RELAY.json", store, head) or {}
    except Fenced:  # a claim of ours that never landed: no lease to hand back either
        return True
    except Transient:
        return False
    return relay_json.get("nonce") != lease.nonce


def cmd_release(args):
    store = open_store(args.store)
    lease = Lease.load(workdir_for(args), store)
    if adopt_landed_push(store, lease):
        print(f"relay: the earlier push had landed as {lease.sha[:10]}")
    pulled = getattr(lease, "run_dir", None)
    for run_dir in dict.fromkeys(d for d in (pulled, getattr(lease, "push_dir", None)) if d):  # pull's, push's
        if not args.discard:  # a newest step a killed re-save left as step_N.old-PID is unpushed work too
            recover_killed_resave(run_dir, "release")
        trained = newest_valid_step(run_dir)
        if trained is not None and trained > (lease.base_step or 0) and not args.discard:  # (it said "released", exit 0)
            if lease_taken(store, lease):  # a push could only be fenced: "push first" sent the user round in circles
                row = landed_row(store, lease, trained)  # its push landed unseen: not "never pushed"
                try:
                    release(store, lease)  # Fenced ("lease already lost"), LEASE.json dropped
                except Fenced as e:
                    if row:
                        raise Fenced(f"{e}; {run_dir}'s step {trained} is in the run: pushed as leg {row['leg']} "
                                     f"(LEDGER.md, steps {row['step_range']}), though its answer never came back; "
                                     f"delete the dir when you no longer need it") from None
                    raise Fenced(f"{e}; {run_dir} keeps step {trained}, never pushed (the run went on without it): "
                                 f"delete it when you no longer need it") from None
            how = "" if run_dir == pulled else f" --run-dir {run_dir}"
            raise RelayError(f"{run_dir} holds step {trained}, past the pulled step {lease.base_step}, never pushed: "
                             f"`relay.py push {store.url}{how}` first, or release with --discard to drop that work")
    release(store, lease)
    print("relay: released the baton")
    return 0


def cmd_decay(args):
    store = open_store(args.store)
    snap = Snapshot(store)
    if (snap.state.get("decay_requested") or snap.state.get("decay")
            or snap.state.get("decay_started_at_tokens") is not None):  # what train.py writes once it decays
        print("relay: decay already requested or under way; nothing changed")
        return 0
    if snap.held:
        raise Busy(f"{store.url}: {snap.relay['holder']} holds the baton; a commit now would fence them out. Run decay "
                   f"after their leg (the next leg then starts the decay)")
    state = dict(snap.state, decay_requested=True, decay_requested_at=time.time())
    # an expired holder stays expired: the lease's age counts from the newest commit, so keeping its name revived it
    relay_json = dict(snap.relay, holder=None, nonce=None) if snap.relay.get("holder") else snap.relay
    try:
        commit_cas(store, snap.sha, {"training_state.json": (json.dumps(state, indent=1) + "\n").encode()}, [],
                   "relay: request the WSD decay from the next leg on", relay_json)
    except Conflict:
        raise Busy(f"{store.url}: the run changed while requesting decay; try again")
    print("relay: decay requested; the next leg begins the WSD decay")
    return 0


def cmd_dashboard(args):
    import relay_dashboard  # the read-only web page: a concern of its own
    return relay_dashboard.serve(args)


# ----------------------------------------------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(prog="relay.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                                epilog="Run `python relay.py CMD --help` for each command's options.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, help_, store_help="hf://owner/name or file:///path", local=True):
        sp = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        sp.add_argument("store", help=store_help)
        if not local:  # status, decay, dashboard read or write the store alone (--who / --workdir went unread)
            return sp
        sp.add_argument("--workdir", default=None, help="local folder for the lease file and leg dirs "
                        "(default ./relay-work/<store name>)")
        sp.add_argument("--who", default=default_who(), help="your name in RELAY.json and LEDGER.md (default $RELAY_WHO or user@host)")
        return sp

    for name, help_ in [("claim", "take the baton (or renew it if you hold it)"), ("run", "claim, pull, train a leg, push, release"),
                        ("init", "create a run: a train.py config (+ --key=value; its init_from: scratch, grow with "
                         "grow_from= and grow_layers=, or finetune with finetune_from=, a local checkpoint) or "
                         "--from-checkpoint DIR")]:
        sp = add(name, help_)
        sp.add_argument("--ttl", type=float, default=None, help="lease time-to-live in seconds (>= 3x --heartbeat; "
                        f"default: the run's, set by init, else {DEFAULT_TTL:.0f})")
        sp.add_argument("--heartbeat", type=float, default=None, help="seconds between lease renewals (default: the "
                        f"run's, else {DEFAULT_HEARTBEAT:.0f})")
        if name in ("run", "init"):
            sp.add_argument("--python", default=sys.executable, help="python that runs the trainer")
            sp.add_argument("--train-script", default=os.path.join(HERE, "train.py"), help="trainer (default train.py next to relay.py)")
        if name == "run":
            sp.add_argument("--steps", type=int, default=None, help="train this many optimizer steps")
            sp.add_argument("--hours", type=float, default=None, help="train this many hours (wall clock)")
            sp.add_argument("--wait", action="store_true", help="if the baton is taken, wait for it")
            sp.add_argument("--supervise", action="store_true", help="train under the guardian (train.py --supervise): "
                            "a crashed trainer restarts from its newest checkpoint, within the leg's --steps / --hours")
            sp.add_argument("--poll", type=float, default=60.0, help="seconds between tries with --wait")
        if name == "init":
            sp.add_argument("config", nargs="?", default=None, help="train.py config file (config/*.py)")
            sp.add_argument("--from-checkpoint", default=None, help="start from this checkpoint as it is (run dir or "
                            "step dir; the config's init_from is not read, but a config that grows or fine-tunes "
                            "needs DIR from that grown / fine-tuned run)")
    add("status", "who holds the baton, lease age, step, tokens, stage, last legs", local=False).add_argument(
        "--json", action="store_true")
    sp = add("pull", "download and verify the latest checkpoint (into the leg dir when you hold the lease)")
    sp.add_argument("--out", default=None, help="download into this dir instead (no lease needed)")
    sp = add("push", "upload your leg (one commit) while you hold the lease")
    sp.add_argument("--run-dir", default=None, help="the leg dir to push (default: the one from the last pull)")
    sp.add_argument("--gpu-hourly-usd", type=float, default=None, help="$ per GPU hour for the ledger (default: the config's)")
    sp = add("release", "hand the baton back")
    sp.add_argument("--discard", action="store_true", help="release even though the leg dir holds steps never pushed")
    add("decay", "start the WSD decay from the next leg on", local=False)
    sp = add("dashboard", "serve a read-only web page of the run", "store URL or a local train.py out_dir", local=False)
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8765)
    sp.add_argument("--refresh", type=float, default=30.0, help="re-read the store at most this often (s)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args, extra = build_parser().parse_known_args(argv)
    bad = [a for a in extra if not (a.startswith("--") and "=" in a)]
    if bad or (extra and args.cmd not in ("run", "init")):
        print(f"relay.py {args.cmd}: error: unrecognized arguments {' '.join(bad or extra)} (train.py overrides are "
              f"--key=value, for run and init)", file=sys.stderr)
        return 2
    args.overrides = extra
    own = INVOCATION_KEYS - {"run": {"mirror_dir"}, "init": START_KEYS}.get(args.cmd, set())  # relay sets the rest
    clash = [a for a in extra if a[2:].split("=", 1)[0] in own]
    if clash:  # (--stop_after_steps=4 after relay's own pushed a 4-step leg for --steps 1)
        key = clash[0][2:].split("=", 1)[0]
        print(f"relay.py {args.cmd}: error: --{key} is a leg's setting, not the run's: `relay.py run` sets the leg's "
              f"run dir and resume, --steps / --hours its length (and takes --mirror_dir)" + (
                  f"; how a run starts (--{key}) is given to `relay.py init` only" if key in START_KEYS else ""),
              file=sys.stderr)
        return 2
    try:
        if extra:  # a typo or a wrong type is refused here, before a lease is claimed or a run created
            args.override_values = train_overrides(args.train_script, extra)
        # the commands that use a workdir's lease (pull --out only reads the store)
        if args.cmd in ("run", "claim", "push", "release") or (args.cmd == "pull" and not args.out):
            with workdir_locked(workdir_for(args)):
                return globals()["cmd_" + args.cmd](args)
        return globals()["cmd_" + args.cmd](args)
    except (RelayError, checkpoint.CheckpointError) as e:
        print(printable(f"relay.py {args.cmd}: error: {e}"), file=sys.stderr)  # (errors quote the store's text)
        return 4 if isinstance(e, Fenced) else 3
    except KeyboardInterrupt:  # (run ends its leg cleanly on Ctrl-C; here a claim, push or release was cut short)
        print(f"relay.py {args.cmd}: interrupted; local files are kept. `relay.py status {args.store}` shows where the "
              f"run stands; a push or release cut short is found by its write id when you run it again",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:  # `relay.py status STORE | head`: the reader left; no traceback (and none at exit's flush)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)
