// The single-copy (CMA) protocols of ShmColl: a large all-reduce that reads every rank's
// input and writes every rank's output in place through process_vm_readv/writev, and a large
// broadcast that readers pull from the root while the root pushes into them. The protocols,
// their ordering and the aliasing contract are described in algo/shm_coll.h.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include "algo/coll.h"
#include "algo/fork_join.h"
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/status.h"
#include "core/wait.h"
#include "transport/shm/cma.h"

namespace linkwise {

namespace {
constexpr uint64_t kLow = 0xffffffffull;
}  // namespace

char* ShmColl::scratch(int thread) {
  // Called by the owner thread before pool_->run(): helpers only index the vector.
  if (scratch_.size() < static_cast<size_t>(pool_->threads())) scratch_.resize(pool_->threads(), nullptr);
  char*& p = scratch_[thread];
  if (!p) {
    p = static_cast<char*>(std::aligned_alloc(4096, (2 * opt_.chunk + 4095) & ~size_t(4095)));
    if (!p) throw Error(ErrorKind::Internal, "out of memory for the all_reduce scratch buffers");
  }
  return p;
}

void ShmColl::cma_all_reduce(const void* in, void* out, size_t count, DType t, RedOp op) {
  LW_CHECK(n_ >= 2, "the CMA all-reduce runs between two ranks or more");
  const size_t es = dtype_size(t);
  const uint32_t r = ++x_round_;
  ++cma_ar_calls_;
  auto& me = slot(rank_)->h();
  me.x_src = reinterpret_cast<uint64_t>(in);
  me.x_dst = reinterpret_cast<uint64_t>(out);
  stamp(me.x_in.stamp);
  publish(me.x_in.v, r);  // release: the addresses are visible with the counter
  cma_busy_ = 1;          // from here on peers may copy from / into my buffers
  x_src_.resize(n_);
  x_dst_.resize(n_);
  for (int q = 0; q < n_; ++q) {
    if (q != rank_) {
      wait_ge(q, slot(q)->h().x_in.v, r, call_what(), true);
      check_line(q, slot(q)->h().x_in.stamp, true);
    }
    x_src_[q] = slot(q)->h().x_src;
    x_dst_[q] = slot(q)->h().x_dst;
  }
  const size_t off = part_off(count, n_, rank_), len = part_off(count, n_, rank_ + 1) - off;
  // Chunks of opt_.chunk bytes; smaller (down to 4 KiB) when that leaves threads idle.
  size_t step = std::max<size_t>(1, opt_.chunk / es);
  const size_t th = static_cast<size_t>(pool_->threads());
  if (th > 1 && len < step * th) step = std::max<size_t>(std::max<size_t>(1, 4096 / es), (len + th - 1) / th);
  const size_t parts = (len + step - 1) / step;
  // Any thread may take a part (helpers are not told how many parts there are).
  for (int i = 0; i < (parts > 1 ? pool_->threads() : 1); ++i) scratch(i);
  // Streamed stores only out of place: in place, the next call reads this segment of my own
  // buffer again, and a streamed store would have pushed it out of the cache.
  const bool stream = count * es >= kStreamMin && in != out;
  pool_->run(static_cast<int>(parts), [&](int i, int thread) {
    const size_t o = off + static_cast<size_t>(i) * step;
    cma_chunk(o, std::min(step, off + len - o), t, op, stream, thread);
  });
  publish(me.x_done.v, r);  // every rank's output has my segment; I no longer read inputs
  for (int q = 0; q < n_; ++q)
    if (q != rank_) wait_ge(q, slot(q)->h().x_done.v, r, call_what(), true);
  cma_busy_ = 0;
}

// Elements [o, o+m) of my segment: read every rank's input (mine directly), combine in rank
// order into scratch `a`, then write `a` to my output and to every peer's output (a reduce:
// only to the root's; the others published no output, x_dst 0).
void ShmColl::cma_chunk(size_t o, size_t m, DType t, RedOp op, bool stream, int thread) {
  const size_t es = dtype_size(t), nb = m * es, ob = o * es;
  char* a = scratch_[thread];
  char* b = a + opt_.chunk;
  const char* mine = reinterpret_cast<const char*>(x_src_[rank_]) + ob;
  auto get = [&](int q, char* buf) -> const char* {
    if (q == rank_) return mine;
    cma_read(pids_[q], q, buf, x_src_[q] + ob, nb);
    return buf;
  };
  // v(0) lands in a (the result's buffer: an exact alias), every later one in b; my own
  // output is written after my input was read, so in place is fine.
  char* own = x_dst_[rank_] ? reinterpret_cast<char*>(x_dst_[rank_]) + ob : nullptr;
  combine_store(n_, a, own, [&](int q) { return get(q, q == 0 ? a : b); }, m, t, op, stream);
  if (stream && own) stream_fence();
  for (int k = 1; k < n_; ++k) {
    const int q = (rank_ + k) % n_;
    if (x_dst_[q]) cma_write(pids_[q], q, x_dst_[q] + ob, a, nb);
  }
}

void ShmColl::cma_broadcast(const void* src, void* buf, size_t bytes, int root) {
  const uint32_t r = ++y_round_;
  ++cma_bc_calls_;
  auto& me = slot(rank_)->h();
  // The root publishes its source (readers copy from it), a reader its destination.
  me.y_addr = reinterpret_cast<uint64_t>(rank_ == root ? src : buf);
  me.y_work.v.store(static_cast<uint64_t>(r) << 32, std::memory_order_relaxed);
  me.y_done.v.store(static_cast<uint64_t>(r) << 32, std::memory_order_relaxed);
  stamp(me.y_in.stamp);
  me.y_call.v.store(static_cast<uint64_t>(r) << 32 | call_, std::memory_order_relaxed);
  publish(me.y_in.v, r);  // seq_cst store: y_addr / y_work / y_done / y_call are visible with it
  // Peer q's call in this round must be this one; q may already be in a later round.
  auto check_round = [&](int q) {
    const uint64_t w = slot(q)->h().y_call.v.load(std::memory_order_relaxed);
    if (static_cast<uint32_t>(w >> 32) == r && static_cast<uint32_t>(w) != call_)
      mismatch(q, static_cast<uint32_t>(w), slot(q)->h().y_in.stamp.desc.load(std::memory_order_relaxed));
    check_line(q, slot(q)->h().y_in.stamp, false);
  };
  cma_busy_ = 2;
  y_root_ = root;
  const uint64_t mine = me.y_addr;
  if (rank_ != root) {
    wait_ge(root, slot(root)->h().y_in.v, r, "broadcast");
    check_round(root);
    const uint64_t from = slot(root)->h().y_addr;
    pool_->run(pool_->threads(), [&](int, int) { cma_take_pieces(rank_, root, r, from, mine, bytes); });
    wait_ge(root, me.y_fin.v, r, "broadcast");  // pieces the root claimed have landed
    cma_busy_ = 0;
    return;
  }
  // Out of place, the root first copies src into its own buf (a user-space copy, faster here
  // than the kernel's), while the readers pull; then it pushes pieces into each reader in
  // turn (readers pull the rest meanwhile). Peers only read src, never buf.
  if (src != buf) copy_out(buf, src, bytes, bytes >= kStreamMin);
  pool_->run(n_ - 1, [&](int k, int) {
    const int q = (root + 1 + k) % n_;
    wait_ge(q, slot(q)->h().y_in.v, r, "broadcast");
    check_round(q);
    cma_take_pieces(q, root, r, mine, slot(q)->h().y_addr, bytes);
  });
  for (int q = 0; q < n_; ++q)
    if (q != root) wait_ge(q, slot(q)->h().y_fin.v, r, "broadcast");  // no one reads my src any more
  cma_busy_ = 0;
}

// After a failure inside a CMA round (this rank already marked itself failed): wait until no
// live peer can still copy from or into this rank's buffers, so that the caller may free or
// reuse them once the error reaches it. A peer is done with them once it finished its part
// of the round (all-reduce: its x_done; broadcast: the reader's y_fin), marked itself failed,
// or died. Bounded by the timeout.
void ShmColl::cma_drain() {
  if (!cma_busy_) return;
  const auto t0 = Clock::now();
  for (int q = 0; q < n_; ++q) {
    if (q == rank_) continue;
    if (cma_busy_ == 2 && rank_ != y_root_ && q != y_root_) continue;  // only the root writes into a reader
    for (;;) {
      auto& h = slot(q)->h();
      bool done;
      if (cma_busy_ == 1) done = reached(h.x_done.v.load(std::memory_order_acquire), x_round_);
      else if (rank_ == y_root_) done = reached(h.y_fin.v.load(std::memory_order_acquire), y_round_);
      else done = reached(slot(rank_)->h().y_fin.v.load(std::memory_order_acquire), y_round_);
      if (done || h.failed.v.load(std::memory_order_acquire) || peer_gone(q) || seconds_since(t0) > timeout_) break;
      usleep(100);
    }
  }
  cma_busy_ = 0;
}

// Claims pieces of reader q's round-r broadcast and copies them from the root's buffer
// (src, in the root's address space) into q's (dst, in q's): the reader itself reads, the
// root writes. Returns when no piece of round r is left to claim.
void ShmColl::cma_take_pieces(int q, int root, uint32_t r, uint64_t src, uint64_t dst, size_t bytes) {
  auto& h = slot(q)->h();
  const uint64_t piece = opt_.piece;
  const uint64_t pieces = (bytes + piece - 1) / piece;
  for (;;) {
    uint64_t w = h.y_work.v.load(std::memory_order_acquire);
    if ((w >> 32) != r || (w & kLow) >= pieces) return;
    if (!h.y_work.v.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel)) continue;
    const uint64_t off = (w & kLow) * piece;
    const size_t len = std::min<uint64_t>(piece, bytes - off);
    if (rank_ == root)
      cma_write(pids_[q], q, dst + off, reinterpret_cast<const char*>(src) + off, len);
    else
      cma_read(pids_[root], root, reinterpret_cast<char*>(dst) + off, src + off, len);
    const uint64_t d = h.y_done.v.fetch_add(1, std::memory_order_acq_rel);
    if ((d & kLow) + 1 == pieces) publish(h.y_fin.v, r);  // the last piece of q's round r
  }
}

}  // namespace linkwise
