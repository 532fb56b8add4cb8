"""
relay_lease.py: the baton of a relay run (relay.py): who holds it, and every write of the holder as a compare-and-swap
commit on the store (relay_store.py), so a paused or partitioned holder can never overwrite another's work.

Safety (Kleppmann 2016, "How to do distributed locking"; see REFERENCES.md, Relay on the Hub): a lease alone
cannot exclude a paused holder, so every write of a holder is a commit whose parent is the holder's own previous
commit (`parent_commit=` on the Hub, a head check under flock for file://). Any other commit in between makes it
fail (HTTP 412) and the holder stops training at once, keeping its local checkpoint, unless that commit changed none
of the run's files (RUN_FILES; a model card edit): the holder then chains from it (adopt_foreign_head). Timing decides only
liveness: a lease has expired when the store's clock (HTTP Date / the local clock for file://) is more than
ttl_s past the newest relay commit's time (every holder write is a commit, so that is the last renewal; a commit
of someone else's that changed no run file does not count).
Every commit carries a fresh write_id in RELAY.json; after a 5xx or a timeout the client re-reads the head and
looks for its own write_id before retrying, so a commit that landed is never made twice.

Files it owns in the store: RELAY.json (holder, nonce, generation, leg, claimed/heartbeat times, ttl, write_id) and,
locally, WORKDIR/LEASE.json (which commit the holder chains from, and the write_ids of writes whose answers may be
lost). relay.py builds the legs (pull, train, push, heartbeat) and the commands on top.
"""

import contextlib
import datetime as dt
import hashlib
import json
import os
import sys
import threading
import time
import uuid

from relay_store import Conflict, RelayError, Transient, write_atomic

RELAY_FORMAT = "picaflor-relay"
RELAY_VERSION = 1  # RELAY.json's "version": a run made by a later relay.py with other rules is refused, not joined
STATE_FORMAT = "picaflor-relay-state"
CKPT_PREFIX = "checkpoint"

DEFAULT_TTL = 1200.0  # 20 min: TTL >= 3x the heartbeat interval (REFERENCES.md), heartbeats every few minutes (429s)
DEFAULT_HEARTBEAT = 300.0
MAX_TTL_S = 86400.0  # a day: a ttl of 1e9 s let one crashed holder stall the run for good
HUB_MIN_HEARTBEAT_S = 60.0  # below it an hf:// lease is warned about: a commit a beat meets 429s (REFERENCES.md)
MIN_HEARTBEAT_S = 0.1  # each beat is a commit: 0 renewed in a loop (1,449 commits in a 2 s leg); tests beat at 0.5 s
SAVE_LOCK = threading.Lock()  # the heartbeat thread saves the lease too: an older snapshot written last lost a write


class Busy(RelayError):
    """Someone else holds a live lease."""


class Fenced(RelayError):
    """Our lease is gone: another commit landed after our last one."""


def now_iso(t=None):
    return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def backoff(delay, stop):
    """Sleep between a commit's tries; stop (a threading.Event: the heartbeat's) set, a Transient instead: the leg's
    push waited out a renewal's whole retry loop (minutes). Its write_id stays recorded: the push finds it if landed."""
    while True:
        if stop is not None and stop.is_set():
            raise Transient("stopped between the tries of a commit (the heartbeat was stopped); whether it landed is "
                            "found by its write id")
        if delay <= 0:
            return
        step = delay if stop is None else min(delay, 0.05)  # (time.sleep, in slices: stop looked at every 50 ms)
        time.sleep(step)
        delay -= step


