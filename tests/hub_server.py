"""
A fake Hugging Face Hub for tests: a stdlib http.server in a thread on 127.0.0.1 that serves local folders as Hub
repos, speaking the endpoints huggingface_hub 2.4.0 uses (read from its source: hf_api.py, file_download.py,
utils/_pagination.py, utils/_http.py):

    GET  /api/{models|datasets}/{owner}/{name}[/revision/{rev}]        repo_info / model_info / dataset_info
    GET  /api/{models|datasets}/{owner}/{name}/tree/{rev}[/{path}]     list_repo_tree / list_repo_files
    HEAD /[datasets/]{owner}/{name}/resolve/{rev}/{file}               hf_hub_download metadata
    GET  /[datasets/]{owner}/{name}/resolve/{rev}/{file}               hf_hub_download body (Range supported)

Layout on disk: ROOT/models/OWNER/NAME/... and ROOT/datasets/OWNER/NAME/... (files of the repo's only branch,
"main"). The commit sha is a hash of the repo's file list and contents, so it changes when a file does.

    with FakeHub(root) as hub:                     # hub.endpoint = "http://127.0.0.1:PORT"
        env = hub.client_env(tmp_path / "hf_home")     # HF_ENDPOINT, HF_HOME, HF_HUB_DISABLE_XET=1, ...
        hub.status_override = 403                  # every request answers 403 (a lapsed bill), None to stop
        hub.fail_left = 2                          # ... or only the next 2 requests do (a blip), then it recovers

To extend (e.g. the relay's commit endpoints): add a (method, regex, handler-name) row to ROUTES and a method
`handle_<name>(self, req, **groups)` on FakeHub; `req` is the BaseHTTPRequestHandler (req.headers, req.rfile),
reply with self.send_json / self.send_error_code / self.send_file.
"""

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

