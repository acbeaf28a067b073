// all_gather and all_to_all larger than the one-shot area through the shared-memory segment
// (see ShmColl::block_rounds in algo/shm_coll.h): rounds in the two-shot protocol's areas and
// counters, each rank posting the next piece of its block (all_to_all: of every block) in its
// `res` area and copying every rank's piece (its own block's piece) out. Through messages each
// block crossed n-1 ring steps (all_gather) or one message per peer, two copies each.
#include <algorithm>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/copy.h"
#include "core/status.h"

namespace linkwise {

void ShmColl::block_rounds(bool a2a, const void* in, void* out, size_t bytes) {
  const char* x = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  // all_gather: x may be exactly my block of out; all_to_all: x may be out. (Every copy out of
  // a round lands where that round's pieces were already posted from.) Any other overlap is
  // staged: a copy out could overwrite what a later round still posts.
  const size_t in_bytes = a2a ? bytes * n_ : bytes;
  std::vector<char> staged;
  const bool overlaps = x < o + n_ * bytes && o < x + in_bytes;
  if (overlaps && x != (a2a ? o : o + rank_ * bytes)) {
    staged.assign(x, x + in_bytes);
    x = staged.data();
  }
  const bool stream = bytes * n_ >= kStreamMin && !overlaps;
  const int lanes = lanes_for(bytes * n_);
  if (lanes > 1) ++lane_ar_calls_;
  run_lanes(lanes, [&](int l) {
    const size_t first = part_off(bytes, lanes, l);
    block_lane(a2a, l, lanes, x + first, o + first, part_off(bytes, lanes, l + 1) - first, bytes, stream);
  });
}

// One lane's stripe of every block (blocks `stride` bytes apart; src: my block's stripe for
// all_gather, block 0's for all_to_all; dst: block 0's stripe of out). Round r: a_in = r
// (every read of earlier rounds done, so my `res` may be rewritten once every peer says so)
// → wait all a_in >= r → my piece(s) into res → a_res = r → wait each a_res >= r and copy
// that rank's piece out (all_to_all: the piece it posted for my block).
void ShmColl::block_lane(bool a2a, int lane, int lanes, const char* src, char* dst, size_t count, size_t stride,
                         bool stream) {
  const size_t area = (kTwoPiece / static_cast<size_t>(lanes)) & ~size_t(63);
  const size_t piece = a2a ? area / static_cast<size_t>(n_) : area;
  LW_CHECK(piece > 0, "the two-shot area holds a byte of every block");
  Slot* me = slot(rank_);
  char* my_res = me->two_res() + lane * area;
  const char* mine = a2a ? src + rank_ * stride : src;  // my own block's stripe
  for (size_t base = 0; base < count; base += piece) {
    const size_t cnt = std::min(piece, count - base);
    const uint32_t r = ++two_round_[lane];
    stamp(me->h().a_in[lane].stamp);
    publish(me->h().a_in[lane].v, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_in[lane].v, r, call_what(), true);
      check_line(q, slot(q)->h().a_in[lane].stamp, true);
    }
    if (!a2a) copy_bytes(my_res, src + base, cnt);
    for (int j = 0; a2a && j < n_; ++j)
      if (j != rank_) copy_bytes(my_res + j * cnt, src + j * stride + base, cnt);
    publish(me->h().a_res[lane].v, r);
    char* to = dst + rank_ * stride + base;
    if (to != mine + base) copy_out(to, mine + base, cnt, stream);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_res[lane].v, r, call_what(), true);
      copy_out(dst + q * stride + base, slot(q)->two_res() + lane * area + (a2a ? rank_ * cnt : 0), cnt, stream);
    }
  }
}

}  // namespace linkwise
