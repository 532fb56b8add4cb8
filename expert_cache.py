"""
expert_cache: the routed experts of a streamed model (stream_infer.py) in one byte budget over all layers, read
from the container on a miss by expert_reader.cpp's C++ threads (Python threads where it cannot be built).

    cache = ExpertCache(container, budget_bytes, make_expert, score_ops, reader_ops)   # stream_infer.Engine does this
    cache.observe(layer, selection_keys); cache.request(keys, protect); expert = cache.get(key, protect)

- Reads: one blob (an expert's gate_up + down, packed + scales) is n_readers aligned parts read at once, O_DIRECT
  when the filesystem allows (so the page cache cannot hide a miss), buffered otherwise; the reader that lands a
  blob's last part checks its crc32 (the first read of it in this process; a re-read checks that the file was not
  rewritten). Evicted experts' buffers are read into again (ExpertCache). A read's buffer stays alive until its
  readers are done with it, whatever happens to the request (an exception, Ctrl-C, exit): _READS_IN_FLIGHT and an
  atexit hook. Ctrl-C is raised within WAIT_SLICE_MS of a native wait, and the request drops the reads its readers
  have not started (ExpertCache.cancel) rather than wait for every one queued (seconds under a small budget).
- Policy "score" (default; "lru" for plain LRU): evict the cached expert whose router scored it lowest lately, an
  average of its selection score (sigmoid + bias) that decays by SCORE_DECAY = 0.85 a token (a prefill chunk
  counts as one step, averaged over its rows). Each token the router scores all 64 experts of a layer, not just
  the two it picks, so the scores say which experts the next tokens are near; LRU sees only the picks. Replayed on
  12 held-out prompts' traces of micro (16 prompt + 32 greedy tokens each, decode hit rate, caches filled as at
  load, bench/cache_replay.py): LRU / score 0.873 / 0.898 at 684 experts (3G), 0.743 / 0.777 at 380 (2G), 0.573 /
  0.650 at 229 (1.5G), 0.214 / 0.364 at 77 (1G); a decay of 0.8-0.9 is within a point of that, ranks in place of
  scores and the max over a prefill chunk were no better. Earlier tried and dropped: LFU (decayed demand counts),
  0.52 vs LRU 0.71 at 361 experts on micro.
- Prefetch (`guess`, off by default; stream_infer's docstring has the measurements): the next MoE layer's likely
  experts are read into their own few buffers (n_slots, carved out of the budget), so a wrong guess only ever
  replaces an older guess, never a cached expert, and a right one joins the cache when demanded; guesses have
  their own readers, so a demand read never queues behind one.
"""

import atexit
import ctypes
import itertools
import os
import sys
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import container as C


class CacheError(Exception):
    """A cache that cannot work as asked (an unknown policy, a budget below one expert); one line, with the fix."""


CACHE_POLICIES = ("score", "lru")
SCORE_DECAY = 0.85  # policy "score": weight of the old average per forward pass (0.8-0.9 within a point in replay)


def check_cache_policy(policy):
    if policy not in CACHE_POLICIES:
        raise CacheError(f"cache policy {policy!r}: use one of {', '.join(CACHE_POLICIES)}")