def commit_cas(store, parent, adds, deletes, message, relay, tries=5, write_id=None, lease=None, stop=None):
    """One fenced commit. `relay` (the new RELAY.json) gets a fresh write_id (or the one given); after a transient
    failure the head is re-read and, if it holds our write_id, the commit landed (no retry, no duplicate). A
    holder's commit (lease given) refused by commits that touched none of the run's files, or by its own renewal whose
    answer was lost, chains from them instead (adopt_foreign_head, adopt_landed_write). stop: an Event that ends the
    retries (backoff). Returns the new head sha."""
    relay = dict(relay, write_id=write_id or uuid.uuid4().hex)
    adds = dict(adds, **{"RELAY.json": (json.dumps(relay, indent=1) + "\n").encode()})
    delay = 0.2
    for attempt in range(tries):
        try:
            return store.commit(parent, adds, deletes, message), relay
        except Conflict as e:
            head, _, _ = store.head()
            if head == parent:  # a 412 from a request before the commit (an upload's): nothing moved, so try again
                err = e
                backoff(delay, stop)
                delay = min(delay * 2, 10)
                continue
            if not (attempt == 0 and write_id is None):
                # refused because the head moved: maybe by our own earlier attempt (this call's, or an earlier
                # call's given the same write_id again), landed after we looked
                landed = parse_json(store.read(head, "RELAY.json"), "RELAY.json", store, head)
                if landed and landed.get("write_id") == relay["write_id"]:
                    return head, landed  # (its heartbeat_at says when: the heartbeat's deadline counts from it)
                # our own renewal, landed unseen (adopt_own_renewal could not look): not someone else's
                if lease is not None and attempt < tries - 1 and adopt_landed_write(lease, head, landed, RENEWAL):
                    parent = lease.sha
                    continue
            if lease is not None and attempt < tries - 1 and adopt_foreign_head(store, lease):
                parent = lease.sha
                continue
            raise
        except Transient as e:
            err = e
        for _ in range(tries):  # find out whether it landed
            backoff(delay, stop)
            delay = min(delay * 2, 10)
            try:
                head, _, _ = store.head()
                landed = parse_json(store.read(head, "RELAY.json"), "RELAY.json", store, head)
                break
            except Transient:
                continue
        else:
            raise Transient(f"{err}; the store stayed unreachable, so it is unknown whether the commit landed")
        if landed and landed.get("write_id") == relay["write_id"]:
            return head, landed  # (what landed: a try of an earlier call with this write_id, built and sent earlier)
        if head != parent:
            if lease is not None and (adopt_landed_write(lease, head, landed, RENEWAL)
                                      or adopt_foreign_head(store, lease)):
                parent = lease.sha
                continue
            raise Conflict(f"{store.url}: after a failed commit the head moved to {head[:10]}, not ours")
    raise Transient(f"{err} (gave up after {tries} tries)")


RUN_FILES = ("RELAY.json", "training_state.json", "config.py", "LEDGER.md", CKPT_PREFIX + "/MANIFEST.json")
RUN_FOLDERS = (CKPT_PREFIX + "/", "logs/")


def adopt_foreign_head(store, lease):
    """Commits after our last one that changed none of the run's files (a model card edited in the Hub's web
    editor): the lease chains from the head instead (each such commit fenced the holder out for good, its leg lost).
    Any change to the run's files (a claim, a push, a hand edit) is still a fence. Returns whether it chained."""
    head, _, _ = store.head()
    if head == lease.sha:
        return False
    if any(store.read(head, f) != store.read(lease.sha, f) for f in RUN_FILES):
        return False
    if any(store.file_ids(head, d) != store.file_ids(lease.sha, d) for d in RUN_FOLDERS):  # contents, not just names
        return False
    print(f"relay: {store.url}: commits after ours ({lease.sha[:10]} -> {head[:10]}) changed none of the run's "
          f"files; the lease goes on from them", file=sys.stderr)
    lease.sha = head
    lease.save()
    return True


def parse_json(data, name, store, sha):
    if data is None:
        return None
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return obj
    except (ValueError, RecursionError) as e:  # (RecursionError: [[[[... nested past the decoder's depth)
        raise RelayError(f"{store.url}: {name} at {sha[:10]} is malformed ({e}); restore it from the previous commit "
                         f"(git revert on the repo); relay changed nothing")


# ----------------------------------------------------------------------------------------------------------------
# The run: RELAY.json (lease) + training_state.json, read at one head


