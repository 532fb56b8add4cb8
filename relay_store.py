"""
relay_store.py: where a relay run lives, behind one small interface (relay.py holds the lease protocol on top).

    store = open_store("hf://owner/name")      # a Hugging Face Hub model repo (huggingface_hub; HF_ENDPOINT, HF_TOKEN)
    store = open_store("file:///abs/path")     # a local directory with the same semantics (offline use, tests)

    store.head() -> (sha, commit_time, server_now)     store.read(sha, path) -> bytes | None
    store.list(sha, prefix) -> [path]                  store.download(sha, paths, dest)
    store.file_ids(sha, prefix) -> {path: content id}  store.sizes(sha, prefix) -> {path: bytes}
    store.commit(parent, adds {path: bytes | local file path}, deletes, message) -> sha

read holds at most read_cap(path) bytes in memory (TooBig past it: RELAY.json, the ledger, a leg's log, ... are
small when relay.py writes them; a store's copy of GBs was read whole by every contributor's command); download, the
checkpoint's payload, goes to disk uncapped (verified by its manifest's hashes).

head's commit_time is the newest relay commit's ("relay: ..."), the lease's clock: a model card edited on the Hub
after a holder died kept its lease alive for another ttl.

commit is a compare-and-swap: it fails with Conflict unless `parent` is still the head (`parent_commit=` on the
Hub, HTTP 412; a head check under flock for file://). Errors: StoreError for good, Transient (5xx, 429, timeout)
when the request may or may not have taken effect (relay.commit_cas finds out which).
"""

import contextlib
import datetime as dt
import email.utils
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid

import checkpoint


class RelayError(Exception):
    """Fatal, user-facing, one line."""


class StoreError(RelayError):
    """The store refused or failed a request for good."""


class Transient(StoreError):
    """A 5xx, a 429 or a timeout: the request may or may not have taken effect."""


class NotFound(StoreError):
    """No such repo, revision or main branch: what exists() may answer False for (any other error is not an answer)."""


class Conflict(StoreError):
    """The head is not the commit we chained from: someone else wrote (HTTP 412)."""


class TooBig(StoreError):
    """A file relay would read into memory is larger than it ever is when relay.py wrote it (read_capped), or a
    listing holds more files than a relay run ever does (LIST_CAP)."""


MiB = 2 ** 20
# bytes of one store file relay reads into memory, by kind (read_cap): a contributor who pushed a multi-GB RELAY.json,
# ledger or leg log made every volunteer's run / status / dashboard read it whole. Generous: relay's own are KBs to
# MBs. Checkpoint payloads are downloaded to disk (store.download, hash-verified), never read through these.
READ_CAPS = {"LEDGER.md": 32 * MiB, "logs/": 64 * MiB}  # ~150 B a leg's row; a leg's metrics lines
SMALL_FILE_CAP = 4 * MiB  # RELAY.json, training_state.json, config.py, checkpoint/MANIFEST.json and state.json, ...
COMMIT_RECORD_CAP = 64 * MiB  # a file:// commit record: the whole tree, ~100 B a file
# files one listing (list, file_ids) returns: a relay run holds a dozen files and one log a leg; a repo with millions
# (pushed by hand, or by a hostile contributor) was listed whole, into memory, by every contributor's command
LIST_CAP = 20_000
STORE_FIX = "restore it from the previous commit (git revert on the repo); relay changed nothing"
LIST_FIX = "revert the commit that added them (git revert on the repo); relay changed nothing"


def read_cap(path):
    """The most bytes relay reads into memory of the store file at path (READ_CAPS, by name or folder)."""
    return next((cap for key, cap in READ_CAPS.items() if path == key or (key.endswith("/") and path.startswith(key))),
                SMALL_FILE_CAP)


def capped_listing(entries, name):
    """The entries (an iterable: the Hub's pages, fetched as iterated) as a list, or TooBig past LIST_CAP of them."""
    out = []
    for e in entries:
        if len(out) == LIST_CAP:
            raise TooBig(f"{name} holds more than the {LIST_CAP} files relay lists (a relay run holds a dozen and one "
                         f"log a leg: pushed by hand?); {LIST_FIX}")
        out.append(e)
    return out