REPO = r"(?P<repo_id>[^/]+/[^/]+)"
ROUTES = [  # (HTTP method, path regex, handler name); first match wins
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "tree"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}(?:/revision/(?P<rev>[^/]+))?$", "info"),
    ("HEAD", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
    ("GET", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
]


class FakeHub:
    def __init__(self, root, host="127.0.0.1", port=0):
        self.root = str(root)
        self.status_override = None  # an int makes every request answer that status (fault injection)
        self.fail_left = None  # with status_override: only this many more requests fail, then the Hub recovers
        self.requests = []  # (method, path) of every request, for assertions
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet test output
                pass

            def do_GET(self):
                hub.dispatch(self, "GET")

            def do_HEAD(self):
                hub.dispatch(self, "HEAD")

            def do_POST(self):
                hub.dispatch(self, "POST")

            def do_PUT(self):
                hub.dispatch(self, "PUT")

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self.thread = None

    # ---- lifecycle ----
    def start(self):
        # a short poll interval: shutdown() waits up to one interval, and every test stops its server
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def client_env(self, hf_home):
        """Environment for a huggingface_hub client (subprocess, or os.environ before importing it)."""
        return {"HF_ENDPOINT": self.endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1",
                "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "HF_TOKEN": "", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "10"}

    # ---- repo model ----
    def repo_dir(self, kind, repo_id):
        return os.path.join(self.root, kind or "models", *repo_id.split("/"))

    def repo_files(self, kind, repo_id):
        d = self.repo_dir(kind, repo_id)
        out = []
        for dirpath, _, names in os.walk(d):
            for n in names:
                out.append(os.path.relpath(os.path.join(dirpath, n), d).replace(os.sep, "/"))
        return sorted(out)

    def file_oid(self, path):
        h = hashlib.sha1()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def commit_sha(self, kind, repo_id):
        d = self.repo_dir(kind, repo_id)
        h = hashlib.sha1()
        for rel in self.repo_files(kind, repo_id):
            h.update(f"{rel}\0{self.file_oid(os.path.join(d, rel))}\n".encode())
        return h.hexdigest()

    def check_repo(self, req, kind, repo_id, rev):
        """True if the repo and revision exist; otherwise answer 404 with the Hub's error code and return False."""
        if not os.path.isdir(self.repo_dir(kind, repo_id)):
            self.send_error_code(req, 404, "RepoNotFound", f"Repository {repo_id} not found")
            return False
        if rev not in (None, "main", self.commit_sha(kind, repo_id)):
            self.send_error_code(req, 404, "RevisionNotFound", f"Revision {rev} not found")
            return False
        return True

    # ---- dispatch and replies ----
    def dispatch(self, req, method):
        url = urlsplit(req.path)
        self.requests.append((method, url.path))
        if self.status_override is not None:
            n = int(req.headers.get("Content-Length") or 0)
            if n:  # read the body first: left unread, the connection's next request would be parsed from it
                req.rfile.read(n)
            status = self.status_override
            if self.fail_left is not None:
                self.fail_left -= 1
                if self.fail_left <= 0:
                    self.status_override = self.fail_left = None
            return self.send_json(req, {"error": f"status {status} (injected)"}, status)
        for m, pattern, name in ROUTES:
            match = re.match(pattern, url.path) if m == method else None
            if match:
                groups = {k: unquote(v) if v is not None else None for k, v in match.groupdict().items()}
                return getattr(self, f"handle_{name}")(req, query=parse_qs(url.query), **groups)
        self.send_error_code(req, 404, None, f"no route for {method} {url.path}")

    def send_json(self, req, obj, status=200, headers=None):
        body = json.dumps(obj).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)

    def send_error_code(self, req, status, error_code, message):
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        self.send_json(req, {"error": message}, status, headers)

    def send_file(self, req, path, headers):
        size = os.path.getsize(path)
        start, status = 0, 200
        m = re.match(r"bytes=(\d+)-$", req.headers.get("Range", ""))
        if m and req.command == "GET":  # resumed download
            start, status = min(int(m.group(1)), size), 206
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(size - start))
        if status == 206:
            req.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        req.send_header("Accept-Ranges", "bytes")
        req.end_headers()
        if req.command == "GET":
            with open(path, "rb") as f:
                f.seek(start)
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    req.wfile.write(chunk)

    # ---- endpoints ----
    def handle_info(self, req, query, kind, repo_id, rev=None):
        if not self.check_repo(req, kind, repo_id, rev):
            return
        d = self.repo_dir(kind, repo_id)
        files = self.repo_files(kind, repo_id)
        self.send_json(req, {
            "id": repo_id, "sha": self.commit_sha(kind, repo_id), "private": False, "disabled": False,
            "lastModified": "2026-01-01T00:00:00.000Z", "tags": [],
            "siblings": [{"rfilename": f, "size": os.path.getsize(os.path.join(d, f))} for f in files],
        })

    def handle_tree(self, req, query, kind, repo_id, rev, path=None):
        if not self.check_repo(req, kind, repo_id, rev):
            return
        d = self.repo_dir(kind, repo_id)
        base = (path or "").strip("/")
        if base and not os.path.isdir(os.path.join(d, base)):
            return self.send_error_code(req, 404, "EntryNotFound", f"{base} does not exist on {rev}")
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        entries = []
        for rel in self.repo_files(kind, repo_id):
            if base and not rel.startswith(base + "/"):
                continue
            parts = rel[len(base) + 1 if base else 0:].split("/")
            # folders on the way: every one when recursive, only the first level otherwise
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = "/".join(filter(None, [base] + parts[:depth]))
                if not any(e["path"] == folder for e in entries):
                    entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                    "path": folder})
            if recursive or len(parts) == 1:
                full = os.path.join(d, rel)
                entries.append({"type": "file", "oid": self.file_oid(full), "size": os.path.getsize(full),
                                "path": rel})
        self.send_json(req, entries)

    def handle_resolve(self, req, query, kind, repo_id, rev, path):
        if not self.check_repo(req, kind, repo_id, rev):
            return
        full = os.path.join(self.repo_dir(kind, repo_id), *path.split("/"))
        if ".." in path.split("/") or not os.path.isfile(full):
            return self.send_error_code(req, 404, "EntryNotFound", f"{path} does not exist on {rev}")
        self.send_file(req, full, {"X-Repo-Commit": self.commit_sha(kind, repo_id),
                                   "ETag": f'"{self.file_oid(full)}"', "Content-Type": "application/octet-stream"})


