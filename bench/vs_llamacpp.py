"""
picaflor's stream_infer vs llama.cpp on the same model, under the same memory limit, side by side in one run.

    python bench/vs_llamacpp.py micro.pcf4 --json bench/vs_llamacpp.json
    python bench/vs_llamacpp.py micro.pcf4 --llama-builds noamx=/tmp/llama_noamx   # each setting on a second build too
    python bench/vs_llamacpp.py --parity out/tiny      # llama.cpp computes picaflor's logits (f16 GGUF)

For every budget (default: none, 100%, 50%, 25% of the int4 container) it runs
  - picaflor: `stream_infer.py MODEL --bench --ram-budget B` (its own cgroup, page cache dropped), and
  - llama.cpp (llama-cpp-python) on a Q4_0 GGUF of the same weights, in a memory cgroup of the same size after
    dropping the GGUF's page cache, once per setting: mmap; mmap + its repacked weight copy (use_extra_bufts);
    mmap + lazy tensor reads (lazy_mode ON). The best setting at each budget is llama.cpp's figure.
Both decode the same number of tokens, greedy, from random prompt ids; llama.cpp on --threads (every core by
default), picaflor with its own --threads auto (every core; its best, measured in stream_infer.py's header).
A run that is killed (out of memory inside the cgroup) or refuses is a row with no figure, not an error.

The GGUF is written from the container (export.py CONTAINER --format gguf --gguf-type q4_0), so both engines
run the same int4 values (requantized to Q4_0 blocks of 32). A container without a tokenizer (micro's random
benchmark weights) gets a small byte-level one so llama.cpp can load the file; the benchmark feeds token ids.

llama-cpp-python is for this benchmark only (not in requirements.txt); it builds llama.cpp from source:
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36
(~25 min on 2 cores of the earlier machine, ~6 on a Sapphire Rapids VM, ~5 on an AMD EPYC one.) A second build goes to its own folder with
--target DIR (and --no-cache-dir --no-binary llama-cpp-python, or pip reuses the first wheel whatever CMAKE_ARGS
say); --llama-builds NAME=DIR then runs every setting on it as well. On Sapphire Rapids the native build's
repacked weights segfault (AMX) and a -DGGML_AMX_INT8=OFF build runs them: bench/STREAMING_LOG.md has that build's command.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SETTINGS = {  # name -> llama_model_params fields; all keep mmap (without it the weights must fit in the budget)
    "mmap": {"use_extra_bufts": False, "lazy": False},
    "mmap+repack": {"use_extra_bufts": True, "lazy": False},
    "mmap+lazy": {"use_extra_bufts": False, "lazy": True},
}


class BenchError(Exception):
    pass


# ----------------------------------------------------------------------------------------------------------
# the llama.cpp child: runs inside the cgroup, writes its result after every token (a timeout keeps the rate)

def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise BenchError('llama-cpp-python is not installed; CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" '
                         'pip install llama-cpp-python==0.3.36 (builds llama.cpp, ~25 min on 2 cores)') from None
    return llama_cpp


def start_llama(L):
    """llama.cpp's log silenced (its callback kept referenced: llama.cpp calls it later) and its backend up."""
    import ctypes
    global _QUIET
    _QUIET = L.llama_log_callback(lambda level, text, data: None)
    L.llama_log_set(_QUIET, ctypes.c_void_p(0))
    L.llama_backend_init()