class Snapshot:
    def __init__(self, store):
        self.store = store
        self.sha, self.commit_time, self.server_now = store.head()
        self.relay = parse_json(store.read(self.sha, "RELAY.json"), "RELAY.json", store, self.sha)
        if self.relay is None:
            raise RelayError(f"{store.url}: not a relay run (no RELAY.json); create one with `relay.py init {store.url} CONFIG`")
        if self.relay.get("format") != RELAY_FORMAT or not isinstance(self.relay.get("generation"), int):
            raise RelayError(f"{store.url}: RELAY.json at {self.sha[:10]} is not a {RELAY_FORMAT} lease file (format/generation "
                             f"missing); restore it from the previous commit; relay changed nothing")
        version = self.relay.get("version", 1)
        if not isinstance(version, int) or version > RELAY_VERSION:  # a later relay.py's run: its rules are not ours
            raise RelayError(f"{store.url}: RELAY.json at {self.sha[:10]} is format version {version!r}, newer than "
                             f"this relay.py's {RELAY_VERSION}; update picaflor (git pull) before joining this run")
        self.state = parse_json(store.read(self.sha, "training_state.json"), "training_state.json", store, self.sha)
        if self.state is None or self.state.get("format") != STATE_FORMAT:
            raise RelayError(f"{store.url}: training_state.json at {self.sha[:10]} missing or not {STATE_FORMAT}; "
                             f"restore it from the previous commit; relay changed nothing")
        # the numbers relay computes with (a hand edit once failed after a whole leg had trained, the baton held)
        for name, d, key, may_be_null in (("RELAY.json", self.relay, "ttl_s", False),
                                          ("RELAY.json", self.relay, "heartbeat_s", False),
                                          ("RELAY.json", self.relay, "default_ttl_s", False),
                                          ("RELAY.json", self.relay, "default_heartbeat_s", False),
                                          ("RELAY.json", self.relay, "claimed_at", True),
                                          ("training_state.json", self.state, "legs", False),
                                          ("training_state.json", self.state, "step", True),
                                          ("training_state.json", self.state, "tokens", True),
                                          ("training_state.json", self.state, "usd_total", True)):
            v = d.get(key)
            if key in d and not (v is None and may_be_null) and (
                    isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf")
                    or (key in ("legs", "step", "tokens") and v != int(v))):  # (Infinity: a lease never expired,
                # and int(inf) an OverflowError traceback in every command)
                raise RelayError(f"{store.url}: {name} at {self.sha[:10]}: {key} {v!r} is not a finite number >= 0; "
                                 f"restore "
                                 f"it from the previous commit; relay changed nothing")

    @property
    def lease_age(self):  # seconds since the last holder write, on the store's clock
        # (never negative: the Hub's Date has 1 s resolution, so its "now" can precede the commit: "-0s ago")
        return max(0.0, self.server_now - self.commit_time)

    @property
    def held(self):
        return bool(self.relay.get("holder")) and self.lease_age <= float(self.relay.get("ttl_s", DEFAULT_TTL))

    def ledger(self):
        return ledger_text(self.store, self.sha)


def ledger_text(store, sha, default=b""):
    """LEDGER.md at sha ("" if none); a hand edit that is not UTF-8 is a one-line error, not a traceback."""
    try:
        return (store.read(sha, "LEDGER.md") or default).decode()
    except UnicodeDecodeError as e:
        raise RelayError(f"{store.url}: LEDGER.md at {sha[:10]} is not UTF-8 ({e.reason} at byte {e.start}); restore it "
                         f"from the previous commit; relay changed nothing") from None


@contextlib.contextmanager
def workdir_locked(workdir):
    """One relay.py at a time in a workdir: a second `run` there renewed the first one's lease as its own and trained
    in its leg dir (flock: released when this process ends, however it ends)."""
    import fcntl
    try:
        os.makedirs(workdir, exist_ok=True)
        f = open(os.path.join(workdir, ".relay.lock"), "a+")
    except OSError as e:
        raise RelayError(f"--workdir {workdir}: {e.strerror}; pass a directory this user can write") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RelayError(f"another relay.py is working in {workdir}; wait for it to end, or pass another "
                             f"--workdir") from None
        yield


class Lease:
    """The holder's local record (WORKDIR/LEASE.json): which commit it chains from and what it holds."""

    def __init__(self, path, **kw):
        self.path = path
        self.__dict__.update(kw)

    @classmethod
    def load(cls, workdir, store):
        path = os.path.join(workdir, "LEASE.json")
        try:
            d = json.load(open(path))
        except FileNotFoundError:
            raise RelayError(f"{path}: no lease held from this workdir; run `relay.py claim {store.url}` first")
        except (ValueError, OSError) as e:  # OSError: e.g. --workdir is a file
            raise RelayError(f"{path}: unreadable ({e}); check --workdir, or delete it and claim again")
        need = ("store", "nonce", "sha", "relay", "leg", "generation", "ttl_s", "heartbeat_s")
        if not isinstance(d, dict) or any(k not in d for k in need) or not isinstance(d["relay"], dict):
            raise RelayError(f"{path}: malformed (not a lease relay.py wrote); delete it and claim again")
        if d.get("store") != store.url:
            raise RelayError(f"{path}: lease is for {d.get('store')}, not {store.url}; pass another --workdir")
        return cls(path, **d)

    def save(self):
        with SAVE_LOCK:  # snapshot and write as one: the newest snapshot is the one left on disk
            d = {k: v for k, v in dict(self.__dict__).items() if k != "path"}  # (a copy: the heartbeat thread adds keys)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            write_atomic(self.path, json.dumps(d, indent=1))

    def drop(self):
        if os.path.exists(self.path):
            os.remove(self.path)


