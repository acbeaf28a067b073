// all_gather larger than the one-shot area through the shared-memory segment (see
// ShmColl::all_gather_rounds in algo/shm_coll.h): rounds in the two-shot protocol's areas and
// counters, each rank posting the next piece of its block in its `res` area and copying every
// rank's piece out. Through the message ring each block crossed n-1 steps, two copies each.
#include <algorithm>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/copy.h"
#include "core/status.h"

namespace linkwise {

void ShmColl::all_gather_rounds(const void* in, void* out, size_t bytes) {
  const char* x = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  // x may be exactly my block of out (in place); any other overlap is staged (a copy out
  // could overwrite what a later round still posts).
  std::vector<char> staged;
  const bool overlaps = x < o + n_ * bytes && o < x + bytes;
  if (overlaps && x != o + rank_ * bytes) {
    staged.assign(x, x + bytes);
    x = staged.data();
  }
  const bool stream = bytes * n_ >= kStreamMin && !overlaps;
  const int lanes = lanes_for(bytes * n_);
  if (lanes > 1) ++lane_ar_calls_;
  run_lanes(lanes, [&](int l) {
    const size_t first = part_off(bytes, lanes, l);
    all_gather_lane(l, lanes, x + first, o + first, part_off(bytes, lanes, l + 1) - first, bytes, stream);
  });
}

// One lane's stripe of every block (src: my block's stripe; dst: block 0's stripe of out,
// blocks `stride` bytes apart). Round r: a_in = r (every read of earlier rounds done, so my
// `res` may be rewritten once every peer says so) → wait all a_in >= r → my piece into res →
// a_res = r → wait each a_res >= r and copy that rank's piece out.
void ShmColl::all_gather_lane(int lane, int lanes, const char* src, char* dst, size_t count, size_t stride,
                              bool stream) {
  const size_t piece = (kTwoPiece / static_cast<size_t>(lanes)) & ~size_t(63);
  Slot* me = slot(rank_);
  char* my_res = me->two_res() + lane * piece;
  for (size_t base = 0; base < count; base += piece) {
    const size_t cnt = std::min(piece, count - base);
    const uint32_t r = ++two_round_[lane];
    stamp(me->h().a_in[lane].stamp);
    publish(me->h().a_in[lane].v, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_in[lane].v, r, "all_gather", true);
      check_line(q, slot(q)->h().a_in[lane].stamp, true);
    }
    copy_bytes(my_res, src + base, cnt);
    publish(me->h().a_res[lane].v, r);
    char* mine = dst + rank_ * stride + base;
    if (mine != src + base) copy_out(mine, src + base, cnt, stream);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_res[lane].v, r, "all_gather", true);
      copy_out(dst + q * stride + base, slot(q)->two_res() + lane * piece, cnt, stream);
    }
  }
}

}  // namespace linkwise
