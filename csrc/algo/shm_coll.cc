#include "algo/shm_coll.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "algo/coll.h"
#include "core/status.h"
#include "core/wait.h"

namespace linkwise {

namespace {
struct alignas(64) Line {
  std::atomic<uint32_t> v;
};
constexpr size_t kHeader = 4096;
constexpr size_t kSub = 32 << 10;
constexpr size_t kStreamMin = 8 << 20;  // messages at least this big are copied out with streaming stores  // reduce, then copy out, this many bytes at a time (in L1/L2)

inline bool reached(uint32_t have, uint32_t want) { return static_cast<int32_t>(have - want) >= 0; }

// Copies into a large destination that will not be read again soon (a big message's user
// buffer) with non-temporal stores, which skip the read-for-ownership of every destination
// line: out-of-cache copies move 2 streams of memory traffic instead of 3.
void copy_out(void* dst, const void* src, size_t n, bool stream) {
#if defined(__SSE2__)
  if (stream && n >= 4096) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    std::memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}
}  // namespace

struct ShmColl::Slot {
  struct Header {
    int64_t pid;
    Line a_in, a_res, b_in, c_in, c_done, sleepers;
  };
  Header& h() { return *reinterpret_cast<Header*>(this); }
  char* base() { return reinterpret_cast<char*>(this); }
  char* two_in() { return base() + kHeader; }
  char* two_res() { return two_in() + kTwoPiece; }
  char* one(uint32_t round) { return two_res() + kTwoPiece + (round & 1) * kOneMax; }
  char* bc(uint64_t piece) { return two_res() + kTwoPiece + 2 * kOneMax + (piece % kBcSlots) * kBcPiece; }
  static constexpr size_t bytes() { return kHeader + 2 * kTwoPiece + 2 * kOneMax + kBcSlots * kBcPiece; }
};

size_t ShmColl::segment_bytes(int n) { return static_cast<size_t>(n) * Slot::bytes(); }

ShmColl::ShmColl(const std::string& name, bool create, int rank, int n, double spin_us)
    : rank_(rank), n_(n), spin_us_(spin_us) {
  seg_ = create ? ShmSegment::create_private(name, segment_bytes(n)) : ShmSegment::open(name);
  LW_CHECK(seg_.size() >= segment_bytes(n), "collective segment has room for every rank");
  slot(rank_)->h().pid = static_cast<int64_t>(getpid());
}

ShmColl::~ShmColl() {
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
}

void ShmColl::connect() {
  pidfds_.assign(n_, -1);
  for (int r = 0; r < n_; ++r) {
    if (r == rank_) continue;
#ifdef SYS_pidfd_open
    pidfds_[r] = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(slot(r)->h().pid), 0));
#endif
  }
}

ShmColl::Slot* ShmColl::slot(int r) const {
  return reinterpret_cast<Slot*>(static_cast<char*>(seg_.data()) + static_cast<size_t>(r) * Slot::bytes());
}

bool ShmColl::peer_gone(int peer) {
  int fd = pidfds_.empty() ? -1 : pidfds_[peer];
  if (fd >= 0) {
    struct pollfd p = {fd, POLLIN, 0};
    return poll(&p, 1, 0) > 0;  // a pidfd turns readable when the process terminates (zombie or not)
  }
  return kill(static_cast<pid_t>(slot(peer)->h().pid), 0) != 0 && errno == ESRCH;
}

void ShmColl::publish(std::atomic<uint32_t>& word, uint32_t value) {
  word.store(value, std::memory_order_seq_cst);
  if (slot(rank_)->h().sleepers.v.load(std::memory_order_seq_cst) > 0) futex_wake_all(&word);
}

void ShmColl::wait_ge(int peer, std::atomic<uint32_t>& word, uint32_t target, const char* what) {
  if (reached(word.load(std::memory_order_acquire), target)) return;
  const auto t0 = Clock::now();
  while (seconds_since(t0) * 1e6 < spin_us_) {
    for (int i = 0; i < 16; ++i) {
      if (reached(word.load(std::memory_order_acquire), target)) return;
      cpu_relax();
    }
  }
  auto& sleepers = slot(peer)->h().sleepers.v;
  auto last_check = Clock::now();
  while (true) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t v = word.load(std::memory_order_seq_cst);
    if (!reached(v, target)) futex_wait(&word, v, 2000);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(word.load(std::memory_order_acquire), target)) return;
    if (seconds_since(last_check) >= 0.1) {
      last_check = Clock::now();
      if (peer_gone(peer) && !reached(word.load(std::memory_order_acquire), target))
        throw Error(ErrorKind::Peer,
                    "rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) + " (pid " +
                        std::to_string(slot(peer)->h().pid) + ") died during a shared-memory " + what +
                        ". Look at that rank's output for the cause.",
                    peer);
      if (seconds_since(t0) > timeout_)
        throw Error(ErrorKind::Timeout, "rank " + std::to_string(rank_) + ": shared-memory " + what +
                                            " waited more than " + std::to_string(timeout_) + " s for rank " +
                                            std::to_string(peer) + "; check that every rank calls it, or raise LINKWISE_TIMEOUT",
                    peer);
    }
  }
}

