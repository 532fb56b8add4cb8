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

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self.thread = None

    # ---- lifecycle ----
    def start(self):
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
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
            return self.send_json(req, {"error": f"status {self.status_override} (injected)"}, self.status_override)
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
#   POST /api/models/{id}/preupload/{rev}                  every file "regular" (inline base64, no LFS)
#   POST /api/models/{id}/commit/{rev}                     ndjson: header (parentCommit), file, deletedFile, deletedFolder
#   GET  info / tree / HEAD|GET resolve                    as FakeHub, at a commit of the history
#
#   hub.fail_after_commit = 1     the next commit lands, then the request answers 500 (the 2025 Hub bug)

import base64 as _base64
import time as _time
import uuid as _uuid

VERSIONED_ROUTES = [
    ("POST", r"^/api/repos/create$", "create_repo"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/refs$", "refs"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/commits/(?P<rev>[^/]+)$", "commits"),
    ("POST", rf"^/api/(?P<kind>models|datasets)/{REPO}/preupload/(?P<rev>[^/]+)$", "preupload"),
    ("POST", rf"^/api/(?P<kind>models|datasets)/{REPO}/commit/(?P<rev>[^/]+)$", "commit"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "vtree"),
    ("GET", rf"^/api/(?P<kind>models|datasets)/{REPO}(?:/revision/(?P<rev>[^/]+))?$", "vinfo"),
    ("HEAD", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "vresolve"),
    ("GET", rf"^/(?:(?P<kind>datasets)/)?{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "vresolve"),
]


def _iso(t):
    return _time.strftime("%Y-%m-%dT%H:%M:%S", _time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


class RelayHub(FakeHub):
    def __init__(self, root, host="127.0.0.1", port=0):
        super().__init__(root, host, port)
        self.vrepos = {}  # (kind, repo_id) -> {"head": sha, "commits": {sha: commit}}
        self.blobs = {}  # git blob sha1 -> bytes
        self.vlock = threading.Lock()  # one commit at a time, like the Hub's per-branch lock
        self.fail_after_commit = 0  # > 0: that many commits land and then answer 500
        # headers and body go out in separate writes: without TCP_NODELAY each keep-alive request waits ~40 ms
        # on Nagle + delayed ACK, which the relay's many small requests feel
        self.server.RequestHandlerClass.disable_nagle_algorithm = True

    def client_env(self, hf_home):
        return dict(super().client_env(hf_home), HF_TOKEN="hf_relaytest")  # writes need a token client-side

    def create_versioned(self, kind, repo_id):
        with self.vlock:
            if (kind, repo_id) in self.vrepos:
                return False
            blob = self.put_blob(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
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
            return self.send_error_code(req, 409, None, "You already created this model repo")
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

    def handle_preupload(self, req, key, query, rev):
        files = json.loads(self.read_body(req))["files"]
        self.send_json(req, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in files], "commitOid": self.vrepos[key]["head"]})

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
                    tree[v["path"]] = self.put_blob(_base64.b64decode(v["content"]))
                elif l["key"] == "deletedFile":
                    tree.pop(v["path"], None)
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

    def handle_vinfo(self, req, key, query, rev=None):
        c = self.at(req, key, rev)
        if c is None:
            return
        self.send_json(req, {"id": key[1], "sha": c["id"], "private": False, "disabled": False,
                             "lastModified": _iso(c["time"]), "tags": [],
                             "siblings": [{"rfilename": p, "size": len(self.blobs[o])} for p, o in sorted(c["tree"].items())]})

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
                entries.append({"type": "file", "oid": oid, "size": len(self.blobs[oid]), "path": rel})
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