def llama_child(args):
    import numpy as np
    import llama_cpp as L
    res = {"setting": args.setting, "tokens": 0, "phase": "load"}

    def dump():
        with open(args.result + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(args.result + ".tmp", args.result)

    dump()
    start_llama(L)
    mp = L.llama_model_default_params()
    mp.load_mode = L.LLAMA_LOAD_MODE_MMAP
    mp.use_extra_bufts = SETTINGS[args.setting]["use_extra_bufts"]
    mp.lazy_mode = L.LLAMA_LAZY_MODE_ON if SETTINGS[args.setting]["lazy"] else L.LLAMA_LAZY_MODE_OFF
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(args.gguf.encode(), mp)
    if not model:
        raise SystemExit(f"error: {args.gguf}: llama.cpp could not load it")
    cp = L.llama_context_default_params()
    cp.n_ctx = args.prompt_tokens + args.tokens + 16
    cp.n_batch = cp.n_ubatch = max(args.prompt_tokens, 1)
    cp.n_threads = cp.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit(f"error: {args.gguf}: llama.cpp could not create a context")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    res.update(load_s=time.perf_counter() - t0, phase="prefill")
    dump()
    prompt = np.random.default_rng(args.seed).integers(1, min(n_vocab, 4096), size=args.prompt_tokens).tolist()

    def step(ids):
        arr = (L.llama_token * len(ids))(*ids)
        if L.llama_decode(ctx, L.llama_batch_get_one(arr, len(ids))) != 0:
            raise SystemExit("error: llama_decode failed")
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    t0 = time.perf_counter()
    nxt = step(prompt)
    res.update(prefill_s=time.perf_counter() - t0, prefill_tok_s=len(prompt) / (time.perf_counter() - t0),
               phase="decode")
    dump()
    t0 = time.perf_counter()
    for i in range(args.tokens):
        nxt = step([nxt])
        el = time.perf_counter() - t0
        res.update(tokens=i + 1, decode_s=el, decode_tok_s=(i + 1) / el, peak_rss_bytes=peak_rss())
        dump()
        if el > args.max_seconds and i >= 1:
            break
    res["phase"] = "done"
    dump()


def parity(ckpt, threads):
    """llama.cpp's logits on an f16 GGUF export of a training checkpoint vs picaflor's own (model.py), position by
    position: proof that the GGUF llama.cpp runs is the same model."""
    import numpy as np
    import torch
    import checkpoint
    import export
    import llama_cpp as L
    import model as M
    try:
        ck = checkpoint.resolve(ckpt)
    except checkpoint.CheckpointError as e:
        raise BenchError(str(e)) from None
    with tempfile.TemporaryDirectory() as td:
        gg = os.path.join(td, "m.gguf")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), ck, "--format", "gguf", "--gguf-type",
                            "f16", "--out", gg, "--no-progress"], stdout=subprocess.DEVNULL)
        if r.returncode:
            raise BenchError(f"{ck}: GGUF export failed (see above)")
        m = M.load_checkpoint(ck).float().eval()
        T = min(24, m.cfg.max_seq_len)
        ids = torch.randint(1, min(m.cfg.vocab_size, 4000), (1, T), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = m(ids)[0].float().numpy()
        start_llama(L)
        model = L.llama_model_load_from_file(gg.encode(), L.llama_model_default_params())
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 2 * T, T, T, threads, threads
        ctx = L.llama_init_from_model(model, cp)
        nv = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        got = []
        for t in range(T):  # one position at a time, so every position's logits come back
            arr = (L.llama_token * 1)(int(ids[0, t]))
            if L.llama_decode(ctx, L.llama_batch_get_one(arr, 1)) != 0:
                raise BenchError("llama_decode failed")
            got.append(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(nv,)).copy())
        got = np.stack(got)[:, :ref.shape[-1]]
        vocab = L.llama_model_get_vocab(model)  # the GGUF's end-of-generation set must hold every special token
        tok = export.Source(ck).tokenizer()
        not_eog = [n for n, i in tok.special_ids.items() if not L.llama_vocab_is_eog(vocab, i)] if tok else None
        L.llama_free(ctx)
        L.llama_model_free(model)
    res = {"checkpoint": ck, "positions": T, "max_abs_diff": float(np.abs(got - ref).max()),
           "max_abs_logit": float(np.abs(ref).max()), "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).mean()),
           "specials_not_ending_generation": not_eog}
    print(f"parity {ck}: llama.cpp vs picaflor logits over {T} positions: max |diff| {res['max_abs_diff']:.2e} "
          f"(max |logit| {res['max_abs_logit']:.2f}), top-1 agreement {res['top1_agreement']:.3f}; "
          + ("no tokenizer" if not_eog is None else
             f"special tokens llama.cpp does not stop at: {', '.join(not_eog) or 'none'}"))
    return res


def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


# ----------------------------------------------------------------------------------------------------------
# parent side

def short_error(why):
    """A table cell: 'killed (OOM)' (in a memory cgroup), 'SIGKILL', 'SIGSEGV', or the first 12 characters."""
    if why.startswith("killed (out of memory"):
        return "killed (OOM)"
    if why.startswith("killed (SIGKILL"):  # no memory limit: not known to be memory
        return "SIGKILL"
    if why.startswith("crashed ("):
        return why[len("crashed ("):-1]
    return why[:12]