void ShmColl::all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, double timeout) {
  timeout_ = timeout;
  if (count * dtype_size(t) <= kOneMax) one_shot(in, out, count, t, op);
  else two_shot(in, out, count, t, op);
}

void ShmColl::one_shot(const void* in, void* out, size_t count, DType t, RedOp op) {
  const size_t bytes = count * dtype_size(t);
  const uint32_t r = ++one_round_;
  Slot* me = slot(rank_);
  std::memcpy(me->one(r), in, bytes);
  publish(me->h().b_in.v, r);
  for (int q = 0; q < n_; ++q)
    if (q != rank_) wait_ge(q, slot(q)->h().b_in.v, r, "all_reduce");
  reduce3(out, slot(0)->one(r), slot(1)->one(r), count, t, op);
  for (int q = 2; q < n_; ++q) reduce_into(out, slot(q)->one(r), count, t, op);
  if (op == RedOp::Avg) avg_finish(out, count, t, n_);
}

void ShmColl::two_shot(const void* in, void* out, size_t count, DType t, RedOp op) {
  const size_t es = dtype_size(t);
  const size_t piece = kTwoPiece / es;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  Slot* me = slot(rank_);
  for (size_t base = 0; base < count; base += piece) {
    const size_t cnt = std::min(piece, count - base);
    const uint32_t r = ++two_round_;
    for (int j = 0; j < n_; ++j) {
      if (j == rank_) continue;
      const size_t off = part_off(cnt, n_, j), len = part_off(cnt, n_, j + 1) - off;
      std::memcpy(me->two_in() + off * es, src + (base + off) * es, len * es);
    }
    publish(me->h().a_in.v, r);
    for (int q = 0; q < n_; ++q)
      if (q != rank_) wait_ge(q, slot(q)->h().a_in.v, r, "all_reduce");
    // My segment, combined in rank order, a sub-block at a time so the copy-out hits cache.
    const size_t off = part_off(cnt, n_, rank_), len = part_off(cnt, n_, rank_ + 1) - off;
    const size_t sub = std::max<size_t>(1, kSub / es);
    auto val = [&](int q, size_t o) -> const char* {
      return q == rank_ ? src + (base + o) * es : slot(q)->two_in() + o * es;
    };
    for (size_t s = 0; s < len; s += sub) {
      const size_t o = off + s, m = std::min(sub, len - s);
      char* res = me->two_res() + o * es;
      reduce3(res, val(0, o), val(1, o), m, t, op);
      for (int q = 2; q < n_; ++q) reduce_into(res, val(q, o), m, t, op);
      if (op == RedOp::Avg) avg_finish(res, m, t, n_);
      copy_out(dst + (base + o) * es, res, m * es, count * es >= kStreamMin);
    }
    publish(me->h().a_res.v, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_res.v, r, "all_reduce");
      const size_t qo = part_off(cnt, n_, q), ql = part_off(cnt, n_, q + 1) - qo;
      copy_out(dst + (base + qo) * es, slot(q)->two_res() + qo * es, ql * es, count * es >= kStreamMin);
    }
  }
}

void ShmColl::broadcast(void* buf, size_t bytes, int root, double timeout) {
  timeout_ = timeout;
  char* b = static_cast<char*>(buf);
  Slot* rs = slot(root);
  for (size_t off = 0; off < bytes; off += kBcPiece) {
    const size_t len = std::min(kBcPiece, bytes - off);
    const uint64_t i = piece_++;
    if (rank_ == root) {
      if (i >= static_cast<uint64_t>(kBcSlots)) {
        const uint32_t need = static_cast<uint32_t>(i - kBcSlots + 1);  // readers done with this slot's old piece
        for (int q = 0; q < n_; ++q)
          if (q != root) wait_ge(q, slot(q)->h().c_done.v, need, "broadcast");
      }
      std::memcpy(rs->bc(i), b + off, len);
      publish(rs->h().c_done.v, static_cast<uint32_t>(i + 1));
      publish(rs->h().c_in.v, static_cast<uint32_t>(i + 1));
    } else {
      wait_ge(root, rs->h().c_in.v, static_cast<uint32_t>(i + 1), "broadcast");
      copy_out(b + off, rs->bc(i), len, bytes >= kStreamMin);
      publish(slot(rank_)->h().c_done.v, static_cast<uint32_t>(i + 1));
    }
  }
}

}  // namespace linkwise
