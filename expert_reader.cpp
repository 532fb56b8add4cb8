// expert_reader.cpp: stream_infer's expert reads on C++ threads, off Python. Included by int4_cpu.cpp, so built
// into its extension (kernels.native_int4()); its ops join the same torch.ops namespace.
//
// Why: with Python reader threads, a miss cost the decoding thread ~0.5 ms of Python (4 ThreadPoolExecutor
// submits and futures, ~145 us alone) and the GIL hops between 5 threads on 2 cores: a reader holding the GIL
// while the scheduler runs a GEMV thread stalls the decoding thread when its op returns. Here a read is one op
// call, the readers never take the GIL, and the decoding thread waits in blob_wait with the GIL released.
//
// A blob is read as n_parts aligned parts (the disk's queue depth) by a pool's threads; the thread that lands the
// last part checks the blob's crc32 (zlib's) when asked. Pools: 0 demand reads, 1 prefetch guesses (so a demand
// read never queues behind a guess), 2 the bench's disk measurement.

#ifndef PICAFLOR_NO_TORCH  // tests/int4_cpu_harness.cpp: the crc32 alone, without torch
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#endif

#if defined(__unix__) || defined(__APPLE__)  // pread, pthreads; elsewhere no ops: stream_infer's Python readers
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#ifdef __PCLMUL__
#include <immintrin.h>
#elif defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace {

// ---- crc32 (zlib's polynomial 0xEDB88320, reflected, inverted in and out) ----

struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (int i = 0; i < 256; i++)
      for (int s = 1; s < 8; s++) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const CrcTables& crc_tables() {
  static const CrcTables tables;
  return tables;
}

// The raw register update (no inversion), a byte at a time, then 8 at a time ("slicing-by-8", Kounavis and
// Berry, Intel 2005) on little-endian CPUs.
uint32_t crc_bytes(uint32_t c, const uint8_t* p, size_t n) {
  const auto& T = crc_tables().t;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = T[7][v & 0xff] ^ T[6][(v >> 8) & 0xff] ^ T[5][(v >> 16) & 0xff] ^ T[4][(v >> 24) & 0xff] ^
        T[3][(v >> 32) & 0xff] ^ T[2][(v >> 40) & 0xff] ^ T[1][(v >> 48) & 0xff] ^ T[0][v >> 56];
  }
#endif
  while (n--) c = T[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return c;
}

#ifdef __PCLMUL__
// Carry-less multiplication folding (Gopal et al., "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ
// Instruction", Intel 2009): four 128-bit lanes folded 512 bits at a time, then into one lane, 16 bytes at a
// time. The last lane's 16 bytes go through the table from a zero register, which is what the fold leaves: the
// rest of the message, congruent mod P. Folding by D bits multiplies by x^(D+32) (low qword) and x^(D-32) (high
// qword), mod P, bit-reflected:
constexpr long long K128_LO = 0x1751997d0LL, K128_HI = 0x0ccaa009eLL;
constexpr long long K512_LO = 0x154442bd4LL, K512_HI = 0x1c6e41596LL;
constexpr long long K2048_LO = 0x11542778aLL, K2048_HI = 0x1322d1430LL;

inline __m128i crc_fold(__m128i x, __m128i k, __m128i data) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), data);
}

// One 128-bit lane folded on 16 bytes at a time, then the tail through the table (x holds the message so far)
uint32_t crc_lane_finish(__m128i x, const uint8_t* p, size_t n) {
  const __m128i k128 = _mm_set_epi64x(K128_HI, K128_LO);
  for (; n >= 16; p += 16, n -= 16) x = crc_fold(x, k128, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) uint8_t last[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(last), x);
  return crc_bytes(crc_bytes(0, last, 16), p, n);
}

#if defined(__VPCLMULQDQ__) && defined(__AVX512F__)
// The same folds 512 bits wide (VPCLMULQDQ: four 128-bit lanes a register): four registers folded 2048 bits at a
// time (constants as above, D = 2048), then into one register (by 512 bits) and
// its four lanes into one (by 128). A 3.5 MB blob just read by O_DIRECT: 0.30 -> 0.12 ms of a reader's CPU here
// (Zen 4; 0.27 -> 0.07 hot), which matters on a disk that reads that blob in ~0.5 ms.
inline __m512i crc_fold512(__m512i x, __m512i k, __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), data,
                                   0x96);  // a ^ b ^ c
}

uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) {
  if (n < 256) return n < 16 ? crc_bytes(c, p, n)
                             : crc_lane_finish(_mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                                             _mm_cvtsi32_si128(int(c))), p + 16, n - 16);
  const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(K2048_HI, K2048_LO));
  const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(K512_HI, K512_LO));
  const __m128i k128 = _mm_set_epi64x(K128_HI, K128_LO);
  auto ld = [](const uint8_t* q) { return _mm512_loadu_si512(reinterpret_cast<const void*>(q)); };
  __m512i x0 = _mm512_xor_si512(ld(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(int(c))));
  __m512i x1 = ld(p + 64), x2 = ld(p + 128), x3 = ld(p + 192);
  for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
    x0 = crc_fold512(x0, k2048, ld(p));
    x1 = crc_fold512(x1, k2048, ld(p + 64));
    x2 = crc_fold512(x2, k2048, ld(p + 128));
    x3 = crc_fold512(x3, k2048, ld(p + 192));
  }
  x3 = crc_fold512(crc_fold512(crc_fold512(x0, k512, x1), k512, x2), k512, x3);
  __m128i x = _mm512_extracti32x4_epi32(x3, 0);
  x = crc_fold(x, k128, _mm512_extracti32x4_epi32(x3, 1));
  x = crc_fold(x, k128, _mm512_extracti32x4_epi32(x3, 2));
  x = crc_fold(x, k128, _mm512_extracti32x4_epi32(x3, 3));
  return crc_lane_finish(x, p, n);
}
#else
uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) {
  if (n < 64) return crc_bytes(c, p, n);
  const __m128i k512 = _mm_set_epi64x(K512_HI, K512_LO);
  const __m128i k128 = _mm_set_epi64x(K128_HI, K128_LO);
  auto ld = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  __m128i x0 = _mm_xor_si128(ld(p), _mm_cvtsi32_si128(int(c))), x1 = ld(p + 16), x2 = ld(p + 32), x3 = ld(p + 48);
  for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
    x0 = crc_fold(x0, k512, ld(p));
    x1 = crc_fold(x1, k512, ld(p + 16));
    x2 = crc_fold(x2, k512, ld(p + 32));
    x3 = crc_fold(x3, k512, ld(p + 48));
  }
  return crc_lane_finish(crc_fold(crc_fold(crc_fold(x0, k128, x1), k128, x2), k128, x3), p, n);
}
#endif
#elif defined(__ARM_FEATURE_CRC32)
// AArch64's CRC32 instructions (ARMv8.1 on; an option in 8.0) compute zlib's CRC-32, reflected, 8 bytes an
// instruction: several times the table's speed, for the reader thread that checks a blob it just read
uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) {
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __crc32d(c, v);
  }
  return crc_bytes(c, p, n);  // the last 0-7 bytes
}
#else
uint32_t crc_update(uint32_t c, const uint8_t* p, size_t n) { return crc_bytes(c, p, n); }
#endif

uint32_t crc32_zlib(uint32_t crc, const uint8_t* p, size_t n) { return ~crc_update(~crc, p, n); }

#ifndef PICAFLOR_NO_TORCH
// ---- the reader pools ----

enum Status { PENDING = -1, OK = 0, CRC_MISMATCH = 1, SHORT_READ = 2, OS_ERROR = 3, CANCELLED = 4 };

struct Blob {
  int pool, direct_fd, fd;
  int64_t offset, nbytes, expected_crc;  // expected_crc < 0: not checked
  uint8_t* dst;
  std::atomic<int> parts_left{0}, first_errno{0};
  std::atomic<int64_t> landed{0};  // bytes read, all parts
  std::atomic<bool> short_read{false}, buffered{false};  // buffered: O_DIRECT failed, the part was reread buffered
  std::atomic<bool> cancelled{false};  // blob_cancel dropped parts of it that had not started
  int status = PENDING;  // set under done_mu once every part is back
};

struct Part {
  std::shared_ptr<Blob> blob;
  int64_t start, n;
};

struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Part> queue;
  int threads = 0;
};

// Never destroyed (heap, leaked on purpose): detached readers may still wait on them while the process exits.
struct State {
  Pool pools[3];
  std::mutex done_mu;
  std::condition_variable done_cv;
  std::unordered_map<int64_t, std::shared_ptr<Blob>> tickets;  // the caller numbers its reads
  std::mutex busy_mu;  // disk busy time: the time at least one part was being read (the bench's disk rate)
  int active_parts = 0;
  std::chrono::steady_clock::time_point busy_since;
  int64_t busy_ns = 0;
  std::atomic<int> delay_us[3] = {{0}, {0}, {0}};  // tests only: a pool's parts sleep this long first (a slow disk)
  std::atomic<int> fail_direct_errno{0};  // tests only: the next O_DIRECT read fails with this errno
};
State* state = new State;

void reset_after_fork() {  // a forked child has none of the readers: start over (the parent's reads are not ours)
  state = new State;
}

