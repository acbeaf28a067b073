// The two-shot protocol of the shared-memory collectives (see algo/shm_coll.h): all-reduce
// and reduce in rounds of 2 MiB pieces, each rank reducing its part of every piece, and the
// larger reduce_scatter in rounds over a piece of every block, on one lane or several.
#include <algorithm>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "algo/shm_kernels.h"
#include "core/copy.h"
#include "core/status.h"

namespace linkwise {

void ShmColl::two_shot(const void* in, void* out, size_t count, DType t, RedOp op) {
  const size_t es = dtype_size(t);
  // Streamed (non-temporal) stores only out of place: in place, every output line was read
  // just before (the reduce reads its sub-block, the copy-in read the rest this round), so
  // plain stores hit the cache, while streamed ones would evict it. Paired 2-rank runs on the
  // 2-core VM: in place 8 / 16 MiB 12-28% faster with plain stores, out of place 12-25% slower.
  two_shot_lanes(in, out, count, 0, t, op, count * es >= kStreamMin && in != out);
}

void ShmColl::reduce_scatter(const void* in, void* out, size_t block, DType t, RedOp op) {
  const size_t es = dtype_size(t), bytes = block * es;
  const char* x = static_cast<const char*>(in);
  const char* o = static_cast<const char*>(out);
  // out may be exactly my block of x (nccl-tests' in place: each element is read before it
  // is written, by this rank only); any other overlap would let a write clobber input that a
  // later round still copies in, so x is staged first.
  std::vector<char> staged;
  const bool overlaps = o < x + n_ * bytes && x < o + bytes;
  if (overlaps && o != x + rank_ * bytes) {
    staged.assign(x, x + n_ * bytes);
    in = staged.data();
  }
  two_shot_lanes(in, out, block, block, t, op, bytes >= kStreamMin && !overlaps);
}

// Splits count elements (of each block, with a stride) into the lanes' stripes and runs them.
void ShmColl::two_shot_lanes(const void* in, void* out, size_t count, size_t stride, DType t, RedOp op,
                             bool stream) {
  const size_t es = dtype_size(t);
  const int lanes = lanes_for(count * es * (stride ? n_ : 1));
  if (lanes > 1) ++lane_ar_calls_;
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  run_lanes(lanes, [&](int l) {
    const size_t first = part_off(count, lanes, l), cnt = part_off(count, lanes, l + 1) - first;
    two_shot_lane(l, lanes, src + first * es, dst ? dst + first * es : nullptr, cnt, stride, t, op, stream);
  });
}

// One lane's stripe (in/out point at its first element), in rounds of 1/lanes of the areas.
// stride == 0 (all-reduce, reduce): rank j reduces part j of each round's piece of in, and
// everyone copies every part out. stride > 0 (reduce_scatter): in holds n blocks `stride`
// elements apart; each round takes the next `cnt` elements of every block, rank j reduces
// those of block j straight into its out, and nothing is copied out.
// out == nullptr (a reduce's non-root): my segment is reduced into res only, and nothing is
// copied out; the waits stay (my `in` is rewritten next round only after every a_res).
void ShmColl::two_shot_lane(int lane, int lanes, const char* src, char* dst, size_t count, size_t stride, DType t,
                            RedOp op, bool stream) {
  const size_t es = dtype_size(t);
  const size_t area = (kTwoPiece / static_cast<size_t>(lanes)) & ~size_t(63);
  const size_t piece = stride ? area / es / static_cast<size_t>(n_) : area / es;
  LW_CHECK(piece > 0, "two-shot area holds an element of every block");
  Slot* me = slot(rank_);
  char* my_in = me->two_in() + lane * area;
  char* my_res = me->two_res() + lane * area;
  auto& a_in = me->h().a_in[lane].v;
  auto& a_res = me->h().a_res[lane].v;
  for (size_t base = 0; base < count; base += piece) {
    const size_t cnt = std::min(piece, count - base);
    const uint32_t r = ++two_round_[lane];
    // Part j of this round: where it starts in the input and in the areas, and its length.
    auto part_in = [&](int j) { return stride ? j * stride + base : base + part_off(cnt, n_, j); };
    auto part_at = [&](int j) { return stride ? j * cnt : part_off(cnt, n_, j); };
    auto part_len = [&](int j) { return stride ? cnt : part_off(cnt, n_, j + 1) - part_off(cnt, n_, j); };
    for (int j = 0; j < n_; ++j) {
      if (j == rank_) continue;
      copy_bytes(my_in + part_at(j) * es, src + part_in(j) * es, part_len(j) * es);
    }
    stamp(me->h().a_in[lane].stamp[r & 1]);
    publish(a_in, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_in[lane].v, r, call_what(), true);
      check_line(q, slot(q)->h().a_in[lane].stamp[r & 1], true);
    }
    // My segment, combined in rank order, a sub-block at a time so the copy-out hits cache.
    const size_t off = part_at(rank_), len = part_len(rank_);
    const char* mine = src + part_in(rank_) * es;
    char* my_out = dst ? dst + (stride ? base : base + off) * es : nullptr;
    const size_t sub = std::max<size_t>(1, kSub / es);
    auto val = [&](int q, size_t s) -> const char* {
      return q == rank_ ? mine + s * es : slot(q)->two_in() + lane * area + (off + s) * es;
    };
    // One pass over every input at once where a kernel exists (the loads of all peers' lines
    // in flight together), else reduce a sub-block at a time so the copy-out hits cache.
    const char* ins[kManyMax];
    const bool many = one_pass(n_);
    for (size_t s = 0; s < len; s += sub) {
      const size_t m = std::min(sub, len - s);
      char* res = my_res + (off + s) * es;
      char* to = my_out ? my_out + s * es : nullptr;
      if (many) {
        for (int q = 0; q < n_; ++q) ins[q] = val(q, s);
        if (reduce_many_store(res, to ? to : res, ins, n_, m, t, op, stream && to)) continue;  // res == out: once
      }
      combine_store(n_, res, to, [&](int q) { return val(q, s); }, m, t, op, stream);
    }
    if (stream) stream_fence();
    publish(a_res, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_res[lane].v, r, call_what(), true);
      if (!dst || stride) continue;
      copy_out(dst + (base + part_at(q)) * es, slot(q)->two_res() + lane * area + part_at(q) * es,
               part_len(q) * es, stream);
    }
  }
}

}  // namespace linkwise
