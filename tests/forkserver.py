"""`python train.py ARGS` for the tests, forked from a process that imported torch once: a train.py start spends ~3 s
importing torch and torch._dynamo (AdamW's first call) before its first step, and the suite starts it a hundred times.

run() answers as subprocess.run(capture_output=True, text=True) does. Each script runs in a fresh fork of a server
that imported only third-party modules (the repo's own are imported in the fork, under the request's environment),
with the request's argv, cwd, environment and pipes, and ends as an interpreter does (non-daemon threads joined,
atexit run, streams flushed). A request the server cannot stand in for exactly (another OMP_NUM_THREADS, for which
torch sized its pools at import; a preexec_fn) runs as a plain subprocess, and so does every request when
PICAFLOR_TEST_FORKSERVER=0."""
import atexit
import io
import json
import os
import queue
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "numpy", "safetensors.torch", "tiktoken")
_server = {}


def _serve(path):
    """The server: import PRELOAD, then fork one child per connection and reap them; one line of JSON in, the
    child's pid and then its wait status out."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        while True:  # reap the runners that ended (each waits for its own script)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.fork() == 0:
            listener.close()
            _runner(conn)
        conn.close()


def _runner(conn):
    """Receives the request and the three fds, forks the script's process, reports its pid and wait status."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not msg.endswith(b"\n"):  # (a long environment may come in more than one piece)
        msg += conn.recv(1 << 16)
    req = json.loads(msg)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _script(req, fds)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{status}\n".encode())
    except OSError:  # the caller gave up on it (its timeout): it killed the script
        pass
    os._exit(0)


def _script(req, fds):
    """Becomes `python SCRIPT ARGS` run in req's cwd and environment, on the given stdin, stdout and stderr."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    script = os.path.abspath(req["argv"][0])
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(script)  # as the interpreter sets it for a script (not this file's folder)
    code = 0
    try:
        import runpy
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    import threading
    threading._shutdown()  # non-daemon threads joined, as at an interpreter's exit
    try:
        atexit._run_exitfuncs()
    finally:
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _start(env):
    path = os.path.join(tempfile.mkdtemp(prefix="picaflor-forkserver-"), "sock")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], env=env, stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, cwd=os.path.dirname(path))
    if proc.stdout.readline().strip() != b"ready":
        raise RuntimeError("the test forkserver did not start")
    atexit.register(lambda: (proc.kill(), proc.wait(), shutil.rmtree(os.path.dirname(path), ignore_errors=True)))
    _server.update(path=path, proc=proc)


def run(argv, cwd, env=None, timeout=None, preexec_fn=None, on_pid=None):
    """subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    for train.py (stream_infer.py and the like set their threads before torch loads: they start as they are).
    on_pid(pid) is called once the script's process exists (a test run from a thread signals or kills it by pid)."""
    env = dict(os.environ if env is None else env)
    if (os.environ.get("PICAFLOR_TEST_FORKSERVER") == "0" or preexec_fn is not None
            or env.get("OMP_NUM_THREADS") != "1" or os.path.basename(argv[0]) != "train.py"):
        if on_pid is None:
            return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout, preexec_fn=preexec_fn)
        with subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn) as p:
            on_pid(p.pid)
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:  # killed, as subprocess.run does
                p.kill()
                p.communicate()
                raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)
    if not _server or _server["proc"].poll() is not None:
        _start(dict(env))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(_server["path"])
    req = {"argv": list(argv), "cwd": os.path.abspath(cwd), "env": dict(env)}
    msg = json.dumps(req).encode() + b"\n"
    socket.send_fds(conn, [msg[:1 << 16]], [null, out_w, err_w])
    conn.sendall(msg[1 << 16:])
    for fd in (null, out_w, err_w):
        os.close(fd)
    deadline = None if timeout is None else time.monotonic() + timeout
    chunks = {out_r: [], err_r: []}
    sel = selectors.DefaultSelector()
    for fd in chunks:
        sel.register(fd, selectors.EVENT_READ)
    replies = b""
    sel.register(conn, selectors.EVENT_READ)
    pid = None
    while len(sel.get_map()) > 0:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            conn.settimeout(10)
            while pid is None and b"\n" not in replies:  # (sent just after the fork) killed, as subprocess.run does
                replies += conn.recv(4096) or b"\n"
            if pid is None and replies.split(b"\n")[0]:
                pid = int(replies.split(b"\n")[0])
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            for key in list(sel.get_map().values()):
                key.fileobj.close() if key.fileobj is conn else os.close(key.fd)
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout)
        for key, _ in sel.select(left):
            if key.fileobj is conn:
                data = conn.recv(4096)
                replies += data
                if replies.count(b"\n") >= 1 and pid is None:
                    pid = int(replies.split(b"\n")[0])
                    if on_pid is not None:
                        on_pid(pid)
                if not data or replies.count(b"\n") == 2:
                    sel.unregister(conn)
                continue
            data = os.read(key.fd, 1 << 16)
            if data:
                chunks[key.fd].append(data)
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
    conn.close()
    if replies.count(b"\n") < 2:
        raise RuntimeError(f"the test forkserver gave no exit status for {argv} (its server or runner died)")
    status = int(replies.split(b"\n")[1])
    text = [io.TextIOWrapper(io.BytesIO(b"".join(chunks[fd]))).read() for fd in (out_r, err_r)]
    return subprocess.CompletedProcess([sys.executable, *argv], os.waitstatus_to_exitcode(status), *text)


def start(argv, cwd, env=None, timeout=None):
    """run(argv, ...) from a thread, for a test that signals or kills the script while it runs: (its pid, the thread,
    alive while it runs, and done(timeout), which waits for it and returns run's CompletedProcess)."""
    pids, got = queue.Queue(), {}

    def run_it():
        try:
            got["r"] = run(argv, cwd, env=env, timeout=timeout, on_pid=pids.put)
        except BaseException as e:  # (raised again by done)
            got["e"] = e
        finally:
            pids.put(None)  # (after its pid, when it had one)

    thread = threading.Thread(target=run_it, daemon=True)
    thread.start()
    pid = pids.get()

    def done(timeout=300):
        thread.join(timeout)
        assert not thread.is_alive(), f"{argv} still runs after {timeout} s"
        if "e" in got:
            raise got["e"]
        return got["r"]
    if pid is None:  # it never started: its error now
        done()
    return pid, thread, done


if __name__ == "__main__":
    _serve(sys.argv[1])