def fmt_bytes(n):
    return f"{n} bytes" if n < MiB else checkpoint.fmt_size(n)  # (a 4 KiB cap is no "0.0 MiB")


def read_capped(src, cap, name, fix, size=None):
    """All of src (a binary file, or an iterable of byte chunks: an HTTP body) if it is at most cap bytes; else
    TooBig naming it (name), its size (given, or the file's fstat), the cap and the fix. Refused on that size before
    reading; read in chunks, never more than cap + 1 bytes whatever the size said (a file still growing, a
    Content-Length that lied)."""
    if size is None and hasattr(src, "fileno"):
        with contextlib.suppress(OSError):  # (io.BytesIO: none)
            size = os.fstat(src.fileno()).st_size
    if size is None or size <= cap:
        step = MiB if size is None else min(MiB, size + 4096)  # (a 41-byte HEAD: no MiB buffer for it)
        parts, n = [], 0
        for chunk in (iter(lambda: src.read(min(step, cap + 1 - n)), b"") if hasattr(src, "read") else src):
            parts.append(chunk)
            n += len(chunk)
            if n > cap:
                break
        else:
            return b"".join(parts)
    is_ = f"is {fmt_bytes(size)}," if size is not None and size > cap else "is"  # (unknown, or grown past it)
    raise TooBig(f"{name} {is_} more than the {fmt_bytes(cap)} relay reads of it (a file relay.py wrote is far "
                 f"smaller: damaged, or pushed by hand); {fix}")


# RELAY_FSYNC=0 skips fsync in relay's own writes (file:// store, lease file): for tests only, where durability
# across power loss is not under test and ~30 fsyncs per leg dominate the run time
FSYNC = os.environ.get("RELAY_FSYNC", "1") != "0"


def write_atomic(path, text):
    if FSYNC:
        return checkpoint.write_atomic_text(path, text)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Staged:
    """A file body a FileStore already holds (FileStore.stage)."""

    def __init__(self, oid):
        self.oid = oid


