"""
stream_bench: stream_infer's honest benchmark (issue 9, items 4 and 6), one budget or a sweep of them.

    python stream_infer.py model.pcf4 --ram-budget 2G --bench [--json OUT]
    python stream_infer.py model.pcf4 --sweep 3G,2G,1G --json OUT.json [--plot OUT.png] [--repeat 3]
    python stream_bench.py model.pcf4 --ram-budget 2G [--json OUT]   # the same as the first line

Each budget runs in a child process (stream_infer.py again, PICAFLOR_BENCH_CHILD set) inside a fresh memory
cgroup limited to the budget, page cache included (v2 memory.max, or v1 memory.limit_in_bytes; we must be root),
after the container's page cache was dropped (posix_fadvise DONTNEED). Where neither can be done the result says
so (page_cache_excluded false) and the figures are not disk-bound. The parent measures memory bandwidth before
and after the child (outside the cgroup: its buffers would count against the budget and the child's peak RSS; the
bound takes the faster, as some VMs' memory switches between two rates); the child measures the disk
(expert blobs read as the cache reads them) before loading, decodes, measures the disk again on blobs it never
read (the bound takes the mean, or the rate decode's own reads ran at if higher), and reports: prefill / decode
tok/s, p50 / p99 token latency, hit rate (lookups decode found cached; right prefetch guesses, read from the disk,
apart), disk bytes per token from /proc/self/io (and as counted), peak RSS, and the lower bound 1 / max(disk time,
memory time) per token, the disk time being the reads decode needed (its misses; with --prefetch its right guesses
too, never its wrong ones) at the measured rate, the memory time the weights one token touches at the rate this
machine reads a working set of their size (in cache where they fit, from DRAM where not). The result names each
rule (disk_bw_rule, mem_bw_rule) and prints it beside the figures. A probe that fails is tried once more; failing
twice, the run failed (a sweep tries the budget again next round), unlike a refusal. Swap on that the cgroup could
not shut out (no swap accounting) is said (swap_past_budget): the budget then bounded the child's RAM, not its memory.
A sweep writes a table, the same rows as a markdown table beside its JSON (OUT.md, what README.md shows) and a PNG
(decode tok/s, hit rate and disk bytes per token against the budget, with llama.cpp's curve from
bench/vs_llamacpp.py's JSON when there is one).
"""

import itertools
import json
import math
import os
import re
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if __name__ == "__main__":  # as stream_infer.py (kernels.openmp_kernels()): read by libgomp at torch import
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE" if sys.platform != "darwin" and
                          os.environ.get("PICAFLOR_OPENMP", "1") != "0" else "PASSIVE")

import torch

import checkpoint
import container as C
import expert_cache as EC
import kernels
import stream_infer as S


# ----------------------------------------------------------------------------------------------------------
# measurements