# ---- versioned repos with commits (relay.py's hf:// store) ------------------------------------------------------
# RelayHub adds git-like history to FakeHub: repos made with create_repo (or hub.create_versioned) live in memory
# as commits {id, parent, time, message, tree {path: blob sha1}}; reads at any commit sha work, and a commit whose
# parentCommit is not the branch head gets HTTP 412, as on the Hub. Folder-backed repos are served as before.
#
#   POST /api/repos/create                                 create_repo (409 if it exists)
#   GET  /api/models/{id}/refs                             list_repo_refs
#   GET  /api/models/{id}/commits/{rev}                    list_repo_commits (one page, newest first)
#   POST /api/models/{id}/preupload/{rev}                  "lfs" or "regular" per file, the Hub's rule (below)
#   POST /api/models/{id}/commit/{rev}                     ndjson: header (parentCommit), file, lfsFile, deletedFile,
#                                                          deletedFolder
#   GET  info / tree / HEAD|GET resolve                    as FakeHub, at a commit of the history
#
# Git LFS, as the Hub does it for huggingface_hub 2.4.0 with HF_HUB_DISABLE_XET=1 (_commit_api.py, lfs.py,
# file_download.py). A file is "lfs" if it is larger than hub.lfs_threshold (10 MB on the Hub), binary (a NUL byte in
# its first 512 bytes, the sample the client sends), or matched by a filter=lfs pattern of the repo's .gitattributes
# (*.safetensors, *.pt, ... in a new repo, as on the Hub). Its bytes go to a second server on another port, standing
# in for S3 and the CDN (another origin, so the client behaves as with the real ones: no auth, no redirect follow):
#
#   POST /{id}.git/info/lfs/objects/batch                  upload actions per {oid, size}: a signed PUT href on the
#                                                          storage server + a verify href; none if already stored
#   PUT  STORAGE/lfs-upload/{token}                        the body; refused (400) unless its sha256 and size are the
#                                                          signed ones; nothing stored then
#   POST /{id}.git/info/lfs/objects/verify                 200 if {oid, size} is stored, else 404
#   commit "lfsFile" {path, algo: sha256, oid, size}       400 unless that object was uploaded to this repo; the tree
#                                                          holds the LFS pointer file (its git blob id)
#   HEAD|GET resolve of an LFS file                        302 to STORAGE/lfs-cdn/{kind}/{id}/{sha256} with
#                                                          X-Linked-Etag (sha256), X-Linked-Size, X-Repo-Commit, ETag
#   tree entries of an LFS file                            real size and "lfs": {oid, size, pointerSize}
#
#   hub.fail_after_commit = 1     the next commit lands, then the request answers 500 (the 2025 Hub bug)
#   hub.corrupt_uploads = 1       the next LFS PUT body arrives with one byte flipped (damage in transit)
#   hub.lfs_objects               {(kind, repo_id): {sha256 hex: bytes}}, for assertions

import base64 as _base64
import fnmatch as _fnmatch
import time as _time
import uuid as _uuid
from http.server import ThreadingHTTPServer as _ThreadingHTTPServer

VERSIONED_ROUTES = [
    ("POST", r"^/api/repos/create$", "create_repo"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/refs$", "refs"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/commits/(?P<rev>[^/]+)$", "commits"),
    ("POST", rf"^/api/(?P<kind>models|datasets)/{REPO}/preupload/(?P<rev>[^/]+)$", "preupload"),
    ("POST", rf"^/api/(?P<kind>models|datasets)/{REPO}/commit/(?P<rev>[^/]+)$", "commit"),
    ("POST", r"^/(?:(?P<kind>datasets)/)?(?P<repo_id>[^/]+/[^/]+?)\.git/info/lfs/objects/batch$", "lfs_batch"),
    ("POST", r"^/(?:(?P<kind>datasets)/)?(?P<repo_id>[^/]+/[^/]+?)\.git/info/lfs/objects/verify$", "lfs_verify"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "vtree"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}(?:/revision/(?P<rev>[^/]+))?$", "vinfo"),
    ("HEAD", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "vresolve"),
    ("GET", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "vresolve"),
]