class FileStore:
    """A local directory with atomic compare-and-swap commits, safe across processes:
        STORE        marker           objects/ab/<sha256>  content-addressed file bodies
        commits/<id>.json  {id, parent, time, message, tree: {path: sha256}}   HEAD  the head commit id
    A commit writes its objects first (outside the lock), then under flock(LOCK) checks HEAD == parent, writes the
    commit record and replaces HEAD atomically. The local clock is this store's server clock."""

    def __init__(self, root):
        self.root = root
        self.url = "file://" + root

    def _p(self, *a):
        return os.path.join(self.root, *a)

    def exists(self):
        return os.path.isfile(self._p("HEAD"))

    def create(self):
        if self.exists():
            return
        if ((os.path.isdir(self.root) and os.listdir(self.root) and not self.half_made())
                or (os.path.exists(self.root) and not os.path.isdir(self.root))):
            raise StoreError(f"{self.root}: exists and is not an empty directory nor a relay store; pick a new path")
        for d in ("objects", "commits"):
            os.makedirs(self._p(d), exist_ok=True)
        write_atomic(self._p("STORE"), json.dumps({"format": "picaflor-file-store", "version": 1}))
        import fcntl
        with open(self._p("LOCK"), "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            if not self.exists():
                self._write_commit(None, {}, "create store")

    def half_made(self):
        """A create cut short before its first commit (a Ctrl-C or kill: the marker, no HEAD): finished by the next
        create (init refused the folder for good: "not a relay store; pick a new path")."""
        try:
            with open(self._p("STORE")) as f:
                return json.load(f).get("format") == "picaflor-file-store" and not self.exists()
        except (OSError, ValueError, AttributeError):
            return False

    def _object(self, sha, path, oid):
        """An object's file: oid is a sha256 hex digest (a shared store's commit record naming /home/x/.ssh/id_rsa or
        ../x made every reader read that file of their own, and a push commit it to the store)."""
        if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid)):
            raise StoreError(f"{self._p('commits', sha + '.json')}: {path} names object {str(oid)[:80]!r}, not a "
                             f"sha256; the store is damaged (or edited by hand): restore that commit record")
        return self._p("objects", oid[:2], oid)

    def _load_commit(self, cid):
        if not (isinstance(cid, str) and re.fullmatch(r"[0-9a-f]{40}", cid)):  # HEAD naming ../x: any .json read
            raise StoreError(f"{self.url}: names commit {str(cid)[:80]!r}, not a commit id; the store is damaged "
                             f"(or edited by hand): restore HEAD or that commit record")
        path = self._p("commits", cid + ".json")
        try:
            with open(path, "rb") as f:
                return json.loads(read_capped(f, COMMIT_RECORD_CAP, path, "restore that commit record"))
        except (OSError, ValueError) as e:
            raise StoreError(f"{self._p('commits', cid + '.json')}: unreadable commit record ({e}); the store is "
                             f"damaged: restore that commit record")

    def _head_id(self):
        try:
            with open(self._p("HEAD"), "rb") as f:  # a commit id: a multi-GB HEAD was read whole by every command
                return read_capped(f, 4096, self._p("HEAD"), "restore HEAD").decode(errors="replace").strip()
        except (FileNotFoundError, NotADirectoryError):
            raise StoreError(f"{self.url}: not a relay store (no HEAD); create the run with `relay.py init {self.url} CONFIG`")

    def head(self):
        cid = self._head_id()
        c = self._load_commit(cid)
        t, back = c["time"], c
        for _ in range(LEASE_CLOCK_LOOKBACK):  # the lease's clock: the newest relay commit, not a card edit after it
            if back["message"].startswith(RELAY_COMMIT_PREFIX) or not back.get("parent"):
                t = back["time"]
                break
            back = self._load_commit(back["parent"])
        return cid, t, time.time()

    def read(self, sha, path):
        obj = self._load_commit(sha)["tree"].get(path)  # commits are immutable: no cache needed, a local read is cheap
        if obj is None:
            return None
        with open(self._object(sha, path, obj), "rb") as f:
            return read_capped(f, read_cap(path), f"{self.url}: {path} at {sha[:10]}", STORE_FIX)

    def list(self, sha, prefix=""):
        return sorted(self.file_ids(sha, prefix))

    def file_ids(self, sha, prefix=""):
        """{path: sha256 of its bytes} under prefix at a commit."""
        tree = self._load_commit(sha)["tree"]
        return dict(capped_listing(((p, oid) for p, oid in tree.items() if p.startswith(prefix)),
                                   f"{self.url}: {prefix or '/'} at {sha[:10]}"))

    def sizes(self, sha, prefix=""):
        """{path: its size in bytes} under prefix at a commit."""
        out = {}
        for p, oid in self.file_ids(sha, prefix).items():
            try:
                out[p] = os.path.getsize(self._object(sha, p, oid))
            except FileNotFoundError:  # (a traceback, or a pull's download said as this machine's disk)
                raise StoreError(f"{self.url}: {p} at {sha[:10]}: its object {oid[:12]} is missing from the store; "
                                 f"{STORE_FIX}") from None
        return out

    def download(self, sha, paths, dest):
        tree = self._load_commit(sha)["tree"]
        for p in paths:
            out = os.path.join(dest, p)
            src = self._object(sha, p, tree[p])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            checkpoint.copy_saying(src, out, f"downloading {p}")

    def _put_object(self, data=None, path=None):
        oid = (checkpoint.sha256_file(path, what=f"hashing {path}") if path is not None
               else hashlib.sha256(data).hexdigest())
        final = self._p("objects", oid[:2], oid)
        if not os.path.exists(final):
            os.makedirs(os.path.dirname(final), exist_ok=True)
            tmp = f"{final}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            try:
                if path is not None:
                    checkpoint.copy_saying(path, tmp, f"uploading {path}")
                else:
                    with open(tmp, "wb") as f:
                        f.write(data)
                if FSYNC:
                    with open(tmp, "rb+") as f:
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except BaseException:  # a Ctrl-C or full disk mid-copy left GBs of partial object in the store for good
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                raise
        return oid

    def _write_commit(self, parent, tree, message):
        t = time.time()
        body = {"parent": parent, "time": t, "message": message, "tree": tree}
        cid = hashlib.sha1(json.dumps(body, sort_keys=True).encode() + uuid.uuid4().bytes).hexdigest()
        body["id"] = cid
        write_atomic(self._p("commits", cid + ".json"), json.dumps(body))  # the record is durable before HEAD names it
        write_atomic(self._p("HEAD"), cid + "\n")
        return cid

    def stage(self, adds):
        """Store the file bodies now (content-addressed; invisible until a commit names them)."""
        try:
            return {p: Staged(self._put_object(path=v) if isinstance(v, str) else self._put_object(data=v))
                    for p, v in adds.items()}
        except OSError as e:
            raise self.denied(e) from None

    def denied(self, e):
        """A store this user may only read (another user's, a read-only mount) is read by status, pull and dashboard;
        a write to it (claim, push, release) was an OSError traceback. Other errors as they were."""
        if e.errno not in checkpoint.DENIED_ERRNOS or not e.filename or not os.path.abspath(
                e.filename).startswith(self.root + os.sep):
            return e
        return StoreError(f"{self.url}: {e.filename}: {e.strerror}; this user can only read the store (status, pull, "
                          f"dashboard): to claim or push, remount it read-write or fix its permissions")

    def commit(self, parent, adds, deletes, message):
        try:
            return self._commit(parent, adds, deletes, message)
        except OSError as e:
            raise self.denied(e) from None

    def _commit(self, parent, adds, deletes, message):
        import fcntl
        oids = {p: v.oid for p, v in self.stage({p: v for p, v in adds.items() if not isinstance(v, Staged)}).items()}
        oids.update({p: v.oid for p, v in adds.items() if isinstance(v, Staged)})
        with open(self._p("LOCK"), "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            head = self._head_id()
            if head != parent:
                raise Conflict(f"{self.url}: head moved to {head[:10]} (expected {str(parent)[:10]})")
            tree = dict(self._load_commit(head)["tree"])
            for p in deletes:
                if p not in tree:  # as the Hub refuses it (404): a delete list computed at another commit
                    raise StoreError(f"{self.url}: commit deletes {p}, which is not in the store at {head[:10]}")
                tree.pop(p)
            tree.update(oids)
            cid = self._write_commit(parent, tree, message)
            if os.environ.get("RELAY_TEST_FAULT") == "file-commit-then-fail":  # tests: a commit that landed, then an error
                raise Transient(f"{self.url}: injected failure after the commit landed")
            return cid


# seconds an HTTP request may wait for a connection or for the next bytes (not the whole transfer): huggingface_hub's
# client waits forever, and a lease renewal stuck in a dead connection hung `relay.py run` for good
HTTP_TIMEOUT_S = float(os.environ.get("RELAY_HTTP_TIMEOUT_S", "60"))


_TIMEOUTS_SET = []


def use_http_timeouts():
    """huggingface_hub's shared HTTP client, with timeouts (HTTP_TIMEOUT_S; connecting at most 30 s). Once per
    process: setting a factory closes the shared client, which another thread (the heartbeat) may be using."""
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http
    if _TIMEOUTS_SET:
        return

    def client():
        c = _http.default_client_factory()
        c.timeout = _http.httpx2.Timeout(HTTP_TIMEOUT_S, connect=min(30.0, HTTP_TIMEOUT_S))
        return c
    set_client_factory(client)
    _TIMEOUTS_SET.append(True)


RELAY_COMMIT_PREFIX = "relay: "  # every commit relay.py makes; head()'s time is the newest one's (the lease's clock)
LEASE_CLOCK_LOOKBACK = 50  # commits looked back through for it (about one page of the Hub's commit list)
READ_CACHE_ENTRIES = 64  # small files kept per store, enough for a few heads' RELAY.json / state / ledger / manifest
# and their bytes: each file is capped (read_cap), but 64 leg logs of 64 MiB were 4 GiB held by a dashboard; a file
# past a quarter of it is not kept (it would push the small ones out; the dashboard keeps its parsed logs itself)
READ_CACHE_BYTES = 16 * MiB


class HfStore:
    """A Hugging Face Hub model repo through huggingface_hub (endpoint and token from HF_ENDPOINT / HF_TOKEN)."""

    def __init__(self, repo_id):
        from huggingface_hub import HfApi
        use_http_timeouts()
        self.repo_id = repo_id
        self.url = "hf://" + repo_id
        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)  # read now, not at import time
        self.cache = {}  # (commit sha, path) -> bytes | None, oldest first
        self.cache_bytes = 0  # of the bytes in it
        self.cache_lock = threading.Lock()  # the heartbeat thread reads through the same store as the main thread

    def _call(self, what, fn, *a, **kw):
        from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
        try:
            return fn(*a, **kw)
        except LocalEntryNotFoundError as e:  # a download that failed and had no local copy
            if isinstance(e.__cause__, HfHubHTTPError):  # it wraps a 403 as it wraps a 503: judge the HTTP error
                return self._call(what, reraise, e.__cause__)
            raise Transient(f"{self.url}: {what}: {one_line(e)}")
        except EntryNotFoundError as e:
            if what.startswith("read "):
                raise  # a missing file: read() answers None
            raise StoreError(f"{self.url}: {what}: a file it names is not in the repo ({one_line(e)}); {STORE_FIX}")
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise NotFound(f"{self.url}: {what}: repository or revision not found ({one_line(e)}); check the name and HF_TOKEN")
        except HfHubHTTPError as e:
            code = e.response.status_code if e.response is not None else None
            if code == 412:
                raise Conflict(f"{self.url}: {what}: a commit has happened since ours (HTTP 412)")
            if code is None or code >= 500 or code in (408, 409, 429):  # 409: the repo was locked, nothing landed
                raise Transient(f"{self.url}: {what}: HTTP {code} ({one_line(e)})")
            raise StoreError(f"{self.url}: {what}: HTTP {code} ({one_line(e)})")
        except (OSError, TimeoutError) as e:  # connection errors and timeouts of the HTTP client
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # this machine's disk full: not the Hub's
                raise
            raise Transient(f"{self.url}: {what}: {type(e).__name__}: {one_line(e)}")
        except json.JSONDecodeError as e:  # a proxy's or load balancer's HTML page where the Hub answers JSON
            raise Transient(f"{self.url}: {what}: the reply was not the Hub's JSON ({one_line(e)})")
        except RuntimeError as e:
            if e.__cause__ is None:
                raise
            # a failed LFS upload (the PUT to storage) comes wrapped: RuntimeError("Error while uploading ...") from
            # the HTTP error; classify the cause like any other call's error
            return self._call(f"{what}: {one_line(e)}", reraise, e.__cause__)
        except Exception as e:
            if type(e).__module__.startswith("httpx"):
                raise Transient(f"{self.url}: {what}: {type(e).__name__}: {one_line(e)}")
            raise

    def exists(self):
        try:
            self.head()
            return True
        except NotFound:  # (a 503 once read as "no run here": init then committed step 0 over a live run)
            return False

    def create(self):
        self._call("create repo", self.api.create_repo, self.repo_id, exist_ok=True)

    def head(self):
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
        refs = self._call("list refs", self.api.list_repo_refs, self.repo_id)
        sha = next((b.target_commit for b in refs.branches if b.name == "main"), None)
        if sha is None:
            raise NotFound(f"{self.url}: has no main branch; create the run with `relay.py init {self.url} CONFIG`")

        def commit_time():  # one page of the commit list: the head's date and the server's Date header
            r = get_session().get(f"{self.api.endpoint}/api/models/{self.repo_id}/commits/{sha}", headers=build_hf_headers())
            hf_raise_for_status(r)
            page = r.json()  # newest first: the lease's clock is the newest relay commit's (not a card edit after it)
            date = next((c["date"] for c in page if str(c.get("title", "")).startswith(RELAY_COMMIT_PREFIX)),
                        page[0]["date"])
            server_now = email.utils.parsedate_to_datetime(r.headers["Date"]).timestamp() if "Date" in r.headers else time.time()
            return dt.datetime.fromisoformat(date.replace("Z", "+00:00")).timestamp(), server_now
        t, server_now = self._call("read head commit", commit_time)
        return sha, t, server_now

    def read(self, sha, path):
        """A small file at an exact commit (immutable, so kept in memory); None if the commit lacks it."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
        with self.cache_lock:
            if (sha, path) in self.cache:
                return self.cache[(sha, path)]

        def get():  # streamed: at most read_cap(path) bytes in memory, whatever the repo holds
            with get_session().stream("GET", hf_hub_url(self.repo_id, path, revision=sha, endpoint=self.api.endpoint),
                                      headers=build_hf_headers(), follow_redirects=True) as r:
                hf_raise_for_status(r)
                size = r.headers.get("Content-Length")
                size = int(size) if size and size.isdigit() and "Content-Encoding" not in r.headers else None
                return read_capped(r.iter_bytes(), read_cap(path), f"{self.url}: {path} at {sha[:10]}", STORE_FIX,
                                   size)
        try:
            data = self._call(f"read {path}", get)
        except EntryNotFoundError:
            data = None
        with self.cache_lock:
            if (sha, path) not in self.cache and len(data or b"") <= READ_CACHE_BYTES // 4:  # (counted once)
                self.cache[(sha, path)] = data
                self.cache_bytes += len(data or b"")
            # oldest first: a dashboard left running for months kept every head's
            while len(self.cache) > READ_CACHE_ENTRIES or self.cache_bytes > READ_CACHE_BYTES:
                self.cache_bytes -= len(self.cache.pop(next(iter(self.cache))) or b"")
        return data

    def list(self, sha, prefix=""):
        return sorted(self.file_ids(sha, prefix))

    def file_ids(self, sha, prefix=""):
        """{path: content id} under prefix at a commit: the LFS sha256, else git's blob id (equal ids, equal bytes)."""
        return {p: (e.lfs.sha256 if e.lfs else e.blob_id) for p, e in self._files(sha, prefix).items()}

    def sizes(self, sha, prefix=""):
        """{path: its size in bytes (the LFS object's for an LFS file)} under prefix at a commit."""
        return {p: (e.lfs.size if e.lfs else e.size) for p, e in self._files(sha, prefix).items()}

    def _files(self, sha, prefix):
        """{path: RepoFile} under prefix: only prefix's folder is listed, page by page, at most LIST_CAP files."""
        from huggingface_hub.errors import EntryNotFoundError
        from huggingface_hub.hf_api import RepoFile
        folder = prefix.rsplit("/", 1)[0] if "/" in prefix else None

        def files():
            try:
                for e in self.api.list_repo_tree(self.repo_id, path_in_repo=folder, revision=sha, recursive=True):
                    if isinstance(e, RepoFile) and e.path.startswith(prefix):
                        yield e.path, e
            except EntryNotFoundError:  # no such folder at sha: no files under it
                return
        return dict(self._call("list files", capped_listing, files(), f"{self.url}: {prefix or '/'} at {sha[:10]}"))

    def download(self, sha, paths, dest):
        from huggingface_hub import hf_hub_download
        for p in paths:
            self._call(f"download {p}", hf_hub_download, self.repo_id, p, revision=sha, local_dir=dest,
                       endpoint=self.api.endpoint)
        shutil.rmtree(os.path.join(dest, ".cache"), ignore_errors=True)

    def stage(self, adds):
        """Upload the LFS files now (preupload_lfs_files); the commit then only names them."""
        from huggingface_hub import CommitOperationAdd
        ops = {p: CommitOperationAdd(path_in_repo=p, path_or_fileobj=v) for p, v in adds.items()}
        self._call("upload", self.api.preupload_lfs_files, self.repo_id, additions=list(ops.values()))
        return ops

    def commit(self, parent, adds, deletes, message):
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        ops = [v if isinstance(v, CommitOperationAdd) else CommitOperationAdd(path_in_repo=p, path_or_fileobj=v)
               for p, v in adds.items()]
        ops += [CommitOperationDelete(path_in_repo=p) for p in deletes]
        info = self._call("commit", self.api.create_commit, self.repo_id, ops, commit_message=message, parent_commit=parent)
        return info.oid


def one_line(e):
    return " ".join(str(e).split())[:300]


def reraise(e):
    raise e


def open_store(url):
    if url.startswith("hf://"):
        repo = url[len("hf://"):].strip("/")
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise RelayError(f"{url}: expected hf://owner/name")
        return HfStore(repo)
    if url.startswith("file://"):
        root = url[len("file://"):]
        if not root.startswith("/"):
            raise RelayError(f"{url}: a file store needs an absolute path, e.g. file:///data/myrun")
        return FileStore(os.path.normpath(root))
    raise RelayError(f"{url}: unknown store; use hf://owner/name or file:///absolute/path")