void read_part(Part& part) {
  Blob& b = *part.blob;
  if (int d = state->delay_us[b.pool].load()) std::this_thread::sleep_for(std::chrono::microseconds(d));
  int fd = b.direct_fd >= 0 ? b.direct_fd : b.fd;
  int64_t got = 0;
  while (got < part.n) {
    int injected = fd == b.direct_fd ? state->fail_direct_errno.exchange(0) : 0;
    ssize_t r = injected ? (errno = injected, -1)
                         : pread(fd, b.dst + part.start + got, size_t(part.n - got), off_t(b.offset + part.start + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      // a filesystem that opened O_DIRECT but cannot do it: buffered from now on; any other error (EIO: a bad
      // sector) is the read's, and O_DIRECT stays (it turned off for good, and the page cache broke --ram-budget)
      if (fd == b.direct_fd && b.fd >= 0 && (errno == EINVAL || errno == EOPNOTSUPP || errno == ENOTSUP)) {
        fd = b.fd;
        b.buffered = true;
        continue;
      }
      int zero = 0;
      b.first_errno.compare_exchange_strong(zero, errno);
      break;
    }
    if (r == 0) {  // end of file before the blob's end: a truncated container
      b.short_read = true;
      break;
    }
    got += r;
  }
  b.landed += got;
}

void reader_loop(Pool* pool) {
  for (;;) {
    Part part;
    {
      std::unique_lock<std::mutex> lock(pool->mu);
      pool->cv.wait(lock, [&] { return !pool->queue.empty(); });
      part = std::move(pool->queue.front());
      pool->queue.pop_front();
    }
    {
      std::lock_guard<std::mutex> lock(state->busy_mu);
      if (state->active_parts++ == 0) state->busy_since = std::chrono::steady_clock::now();
    }
    read_part(part);
    {
      std::lock_guard<std::mutex> lock(state->busy_mu);
      if (--state->active_parts == 0)
        state->busy_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                                               state->busy_since).count();
    }
    Blob& b = *part.blob;
    if (--b.parts_left > 0) continue;
    int status = b.first_errno ? OS_ERROR : b.short_read || b.landed != b.nbytes ? SHORT_READ : OK;
    if (b.cancelled) status = CANCELLED;  // parts were dropped: the blob is not all there
    if (status == OK && b.expected_crc >= 0 && crc32_zlib(0, b.dst, size_t(b.nbytes)) != uint32_t(b.expected_crc))
      status = CRC_MISMATCH;
    {
      std::lock_guard<std::mutex> lock(state->done_mu);
      b.status = status;
    }
    state->done_cv.notify_all();
  }
}

// Start reading bytes [offset, offset + nbytes) of the file into addr (page-aligned memory the caller keeps alive
// until blob_wait returns), as n_parts parts of `align`-multiple sizes on pool `pool` (at least n_threads readers;
// a pool keeps the most it was ever asked for); check its crc32 against expected_crc when that is >= 0. `ticket`
// (the caller's number, unique) names it for blob_done / blob_wait. Nothing is queued if it throws.
void blob_read(int64_t ticket, int64_t pool, int64_t direct_fd, int64_t fd, int64_t offset, int64_t addr,
               int64_t nbytes, int64_t n_parts, int64_t align, int64_t expected_crc, int64_t n_threads) {
  TORCH_CHECK(pool >= 0 && pool < 3 && nbytes > 0 && n_parts > 0 && align > 0 && n_threads > 0 && addr != 0,
              "blob_read: bad arguments");
  auto b = std::make_shared<Blob>();
  b->pool = int(pool), b->direct_fd = int(direct_fd), b->fd = int(fd), b->offset = offset, b->nbytes = nbytes;
  b->expected_crc = expected_crc, b->dst = reinterpret_cast<uint8_t*>(addr);
  const int64_t step = (nbytes + n_parts - 1) / n_parts, part = (step + align - 1) / align * align;
  std::vector<Part> parts;
  for (int64_t o = 0; o < nbytes; o += part) parts.push_back({b, o, std::min(part, nbytes - o)});
  b->parts_left = int(parts.size());
  Pool* p = &state->pools[pool];
  {
    std::lock_guard<std::mutex> lock(p->mu);  // the readers first: starting one may throw
    for (; p->threads < n_threads; p->threads++) std::thread(reader_loop, p).detach();
  }
  {
    std::lock_guard<std::mutex> lock(state->done_mu);
    TORCH_CHECK(state->tickets.emplace(ticket, b).second, "blob_read: ticket ", ticket, " is in use");
  }
  {
    std::lock_guard<std::mutex> lock(p->mu);
    for (auto& x : parts) p->queue.push_back(std::move(x));
  }
  p->cv.notify_all();
}