def measure_disk_bandwidth(cont, n_blobs=64, n_readers=4, exclude=(), picked=None):
    """O_DIRECT (when possible) reads of n_blobs expert blobs spread over the file, each as n_readers aligned parts
    on n_readers threads (expert_reader.cpp's, else Python's), as the cache reads them; only blobs not in `exclude` (those this run already read: a
    cache below the guest served recently read blobs at 2 GB/s here, fresh ones at 0.6-1.6). None if fewer than
    8 such blobs are left. The blobs it reads are added to the set `picked` when one is given."""
    import random
    keys = [(int(l), e) for l, ents in cont.header["experts"].items() for e in range(len(ents))]
    keys = [k for k in keys if k not in exclude]
    if len(keys) < 8:
        return None
    pick = random.sample(keys, min(n_blobs, len(keys)))  # fresh picks each time: a storage-side cache of
    n = cont.expert_nbytes                                # yesterday's picks would inflate the figure
    if picked is not None:
        picked.update(pick)
    part = -(-n // n_readers // C.ALIGN) * C.ALIGN
    blobs = EC.BlobBuffers(n)  # as the cache's buffers (huge pages, which read faster)
    bufs = [blobs.take() for _ in range(2)]
    ops = kernels.native_reader()  # (before the clock: its first load, ~0.1 s, read as slow disk)
    t0 = time.perf_counter()
    if ops is not None:  # expert_reader.cpp's threads, as the cache reads (its pool 2: the bench's)
        for r in [EC.NativeRead(cont, k, bufs[i % 2], 2, n_readers, ops, verify=False) for i, k in enumerate(pick)]:
            r.result()
        return len(pick) * n / (time.perf_counter() - t0)
    with ThreadPoolExecutor(n_readers) as pool:
        futs = [pool.submit(cont.read_expert_part, *k, bufs[i % 2], o, min(part, n - o))
                for i, k in enumerate(pick) for o in range(0, n, part)]
        for f in futs:
            f.result()
    return len(pick) * n / (time.perf_counter() - t0)


class ProbeFailed(S.StreamError):
    """A bandwidth probe failed twice: unlike a refusal, the next round may pass (a sweep runs the budget again)."""


def probe_twice(what, fn, *a, **kw):
    """fn(*a, **kw), a bandwidth probe, tried once more when it raises: one read's EINTR / EAGAIN or a momentary
    ENOMEM marked a whole budget refused (and a sweep never ran it again). Failing twice raises ProbeFailed."""
    errors = (OSError, MemoryError, C.ContainerError, EC.CacheError, S.StreamError)
    try:
        return fn(*a, **kw)
    except errors as e:
        print(f"stream_bench: {what} failed ({e}); trying it once more", file=sys.stderr)
    try:
        return fn(*a, **kw)
    except errors as e:
        raise ProbeFailed(f"{what} failed twice: {e}") from None


def cpu_times():
    """(steal, busy) jiffies of all CPUs from /proc/stat, or None: steal is time a hypervisor ran something else
    while this guest wanted the CPU (this VM lost 20-40% of its cycles so in busy hours, and tok/s with them);
    busy is all time but idle and iowait (user, nice, system, irq, softirq, steal; guest is inside user)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        v += [0] * (8 - len(v))
        return v[7], sum(v) - v[3] - v[4]
    except (OSError, ValueError):
        return None


def huge_page_bytes():
    """Bytes of this process's memory in transparent huge pages (/proc/self/smaps_rollup), or None: whether the
    kernel granted the weights and blob buffers the huge pages container.anon_buffer asks for."""
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def others_cpu_fraction(before, after, own_cpu_s, wall_s):
    """The share of all cores that other processes kept busy between two cpu_times() reads (busy less steal less
    this process's own CPU time): a neighbour (a spinning parent, a test run) takes cores decode wants. None for a
    window under 50 clock ticks (0.5 s): /proc/stat counts whole ticks, and a tiny model's 3-token decode once
    read 132% of the cores."""
    hz = os.sysconf("SC_CLK_TCK")
    if before is None or after is None or wall_s < 50 / hz:
        return None
    busy_s = ((after[1] - before[1]) - (after[0] - before[0])) / hz
    return max(0.0, busy_s - own_cpu_s) / (wall_s * (os.cpu_count() or 1))


def steal_fraction(before, after):
    """The share of the CPU time this machine wanted (busy jiffies) that the hypervisor took between two reads."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def weight_bytes_per_token(cont, experts_per_token=None):
    """Bytes of weights one decode token reads: everything resident but the input embedding (one row of it) plus
    experts_per_token routed experts in each MoE layer."""
    cfg = cont.config
    embed = cont.header["tensors"]["embed_tokens.weight"]["nbytes"] if not cfg.tie_embeddings else 0
    k = experts_per_token or cfg.top_k
    return cont.resident_bytes() - embed + k * (cfg.n_layer - cfg.n_dense_layers) * cont.expert_nbytes


def measure_memory_bandwidth(nbytes=64 << 20, reps=5, max_reps=40, max_s=0.5):
    """Bytes per second over a working set of nbytes, the weights a token reads (weight_bytes_per_token), read
    again and again as decode reads them: the faster of a read-only pass (a sum; decode only reads weights) and a
    copy of one half onto the other (read + write bytes), each the fastest of at least `reps` passes, then more
    (up to max_reps) while max_s lasts. The size matters: a Xeon VM here has a 260 MB L3, from which 64 MB read
    at 57 GB/s against 28 from DRAM (1 GB); a fixed 64 MB probe put a cache's speed in micro's bound (~0.5 GB a
    token) there, and a tiny model's weights do sit in cache. A hypervisor that takes the CPU for a few ms slows
    some passes, not the fastest: five copies in a steal spike once read 8.3 GB/s here against ~20."""
    n = max(1 << 18, nbytes // 8 * 2)  # fp32 elements, even, at least 1 MB
    buf = C.anon_tensor([n], torch.float32).fill_(1.0)  # in huge pages, as the engine's weights
    a, b = buf[: n // 2], buf[n // 2:]

    def fastest(fn):
        best, start = 1e9, time.perf_counter()
        for i in range(max_reps):
            if i >= reps and time.perf_counter() - start > max_s:
                break
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    return max(n * 4 / fastest(lambda: buf.sum()), n * 4 / fastest(lambda: b.copy_(a)))


def memory_bandwidth_elsewhere(threads, nbytes):
    """measure_memory_bandwidth over nbytes in a process of its own, with the threads decode will use, outside
    the child's cgroup (its buffer would count against the budget and stay in the child's peak RSS). Not in the
    parent: under OMP_WAIT_POLICY=ACTIVE the copy's OpenMP threads would spin on for the whole child run, and on
    2 cores they took ~1.4 of them from the child (micro 2G decode 11-14 tok/s against 25 without them)."""
    import subprocess
    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import stream_bench as B, stream_infer as S; "
            "torch.set_num_threads(S.compute_threads(None, sys.argv[2])); "
            "print(repr(B.measure_memory_bandwidth(int(sys.argv[3]))))")
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "ACTIVE"))
    r = subprocess.run([sys.executable, "-c", code, here, str(threads), str(nbytes)], env=env, capture_output=True,
                       text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise S.StreamError(f"measuring memory bandwidth failed (exit {r.returncode}): {tail}")
    return float(r.stdout.split()[-1])


def measure_kernels(cont, reps=20):
    """ms per decode GEMV (M=1) of one expert's gate_up (hot in cache): native (int4_cpu.cpp) vs torch's int4pack
    kernel vs dequantize-then-matmul vs fp32 dense; None for a model without routed experts."""
    if not cont.header["experts"]:
        return None
    dec = cont.decode_expert(cont.read_expert_blob(int(next(iter(cont.header["experts"]))), 0))["gate_up_proj"]
    shape, g = dec["shape"], dec["group_size"]
    x = torch.randn(1, shape[1])
    w = C.dequantize_int4(dec["packed"], dec["sz"], shape, g)
    fns = {"reference_dequant_matmul": lambda: kernels.int4_matmul_reference(x, dec["packed"], dec["sz"], shape, g),
           "fp32_dense": lambda: x @ w.t()}
    if kernels.native_int4() is not None:
        fns["native"] = lambda: kernels.int4_matmul_native(x, dec["packed"], dec["sz"], shape, g)
    if kernels.cpu_int4pack_ok() and g in kernels.INT4PACK_GROUPS:
        packed4 = kernels.to_int4pack_layout(dec["packed"].clone(), shape, g)
        fns["int4pack"] = lambda: kernels.int4_matmul_cpu(x, packed4, dec["sz"], shape, g)
    out = {"shape": shape}
    for name, fn in fns.items():
        fn()
        ts = []
        for _ in range(reps if name != "reference_dequant_matmul" else 3):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = sorted(ts)[len(ts) // 2] * 1e3
    return out


def run_bench(eng, n_prompt=32, n_new=32, experts_per_token=None, seed=0, disk_bw=None, mem_bw=None,
              disk_picked=()):
    """Decode n_new tokens after an n_prompt-token random prompt and measure. The disk is measured before loading
    (disk_bw, by the caller; disk_picked: the blobs it read) and again right after decoding, on blobs this run has
    not read; the bound uses their mean (this VM's disk drifted 0.6-2 GB/s between runs minutes apart, and one
    figure taken before a run misjudged it), or the rate decode's own reads ran at when that is higher: blobs
    that earlier runs read came back at 2-4 GB/s here (a cache below the guest), and a bound looser than what
    was achieved would flatter the result. Memory bandwidth (mem_bw) is measured before loading too, by the
    parent under --bench: its buffer, a token's weights in size, would not fit in the budget's working memory."""
    cfg, cont = eng.cfg, eng.container
    k = experts_per_token or cfg.top_k
    mem_per_tok = weight_bytes_per_token(cont, k)
    picked = set(disk_picked)
    disk_before = disk_bw or probe_twice("the disk probe before decode", measure_disk_bandwidth, cont,
                                         n_readers=eng.n_readers, picked=picked)
    mem_rule = "the parent's probe before loading" if mem_bw else "one probe before decode"
    mem_bw = mem_bw or probe_twice("the memory probe", measure_memory_bandwidth, mem_per_tok)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, cfg.vocab_size, (n_prompt,), generator=gen).tolist()
    eng.cache.reset_counters()
    timings = []
    rb0 = S.io_counters()
    t0 = time.perf_counter()
    it = eng.stream(prompt, n_new, temperature=0.0, experts_per_token=experts_per_token, timings=timings)
    first = next(it)
    prefill_s = time.perf_counter() - t0
    st_prefill = eng.cache.stats()
    rb1 = S.io_counters()
    majflt0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    cpu0, own0, wall0 = cpu_times(), time.process_time(), time.perf_counter()
    lookups0, hits0, guess_hits0 = eng.cache.lookups, eng.cache.hits, eng.cache.prefetch_hits
    demanded0 = eng.cache.misses + eng.cache.prefetch_hits  # reads decode needed (a right guess is one)
    bytes0, wait0, busy0 = eng.cache.bytes_read, eng.cache.read_wait_s, eng.cache.disk_busy_s
    tally0 = list(eng.guess_tally)
    out = [first] + list(it)
    cpu1, own1, wall1 = cpu_times(), time.process_time(), time.perf_counter()
    rb2 = S.io_counters()
    majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - majflt0  # pages (code, page cache) the budget evicted and decode faulted back
    decode_lat = timings[1:]
    n_dec = len(decode_lat)
    st = eng.cache.stats()
    dec_lookups = st["lookups"] - lookups0
    # a hit: an expert decode found cached, no read for it; a right guess was read from the disk this token (a
    # prefetch hit, counted as a hit, put 0.73 on a run whose reads left 0.38 of its lookups unread)
    dec_hit = (st["hits"] - hits0) / max(dec_lookups, 1)
    dec_guess_hit = (st["prefetch_hits"] - guess_hits0) / max(dec_lookups, 1)
    dec_bytes = st["bytes_read"] - bytes0
    counted_per_tok = dec_bytes / max(n_dec, 1)
    # storage reads as the kernel counts them; without /proc/self/io (macOS) the cache's own count stands in
    disk_per_tok = (rb2[0] - rb1[0]) / max(n_dec, 1) if rb1 and rb2 else counted_per_tok
    wait_per_tok = (eng.cache.read_wait_s - wait0) / max(n_dec, 1)
    busy = eng.cache.disk_busy_s - busy0  # decode's own reads: bytes over the time any was running
    disk_decode = dec_bytes / busy if busy > 0 and dec_bytes >= 8 * cont.expert_nbytes else None
    disk_after = probe_twice("the disk probe after decode", measure_disk_bandwidth, cont, n_readers=eng.n_readers,
                             exclude=eng.cache.read_keys | picked)
    known = [b for b in (disk_before, disk_after) if b]
    disk_bw = sum(known) / len(known) if known else None
    # which rule set the bound's disk figure, in the result and the printed line (memory's is another: the faster)
    disk_rule = ("mean of before and after" if len(known) == 2 else "before alone" if disk_before else
                 "after alone" if disk_after else None)
    if disk_decode and (disk_bw is None or disk_decode > disk_bw):  # the disk served decode faster than measured
        disk_bw = disk_decode  # (a cache below this machine): the bound must not be looser than what was achieved
        disk_rule = f"decode's reads (faster than {disk_rule or 'no probe'})"
    # the bound's disk time: the reads decode needed (its misses, right guesses included), not wrong guesses
    demanded_per_tok = (st["misses"] + st["prefetch_hits"] - demanded0) * cont.expert_nbytes / max(n_dec, 1)
    guessed = eng.guess_tally[0] - tally0[0]  # picks a guess was made for (prefetch on, or auto's probe)
    lat = sorted(decode_lat)
    # nearest rank: the smallest latency at least a q share of tokens took no longer than (int(q * n) took the one
    # above it: of 2 tokens p50 was the slower, of 100 p99 the slowest)
    pct = (lambda q: lat[max(0, math.ceil(q * len(lat) - 1e-9) - 1)] if lat else float("nan"))
    return {
        "container": eng.path, "container_bytes": cont.file_size, "random_weights": cont.header.get("random_weights"),
        "ram_budget": eng.budget, "kernel": eng.kernel, "experts_per_token": k, "threads": torch.get_num_threads(),
        "prompt_tokens": n_prompt, "new_tokens": len(out),
        "prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_dec / max(sum(decode_lat), 1e-9),
        "p50_token_latency_s": pct(0.5), "p99_token_latency_s": pct(0.99),
        "hit_rate": dec_hit, "prefetch_hit_rate": dec_guess_hit, "hit_rate_with_prefill": st["cache_hit_rate"],
        "prefill_reads": st_prefill["reads"],
        "disk_bytes_per_token": disk_per_tok, "counted_bytes_per_token": counted_per_tok,
        "prefill_disk_bytes": rb1[0] - rb0[0] if rb0 and rb1 else st_prefill["bytes_read"],
        "disk_bytes_source": "/proc/self/io" if rb1 and rb2 else "counted (no /proc/self/io here)",
        "demanded_bytes_per_token": demanded_per_tok,
        "read_wait_s_per_token": wait_per_tok, "major_faults_per_token": majflt / max(n_dec, 1),
        "cpu_steal_fraction": steal_fraction(cpu0, cpu1),
        "others_cpu_fraction": others_cpu_fraction(cpu0, cpu1, own1 - own0, wall1 - wall0), "cache_policy": eng.cache.policy,
        "expert_bytes": cont.expert_nbytes, "cache_capacity_experts": st["capacity_experts"],
        "model_experts": eng.every_expert_bytes // cont.expert_nbytes if cont.expert_nbytes else 0,
        "peak_rss_bytes": S.peak_rss_bytes(), "resident_rss_bytes": eng.resident_rss, "baseline_rss_bytes": eng.baseline_rss,
        "huge_page_bytes": huge_page_bytes(),
        "disk_bw_bytes_s": disk_bw, "disk_bw_before_bytes_s": disk_before, "disk_bw_after_bytes_s": disk_after,
        "disk_bw_decode_bytes_s": disk_decode, "disk_bw_rule": disk_rule,
        "mem_bw_bytes_s": mem_bw, "mem_bw_rule": mem_rule, "weight_bytes_per_token": mem_per_tok,
        **bounds(mem_per_tok, mem_bw, demanded_per_tok, disk_bw),
        "prefetch": eng.prefetch_mode, "prefetch_on_at_end": bool(eng.moes and eng.moes[0].prefetch),
        "guess_right_rate": (eng.guess_tally[1] - tally0[1]) / guessed if guessed else None,
        "prefetch_verdicts": list(eng.prefetch_verdicts),
        "direct_io": cont.direct_fd is not None, "load_s": eng.load_s, "cache": st, "preloaded": eng.preloaded, "preloaded_experts": eng.preloaded_experts,
        "kernel_ms": measure_kernels(cont) if eng.device == "cpu" else None,
    }


def bounds(weight_bytes_per_token, mem_bw, demanded_bytes_per_token, disk_bw):
    """The lower bound per token: 1 / max(memory time, disk time) (perfect overlap), and 1 / their sum (serial)."""
    t_mem = weight_bytes_per_token / mem_bw
    t_disk = demanded_bytes_per_token / disk_bw if disk_bw else 0.0
    return {"bound_tok_s": 1.0 / max(t_mem, t_disk, 1e-12), "bound_tok_s_serial": 1.0 / max(t_mem + t_disk, 1e-12)}


_CGROUP_SERIAL = itertools.count(1)


def signal_reason(signum, limited):
    """Why a child a signal ended died: SIGKILL is the OOM killer's only where a memory cgroup limited it (any signal
    was said to be "out of memory inside the cgroup?", with no cgroup made or for a SIGSEGV)."""
    import signal
    sig = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
    if sig == "SIGKILL":
        return "killed (out of memory in the cgroup)" if limited else "killed (SIGKILL; no memory limit was set)"
    return f"crashed ({sig})"


class ChildFailed(S.StreamError):
    """The measuring child died (an OOM kill, say): unlike a refusal, the next try may not."""


def remove_stale_cgroups(parent):
    """Empty picaflor-bench-PID-N cgroups in parent whose PID is dead (a bench killed with SIGKILL left them)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = re.match(r"^picaflor-bench-(\d+)-\d+$", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.rmdir(os.path.join(parent, name))  # refused while a process is still inside: left alone
            except OSError:
                pass


def cgroup_memory_dir():
    """A fresh child memory cgroup (v2 memory.max or v1 memory.limit_in_bytes) or None; we must be root."""
    name = f"picaflor-bench-{os.getpid()}-{next(_CGROUP_SERIAL)}"  # one per budget of a sweep (a leftover one's
    # name, reused, made the next mkdir fail and that budget ran unlimited)
    try:
        with open(os.path.join(S.PROC_SELF, "cgroup")) as f:
            own = f.read().splitlines()  # this process's cgroups, v2 ("0::path") and v1 ("N:controllers:path")
    except OSError:  # no /proc (macOS): no cgroups either
        return None, None
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        ctl = os.path.join(root, "cgroup.controllers")
        if os.path.exists(ctl) and "memory" in open(ctl).read().split():
            rel = next((l.split(":", 2)[2].strip() for l in own if l.startswith("0::")), "/")
            d = os.path.join(root, rel.lstrip("/"), name)
            remove_stale_cgroups(os.path.dirname(d))
            try:
                os.mkdir(d)
                return d, "v2"
            except OSError:
                pass
    rel = next((l.split(":", 2)[2].strip() for l in own if ":memory:" in l), None)
    if rel is not None and os.path.isdir("/sys/fs/cgroup/memory"):
        d = os.path.join("/sys/fs/cgroup/memory", rel.lstrip("/"), name)
        remove_stale_cgroups(os.path.dirname(d))
        try:
            os.mkdir(d)
            return d, "v1"
        except OSError:
            pass
    return None, None


def die_with_parent():
    """In a child (preexec_fn): SIGKILL it when the parent dies (a SIGKILLed bench left its child running in its
    cgroup); Linux's prctl(PR_SET_PDEATHSIG), nothing elsewhere."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def drop_page_cache(path):
    """posix_fadvise(DONTNEED) over a whole file, so the next reads come from the disk; True if it was done."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a container just written) survive DONTNEED: 84 of 300 MB stayed cached
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def page_cache_resident_bytes(path):
    """Bytes of the file at path in the page cache now (mincore over a read-only mapping of it, which faults nothing
    in), or None where that cannot be asked (not Linux, no libc mincore): "unverified"."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import mmap
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                                  ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        fd = os.open(path, os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
            if libc.mincore(addr, size, vec) != 0:
                return None
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    pages = bytes(vec).translate(bytes(b & 1 for b in range(256)))  # bit 0: resident (the others are reserved)
    tail = size - (len(pages) - 1) * mmap.PAGESIZE  # the last page is partly past the file's end
    return pages[:-1].count(1) * mmap.PAGESIZE + pages[-1] * tail


RESIDENT_AFTER_DROP_SHARE = 0.01  # more of the container cached after the drop: its misses may be served from RAM


def page_cache_verdict(dropped, resident, size, memory_limited, direct_io, fs):
    """(page_cache_excluded, why not or None). resident: page_cache_resident_bytes after the drop (None: unverified)."""
    if fs in RAM_FILESYSTEMS:  # tmpfs / ramfs: O_DIRECT and DONTNEED succeed, and every read is served from memory
        return False, f"the container is on {fs}"
    if not dropped:
        return False, "posix_fadvise(DONTNEED) failed on the container"
    if resident is not None and resident > RESIDENT_AFTER_DROP_SHARE * size:
        return False, (f"{S.fmt_size(resident)} of the container's {S.fmt_size(size)} stayed in the page cache after "
                       f"the drop")
    if not (memory_limited or direct_io):
        return False, "no memory cgroup and no O_DIRECT"
    return True, None


def limited_cgroup(budget):
    """A fresh memory cgroup limited to budget bytes (page cache included, no swap): (dir, "v1"/"v2") or
    (None, None) where none can be made. Processes join by writing their pid to dir/cgroup.procs."""
    def write(name, value):  # closed here: a write the kernel refused raised at a garbage-collected close, unheard,
        with open(os.path.join(cg, name), "w") as f:  # and the budget ran unlimited, reported as limited
            f.write(value)

    cg, ver = cgroup_memory_dir()
    if cg:
        try:
            if filesystem_type(cg) not in (None, "cgroup", "cgroup2"):  # a plain folder (a tmpfs where a cgroup mount
                raise OSError  # was expected) took the limit and the pid as files and limited nothing, said limited
            if ver == "v2":
                write("memory.max", str(budget))
                try:
                    write("memory.swap.max", "0")
                except OSError:
                    pass
            else:
                write("memory.limit_in_bytes", str(budget))
                try:  # memory + swap at the same limit: no swap (absent when the kernel does not account swap)
                    write("memory.memsw.limit_in_bytes", str(budget))
                except OSError:
                    pass
        except OSError:
            try:
                os.rmdir(cg)
            except OSError:  # (left for remove_stale_cgroups)
                pass
            return None, None
    return cg, ver


PROC_SWAPS, PROC_MEMINFO = "/proc/swaps", "/proc/meminfo"  # (tests point these elsewhere)


def swap_total_bytes():
    """Bytes of swap this machine has on (/proc/swaps' devices, else /proc/meminfo's SwapTotal), or None where
    neither can be read (not Linux)."""
    try:
        with open(PROC_SWAPS) as f:  # "Filename Type Size Used Priority", then one line a device, sizes in KiB
            total = sum(int(line.split()[2]) * 1024 for line in f.read().splitlines()[1:] if line.strip())
        if total:
            return total
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(PROC_MEMINFO) as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def swap_limited(cg, ver):
    """Whether the cgroup keeps its processes out of swap, read back from the kernel (the write was let fail unsaid:
    with swap on and no swap accounting, the child could hold more than the budget, its excess swapped out): v2
    memory.swap.max 0, v1 memory.memsw.limit_in_bytes (memory + swap) no more than memory.limit_in_bytes."""
    def read(name):
        try:
            with open(os.path.join(cg, name)) as f:
                return f.read().strip()
        except OSError:
            return None
    if ver == "v2":
        return read("memory.swap.max") == "0"
    both, mem = read("memory.memsw.limit_in_bytes"), read("memory.limit_in_bytes")
    return both is not None and mem is not None and both.isdigit() and mem.isdigit() and int(both) <= int(mem)


def close_cgroup(cg):
    """The peak memory the cgroup saw (bytes, or None), then remove it (its processes have exited)."""
    if not cg:
        return None
    peak = None
    for fname in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            peak = int(open(os.path.join(cg, fname)).read().split()[0])
            break
        except (OSError, ValueError):
            pass
    import signal
    if not os.path.isdir(cg):
        return peak
    try:  # v2: the kernel ends them all (no pid read, then reused, then killed)
        open(os.path.join(cg, "cgroup.kill"), "w").write("1")
    except OSError:
        pass
    for _ in range(50):  # what the child left in it (a compiler it started, its grandchildren): ended, then removed
        try:
            pids = [int(p) for p in open(os.path.join(cg, "cgroup.procs")).read().split()]
        except (OSError, ValueError):
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(cg)
            return peak
        except OSError:
            time.sleep(0.1)
    print(f"stream_bench: WARNING: could not remove the memory cgroup {cg}; remove it with rmdir when its processes "
          f"have exited", file=sys.stderr)
    return peak


def least_budget(args):
    """The --ram-budget a plain run of these settings would ask for (its "raise it to at least"), or None: the
    engine's own check, asked with a 1-byte budget, refuses before loading anything big."""
    try:
        S.load(args.container, 1, args.device, kernel=args.kernel, n_readers=args.readers, prefetch=args.prefetch,
               context=args.context, cache_policy=args.cache_policy, preload=False)
    except (S.StreamError, C.ContainerError) as e:
        return getattr(e, "least_budget", None)
    return None


def bench_in_cgroup(args, argv):
    """Parent side: drop the container's page cache, make a memory cgroup of --ram-budget, run the benchmark in
    a child process inside it. Returns the result dict."""
    import subprocess
    import tempfile
    budget = S.parse_size(args.ram_budget) if args.ram_budget else None
    baseline = S.rss_bytes()  # python and torch: the child would be OOM-killed importing torch ("killed (OOM?)")
    if budget and budget < baseline:
        least = least_budget(args)
        raise S.StreamError(f"--ram-budget {args.ram_budget}: below the {S.fmt_size(baseline)} python and torch "
                            f"alone take here, before any of the model; raise it"
                            + (f" to at least {S.fmt_budget(least)}" if least else ""))
    # the figures come at the end: a tiny model's run printed nothing for 20-30 s, a big one's for minutes
    where = f"at --ram-budget {args.ram_budget}" if budget else "without a --ram-budget"
    print(f"stream_bench: {args.container} {where}{getattr(args, 'run_label', '')}: a memory probe, then a child "
          f"loads it, prefills {S.plural(args.bench_prompt_tokens, 'token')} and decodes {args.max_new_tokens}"
          + (" in its own memory cgroup" if budget else "") + ", then the probe again; figures at the end",
          file=sys.stderr, flush=True)
    try:
        cont = C.load_container(args.container)
        per_token = weight_bytes_per_token(cont, args.experts_per_token)
        cont.close()
    except C.ContainerError as e:
        raise S.StreamError(str(e)) from None
    # before the cgroup exists: its failure leaves none behind
    mem_bw = probe_twice("the memory probe before the child", memory_bandwidth_elsewhere, args.threads, per_token)
    if args.device == "cpu":  # a first build compiles here, not inside the budget (the compiler was OOM-killed, or
        kernels.native_int4()  # its ~15 s sat in the child's timed disk measurement)
        kernels.native_reader()
    dropped = drop_page_cache(args.container)
    resident = page_cache_resident_bytes(args.container)  # did the drop work? (before the child reads anything)
    cg, ver = limited_cgroup(budget) if budget else (None, None)
    swap = swap_total_bytes()
    swap_ok = swap_limited(cg, ver) if cg else None
    if budget and not cg:
        print(f"stream_bench: WARNING: no memory cgroup could be made (root and cgroup v1 or v2 with the memory "
              f"controller are needed); --ram-budget {args.ram_budget} bounds the engine's own accounting only, not "
              f"the page cache: the figures are not memory-limited", file=sys.stderr)
    with tempfile.TemporaryDirectory() as td:
        res_path = os.path.join(td, "result.json")
        argv = [sys.executable, os.path.abspath(S.__file__)] + list(argv)  # the child: stream_infer.py
        env = dict(os.environ, PICAFLOR_BENCH_CHILD=res_path, PICAFLOR_BENCH_MEM_BW=repr(mem_bw))
        procs = os.path.join(cg, "cgroup.procs") if cg else None

        def enter_cgroup():
            die_with_parent()
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        cpu0 = time.process_time()

        def on_sigterm(signum, frame):  # as Ctrl-C (a sweep stops too): kill left the child running, its cgroup and
            raise KeyboardInterrupt  # temp dir behind
        import signal
        old = {sig: signal.signal(sig, on_sigterm) for sig in (signal.SIGTERM, signal.SIGHUP)}  # (a hangup left both)
        try:  # Ctrl-C: subprocess.run ends the child, then the cgroup goes too (it was left behind)
            r = subprocess.run(argv, env=env, preexec_fn=enter_cgroup)
        except subprocess.SubprocessError:  # enter_cgroup failed: the child never ran (a traceback, the sweep ended)
            raise S.StreamError(f"{args.container}: could not move the benchmark child into the memory cgroup {cg} "
                                f"(writing its pid to {procs} failed); run without --ram-budget, or as root with a "
                                f"memory controller that lets this process's cgroup have children") from None
        finally:
            cg_peak = close_cgroup(cg)
            for sig, handler in old.items():  # (after: a second signal while cleaning up is the same request)
                signal.signal(sig, handler)
        parent_cpu_s = time.process_time() - cpu0  # this process while the child ran: ~0, or it stole the child's cores
        res = json.load(open(res_path)) if r.returncode >= 0 and os.path.exists(res_path) else None
        if res is not None and "error" in res:  # the child refused (below the resident size): its reason, not "exit 1"
            raise (ProbeFailed if res.get("probe_failed") else S.StreamError)(res["error"])
        if r.returncode != 0 or res is None:
            why = signal_reason(-r.returncode, cg is not None) if r.returncode < 0 else f"exit {r.returncode}"
            raise ChildFailed(f"{args.container}: benchmark child failed ({why}) at --ram-budget {args.ram_budget}")
    # memory again, after the child: a 2-vCPU AMD EPYC VM read 34-37 GB/s or 57-68 GB/s by turns, switching within
    # seconds (fresh buffers alike: the host's state, not page placement), so one probe before a run set the bound by
    # luck (36% or 57% of it at 3G, decode the same); the faster of the two: a bound no looser than what it showed
    mem_after = probe_twice("the memory probe after the child", memory_bandwidth_elsewhere, args.threads, per_token)
    res["mem_bw_before_bytes_s"], res["mem_bw_after_bytes_s"] = mem_bw, mem_after
    res["mem_bw_bytes_s"], res["mem_bw_rule"] = max(mem_bw, mem_after), "faster of before and after"
    res.update(bounds(res["weight_bytes_per_token"], res["mem_bw_bytes_s"], res["demanded_bytes_per_token"],
                      res["disk_bw_bytes_s"]))
    res["cgroup"] = ver if cg else None
    res["parent_cpu_s"] = parent_cpu_s
    res["mem_probe_bytes"] = per_token  # the working set memory bandwidth was measured over
    res["cgroup_peak_bytes"] = cg_peak
    res["page_cache_dropped"] = dropped
    res["page_cache_resident_after_drop_bytes"] = resident  # None: unverified (no mincore here)
    fs = filesystem_type(args.container)
    res["container_filesystem"] = fs
    res["memory_limited"] = cg is not None
    # swap on that the cgroup could not shut out: memory.max bounded RAM alone, the rest of the child could swap
    res["swap_total_bytes"], res["swap_limited"] = swap, swap_ok
    res["swap_past_budget"] = bool(cg and not swap_ok and swap)
    res["page_cache_excluded"], res["page_cache_not_excluded_why"] = page_cache_verdict(
        dropped, resident, os.path.getsize(args.container), cg is not None, res.get("direct_io"), fs)
    if fs in RAM_FILESYSTEMS:
        print(f"stream_bench: WARNING: {args.container} is on {fs} (memory): its reads never reach a disk; the figures "
              f"are not disk-bound", file=sys.stderr)
    return res


RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "hugetlbfs")


def filesystem_type(path, _depth=0):
    """The type of the filesystem holding path (the longest mount point over it in /proc/self/mounts), or None."""
    try:
        mounts = [line.split() for line in open(os.path.join(S.PROC_SELF, "mounts"))]
    except OSError:  # macOS
        return None
    real = os.path.realpath(path)
    best, fs, opts = "", None, ""
    for m in mounts:
        point = re.sub(r"\\([0-7]{3})", lambda o: chr(int(o.group(1), 8)), m[1]) if len(m) > 2 else None  # \040 ...
        if point and (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, fs, opts = point, m[2], (m[3] if len(m) > 3 else "")
    if fs == "overlay" and _depth < 4:  # what its layers sit on: an overlay over tmpfs was reported as disk-bound
        dirs = [d for o in opts.split(",") if o.startswith(("lowerdir=", "upperdir="))
                for d in o.split("=", 1)[1].split(":") if d]
        under = [filesystem_type(d, _depth + 1) for d in dirs]
        return next((u for u in under if u in RAM_FILESYSTEMS), fs)
    return fs


def disk_spread(res):
    """' (mean of before and after: before 0.81, after 1.20, decode's reads 0.90)': the rule that set the bound's
    disk figure, and what it came from (a reader took the memory's rule, the faster, for the disk's too)."""
    parts = [f"{name} {res[key] / 1e9:.2f}" for name, key in (("before", "disk_bw_before_bytes_s"),
             ("after", "disk_bw_after_bytes_s"), ("decode's reads", "disk_bw_decode_bytes_s")) if res.get(key)]
    rule = f"{res['disk_bw_rule']}: " if res.get("disk_bw_rule") else ""
    return f" ({rule}{', '.join(parts)})" if parts else ""


def mem_spread(res):
    """' (faster of before and after: before 35.7, after 64.1)': the rule, and the two memory probes (--bench's
    parent only)."""
    rule = f"{res['mem_bw_rule']}: " if res.get("mem_bw_rule") else ""
    if res.get("mem_bw_after_bytes_s") is None:
        return f" ({res['mem_bw_rule']})" if rule else ""
    return f" ({rule}before {res['mem_bw_before_bytes_s'] / 1e9:.1f}, after {res['mem_bw_after_bytes_s'] / 1e9:.1f})"


OTHERS_WARN = 0.10  # above this share of the cores busy with other processes during decode, likewise
STEAL_WARN = 0.05  # above this share of CPU time taken by the hypervisor, the bench says its tok/s is not the machine's


def fmt_steal(r):
    """'3%', or '3% (1-22)' over a row's runs, or 'n/a'."""
    v = r.get("cpu_steal_fraction")
    out = "n/a" if v is None else f"{v * 100:.0f}%"
    runs = [x.get("cpu_steal_fraction") for x in r.get("runs", [])]
    if runs and None not in runs:
        out += f" ({min(runs) * 100:.0f}-{max(runs) * 100:.0f})"
    return out


def prefetch_summary(res):
    """'off', 'on (guesses 86% right)', 'auto: off at the end (guesses 61% right)'."""
    mode, rate = res.get("prefetch", "off"), res.get("guess_right_rate")
    out = mode if mode != "auto" else f"auto: {'on' if res.get('prefetch_on_at_end') else 'off'} at the end"
    return out + (f" (guesses {rate * 100:.0f}% right)" if rate is not None else "")


def print_bench(res):
    g = lambda n: f"{n / 1e9:.2f} GB" if n is not None else "n/a"  # noqa: E731
    print(f"container {res['container']} ({S.fmt_size(res['container_bytes'])}, "
          f"random weights: {res['random_weights']}), "
          f"budget {S.fmt_size(res['ram_budget']) if res['ram_budget'] else 'none'}, kernel {res['kernel']}, "
          f"{S.plural(res['threads'], 'thread')}, top-{res['experts_per_token']}")
    print(f"prefill {res['prefill_tok_s']:.2f} tok/s ({S.plural(res['prompt_tokens'], 'token')}) | decode "
          f"{res['decode_tok_s']:.2f} tok/s "
          f"| token latency p50 {res['p50_token_latency_s'] * 1e3:.1f} ms p99 {res['p99_token_latency_s'] * 1e3:.1f} ms")
    guess = res.get("prefetch_hit_rate")
    print(f"expert cache: hit rate {res['hit_rate']:.3f} (decode" + (f"; {guess:.3f} more were right guesses, read "
          f"ahead" if guess else "") + "), "
          f"capacity {S.plural(res['cache_capacity_experts'], 'expert')} "
          f"(the model has {res.get('model_experts', '?')}) of {res['expert_bytes'] / 1e6:.2f} MB | "
          f"disk read per token {res['disk_bytes_per_token'] / 1e6:.2f} MB "
          f"({res.get('disk_bytes_source', '/proc/self/io')}; counted {res['counted_bytes_per_token'] / 1e6:.2f} MB) "
          f"| waiting for reads "
          f"{res['read_wait_s_per_token'] * 1e3:.1f} ms of a token's {1e3 / max(res['decode_tok_s'], 1e-9):.1f} ms")
    cgp = res.get("cgroup_peak_bytes")
    huge = res.get("huge_page_bytes")
    # a page is charged to the cgroup that first read it: torch's libraries, cached by an earlier process, are not
    below = " (under RSS: pages other processes cached first, torch's libraries, are charged to theirs)"
    print(f"peak RSS {S.fmt_size(res['peak_rss_bytes'])} (cgroup peak incl. page cache "
          f"{S.fmt_size(cgp) if cgp else 'n/a'}{below if cgp and cgp < res['peak_rss_bytes'] else ''}; "
          f"in huge pages {S.fmt_size(huge) if huge is not None else 'n/a'}) | "
          f"disk {g(res['disk_bw_bytes_s']).replace(' GB', ' GB/s')}{disk_spread(res)}, memory "
          f"{res['mem_bw_bytes_s'] / 1e9:.2f} GB/s{mem_spread(res)} -> bound "
          f"{res['bound_tok_s']:.2f} tok/s (serial {res['bound_tok_s_serial']:.2f}); decode is "
          f"{res['decode_tok_s'] / res['bound_tok_s'] * 100:.0f}% of the bound")
    km = res.get("kernel_ms")
    if km:
        print(f"expert gate_up GEMV {km['shape']}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in km.items() if k != "shape"))
    steal, others = res.get("cpu_steal_fraction"), res.get("others_cpu_fraction")
    resident = res.get("page_cache_resident_after_drop_bytes")
    print(f"cgroup: {res.get('cgroup')}, O_DIRECT: {res['direct_io']}, page cache excluded: {res.get('page_cache_excluded')} "
          f"(cached after the drop: {'unverified' if resident is None else S.fmt_size(resident)}), "
          f"cache policy {res.get('cache_policy')}, prefetch {prefetch_summary(res)}, CPU steal during decode "
          f"{'n/a' if steal is None else f'{steal * 100:.1f}%'}, other processes' CPU "
          f"{'n/a' if others is None else f'{others * 100:.1f}%'}")
    if steal is not None and steal > STEAL_WARN:
        print(f"WARNING: the hypervisor took {steal * 100:.0f}% of the CPU time this machine wanted during decode: tok/s is "
              f"lower than this machine gives alone; rerun in a quieter hour or take the median of --repeat", file=sys.stderr)
    if others is not None and others > OTHERS_WARN:
        print(f"WARNING: other processes kept {others * 100:.0f}% of this machine's cores busy during decode "
              f"(this benchmark's parent: {res.get('parent_cpu_s', 0):.1f} s of CPU): tok/s is lower than this "
              f"machine gives alone; stop them and rerun", file=sys.stderr)
    if res["decode_tok_s"] > res["bound_tok_s"]:
        print(f"WARNING: decode ran faster than its lower bound ({res['decode_tok_s']:.2f} > {res['bound_tok_s']:.2f} "
              f"tok/s): a bandwidth measurement was disturbed (CPU steal or a cache below this machine), so the % of "
              f"the bound means nothing here; rerun", file=sys.stderr)
    if res["bound_tok_s"] > 500:  # (config/tiny: "0% of the bound" of 77,525 tok/s, read as a broken engine)
        print(f"note: a token reads {res['weight_bytes_per_token'] / 1e6:.1f} MB of weights, so the bound is under 2 ms a "
              f"token: per-token overhead (Python, kernel calls), which it leaves out, sets a model this small's speed; "
              f"the bound speaks for models whose weights a token reads are far above the CPU's cache", file=sys.stderr)
    if not res.get("page_cache_excluded"):
        why = res.get("page_cache_not_excluded_why") or "no memory cgroup and no O_DIRECT"
        print(f"WARNING: the page cache could not be excluded ({why}): misses may have been served from RAM, so these "
              f"figures are NOT disk-bound", file=sys.stderr)
    if res.get("swap_past_budget"):
        print(f"WARNING: swap is on ({S.fmt_size(res['swap_total_bytes'])}) and the memory cgroup could not keep the "
              f"benchmark out of it (no swap accounting in this kernel?): the budget bounded its RAM only, so these "
              f"figures are NOT under --ram-budget; swapoff -a (or boot with swap accounting) and rerun",
              file=sys.stderr)


def budget_caveat(r):
    """Why a result that ran at a --ram-budget is not under it, or None: no memory cgroup (the page cache was not
    limited), or swap on that the cgroup could not shut out (RAM alone was limited). The sweep's tables say it."""
    if not r.get("ram_budget"):
        return None
    if r.get("memory_limited") is False:
        return "no memory cgroup"
    return "swap not limited" if r.get("swap_past_budget") else None


def strip_args(argv, names_with_value, flags=()):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names_with_value:
            skip = True
            continue
        if a in flags or any(a.startswith(n + "=") for n in names_with_value):
            continue
        out.append(a)
    return out


RUN_KEYS = ("decode_tok_s", "prefill_tok_s", "hit_rate", "disk_bytes_per_token", "read_wait_s_per_token",
            "bound_tok_s", "bound_tok_s_serial", "pct_of_bound", "disk_bw_bytes_s", "mem_bw_bytes_s",
            "cpu_steal_fraction")


def run_sweep(args, argv):
    """The honest benchmark at each budget (each in its own cgroup), a table and a PNG of the curves. With --repeat N
    every budget runs N times, in rounds over all budgets (so a drifting disk touches each budget alike); a
    budget's row is its successful run with the median % of the bound (a real run, not a mix; of an even count the
    lower middle one; runs above 100%, whose bandwidth measurement was disturbed, only when all are), every
    successful run under "runs", failed ones' errors under "failed_runs"."""
    budgets = [b.strip() for b in args.sweep.split(",") if b.strip()]  # (each a size: check_args parsed them)
    base = strip_args(argv, {"--sweep", "--ram-budget", "--json", "--plot", "--llamacpp-json", "--repeat"}, {"--bench"})
    results = {b: [] for b in budgets}
    n_runs = max(1, args.repeat) * len(budgets)
    for i in range(max(1, args.repeat)):
        for j, b in enumerate(budgets):
            if results[b] and results[b][0].get("refused"):
                continue  # refused once (e.g. below the resident size): it would be refused again; a crash may not
            args.ram_budget, args.run_label = b, f" (run {i * len(budgets) + j + 1} of {n_runs})"
            try:
                res = bench_in_cgroup(args, base + ["--bench", "--ram-budget", b])
                res["pct_of_bound"] = res["decode_tok_s"] / res["bound_tok_s"]
            except S.StreamError as e:  # e.g. below the resident size: a point with no figures, the sweep goes on
                print(f"budget {b}: {e}", file=sys.stderr)
                res = {"ram_budget": S.parse_size(b), "error": str(e),
                       "refused": not isinstance(e, (ChildFailed, ProbeFailed))}
            res["budget_str"] = b
            results[b].append(res)
            if "error" not in res:
                print_bench(res)
    rows = []
    for b in budgets:
        ok = sorted((r for r in results[b] if "error" not in r), key=lambda r: r["pct_of_bound"])
        # a run faster than its lower bound measured a bandwidth wrong (print_bench warned): never the row's run
        ok = [r for r in ok if r["pct_of_bound"] <= 1.0] or ok
        failed = [r["error"] for r in results[b] if "error" in r]
        if not ok:  # every run refused or failed: the row is the first error
            rows.append(results[b][0])
            continue
        row = dict(ok[(len(ok) - 1) // 2])  # the median run; of an even count the lower middle one
        if len(results[b]) > 1:
            row["runs"] = [{k: r.get(k) for k in RUN_KEYS} for r in results[b] if "error" not in r]  # in the order run
            row["failed_runs"] = failed
        rows.append(row)
    print(f"\n{'budget':>8} {'decode tok/s':>12} {'prefill tok/s':>13} {'hit rate':>8} {'disk MB/tok':>11} "
          f"{'peak RSS':>9} {'bound tok/s':>11} {'% of bound':>10} {'cache excl.':>11} {'CPU steal':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['budget_str']:>8} {r['error']}")  # refused (below the resident size) or failed: its reason
            continue
        pct = f"{r['pct_of_bound'] * 100:.0f}%"
        if "runs" in r:  # the median run, and the range over all runs
            pcts = [x["pct_of_bound"] * 100 for x in r["runs"]]
            pct += f" ({min(pcts):.0f}-{max(pcts):.0f})"
            if r["failed_runs"]:
                pct += f", {len(r['failed_runs'])} failed"
        print(f"{r['budget_str']:>8} {r['decode_tok_s']:12.2f} {r['prefill_tok_s']:13.2f} {r['hit_rate']:8.3f} "
              f"{r['disk_bytes_per_token'] / 1e6:11.1f} {S.fmt_size(r['peak_rss_bytes']):>9} {r['bound_tok_s']:11.2f} "
              f"{pct:>10} {str(r['page_cache_excluded']):>11} {fmt_steal(r):>9}")
    caveats = [f"{r['budget_str']} ({budget_caveat(r)})" for r in rows if budget_caveat(r)]
    if caveats:
        print(f"NOT under their budget: {', '.join(caveats)}")
    if args.repeat > 1:
        print(f"each row: the run with the median % of the bound of {args.repeat} (range in brackets; of an even "
              f"count, the lower middle run); its tok/s are that run's, not a median of tok/s:")
        for r in rows:
            if "runs" in r and len(r["runs"]) > 1:
                toks = [x["decode_tok_s"] for x in r["runs"]]
                print(f"  {r['budget_str']}: decode tok/s over its runs {min(toks):.2f}-{max(toks):.2f} "
                      f"(median {sorted(toks)[(len(toks) - 1) // 2]:.2f})")
    if args.json:
        try:  # (a disk that filled during the sweep: a traceback)
            # each whole or the old one (another sweep writing the same --json at once: the two mixed)
            checkpoint.write_atomic_text(args.json, json.dumps(rows, indent=1))
            checkpoint.write_atomic_text(os.path.splitext(args.json)[0] + ".md", sweep_markdown(rows))  # README's
        except OSError as e:
            raise S.StreamError(f"--json {args.json}: cannot write it ({e.strerror or e}); the table is above")
    plot_sweep(rows, args.plot or os.path.splitext(args.json or "sweep.json")[0] + ".png", args.llamacpp_json,
               args.container)
    return rows


def sweep_markdown(rows):
    """A sweep's rows as a markdown table (what README.md shows): each budget's median run, with the range of %
    of the bound and of CPU steal over its runs, and how many of its runs failed."""
    def ranged(r, key, scale=100):
        runs = [x[key] for x in r.get("runs", []) if x.get(key) is not None]
        return f" ({min(runs) * scale:.0f}-{max(runs) * scale:.0f})" if len(runs) > 1 else ""

    def opt(v, f):
        return "n/a" if v is None else f(v)

    def failed(r):  # as the console table: a budget that was OOM-killed in 2 of 3 rounds read as a clean row
        n = len(r.get("failed_runs") or [])
        return f", {n} of {n + len(r.get('runs', []))} failed" if n else ""

    gb = lambda v: f"{v / 1e9:.2f}"  # noqa: E731
    head = ["budget", "decode tok/s", "prefill tok/s", "p50 / p99 ms", "hit rate", "experts cached", "disk MB / token",
            "waiting for reads, ms / token", "peak RSS", "in huge pages",
            "disk GB/s for the bound (its rule; before / after / decode's reads)",
            "memory GB/s for the bound (its rule; before / after)", "lower-bound tok/s", "% of bound (runs)",
            "% of serial bound", "CPU steal (runs)", "other processes' CPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['budget_str']} | {r['error']} |" + " |" * (len(head) - 2))
            continue
        disk = opt(r.get("disk_bw_bytes_s"), gb) + " (" + "; ".join(
            ([r["disk_bw_rule"]] if r.get("disk_bw_rule") else []) + [" / ".join(opt(r.get(k), gb) for k in (
                "disk_bw_before_bytes_s", "disk_bw_after_bytes_s", "disk_bw_decode_bytes_s"))]) + ")"
        mem = ([r["mem_bw_rule"]] if r.get("mem_bw_rule") else []) + (
            [f"{r['mem_bw_before_bytes_s'] / 1e9:.1f} / {r['mem_bw_after_bytes_s'] / 1e9:.1f}"]
            if r.get("mem_bw_after_bytes_s") is not None else [])
        mem = f"{r['mem_bw_bytes_s'] / 1e9:.1f}" + (f" ({'; '.join(mem)})" if mem else "")
        lines.append("| " + " | ".join([
            r["budget_str"] + (f" (NOT under it: {budget_caveat(r)})" if budget_caveat(r) else ""),
            f"{r['decode_tok_s']:.2f}{ranged(r, 'decode_tok_s', 1)}", f"{r['prefill_tok_s']:.2f}",
            f"{r['p50_token_latency_s'] * 1e3:.0f} / {r['p99_token_latency_s'] * 1e3:.0f}", f"{r['hit_rate']:.3f}",
            str(r["cache_capacity_experts"]), f"{r['disk_bytes_per_token'] / 1e6:.1f}",
            # in the budget column's binary units, as the console table: 3G's 2.91G read "3.13 GB", over its budget
            f"{r['read_wait_s_per_token'] * 1e3:.0f}", S.fmt_size(r["peak_rss_bytes"]),
            opt(r.get("huge_page_bytes"), S.fmt_size), disk, mem,
            f"{r['bound_tok_s']:.2f}", f"**{r['pct_of_bound'] * 100:.0f}%**{ranged(r, 'pct_of_bound')}{failed(r)}",
            f"{r['decode_tok_s'] / r['bound_tok_s_serial'] * 100:.0f}%",
            opt(r.get("cpu_steal_fraction"), lambda v: f"{v * 100:.0f}%") + ranged(r, "cpu_steal_fraction"),
            opt(r.get("others_cpu_fraction"), lambda v: f"{v * 100:.0f}%")]) + " |")
    return "\n".join(lines) + "\n"


def plot_sweep(rows, plot, llamacpp_json, container):
    """The sweep's PNG: decode tok/s and the bound (with llama.cpp's curve when its JSON exists), hit rate and disk
    bytes per token against the budget. Re-plot from saved JSON with
    python -c "import json, stream_bench as B; B.plot_sweep(json.load(open('bench/micro_sweep.json')),
    'bench/micro_sweep.png', 'bench/vs_llamacpp.json', 'micro.pcf4')"."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = [r["ram_budget"] / (1 << 30) for r in ok]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    ax[0].plot(x, [r["decode_tok_s"] for r in ok], "o-", label="picaflor decode")
    ax[0].plot(x, [r["bound_tok_s"] for r in ok], "k--", label="bound (disk + memory bandwidth)")
    if llamacpp_json and os.path.exists(llamacpp_json):
        lc = [r for r in json.load(open(llamacpp_json)).get("rows", [])
              if r.get("llamacpp_tok_s") and r.get("budget_bytes")]  # the unlimited row has no x position
        ax[0].plot([r["budget_bytes"] / (1 << 30) for r in lc], [r["llamacpp_tok_s"] for r in lc], "s-",
                   label="llama.cpp")
    bad = [r["ram_budget"] / (1 << 30) for r in rows if "error" in r and r.get("ram_budget")]
    if bad:  # a budget that failed or was refused: marked, not a gap the curve's line runs across unseen
        ax[0].plot(bad, [0] * len(bad), "rx", markersize=9, label="failed or refused (see the table)")
    ax[0].set_ylabel("tok/s")
    ax[0].legend()
    ax[1].plot(x, [r["hit_rate"] for r in ok], "o-")
    ax[1].set_ylabel("expert hit rate (decode)")
    ax[2].plot(x, [r["disk_bytes_per_token"] / 1e6 for r in ok], "o-")
    ax[2].set_ylabel("disk MB per token")
    for a in ax:
        a.set_xlabel("RAM budget (GiB)")
        a.grid(alpha=0.3)
    fig.suptitle(f"{os.path.basename(container)} ({ok[0]['container_bytes'] / 1e9:.2f} GB, "
                 f"random weights: {ok[0]['random_weights']}), {ok[0]['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(plot, dpi=110)
    print(f"plot: {plot}")


# ----------------------------------------------------------------------------------------------------------
# entry points

def bench_child(args, result_path):
    """Inside the cgroup: measure the disk and memory, load, decode, measure, write the result as JSON (or a
    refusal's reason as {"error": ...}, which the parent reports: a sweep's row said only "exit 1")."""
    picked = set()
    try:  # the disk before loading: the preload's reads would leave the storage's own cache warm
        cont = C.load_container(args.container)
        disk_bw = probe_twice("the disk probe before loading", measure_disk_bandwidth, cont, n_readers=args.readers,
                              picked=picked)
        cont.close()
        torch.set_num_threads(S.compute_threads(None, args.threads))  # as decode will run
        mem_bw = float(os.environ.get("PICAFLOR_BENCH_MEM_BW") or 0) or None  # the parent's (else run_bench measures)
        eng = S.load(args.container, args.ram_budget, args.device, kernel=args.kernel, n_readers=args.readers,
                     prefetch=args.prefetch, context=args.context, cache_policy=args.cache_policy,
                     preload=False if args.no_preload else "auto")
        torch.set_num_threads(S.compute_threads(eng, args.threads))
        res = run_bench(eng, args.bench_prompt_tokens, args.max_new_tokens, args.experts_per_token, disk_bw=disk_bw,
                        mem_bw=mem_bw, disk_picked=picked)
    except (S.StreamError, EC.CacheError, C.ContainerError) as e:
        with open(result_path, "w") as f:  # a probe that failed twice: a failure the next round may not repeat
            json.dump({"error": str(e), "probe_failed": isinstance(e, ProbeFailed)}, f)
        return 1
    with open(result_path, "w") as f:
        json.dump(res, f)
    return 0


def main(args, argv):
    """stream_infer.py --bench / --sweep (args parsed and checked there; argv as given, for the children)."""
    child_result = os.environ.get("PICAFLOR_BENCH_CHILD")
    if child_result:
        return bench_child(args, child_result)
    if args.sweep:
        run_sweep(args, argv)
        return 0
    res = bench_in_cgroup(args, argv)
    print_bench(res)
    if args.json:
        try:  # (a disk that filled during the run: a traceback)
            checkpoint.write_atomic_text(args.json, json.dumps(res, indent=1))  # (another bench's at once: mixed)
        except OSError as e:
            raise S.StreamError(f"--json {args.json}: cannot write it ({e.strerror or e}); the figures are above")
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip() + "\n\nIts options are stream_infer.py's:\n")
    elif "--sweep" not in argv and not any(a.startswith("--sweep=") for a in argv) and "--bench" not in argv:
        argv.append("--bench")
    sys.exit(S.main(argv))