def partial_preload_keys(layers, n_experts, capacity):
    """The experts a partial preload reads into a cache of `capacity`, oldest (first evicted) first: the same
    number from every layer, expert 0 of each layer, then expert 1, ... (bench/cache_replay.py starts from it)."""
    per_layer = min(n_experts, capacity // max(len(layers), 1))
    return [(layer, e) for e in range(per_layer) for layer in layers]

# ticket -> (ops, buf, pin) of every native read not yet waited for: the readers write into buf until blob_wait
# returns, whatever happens to its NativeRead meanwhile (an exception, Ctrl-C, a reference cycle at exit), so buf
# stays alive (and cannot be closed: pin is an export of it) until then, and atexit waits for what is left
_READS_IN_FLIGHT = {}
_NEXT_TICKET = itertools.count(1)
WAIT_SLICE_MS = 50  # a native wait returns to Python this often, so a Ctrl-C is raised within it


@atexit.register
def _wait_reads_in_flight():
    for ticket, (ops, _, _) in list(_READS_IN_FLIGHT.items()):
        try:
            ops.blob_wait(ticket)
        except Exception:  # a ticket that never reached the readers
            pass
    _READS_IN_FLIGHT.clear()


class NativeRead:
    """One expert blob being read by expert_reader.cpp's threads, with the two methods of a Future that
    ExpertCache uses (done, result). The blob's crc32 is checked by its last reader the first time this process
    reads it (unless verify is False: the bench's disk measurement); a re-read checks that the open file was not
    rewritten (as Container.check_expert_blob). Pools: 0 demand reads, 1 guesses, 2 the bench. `buf` (a
    page-aligned mmap of at least one blob) is held in _READS_IN_FLIGHT until the read has landed. ops: the
    extension's torch.ops namespace (kernels.native_reader())."""

    def __init__(self, container, key, buf, pool, n_parts, ops, verify=True):
        c = self.c = container
        self.key, self.buf, self.error, self.waited, self.verify = key, buf, None, True, verify  # until queued
        self.ops, self.in_flight = ops, _READS_IN_FLIGHT  # (held: __del__ at interpreter exit finds no module globals)
        if len(buf) < c.expert_nbytes:
            raise ValueError(f"NativeRead: a buffer of {len(buf)} bytes cannot hold a {c.expert_nbytes}-byte blob")
        ent = c.expert_entry(*key)
        self.offset, self.check = ent["offset"], verify and key not in c.verified
        pin = ctypes.c_char.from_buffer(buf)
        direct = c.direct_fd if c.direct_fd is not None else -1
        crc = int(ent["crc32"], 16) if self.check else -1
        self.ticket = ticket = next(_NEXT_TICKET)
        self.waited = False
        _READS_IN_FLIGHT[ticket] = (self.ops, buf, pin)  # before the readers can see it
        try:
            self.ops.blob_read(ticket, pool, direct, c.fd, self.offset, ctypes.addressof(pin), c.expert_nbytes,
                               n_parts, C.ALIGN, crc, n_parts)
        except Exception:
            self.waited = True  # nothing was queued (blob_read queues last; an error raises before)
            _READS_IN_FLIGHT.pop(ticket, None)
            raise
        except BaseException:  # Ctrl-C raised as the op returned, maybe after it queued: buf stays held until
            self.cancel()      # the parts being read land (__del__ waits; an unknown ticket is no error there)
            raise

    def done(self):
        return self.waited or self.ops.blob_done(self.ticket)

    def cancel(self):
        """Drop the parts the readers have not started (nobody will use this read); the buffer stays held until
        the parts being read land, as ever."""
        if not self.waited:
            self.ops.blob_cancel(self.ticket)

    def wait(self):
        """Until the read landed, without raising (result() raises its error, each time it is called)."""
        try:
            self.result()
        except (C.ContainerError, RuntimeError):  # RuntimeError: a forked child's copy of a parent's read
            pass

    def result(self):
        if not self.waited and self.ticket not in self.in_flight:  # waited for by the atexit hook: its status is gone
            self.waited = True
            self.error = C.ContainerError(f"{self.c.path}: the read of layer {self.key[0]} expert {self.key[1]} was "
                                          f"ended at interpreter exit")
        if not self.waited:
            # in slices, without the GIL: a Ctrl-C is raised between them (one wait took every read queued ahead of
            # this one), leaving the read in flight and its buffer held; the slices keep the ticket (a Ctrl-C raised
            # as the one the read landed in returns lost its status), a last wait that returns at once forgets it
            try:
                status = -1
                while status == -1:
                    status = self.ops.blob_wait(self.ticket, WAIT_SLICE_MS, False)[0]
                status, err, landed, buffered = self.ops.blob_wait(self.ticket, 0)
            except Exception:  # (a forked child's copy of a parent's read: an unknown ticket)
                self.waited = True
                _READS_IN_FLIGHT.pop(self.ticket, None)
                raise
            self.waited = True
            _READS_IN_FLIGHT.pop(self.ticket, None)
            (layer, e), c = self.key, self.c
            if buffered:  # O_DIRECT failed on this filesystem: buffered reads from now on (as Container._pread)
                c.stop_direct_reads()
            if status == 0:
                if self.check:
                    c.verified.add(self.key)
                elif self.verify:
                    try:
                        c._check_unchanged()
                    except C.ContainerError as ex:
                        self.error = ex
            elif status == 1:
                self.error = c.checksum_error(layer, e)
            elif status == 2:
                self.error = C.ContainerError(f"{c.short_read_error(self.offset, landed, c.expert_nbytes)} "
                                              f"(layer {layer} expert {e})")
            elif status == 4:
                self.error = C.ContainerError(f"{c.path}: the read of layer {layer} expert {e} was cancelled")
            else:
                self.error = C.ContainerError(f"{c.path}: read error at offset {self.offset} (layer {layer} expert "
                                              f"{e}): {os.strerror(err)}; check the disk")
        if self.error is not None:
            raise self.error
        return self.buf

    def __del__(self):  # dropped unwaited (an error elsewhere): wait here rather than at exit
        # (not after the atexit hook waited for it: a dropped ticket, and module globals maybe gone)
        if not getattr(self, "waited", True) and self.ticket in self.in_flight:
            self.wait()


def wait_quietly(futures):
    """Wait for a guess's reads without raising: a failed read of a guess nobody asks for is no error (one that
    is asked for raises in ExpertCache._finish, with the read's own message)."""
    import concurrent.futures
    native = [f for f in futures if isinstance(f, NativeRead)]
    for f in native:
        f.wait()
    concurrent.futures.wait([f for f in futures if not isinstance(f, NativeRead)])


class BlobBuffers:
    """Expert blob buffers carved from chunks of container.anon_buffer memory (huge pages: a blob read through the
    readers cost ~60% of the CPU in the same time, see there; one 3.5 MB mapping per blob holds at most one aligned
    2 MB page, so they share chunks). A slot is a ctypes array over its part of a chunk: a tensor over it, a memoryview
    of it (or a slice of one) and a read in flight all hold the slot object itself (a memoryview slot would not
    be held by its slices), so its reference count tells when every holder has let go. take() gives a slot nobody
    holds: one let go of (so memory a caller held and released is used again before any new page is touched),
    else one never used, else a new chunk's first. A chunk lives as long as its slots."""

    def __init__(self, nbytes, chunk_bytes=64 << 20):
        self.nbytes, self.stride = nbytes, C.align_up(nbytes)  # O_DIRECT wants each slot page-aligned
        self.per_chunk = max(1, chunk_bytes // self.stride)
        self.slots, self.fresh = [], []  # every slot made; those never handed out
        self.where = {}  # id(slot) -> (its chunk, offset, index): to give a let-go slot's pages back (trim)
        probe = [bytearray()]  # a slot's reference count when only self.slots holds it (measured: the offsets
        self.free_refs = sys.getrefcount(probe[0])  # differ between Python versions)

    def _idle(self, i):
        return sys.getrefcount(self.slots[i]) == self.free_refs

    def take(self):
        for i in range(len(self.slots)):  # a slot every holder let go of (a never-used one is held by self.fresh too)
            if self._idle(i):
                return self.slots[i]
        if not self.fresh:
            chunk = C.anon_buffer(self.per_chunk * self.stride)
            made = [(ctypes.c_char * self.nbytes).from_buffer(chunk, i * self.stride) for i in range(self.per_chunk)]
            base = len(self.slots)
            self.where.update((id(v), (chunk, i * self.stride, base + i)) for i, v in enumerate(made))
            self.slots += made
            self.fresh = made[::-1]
        return self.fresh.pop()

    def trim(self, ids):
        """Of the slots named by id (buffers that left a cache while a caller held them), give back the pages of
        those now let go (MADV_DONTNEED: they read as zeros when taken again), so memory a caller held and released
        is no longer in the process; returns the ids still held."""
        import mmap
        held = set()
        for i in ids:
            if i not in self.where:
                continue
            chunk, off, k = self.where[i]
            if not self._idle(k):
                held.add(i)
            elif hasattr(mmap, "MADV_DONTNEED"):
                pages = whole_pages(off, self.stride, mmap.PAGESIZE)
                if pages:
                    chunk.madvise(mmap.MADV_DONTNEED, *pages)
        return held


def whole_pages(off, nbytes, page):
    """(start, length) of the whole pages inside [off, off + nbytes), or None. Slots are 4 KiB-aligned; on a 16 or
    64 KiB-page kernel (Asahi, some ARM servers) madvise refuses an unaligned start and rounds the length up to a
    page, so a slot's range as it is would zero the start of its neighbour, maybe a cached expert."""
    start, end = -(-off // page) * page, (off + nbytes) // page * page
    return (start, end - start) if end > start else None


class ExpertCache:
    """All routed experts of all layers share one byte budget. Policy "score" (default): evict the cached expert
    its layer's router has scored lowest lately (an average of its selection score, sigmoid + bias, decaying by
    SCORE_DECAY a token, fed by `observe`; least recently used first among equals). Policy "lru": a hit moves to
    the back, eviction takes the front. Reads happen on expert_reader.cpp's threads (NativeRead), or without it
    on a small Python thread pool (os.preadv releases the GIL; so does the crc32 check); the dict itself is only
    touched by the calling thread. An evicted expert's buffer is read into again by the
    next miss (`free_bufs`), unless something still holds that expert: a fresh 3.5 MB anonymous mmap cost ~4.6 ms
    to fault in and its munmap ~0.9 ms here, per miss. New buffers come from BlobBuffers (huge pages)."""

    def __init__(self, container, budget_bytes, make_expert, score_ops=None, reader_ops=None, n_readers=4,
                 policy="score", reuse_views=False):
        """make_expert(buf, views) -> an expert over a landed blob (stream_infer.Expert: .buf, .tensors, callable);
        views: with reuse_views, the buffer's tensor views (container.decode_expert(buf), made once per buffer),
        which the expert must use as they are (no copy; a re-layout only in place, redone for each blob); else None;
        score_ops / reader_ops: the extension's torch.ops (int4_cpu.cpp's policy ops, expert_reader.cpp's readers),
        None for the numpy policy and the Python readers."""
        check_cache_policy(policy)
        self.c, self.budget, self.make_expert, self.policy = container, budget_bytes, make_expert, policy
        # policy "score", as arrays [layer, expert] so a victim is a few numpy ops, not a Python scan of every
        # cached expert (that cost ~0.3 ms an eviction, ~2.5 ms a token at 2G on micro): each expert's decayed
        # selection score (-inf until its layer is first routed) and when it last entered or hit (-1: not cached;
        # the oldest first among equal scores, as LRU order)
        cfg = container.config
        self.score_tab = np.full((cfg.n_layer, max(cfg.n_experts, 1)), -np.inf)
        self.score_seen = set()
        self.stamp = np.full(self.score_tab.shape, -1, dtype=np.int64)
        # the same arrays as tensors (shared memory) for int4_cpu.cpp's observe_scores / score_victim: numpy's
        # version of the two cost ~0.1 and ~0.2 ms a call in decode (cold caches after each GEMV), ~3 ms a token
        self.score_ops = score_ops
        self.native_score = score_ops is not None
        self.score_t, self.stamp_t = torch.from_numpy(self.score_tab), torch.from_numpy(self.stamp)
        self.score_rows = list(self.score_t)  # per layer, made once (indexing a tensor costs ~5 us a call)
        self.clock = 0
        self.nbytes = container.expert_nbytes
        self.every_expert_bytes = (cfg.n_layer - cfg.n_dense_layers) * cfg.n_experts * self.nbytes
        self.entries = OrderedDict()  # (layer, expert) -> Expert
        self.inflight = {}  # (layer, expert) -> ([Future per part], is_prefetch, buffer)
        self.free_bufs = []  # evicted experts' buffers, for the next read (counted in `used` until reused)
        # ids of buffers that left while something held them (outside `used`): once let go, their pages go back
        # (BlobBuffers.trim, at the next request), so the process is under its budget again
        self.orphans = set()
        self.blob_buffers = BlobBuffers(self.nbytes)  # where buffers come from when none is free
        # id(buffer) -> [buffer (kept alive, so the id is its own), its tensor views, those tensors, their reference
        # counts held here alone]: a blob's views are made once per buffer and serve every blob read into it after
        # (decode_expert cost 20-45 us hot, more after a GEMV, on the critical path of a layer's last miss)
        self.reuse_views = reuse_views
        self.views_of_buf = {}
        # prefetch: guesses are read into their own few buffers (`n_slots`, carved out of the budget), so a wrong
        # guess never evicts a cached expert; a right one joins the cache when demanded
        self.n_slots = 0
        self.slot_bufs = []  # guess buffers not in use
        self.guesses = OrderedDict()  # (layer, expert) -> ([Future per part], buffer), oldest first
        self.read_keys = set()  # every blob read since load (the bench measures the disk on others)
        self.pool = ThreadPoolExecutor(max_workers=n_readers, thread_name_prefix="expert-reader")
        self.guess_pool = None  # guesses' own readers (made with the first guess slot): a demand read never
        # queues behind a guess
        self.busy_lock, self.py_active_reads, self.busy_since, self.py_disk_busy_s = threading.Lock(), 0, 0.0, 0.0
        self.n_parts = max(1, n_readers)
        # reads on expert_reader.cpp's threads when given (no Python per part, no GIL); the Python pool above is
        # the fallback where it cannot be built (and the tests' way to inject slow or failing reads)
        self.reader_ops = reader_ops
        self.native_reads = self.reader_ops is not None
        self.record_trace = False
        self.reset_counters()

    @property
    def disk_busy_s(self):
        """Seconds at least one read was running (both reader kinds; the native one counts since process start)."""
        native = self.reader_ops.reader_stats()[0] / 1e9 if self.reader_ops is not None else 0.0
        return self.py_disk_busy_s + native

    @property
    def active_reads(self):
        return self.py_active_reads + (self.reader_ops.reader_stats()[1] if self.reader_ops is not None else 0)

    def reset_counters(self):
        self.lookups = self.hits = self.prefetch_hits = self.misses = 0
        self.reads = self.prefetch_reads = 0
        self.bytes_read = 0
        self.read_wait_s = 0.0
        # demanded keys in order, kept only while record_trace is set (tests replay it): 32 a token on micro, it
        # grew by ~70 bytes per lookup over a whole session under a RAM budget; `observed`: (lookups before it,
        # layer, scores) per observe call, likewise
        self.trace, self.observed = [], []

    @property
    def used(self):
        return (len(self.entries) + len(self.inflight) + len(self.free_bufs) + len(self.slot_bufs)
                + len(self.guesses)) * self.nbytes

    def _touch(self, key):
        self.clock += 1
        self.stamp[key] = self.clock

    def _score_victim(self, protect):
        """The cached expert outside `protect` with the lowest decayed score (the oldest among equals), or None."""
        if self.native_score:
            E = self.score_tab.shape[1]
            i = self.score_ops.score_victim(self.score_t, self.stamp_t, [layer * E + e for layer, e in protect])
            return None if i < 0 else divmod(i, E)
        return self._score_victim_numpy(protect)

    def _score_victim_numpy(self, protect):
        """_score_victim without the native kernel (and the test's reference for it)."""
        cand = self.stamp >= 0
        for key in protect:
            cand[key] = False
        if not cand.any():
            return None
        # a NaN score (a router fed a NaN) counts as the lowest, as int4_cpu.cpp's score_victim (s[i] < s[best] is
        # false for NaN, so a NaN first candidate stays): min() of it was NaN, nothing equalled it, argmin of nothing
        tab = np.where(np.isnan(self.score_tab), -np.inf, self.score_tab)
        s = np.where(cand, tab, np.inf)
        idx = np.flatnonzero(s == s.min())
        i = int(idx[np.argmin(self.stamp.flat[idx])])
        return divmod(i, s.shape[1])

    @staticmethod
    def _view_refs(rec):
        """The reference counts of a buffer's view tensors, and of their storages (a tensor derived from one, a
        slice say, holds the storage, not the tensor)."""
        use_count = getattr(torch._C, "_storage_Use_Count", None)
        return ([sys.getrefcount(t) for t in rec[2]]
                + ([use_count(t.untyped_storage()._cdata) for t in rec[2]] if use_count else []))

    def _expert_over(self, buf):
        """A new expert over a buffer whose read has landed, on the buffer's own views with reuse_views (the views
        stay right whatever blob is read into the buffer)."""
        if not self.reuse_views:
            return self.make_expert(buf, None)
        rec = self.views_of_buf.get(id(buf))  # its record holds buf, so no other buffer has this id meanwhile
        if rec is None:
            views = self.c.decode_expert(buf)
            rec = self.views_of_buf[id(buf)] = [buf, views, [t for part in views.values() for t in part.values()
                                                             if isinstance(t, torch.Tensor)], None]
            rec[3] = self._view_refs(rec)  # held by the cache alone, as _evict compares them
        return self.make_expert(buf, rec[1])

    def _evict(self, key):
        """Drop an entry; recycle its buffer only when nothing else holds the expert or any tensor over the buffer:
        checked by weak references, or with the buffer's own views (which the cache holds) by their reference
        counts against the counts they had when the cache alone held them (in this process: the counts' offsets
        differ between Python versions)."""
        self.stamp[key] = -1
        expert = self.entries.pop(key)
        buf = expert.buf
        try:
            refs = [weakref.ref(expert)] + [weakref.ref(t) for t in expert.tensors]
            del expert
            rec = self.views_of_buf.get(id(buf))
            if rec is not None:
                if self._view_refs(rec) == rec[3]:
                    self.free_bufs.append(buf)
                else:  # someone still holds the expert or a tensor over its buffer: both stay theirs
                    del self.views_of_buf[id(buf)]
                    self.orphans.add(id(buf))
            elif buf is not None and all(r() is None for r in refs):
                self.free_bufs.append(buf)
            elif buf is not None:
                self.orphans.add(id(buf))
        except BaseException:  # Ctrl-C mid-way: the buffer leaves as a failed read's (given back once let go)
            if buf is not None:
                self.views_of_buf.pop(id(buf), None)
                self.orphans.add(id(buf))
            raise

    def _ensure_room(self, protect, wait):
        """Evict entries not in `protect` (by the policy) until one more blob fits (a free buffer is one: the next
        read goes into it). With wait, finish in-flight reads (they become evictable entries) when nothing else can go;
        False if it cannot fit."""
        while not self.free_bufs and self.used + self.nbytes > self.budget:
            if self.policy == "score":  # the lowest recent router score; a layer not routed yet goes first
                victim = self._score_victim(protect)
            else:
                victim = next((k for k in self.entries if k not in protect), None)
            if victim is not None:
                self._evict(victim)
                continue
            # demand reads that already landed become evictable entries at no cost; then spare guess buffers
            pending = next((k for k in self.inflight if k not in protect and all(f.done() for f in self.inflight[k][0])),
                           None)
            if pending is None and self._drop_guess(protect, wait):
                continue
            if pending is None and wait:
                pending = next((k for k in self.inflight if k not in protect), None)
            if pending is None:
                return False
            self._finish(pending)
        return True

    def _drop_guess(self, protect, wait):
        """Give one guess buffer (a spare one, else the oldest landed guess not in `protect`; with wait, the oldest
        one) to free_bufs, for a demand read that has no other room. False if there is none."""
        if self.slot_bufs:
            self.free_bufs.append(self.slot_bufs.pop())
            return True
        key = next((k for k in self.guesses if k not in protect and (wait or all(f.done() for f in self.guesses[k][0]))),
                   None)
        if key is None:
            return False
        wait_quietly(self.guesses[key][0])  # still a guess while waited for (a Ctrl-C here leaves it one)
        self.free_bufs.append(self.guesses.pop(key)[1])
        return True

    def _read(self, key, buf, guess=False):
        """Start reading one blob into buf (on the guess readers or the demand ones): [Future per part], or with
        native_reads [one NativeRead] (expert_reader.cpp's readers: its pool 1 for guesses, 0 on demand)."""
        if self.native_reads:
            fut = [NativeRead(self.c, key, buf, 1 if guess else 0, self.n_parts, self.reader_ops)]
        else:
            # one blob = n_readers aligned parts read at once (queue depth; see container.read_expert_part)
            step = -(-self.nbytes // self.n_parts // C.ALIGN) * C.ALIGN
            parts = [(o, min(step, self.nbytes - o)) for o in range(0, self.nbytes, step)]
            left = [len(parts)]  # parts not landed yet: the reader that lands the last one checks the blob
            pool, fut = self.guess_pool if guess else self.pool, []
            try:
                for o, n in parts:
                    fut.append(pool.submit(self._read_part, key, buf, o, n, left))
            except BaseException:  # (a pool shut down): the parts queued land before buf goes back to the caller
                wait_quietly(fut)
                raise
        self.reads += 1  # (counted once started: the bench checks them against /proc/self/io)
        self.bytes_read += self.nbytes
        self.read_keys.add(key)
        return fut

    def _read_part(self, key, buf, start, nbytes, left):
        """One part read on a reader thread, timed: disk_busy_s adds up the time at least one read was running (the
        bench's measure of how fast the disk really served this run's reads). The thread that lands a blob's last
        part checks its crc32 there (the first read in this process; the check releases the GIL), off the decoding
        thread, which computes meanwhile: 1-1.7 ms a token at 2G on micro."""
        with self.busy_lock:
            if self.py_active_reads == 0:
                self.busy_since = time.perf_counter()
            self.py_active_reads += 1
        try:
            self.c.read_expert_part(*key, buf, start, nbytes)
        finally:
            with self.busy_lock:
                self.py_active_reads -= 1
                if self.py_active_reads == 0:
                    self.py_disk_busy_s += time.perf_counter() - self.busy_since
        with self.busy_lock:  # reached only when this part landed: a failed part leaves the blob unchecked
            left[0] -= 1
            last = left[0] == 0
        if last:
            self.c.check_expert_blob(*key, buf)  # raises ContainerError (naming the expert) through the future

    def _submit(self, key):
        buf = self.free_bufs.pop() if self.free_bufs else self.blob_buffers.take()
        try:
            self.inflight[key] = (self._read(key, buf), False, buf)
        except Exception:  # a read that could not start (_read raises only once nothing of it is queued)
            self.free_bufs.append(buf)
            raise
        except BaseException:  # Ctrl-C, maybe after the read was queued (it may still land in buf): not a free buffer
            self.views_of_buf.pop(id(buf), None)  # (the next read went into it too), but one BlobBuffers gives out
            self.orphans.add(id(buf))             # once nothing holds it, as a failed read's (_finish)
            raise

    def _finish(self, key):
        fut, prefetch, buf = self.inflight.pop(key)
        t0 = time.perf_counter()
        try:
            for f in fut:
                f.result()
            self.read_wait_s += time.perf_counter() - t0  # the decoding thread stalled on the disk (the bench's split)
            expert = self._expert_over(buf)  # crc checked by its last reader
        except BaseException:  # a failed read (or Ctrl-C while waiting, or while the expert is made): the buffer
            for f in fut:  # leaves the cache, its views too (and its parts not started are dropped)
                f.cancel()
            self.views_of_buf.pop(id(buf), None)
            self.orphans.add(id(buf))
            raise
        self.entries[key] = expert
        self._touch(key)
        return prefetch

    def request(self, keys, protect):
        """Start reads for keys neither cached nor in flight, while they fit without evicting `protect`. A key
        that was guessed leaves the guess buffers with its read (landed or not) and joins the cache."""
        if self.orphans:
            self.orphans = self.blob_buffers.trim(self.orphans)
        for key in keys:  # first the right guesses: they need no room
            if key in self.guesses:
                fut, buf = self.guesses.pop(key)
                self.inflight[key] = (fut, True, buf)
        for key in keys:
            if key in self.entries or key in self.inflight:
                continue
            if not self._ensure_room(protect, wait=False):
                return
            self._submit(key)

    def guess(self, keys, protect):
        """Prefetch: start reading keys (the next layer's likely experts) into the guess buffers. A guess buffer is
        a spare one, else (once there are n_slots) the oldest guess that has landed: a wrong guess only ever
        replaces a guess. A slot is made by evicting an expert (the policy's victim) only while there are fewer
        than n_slots, i.e.
        at the start and after a right guess joined the cache (the cost any newly cached expert has). Skipped while
        every guess is still in flight (the disk is busy), and for small caches (fewer than 4 experts per slot),
        which keep their room."""
        for key in keys:
            if key in self.entries or key in self.inflight or key in self.guesses:
                continue
            slots = min(self.n_slots, self.budget // self.nbytes // 4)
            if not self.slot_bufs and len(self.guesses) < slots and self._ensure_room(protect, wait=False):
                self.slot_bufs.append(self.free_bufs.pop() if self.free_bufs else self.blob_buffers.take())
            if not self.slot_bufs:
                old = next((k for k in self.guesses if k not in protect and all(f.done() for f in self.guesses[k][0])),
                           None)
                if old is None:
                    return
                self.slot_bufs.append(self.guesses.pop(old)[1])
            buf = self.slot_bufs.pop()
            try:
                self.guesses[key] = (self._read(key, buf, guess=True), buf)
            except Exception:  # (as _submit)
                self.slot_bufs.append(buf)
                raise
            except BaseException:
                self.views_of_buf.pop(id(buf), None)
                self.orphans.add(id(buf))
                raise
            self.prefetch_reads += 1

    def set_slots(self, n):
        """n guess buffers (0: prefetch off; the buffers go back to the cache as free ones)."""
        if n == 0:
            for fut, _ in self.guesses.values():
                wait_quietly(fut)
            self.free_bufs += self.slot_bufs + [buf for _, buf in self.guesses.values()]
            self.slot_bufs, self.guesses = [], OrderedDict()
        elif self.guess_pool is None:
            self.guess_pool = ThreadPoolExecutor(max_workers=self.n_parts, thread_name_prefix="expert-guess")
        self.n_slots = n

    def observe(self, layer, keys):
        """A layer's router just scored its experts (selection keys [rows, E], as route returns them): policy
        "score" keeps their average, new = SCORE_DECAY * old + (1 - SCORE_DECAY) * mean over the rows, once per
        forward pass (a decode token, or a prefill chunk as one step). Call it before requesting the layer's
        experts, so its evictions see this pass."""
        if self.policy != "score" or (self.budget >= self.every_expert_bytes and not self.record_trace):
            return  # nothing can be evicted (every expert fits): no work, and on a GPU no sync per layer
        if (self.native_score and keys.is_cpu and keys.dtype == torch.float32 and keys.shape[0] == 1
                and keys.is_contiguous()):
            # decode: int4_cpu.cpp rounds as the numpy lines below
            self.score_ops.observe_scores(self.score_rows[layer], keys, SCORE_DECAY, layer not in self.score_seen)
            self.score_seen.add(layer)
            if self.record_trace:
                self.observed.append((self.lookups, layer, keys[0].double().tolist()))
            return
        s = (keys[0] if keys.shape[0] == 1 else keys.float().mean(0)).double().cpu().numpy()  # 64 floats off a GPU
        row = self.score_tab[layer]
        if layer in self.score_seen:  # float64, the same two products and sum as the replay's Python floats
            row *= SCORE_DECAY
            row += (1.0 - SCORE_DECAY) * s
        else:
            row[:] = s
            self.score_seen.add(layer)
        if self.record_trace:
            self.observed.append((self.lookups, layer, s.tolist()))

    @property
    def router_score(self):
        """layer -> [decayed selection score per expert] of the layers routed so far (replays start from it)."""
        return {layer: self.score_tab[layer].tolist() for layer in sorted(self.score_seen)}

    def get(self, key, protect):
        self.lookups += 1
        if self.record_trace:
            self.trace.append(key)
        expert = self.entries.get(key)
        if expert is not None:  # a hit: one dict lookup, _touch inlined (decode makes 32 a token on micro)
            self.hits += 1
            self.entries.move_to_end(key)
            self.clock += 1
            self.stamp[key] = self.clock
            return expert
        if key in self.guesses:
            self.request([key], {key})
        guessed = key in self.inflight and self.inflight[key][1]
        if not guessed:
            self.misses += 1
        if key not in self.inflight:
            # room without evicting the caller's other experts of this pass (their arguments may be held for one
            # call: evicted, their buffers could not be recycled), else with only this one kept
            if not self._ensure_room(set(protect) | {key}, wait=True) and not self._ensure_room({key}, wait=True):
                raise CacheError(f"{self.c.path}: an expert cache of {self.budget / 2**20:.1f} MiB cannot hold one "
                                 f"expert ({self.nbytes / 2**20:.1f} MiB); raise --ram-budget")
            self._submit(key)
        try:
            self._finish(key)
        except BaseException:
            self.misses += guessed  # a guess whose read failed (a bad crc) is no prefetch hit
            raise
        self.prefetch_hits += guessed
        return self.entries[key]

    def settle(self):
        """Wait for every in-flight read (end of a request) so counters and memory are final. A failed read does not
        stop the others' (left in flight, one raised its stale error later, from an unrelated request's eviction):
        all are finished, then the first error is raised."""
        first = None
        for key in list(self.inflight):
            try:
                self._finish(key)
            except Exception as e:  # (a Ctrl-C is not held back)
                first = first or e
        for fut, _ in self.guesses.values():
            wait_quietly(fut)
        if first is not None:
            raise first

    def cancel(self):
        """Ctrl-C: drop every read in flight (demand and guesses) instead of waiting for it (settle took every read
        queued, seconds under a small budget): parts not started never run, a part being read lands; the buffers leave
        the cache as a failed read's (orphans, given back once the readers let go), so the cache stays usable."""
        reads = [(fut, buf) for fut, _, buf in self.inflight.values()] + list(self.guesses.values())
        for fut, buf in reads:  # all first: a dropped NativeRead waits for its parts being read
            for f in fut:
                f.cancel()
            self.views_of_buf.pop(id(buf), None)
            self.orphans.add(id(buf))
        self.inflight, self.guesses = {}, OrderedDict()

    def stats(self):
        return {"lookups": self.lookups, "hits": self.hits, "prefetch_hits": self.prefetch_hits,
                "misses": self.misses, "hit_rate": (self.hits + self.prefetch_hits) / max(self.lookups, 1),
                "cache_hit_rate": self.hits / max(self.lookups, 1), "reads": self.reads,
                "prefetch_reads": self.prefetch_reads, "bytes_read": self.bytes_read,
                "cached_experts": len(self.entries), "capacity_experts": self.budget // self.nbytes}