std::shared_ptr<Blob> ticket_blob(int64_t ticket) {
  auto it = state->tickets.find(ticket);
  TORCH_CHECK(it != state->tickets.end(), "blob_wait: unknown ticket ", ticket, " (waited for twice?)");
  return it->second;
}

bool blob_done(int64_t ticket) {
  std::lock_guard<std::mutex> lock(state->done_mu);
  return ticket_blob(ticket)->status != PENDING;
}

// Wait for a read (torch.ops calls run without the GIL) and forget its ticket: [status, errno, bytes landed,
// buffered], status 0 ok, 1 crc mismatch, 2 short read (end of file), 3 an OS error (errno), 4 cancelled (blob_cancel);
// buffered 1 when O_DIRECT failed and a part was read through the page cache instead. With timeout_ms >= 0, at most
// that long: [-1, 0, 0, 0] (the ticket kept) if it has not landed, so the caller sees a Ctrl-C between waits (one
// wait for a read queued behind many took them all). forget=false keeps the ticket even once landed: a Ctrl-C is
// raised as the op returns, which lost the status of a read that landed in that wait (the caller then forgets it
// with a wait that returns at once).
std::vector<int64_t> blob_wait(int64_t ticket, int64_t timeout_ms, bool forget) {
  std::unique_lock<std::mutex> lock(state->done_mu);
  auto b = ticket_blob(ticket);
  auto landed = [&] { return b->status != PENDING; };
  if (timeout_ms < 0)
    state->done_cv.wait(lock, landed);
  else if (!state->done_cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), landed))
    return {PENDING, 0, 0, 0};
  if (forget) state->tickets.erase(ticket);
  return {b->status, b->first_errno.load(), b->landed.load(), b->buffered.load() ? 1 : 0};
}

// Drop a read's parts the readers have not started (Ctrl-C: nobody will use it): its blob_wait then returns once the
// parts being read land, status 4 if any part was dropped. An unknown (waited-for) ticket is no error.
void blob_cancel(int64_t ticket) {
  std::shared_ptr<Blob> b;
  {
    std::lock_guard<std::mutex> lock(state->done_mu);
    auto it = state->tickets.find(ticket);
    if (it == state->tickets.end()) return;
    b = it->second;
  }
  Pool* p = &state->pools[b->pool];
  int dropped = 0;
  {
    std::lock_guard<std::mutex> lock(p->mu);
    for (auto it = p->queue.begin(); it != p->queue.end();) {
      if (it->blob == b) {
        it = p->queue.erase(it);
        dropped++;
      } else {
        ++it;
      }
    }
  }
  if (!dropped) return;
  b->cancelled = true;  // before parts_left: the reader that lands the last started part sees it
  if ((b->parts_left -= dropped) > 0) return;
  {
    std::lock_guard<std::mutex> lock(state->done_mu);
    b->status = CANCELLED;
  }
  state->done_cv.notify_all();
}

// [ns the disk was busy (at least one part being read) since load, parts being read now]
std::vector<int64_t> reader_stats() {
  std::lock_guard<std::mutex> lock(state->busy_mu);
  return {state->busy_ns, state->active_parts};
}

void reader_fail_direct(int64_t err) {
  state->fail_direct_errno = int(err);
}

void reader_delay_us(int64_t pool, int64_t us) {
  TORCH_CHECK(pool >= 0 && pool < 3, "reader_delay_us: pool 0, 1 or 2");
  state->delay_us[pool] = int(us);
}

int64_t crc32(const at::Tensor& buf, int64_t crc) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(), "crc32: CPU uint8");
  return crc32_zlib(uint32_t(crc), buf.data_ptr<uint8_t>(), size_t(buf.numel()));
}

const int fork_handler = pthread_atfork(nullptr, nullptr, reset_after_fork);

#endif  // PICAFLOR_NO_TORCH
}  // namespace

#ifndef PICAFLOR_NO_TORCH
TORCH_LIBRARY_FRAGMENT(picaflor_int4, m) {
  m.def("blob_read(int ticket, int pool, int direct_fd, int fd, int offset, int addr, int nbytes, int n_parts, "
        "int align, int expected_crc, int n_threads) -> ()", &blob_read);
  m.def("blob_done(int ticket) -> bool", &blob_done);
  m.def("blob_wait(int ticket, int timeout_ms=-1, bool forget=True) -> int[]", &blob_wait);
  m.def("blob_cancel(int ticket) -> ()", &blob_cancel);
  m.def("reader_stats() -> int[]", &reader_stats);
  m.def("reader_delay_us(int pool, int us) -> ()", &reader_delay_us);
  m.def("reader_fail_direct(int err) -> ()", &reader_fail_direct);
  m.def("crc32(Tensor buf, int crc) -> int", &crc32);
}

#endif  // PICAFLOR_NO_TORCH
#endif  // __unix__ || __APPLE__