def exit_reason(returncode, err, limited):
    """Why a child ended: SIGKILL inside a memory cgroup is its OOM killer; any other signal is a crash (llama.cpp's
    repacked weights took a general protection fault in libggml-cpu.so on a Sapphire Rapids VM, signal 11)."""
    import stream_bench
    if returncode > 0:
        return f"exit {returncode}: {(err.strip().splitlines() or ['no message'])[-1]}"  # (a list's repr: "['error: ...']")
    return stream_bench.signal_reason(-returncode, limited)


def run_llama(args, budget_bytes, setting, build_dir=None):
    """One llama.cpp run in a fresh memory cgroup of budget_bytes (None: no limit), with the llama-cpp-python in
    build_dir (None: the installed one). Returns its result dict."""
    import stream_bench
    dropped = stream_bench.drop_page_cache(args.gguf)
    resident = stream_bench.page_cache_resident_bytes(args.gguf)  # did the drop work (tmpfs keeps every page)?
    cg, ver = stream_bench.limited_cgroup(budget_bytes) if budget_bytes else (None, None)
    if budget_bytes and not cg:
        raise BenchError("cannot create a memory cgroup (needs root and cgroup v1/v2 memory controller); "
                         "the comparison would not be under the same limit")
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--llama-child", "--gguf", args.gguf, "--setting", setting,
               "--threads", str(args.threads), "--tokens", str(args.tokens), "--prompt-tokens",
               str(args.prompt_tokens), "--max-seconds", str(args.max_seconds), "--result", out, "--seed", str(args.seed)]
        procs = os.path.join(cg, "cgroup.procs") if cg else None

        def enter():
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))
        t0 = time.time()
        env = dict(os.environ)
        if build_dir:
            env["PYTHONPATH"] = os.pathsep.join([build_dir] + [p for p in [env.get("PYTHONPATH")] if p])
        try:  # (Ctrl-C, an error: the child and its cgroup go too; they were left behind)
            try:
                p = subprocess.Popen(cmd, preexec_fn=enter, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env)
            except subprocess.SubprocessError:  # enter() failed: the child never ran (a traceback)
                raise BenchError(f"could not move the llama.cpp child into the memory cgroup {cg} (writing its pid "
                                 f"to {procs} failed); the comparison would not be under the same limit") from None
            try:
                _, err = p.communicate(timeout=args.max_seconds * 2 + 300)
                why = None if p.returncode == 0 else exit_reason(p.returncode, err, cg is not None)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                why = "timed out"
            except BaseException:
                p.kill()
                p.wait()
                raise
        finally:
            cg_peak = stream_bench.close_cgroup(cg)
        res = json.load(open(out)) if os.path.exists(out) else {"setting": setting, "tokens": 0}
        res.update(wall_s=time.time() - t0, cgroup=ver, cgroup_peak_bytes=cg_peak,
                   page_cache_dropped=bool(dropped) and (resident is None or resident <= stream_bench.RESIDENT_AFTER_DROP_SHARE
                                                         * os.path.getsize(args.gguf)),
                   page_cache_resident_after_drop_bytes=resident)
    if why:
        res["error"] = why
    if res.get("tokens", 0) < 2:
        res["decode_tok_s"] = None  # fewer than 2 decoded tokens is no rate
    return res


def run_picaflor(args, budget_str):
    with tempfile.TemporaryDirectory() as td:
        out = os.path.join(td, "p.json")
        # --tokens decode steps each: stream_infer's first new token comes from the prefill, its decode is the rest
        cmd = [sys.executable, os.path.join(ROOT, "stream_infer.py"), args.container, "--bench", "--max-new-tokens",
               str(args.tokens + 1), "--bench-prompt-tokens", str(args.prompt_tokens), "--threads", str(args.picaflor_threads),
               "--json", out] + (["--ram-budget", budget_str] if budget_str else [])
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if r.returncode != 0 or not os.path.exists(out):
            return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]}
        return json.load(open(out))