def check_lease_times(ttl, heartbeat):
    if not (heartbeat >= MIN_HEARTBEAT_S and 3 * heartbeat <= ttl <= MAX_TTL_S):
        raise RelayError(f"--ttl {ttl} / --heartbeat {heartbeat}: the heartbeat must be at least {MIN_HEARTBEAT_S}s "
                         f"(each beat is a commit) and the ttl at least 3x it (a lease needs missed beats to expire) "
                         f"and at most {MAX_TTL_S:.0f}s (a crashed holder blocks the run for a whole ttl)")


def warn_hub_heartbeat(store, heartbeat):
    """A heartbeat of seconds on the Hub: every beat is a commit, and the Hub's rate limit (429) answers them; said."""
    if getattr(store, "url", "").startswith("hf://") and heartbeat < HUB_MIN_HEARTBEAT_S:
        print(f"relay: WARNING: --heartbeat {heartbeat:g}s on {store.url}: each beat is a commit, and the Hub rate-"
              f"limits commits (HTTP 429); beat every few minutes (default {DEFAULT_HEARTBEAT:.0f}s)", file=sys.stderr)


def claim(store, workdir, who, ttl=None, heartbeat=None):
    """ttl / heartbeat None: the run's (relay.py init --ttl / --heartbeat), else DEFAULT_TTL / DEFAULT_HEARTBEAT."""
    if ttl is not None and heartbeat is not None:  # (one of them alone: checked against the run's other below)
        check_lease_times(ttl, heartbeat)
    try:  # before anything is committed: a claim whose LEASE.json cannot be written is a baton nobody can release
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise RelayError(f"--workdir {workdir}: cannot use it ({e.strerror}); pass a folder") from None
    snap = Snapshot(store)
    snap.ledger()  # a LEDGER.md push cannot append to: refused now, not after a whole leg has trained
    r = snap.relay
    ttl = float(r.get("default_ttl_s", DEFAULT_TTL)) if ttl is None else ttl
    heartbeat = float(r.get("default_heartbeat_s", DEFAULT_HEARTBEAT)) if heartbeat is None else heartbeat
    check_lease_times(ttl, heartbeat)
    warn_hub_heartbeat(store, heartbeat)
    lease_path = os.path.join(workdir, "LEASE.json")
    # another store's live lease (a shared --workdir) or a malformed file: refused, not overwritten (that lease
    # could then never be pushed or released)
    mine = Lease.load(workdir, store) if os.path.exists(lease_path) else None
    if mine and r.get("nonce") == mine.nonce and adopt_own_head(store, mine, snap):
        # the head is our own commit: `claim` again is a heartbeat (same generation, same leg), also past the ttl
        # when nobody took the baton meanwhile (the compare-and-swap decides), so a crashed leg's work resumes
        try:
            renew(store, mine)
            return mine
        except Fenced:
            snap = Snapshot(store)  # someone claimed it in between
            r = snap.relay
    if snap.held:
        raise busy(store, snap)
    legs = int(snap.state.get("legs", 0))
    new = dict(r, holder=who, nonce=uuid.uuid4().hex, generation=r["generation"] + 1, leg=legs + 1,
               claimed_at=time.time(), heartbeat_at=time.time(), ttl_s=float(ttl), heartbeat_s=float(heartbeat),
               taken_from=r.get("holder") if r.get("holder") else None)
    msg = f"relay: claim leg {legs + 1} (generation {new['generation']}) by {who}"
    # recorded before the commit: a claim that lands while its answer is lost is found again by its write_id (the
    # next `claim` adopts it) instead of locking its own claimer out for a whole ttl
    lease = Lease(lease_path, store=store.url, who=who, nonce=new["nonce"], generation=new["generation"], leg=new["leg"],
                  sha=snap.sha, relay=r, base_step=snap.state.get("step"), ttl_s=float(ttl), heartbeat_s=float(heartbeat),
                  run_dir=None, pulled_at=None, pending_claim=uuid.uuid4().hex)
    lease.save()
    try:
        sha, new = commit_cas(store, snap.sha, {}, [], msg, new, write_id=lease.pending_claim)
    except Conflict:
        lease.drop()
        try:  # who won: named as any live holder is (it said only "someone else committed first")
            won = Snapshot(store)
        except RelayError:
            won = None
        if won is not None and won.held:
            raise busy(store, won, f"claim of generation {new['generation']} lost the race: ")
        raise Busy(f"{store.url}: someone else committed first (claim of generation {new['generation']} lost the race); "
                   f"try again later")
    lease.sha, lease.relay, lease.pending_claim = sha, new, None
    lease.save()
    return lease