STORAGE_ROUTES = [  # served only on the storage server (S3 + CDN stand-in)
    ("PUT", r"^/lfs-upload/(?P<token>[0-9a-f]+)$", "lfs_put"),
    ("GET", rf"^/lfs-cdn/(?P<kind>models|datasets)/{REPO}/(?P<oid>[0-9a-f]{{64}})$", "lfs_get"),
    ("HEAD", rf"^/lfs-cdn/(?P<kind>models|datasets)/{REPO}/(?P<oid>[0-9a-f]{{64}})$", "lfs_get"),
]
NEW_REPO_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in (
    "*.bin", "*.ckpt", "*.gguf", "*.h5", "*.npy", "*.onnx", "*.pt", "*.pth", "*.safetensors", "*.tar.*", "*.zip"))


def _lfs_pointer(oid, size):  # the git-lfs pointer file (git-lfs spec v1) that the repo's tree holds
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _iso(t):
    return _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class RelayHub(FakeHub):
    def __init__(self, root, host="127.0.0.1", port=0):
        super().__init__(root, host, port)
        self.vrepos = {}  # (kind, repo_id) -> {"head": sha, "commits": {sha: commit}}
        self.blobs = {}  # git blob sha1 -> bytes
        self.vlock = threading.Lock()  # one commit at a time, like the Hub's per-branch lock
        self.fail_after_commit = 0  # > 0: that many commits land and then answer 500
        self.lfs_threshold = 10 * 1000 * 1000  # bytes; bigger files are "lfs" (the Hub's 10 MB rule)
        self.lfs_objects = {}  # (kind, repo_id) -> {sha256 hex: bytes}
        self.lfs_pointers = {}  # git blob id of a pointer file -> (sha256 hex, size)
        self.upload_tokens = {}  # signed PUT href token -> ((kind, repo_id), sha256 hex, size)
        self.corrupt_uploads = 0  # > 0: that many LFS PUT bodies arrive with a byte flipped
        self.storage = _ThreadingHTTPServer(self.server.server_address[:1] + (0,), self.server.RequestHandlerClass)
        self.storage_endpoint = f"http://{host}:{self.storage.server_address[1]}"
        # headers and body go out in separate writes: without TCP_NODELAY each keep-alive request waits ~40 ms
        # on Nagle + delayed ACK, which the relay's many small requests feel
        self.server.RequestHandlerClass.disable_nagle_algorithm = True

    def start(self):
        threading.Thread(target=self.storage.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return super().start()

    def stop(self):
        super().stop()
        self.storage.shutdown()
        self.storage.server_close()

    def client_env(self, hf_home):
        return dict(super().client_env(hf_home), HF_TOKEN="hf_relaytest")  # writes need a token client-side

    def create_versioned(self, kind, repo_id):
        with self.vlock:
            if (kind, repo_id) in self.vrepos:
                return False
            blob = self.put_blob(NEW_REPO_GITATTRIBUTES.encode())
            self.lfs_objects[(kind, repo_id)] = {}
            self.vrepos[(kind, repo_id)] = {"head": None, "commits": {}}
            self.add_commit(kind, repo_id, {".gitattributes": blob}, "initial commit")
            return True

    def put_blob(self, data):
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
        self.blobs[oid] = data
        return oid

    def add_commit(self, kind, repo_id, tree, message):
        repo = self.vrepos[(kind, repo_id)]
        sha = hashlib.sha1(f"{repo['head']}{_uuid.uuid4()}".encode()).hexdigest()
        repo["commits"][sha] = {"id": sha, "parent": repo["head"], "time": _time.time(), "message": message,
                                "tree": tree}
        repo["head"] = sha
        return sha

    def dispatch(self, req, method):
        url = urlsplit(req.path)
        if req.server is self.storage:  # the storage server answers only its own routes
            for m, pattern, name in STORAGE_ROUTES:
                match = re.match(pattern, url.path) if m == method else None
                if match:
                    self.requests.append((method, "STORAGE" + url.path))
                    return getattr(self, f"handle_{name}")(req, **match.groupdict())
            return self.send_error_code(req, 404, None, f"no storage route for {method} {url.path}")
        if self.status_override is None:
            for m, pattern, name in VERSIONED_ROUTES:
                match = re.match(pattern, url.path) if m == method else None
                if not match:
                    continue
                groups = {k: unquote(v) if v is not None else None for k, v in match.groupdict().items()}
                key = (groups.get("kind") or "models", groups.get("repo_id"))
                if name == "create_repo" or key in self.vrepos:
                    self.requests.append((method, url.path))
                    groups.pop("kind", None)
                    groups.pop("repo_id", None)
                    return getattr(self, f"handle_{name}")(req, key, query=parse_qs(url.query), **groups)
                if name == "refs":  # the Hub's answer for a repo that is not there (the error code names it)
                    self.requests.append((method, url.path))
                    return self.send_error_code(req, 404, "RepoNotFound", f"Repository {key[1]} not found")
                break
        return super().dispatch(req, method)

    def read_body(self, req):
        n = int(req.headers.get("Content-Length") or 0)
        if n:
            return req.rfile.read(n)
        if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(req.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    req.rfile.readline()
                    return out
                out += req.rfile.read(size)
                req.rfile.readline()
        return b""

    def at(self, req, key, rev):
        """The commit `rev` (main or a sha) of versioned repo `key`, or None after answering 404."""
        repo = self.vrepos[key]
        sha = repo["head"] if rev in (None, "main") else rev
        if sha not in repo["commits"]:
            self.send_error_code(req, 404, "RevisionNotFound", f"Revision {rev} not found")
            return None
        return repo["commits"][sha]

    def handle_create_repo(self, req, key, query):
        body = json.loads(self.read_body(req) or b"{}")
        kind = (body.get("type") or "model") + "s"
        repo_id = f"{body.get('organization') or 'user'}/{body['name']}"
        if not self.create_versioned(kind, repo_id):
            headers = {"X-Error-Message": "You already created this model repo"}  # the Hub's 409 carries the url
            return self.send_json(req, {"error": headers["X-Error-Message"], "url": f"{self.endpoint}/{repo_id}"},
                                  409, headers)
        self.send_json(req, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id})

    def handle_refs(self, req, key, query):
        head = self.vrepos[key]["head"]
        self.send_json(req, {"branches": [{"name": "main", "ref": "refs/heads/main", "targetCommit": head}],
                             "tags": [], "converts": []})

    def handle_commits(self, req, key, query, rev):
        c = self.at(req, key, rev)
        if c is None:
            return
        out = []
        commits = self.vrepos[key]["commits"]
        while c is not None and len(out) < 50:
            out.append({"id": c["id"], "title": c["message"], "message": "", "authors": [], "date": _iso(c["time"])})
            c = commits.get(c["parent"])
        self.send_json(req, out)

    def lfs_patterns(self, key):
        """filter=lfs patterns of .gitattributes at the head."""
        c = self.vrepos[key]["commits"][self.vrepos[key]["head"]]
        text = self.blobs[c["tree"][".gitattributes"]].decode() if ".gitattributes" in c["tree"] else ""
        return [l.split()[0] for l in text.splitlines() if "filter=lfs" in l.split()[1:]]

    def is_lfs(self, key, path, size, sample):
        patterns = self.lfs_patterns(key)
        name = path.rsplit("/", 1)[-1]  # a pattern without a slash matches the file name at any depth (gitattributes)
        matched = any(_fnmatch.fnmatchcase(path if "/" in p else name, p.lstrip("/")) for p in patterns)
        return size > self.lfs_threshold or b"\0" in sample or matched

    def handle_preupload(self, req, key, query, rev):
        files = json.loads(self.read_body(req))["files"]
        out = []
        for f in files:
            lfs = self.is_lfs(key, f["path"], int(f["size"]), _base64.b64decode(f.get("sample", "")))
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
        self.send_json(req, {"files": out, "commitOid": self.vrepos[key]["head"]})

    def handle_lfs_batch(self, req, key, query):
        body = json.loads(self.read_body(req))
        if body.get("operation") != "upload" or body.get("hash_algo", "sha256") != "sha256":
            return self.send_json(req, {"message": "only sha256 uploads are supported"}, 422)
        out = []
        for o in body.get("objects", []):
            oid, size = o.get("oid"), o.get("size")
            if not (isinstance(oid, str) and re.fullmatch(r"[0-9a-f]{64}", oid)) or not isinstance(size, int) or size < 0:
                out.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                            "error": {"code": 422, "message": "invalid oid or size"}})
                continue
            with self.vlock:
                stored = self.lfs_objects[key].get(oid)
                if stored is not None and len(stored) == size:
                    out.append({"oid": oid, "size": size})  # already there: no actions, the client skips the upload
                    continue
                token = _uuid.uuid4().hex
                self.upload_tokens[token] = (key, oid, size)
            prefix = "datasets/" if key[0] == "datasets" else ""
            out.append({"oid": oid, "size": size, "authenticated": True, "actions": {
                "upload": {"href": f"{self.storage_endpoint}/lfs-upload/{token}", "header": {}},
                "verify": {"href": f"{self.endpoint}/{prefix}{key[1]}.git/info/lfs/objects/verify", "header": {}}}})
        self.send_json(req, {"transfer": "basic", "objects": out}, headers={"Content-Type": "application/vnd.git-lfs+json"})

    def handle_lfs_put(self, req, token):
        data = self.read_body(req)
        with self.vlock:
            signed = self.upload_tokens.get(token)
            if self.corrupt_uploads > 0 and data:
                self.corrupt_uploads -= 1
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        if signed is None:
            return self.send_error_code(req, 403, None, "upload URL unknown or expired")
        key, oid, size = signed
        if len(data) != size:
            return self.send_error_code(req, 400, None, f"size {len(data)} is not the signed size {size}")
        if hashlib.sha256(data).hexdigest() != oid:
            return self.send_error_code(req, 400, None, "BadDigest: the body's sha256 is not the signed oid")
        with self.vlock:
            self.lfs_objects[key][oid] = data
            self.upload_tokens.pop(token, None)
        req.send_response(200)
        req.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')
        req.send_header("Content-Length", "0")
        req.end_headers()

    def handle_lfs_verify(self, req, key, query):
        body = json.loads(self.read_body(req) or b"{}")
        stored = self.lfs_objects[key].get(body.get("oid"))
        if stored is None or len(stored) != body.get("size"):
            return self.send_error_code(req, 404, None, f"LFS object {body.get('oid')} not found (or another size)")
        self.send_json(req, {"success": True})

    def handle_lfs_get(self, req, kind, repo_id, oid):
        data = self.lfs_objects.get((kind, repo_id), {}).get(oid)
        if data is None:
            return self.send_error_code(req, 404, None, "NoSuchKey")
        start, status = 0, 200
        m = re.match(r"bytes=(\d+)-$", req.headers.get("Range", ""))
        if m and req.command == "GET":  # resumed download
            start, status = min(int(m.group(1)), len(data)), 206
        req.send_response(status)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("ETag", f'"{oid}"')
        req.send_header("Content-Length", str(len(data) - start))
        if status == 206:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.end_headers()
        if req.command == "GET":
            req.wfile.write(data[start:])

    def handle_commit(self, req, key, query, rev):
        lines = [json.loads(l) for l in self.read_body(req).splitlines() if l.strip()]
        header = next((l["value"] for l in lines if l["key"] == "header"), {})
        with self.vlock:
            repo = self.vrepos[key]
            parent = header.get("parentCommit")
            if parent is not None and parent != repo["head"]:
                return self.send_error_code(req, 412, None, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo["commits"][repo["head"]]["tree"])
            for l in lines:
                v = l["value"]
                if l["key"] == "file":
                    data = _base64.b64decode(v["content"])
                    if data and self.is_lfs(key, v["path"], len(data), data[:512]):  # the Hub refuses these outside LFS
                        return self.send_error_code(req, 400, None, f"{v['path']}: binary, too big or an LFS pattern: "
                                                    f"upload it with Git LFS")
                    tree[v["path"]] = self.put_blob(data)
                elif l["key"] == "lfsFile":
                    stored = self.lfs_objects[key].get(v.get("oid"))
                    if v.get("algo", "sha256") != "sha256" or stored is None or v.get("size", len(stored)) != len(stored):
                        return self.send_error_code(req, 400, None, f"{v.get('path')}: LFS object {v.get('oid')} was "
                                                    f"never uploaded to this repo (or has another size)")
                    pointer = self.put_blob(_lfs_pointer(v["oid"], len(stored)))
                    self.lfs_pointers[pointer] = (v["oid"], len(stored))
                    tree[v["path"]] = pointer
                elif l["key"] == "deletedFile":
                    if v["path"] not in tree:  # the Hub refuses a delete of a missing file
                        return self.send_error_code(req, 404, "EntryNotFound", f"A file with this name doesn't exist: "
                                                    f"{v['path']}")
                    del tree[v["path"]]
                elif l["key"] == "deletedFolder":
                    for p in [p for p in tree if p.startswith(v["path"].rstrip("/") + "/")]:
                        del tree[p]
                elif l["key"] != "header":
                    return self.send_error_code(req, 400, None, f"unsupported commit operation {l['key']}")
            sha = self.add_commit(*key, tree, header.get("summary", ""))
            if self.fail_after_commit > 0:
                self.fail_after_commit -= 1
                return self.send_json(req, {"error": "Internal Error (injected after the commit landed)"}, 500)
        self.send_json(req, {"success": True, "commitOid": sha, "commitUrl": f"{self.endpoint}/{key[1]}/commit/{sha}",
                             "pullRequestUrl": None})

    def file_size(self, oid):  # what the Hub reports: the LFS object's size for a pointer, else the blob's
        return self.lfs_pointers[oid][1] if oid in self.lfs_pointers else len(self.blobs[oid])

    def handle_vinfo(self, req, key, query, rev=None):
        c = self.at(req, key, rev)
        if c is None:
            return
        self.send_json(req, {"id": key[1], "sha": c["id"], "private": False, "disabled": False,
                             "lastModified": _iso(c["time"]), "tags": [],
                             "siblings": [{"rfilename": p, "size": self.file_size(o)} for p, o in sorted(c["tree"].items())]})

    def handle_vtree(self, req, key, query, rev, path=None):
        c = self.at(req, key, rev)
        if c is None:
            return
        base = (path or "").strip("/")
        recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
        entries, folders = [], set()
        for rel, oid in sorted(c["tree"].items()):
            if base and not rel.startswith(base + "/"):
                continue
            parts = rel[len(base) + 1 if base else 0:].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                folder = "/".join(filter(None, [base] + parts[:depth]))
                if folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(), "path": folder})
            if recursive or len(parts) == 1:
                entry = {"type": "file", "oid": oid, "size": self.file_size(oid), "path": rel}
                if oid in self.lfs_pointers:
                    sha256, size = self.lfs_pointers[oid]
                    entry["lfs"] = {"oid": sha256, "size": size, "pointerSize": len(self.blobs[oid])}
                entries.append(entry)
        if base and not entries:
            return self.send_error_code(req, 404, "EntryNotFound", f"{base} does not exist on {rev}")
        self.send_json(req, entries)

    def handle_vresolve(self, req, key, query, rev, path):
        c = self.at(req, key, rev)
        if c is None:
            return
        oid = c["tree"].get(path)
        if oid is None:
            return self.send_error_code(req, 404, "EntryNotFound", f"{path} does not exist on {rev}")
        if oid in self.lfs_pointers:  # as the Hub: a redirect to the CDN, the file's metadata on the redirect itself
            sha256, size = self.lfs_pointers[oid]
            req.send_response(302)
            for k, v in {"Location": f"{self.storage_endpoint}/lfs-cdn/{key[0]}/{key[1]}/{sha256}", "X-Repo-Commit": c["id"],
                         "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(size), "ETag": f'"{oid}"',
                         "Content-Length": "0"}.items():
                req.send_header(k, v)
            return req.end_headers()
        data = self.blobs[oid]
        req.send_response(200)
        for k, v in {"X-Repo-Commit": c["id"], "ETag": f'"{oid}"', "Content-Type": "application/octet-stream",
                     "Content-Length": str(len(data))}.items():
            req.send_header(k, v)
        req.end_headers()
        if req.command == "GET":
            req.wfile.write(data)


if __name__ == "__main__":  # serve a folder by hand: python tests/hub_server.py ROOT [PORT]
    import sys
    import time

    hub = FakeHub(sys.argv[1], port=int(sys.argv[2]) if len(sys.argv) > 2 else 0).start()
    print(f"serving {hub.root} at {hub.endpoint} (HF_ENDPOINT={hub.endpoint} HF_HUB_DISABLE_XET=1)")
    while True:
        time.sleep(3600)