def make_gguf(args):
    """A Q4_0 GGUF of the container's weights, next to it; reused when it is newer than the container."""
    import container
    if os.path.exists(args.gguf) and os.path.getmtime(args.gguf) >= os.path.getmtime(args.container):
        return
    tok = args.tokenizer
    with tempfile.TemporaryDirectory() as td:
        if tok is None and not container.load_container(args.container).tokenizer_json:
            import tokenizer as tokmod  # a byte-level tokenizer so llama.cpp can load the vocab; ids are what we feed
            text = open(__file__).read() + open(os.path.join(ROOT, "README.md")).read()
            tok = os.path.join(td, "tokenizer.json")
            tokmod.train_tokenizer([text], 512).save(tok)
        cmd = [sys.executable, os.path.join(ROOT, "export.py"), args.container, "--format", "gguf", "--gguf-type",
               "q4_0", "--out", args.gguf] + (["--tokenizer", tok] if tok else [])
        print("writing the GGUF:", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            raise BenchError(f"{args.container}: GGUF export failed (see above)")


def budget_bytes_of(b, container_bytes):
    """Bytes of one --budgets item (None: no limit); BenchError for one that is not none, N% or a size."""
    import stream_infer
    if b in ("none", ""):
        return None
    try:
        if b.endswith("%"):
            pct = float(b[:-1])
            n = max(1, int(container_bytes * pct / 100)) if pct > 0 else None  # (NaN: not > 0)
        else:
            n = stream_infer.parse_size(b)
    except (ValueError, OverflowError, stream_infer.StreamError):  # (inf% overflowed)
        n = None
    if not n or n <= 0:  # (0% gave 0, which read as no limit)
        raise BenchError(f"--budgets: {b!r} is not none, a positive N% of the container, or a size like 2G")
    return n


def fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("container", nargs="?", help="int4 container (python export.py CKPT --format int4 --out X.pcf4)")
    ap.add_argument("--gguf", help="Q4_0 GGUF of the same model (default: next to the container, written if missing)")
    ap.add_argument("--tokenizer", help="tokenizer file for the GGUF when the container has none")
    ap.add_argument("--budgets", default="none,100%,50%,25%", help="memory limits: none, N%% of the container, or 2G")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="llama.cpp settings to try at each budget")
    ap.add_argument("--llama-builds", default="",
                    help="more llama-cpp-python builds to try each setting on, NAME=DIR,... (pip install --target DIR); "
                         "the installed one is 'installed'. Its native build's repacked weights (AMX) segfaulted on a "
                         "Sapphire Rapids VM, where a build with -DGGML_AMX_INT8=OFF ran them")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--picaflor-threads", default="auto", help="stream_infer --threads (auto: its own best choice)")
    ap.add_argument("--tokens", type=int, default=16, help="decoded tokens per run")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=180, help="stop a llama.cpp decode after this long (rate kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here (stream_infer.py --sweep plots llama.cpp's curve from it)")
    ap.add_argument("--parity", metavar="CKPT", help="only check that llama.cpp computes picaflor's logits on an f16 "
                                                      "GGUF of this training checkpoint, then exit")
    ap.add_argument("--llama-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--setting", default="mmap", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.llama_child and threading.current_thread() is threading.main_thread():
        def on_sigterm(signum, frame):  # as Ctrl-C: run_llama's cleanup ends the child and removes its cgroup
            raise KeyboardInterrupt
        signal.signal(signal.SIGTERM, on_sigterm)
    if args.llama_child:
        return llama_child(args)
    try:
        if args.parity:
            import_llama_cpp()
            return parity(args.parity, args.threads)
        if not args.container or not os.path.isfile(args.container):
            raise BenchError(f"{args.container}: no such container; make one with python container.py "
                             f"--random-config config/micro.py --out micro.pcf4")
        budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        for b in budgets:  # before the import and the GGUF export (minutes), not after them
            budget_bytes_of(b, os.path.getsize(args.container))
        settings = [s for s in args.settings.split(",") if s]
        bad = [s for s in settings if s not in SETTINGS]
        if bad:
            raise BenchError(f"--settings: unknown {bad[0]!r}; choose from {','.join(SETTINGS)}")
        builds = {"installed": None}
        for item in (x for x in args.llama_builds.split(",") if x):
            name, _, path = item.partition("=")
            if name in builds:
                raise BenchError(f"--llama-builds {item!r}: the name {name!r} is taken (one name per build; "
                                 f"'installed' is the llama-cpp-python installed here)")
            if not name or not os.path.isdir(os.path.join(path, "llama_cpp")):
                raise BenchError(f"--llama-builds {item!r}: NAME=DIR where DIR holds a llama_cpp package "
                                 f"(pip install --target DIR llama-cpp-python)")
            builds[name] = os.path.abspath(path)
        import_llama_cpp()
        # column name -> (setting, build dir): "mmap", or "mmap@noamx" once there is more than one build
        runs = {(st if len(builds) == 1 else f"{st}@{b}"): (st, d) for b, d in builds.items() for st in settings}
        settings = list(runs)
        args.gguf = args.gguf or os.path.splitext(args.container)[0] + ".q4_0.gguf"
        make_gguf(args)
        cbytes = os.path.getsize(args.container)
        rows = []
        for b in budgets:
            bb = budget_bytes_of(b, cbytes)
            bstr = None if bb is None else str(bb)
            print(f"\n== budget {b} ({'no limit' if bb is None else f'{bb / 1e9:.2f} GB'})", flush=True)
            pic = run_picaflor(args, bstr)
            print(f"picaflor: {fmt(pic.get('decode_tok_s'))} tok/s" + (f" ({pic['error']})" if "error" in pic else ""),
                  flush=True)
            lc = {}
            for s, (setting, build_dir) in runs.items():
                lc[s] = run_llama(args, bb, setting, build_dir)
                r = lc[s]
                print(f"llama.cpp {s}: {fmt(r.get('decode_tok_s'))} tok/s, {r.get('tokens', 0)} tokens"
                      + (f", peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB" if r.get("peak_rss_bytes") else "")
                      + (f" ({r['error']})" if "error" in r else ""), flush=True)
            ok = {s: r["decode_tok_s"] for s, r in lc.items() if r.get("decode_tok_s")}
            best = max(ok, key=ok.get) if ok else None
            p_tok = pic.get("decode_tok_s")
            rows.append({"budget": b, "budget_bytes": bb, "picaflor_tok_s": p_tok,
                         "picaflor_error": pic.get("error"),
                         "picaflor_hit_rate": pic.get("hit_rate"), "picaflor_disk_bytes_per_token": pic.get("disk_bytes_per_token"),
                         "picaflor_peak_rss_bytes": pic.get("peak_rss_bytes"), "picaflor_bound_tok_s": pic.get("bound_tok_s"),
                         "picaflor_page_cache_excluded": pic.get("page_cache_excluded"),
                         "llamacpp_tok_s": ok.get(best), "llamacpp_best_setting": best,
                         "ratio": (p_tok / ok[best]) if (p_tok and best) else None, "llamacpp": lc})
        w = max([12] + [len(c) for c in settings])
        print(f"\n{'budget':>8} {'GB':>6} {'picaflor tok/s':>14} {'llama.cpp tok/s':>15} {'best setting':>{w}} {'ratio':>7}   "
              + "  ".join(f"{s:>{w}}" for s in settings))
        for r in rows:
            print(f"{r['budget']:>8} {fmt(r['budget_bytes'] and r['budget_bytes'] / 1e9):>6} {fmt(r['picaflor_tok_s']):>14} "
                  f"{fmt(r['llamacpp_tok_s']):>15} {str(r['llamacpp_best_setting'] or '-'):>{w}} {fmt(r['ratio']):>7}   "
                  + "  ".join(f"{fmt(r['llamacpp'][s].get('decode_tok_s')) if r['llamacpp'][s].get('decode_tok_s') else short_error(r['llamacpp'][s].get('error', '-')):>{w}}"
                              for s in settings))
        resident = [r for r in rows if r["budget_bytes"] is None or r["budget_bytes"] >= cbytes]
        best_resident_lc = max((r["llamacpp_tok_s"] or 0 for r in resident), default=0)
        best_resident_pf = max((r["picaflor_tok_s"] or 0 for r in resident), default=0)
        summary = {"container": args.container, "container_bytes": cbytes, "gguf": args.gguf,
                   "gguf_bytes": os.path.getsize(args.gguf), "threads": args.threads, "tokens": args.tokens,
                   "prompt_tokens": args.prompt_tokens, "rows": rows,
                   "resident_ratio": best_resident_pf / best_resident_lc if best_resident_lc else None}
        if summary["resident_ratio"]:
            print(f"fully resident: picaflor {best_resident_pf:.2f} vs llama.cpp best {best_resident_lc:.2f} tok/s "
                  f"-> {summary['resident_ratio']:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"wrote {args.json}")
        return summary
    except BenchError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run in flight and its cgroup are gone (run_llama's finally)
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    main()