def busy(store, snap, why=""):
    """Busy naming the live holder of snap and when its lease expires on the store's clock."""
    r = snap.relay
    until = snap.commit_time + float(r.get("ttl_s", DEFAULT_TTL))
    return Busy(f"{store.url}: {why}{r['holder']} holds the baton (leg {r.get('leg')}, generation {r['generation']}, "
                f"last renewed {snap.lease_age:.0f}s ago); it expires at {now_iso(until)} UTC unless renewed")


def taken_by(store, lease):
    """The lease at the head that fenced ours, in words ("bob (leg 3, generation 7, claimed ... UTC)"), or "" when
    the head cannot be read or names no other holder (a fenced holder was told only that someone took the baton)."""
    try:
        r = Snapshot(store).relay
    except RelayError:
        return ""
    if not r.get("holder") or r.get("nonce") == lease.nonce:
        return ""
    when = f", claimed {now_iso(r['claimed_at'])} UTC" if r.get("claimed_at") is not None else ""
    return f"{r['holder']} (leg {r.get('leg')}, generation {r['generation']}{when})"


def renew(store, lease, stop=None):
    """Heartbeat: a commit of RELAY.json chained from our last commit. Raises Fenced if anything else landed. Its
    write_id is recorded first and reused until one lands: a renewal whose answer was lost (the store unreachable
    after it landed) is then found at the head by the next try, not taken for someone else's commit. stop: the
    heartbeat's Event, which ends the commit's retries (a Transient)."""
    wid = getattr(lease, "pending_renewal", None)
    if not wid:
        lease.pending_renewal = wid = uuid.uuid4().hex
        lease.save()
    new = dict(lease.relay, heartbeat_at=time.time())
    try:
        sha, new = commit_cas(store, lease.sha, {}, [], f"relay: heartbeat leg {lease.leg} by {lease.who}", new,
                              write_id=wid, lease=lease, stop=stop)
    except Conflict as e:
        lease.pending_renewal = None
        lease.save()
        raise Fenced(f"lease lost: {e}; {taken_by(store, lease) or 'another contributor'} took the baton (our lease "
                     f"had expired or was released)")
    lease.sha, lease.relay, lease.pending_renewal = sha, new, None
    lease.save()


def adopt_own_head(store, lease, snap):
    """Our own commits whose answers were lost: a push that landed moves the lease on (adopt_landed_push), a renewal
    that landed is the head we chain from. Returns whether the head is now our lease's."""
    if snap.sha != lease.sha and not adopt_landed_push(store, lease):
        adopt_landed_write(lease, snap.sha, snap.relay)
    if snap.sha != lease.sha:
        adopt_foreign_head(store, lease)
    return snap.sha == lease.sha


RENEWAL = ("pending_renewal",)  # a renewal changed only heartbeat_at: a write built before it may chain from it


def adopt_landed_write(lease, head, landed, keys=("pending_renewal", "pending_claim")):
    """A renewal or claim of ours whose answer was lost, found at the head by its write_id: the lease chains from it
    (returns whether it did)."""
    for key in keys:
        wid = getattr(lease, key, None)
        if wid and landed and landed.get("write_id") == wid:
            lease.sha, lease.relay = head, landed
            setattr(lease, key, None)
            lease.save()
            return True
    return False


def adopt_own_renewal(store, lease):
    """A heartbeat that landed while its answer was lost, then stopped before its retry (the leg ended), or a claim
    whose answer was lost: the head is ours, and a renewal, push or release chained from the commit before it was
    fenced by our own write."""
    if not (getattr(lease, "pending_renewal", None) or getattr(lease, "pending_claim", None)):
        return
    try:
        head, _, _ = store.head()
        landed = parse_json(store.read(head, "RELAY.json"), "RELAY.json", store, head)
    except Transient:
        if getattr(lease, "pending_claim", None):  # a write now is refused by our own claim if it landed: taken for
            raise  # someone else's (release dropped LEASE.json, the claim a ghost holder for a ttl); unknown, say so
        return  # a renewal still unknown: the commit below chains from it if it landed (commit_cas)
    if not adopt_landed_write(lease, head, landed) and getattr(lease, "pending_claim", None):
        # the claim did not land (or was overtaken): its lease chains from the head before it, which a "heartbeat"
        # of that old RELAY.json renewed with nobody holding the baton, and pull said "train"
        raise Fenced(f"{store.url}: your claim of leg {lease.leg} did not land (the store failed while it was sent; "
                     f"the head {head[:10]} is not it); run `relay.py claim` again")


def release(store, lease):
    """Its write_id is recorded first, as a renewal's: a retry after a release whose answer was lost finds it landed
    (it said "lease already lost", exit 4, for a release that had worked)."""
    try:
        adopt_own_renewal(store, lease)
    except Fenced:  # a claim that never landed: nothing to hand back
        lease.drop()
        raise
    wid = getattr(lease, "pending_release", None)
    if not wid:
        lease.pending_release = wid = uuid.uuid4().hex
        lease.save()
    new = dict(lease.relay, holder=None, nonce=None, released_at=time.time())
    try:
        sha, _ = commit_cas(store, lease.sha, {}, [], f"relay: release by {lease.who} after leg {lease.leg}", new,
                            write_id=wid, lease=lease)
    except Conflict as e:
        lease.drop()
        by = taken_by(store, lease)
        raise Fenced(f"release: lease already lost ({e}{'; ' + by + ' took the baton' if by else ''}); nothing to "
                     f"hand back")
    lease.drop()
    return sha


def chain_lease_to(lease, sha, new_relay, step, run_dir):
    """Our push is the head: the lease chains from it."""
    lease.sha, lease.relay, lease.leg, lease.base_step = sha, new_relay, lease.leg + 1, step
    lease.pulled_at = time.time()  # a second push in this lease bills from here, not from the pull again
    lease.pending_push, lease.leg_wall_s = None, None
    lease.save()
    if run_dir and os.path.isdir(run_dir):  # the step too: steps trained here after this push are not in the store
        write_atomic(os.path.join(run_dir, "PUSHED"), f"{sha} {step}\n")
        try:  # a leg dir's steps now stand on this push (relay.prepare_push refuses a dir the run moved past)
            rec = json.load(open(os.path.join(run_dir, "LEG.json")))
            ours = open(os.path.join(run_dir, f"step_{step:07d}", "MANIFEST.json"), "rb").read()
            # its trainer time is billed now: a later push from this dir (steps trained after this one) bills its own
            write_atomic(os.path.join(run_dir, "LEG.json"), json.dumps(dict(rec, base_manifest=manifest_id(ours),
                                                                             wall_s=0.0)))
        except (OSError, ValueError, TypeError):
            pass  # not a leg dir (a train.py out_dir given to push), or its pushed step is gone: nothing recorded


def manifest_id(data):
    """Which checkpoint a MANIFEST.json's bytes name (their sha256: its files' hashes and its write time), or None."""
    return hashlib.sha256(data).hexdigest() if data is not None else None


def adopt_landed_push(store, lease):
    """A push left unknown (the store failed mid-commit): if the head carries its write_id it landed, and the lease
    moves on to it (returns the head sha); otherwise it did not land, and the lease is as it was (None)."""
    pending = getattr(lease, "pending_push", None)
    if not pending:
        return None
    head, _, _ = store.head()
    relay = parse_json(store.read(head, "RELAY.json"), "RELAY.json", store, head) if head != lease.sha else None
    if relay and relay.get("write_id") == pending["write_id"]:
        # the dir that push was made from (push --run-dir), not the leg dir pull recorded
        chain_lease_to(lease, head, relay, pending["step"], pending.get("run_dir", getattr(lease, "run_dir", None)))
        return head
    lease.pending_push = None
    lease.save()
    return None
