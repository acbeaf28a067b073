// all_gather, all_to_all and gather larger than the one-shot area through the shared-memory
// segment (see ShmColl::block_rounds in algo/shm_coll.h): rounds in the two-shot protocol's
// areas and counters, the posting ranks putting the next piece of their block (all_to_all: of
// every block) in their `res` area and the reading ranks copying the pieces for them out.
// Through messages each block crossed n-1 ring steps (all_gather) or one message per peer,
// two copies each.
#include <algorithm>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "algo/shm_coll_slot.h"
#include "core/copy.h"
#include "core/status.h"

namespace linkwise {

void ShmColl::block_rounds(BlockMove m, int root, const void* in, void* out, size_t bytes) {
  const char* x = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  // x holds n blocks for all_to_all, else one; out n blocks but on a gather's non-roots.
  const bool many_in = m == BlockMove::kAllToAll;
  const size_t in_bytes = many_in ? bytes * n_ : bytes;
  // The one overlap that needs no staging: x is out (all_to_all) or my own block of out
  // (all_gather, a gather's root). Every copy out of a round then lands where that round's
  // pieces were already posted from. Any other overlap is staged: a copy out could overwrite
  // what a later round still posts.
  const bool exact = many_in ? x == o : x == o + rank_ * bytes;
  const bool overlaps = o && x < o + bytes * n_ && o < x + in_bytes;
  std::vector<char> staged;
  if (overlaps && !exact) {
    staged.assign(x, x + in_bytes);
    x = staged.data();
  }
  const bool stream = bytes * n_ >= kStreamMin && !overlaps;
  const int lanes = lanes_for(bytes * n_);
  if (lanes > 1) ++lane_ar_calls_;
  run_lanes(lanes, [&](int l) {
    const size_t first = part_off(bytes, lanes, l);
    block_lane(m, root, l, lanes, x + first, o ? o + first : nullptr, part_off(bytes, lanes, l + 1) - first, bytes,
               stream);
  });
}

// One lane's stripe of every block (blocks `stride` bytes apart; src: the stripe of my block,
// or of block 0 for all_to_all; dst: block 0's stripe of out). Round r: a_in = r (every read
// of earlier rounds done, so my `res` may be rewritten once every peer says so) → wait all
// a_in >= r → a poster puts its piece(s) in res, a_res = r → a reader waits for each
// source's a_res >= r and copies the piece meant for it out. all_gather, all_to_all: every
// rank posts and reads; gather: the non-roots post, the root reads. A non-root returns
// without waiting for the reads: its next round (in any protocol of these areas) rewrites res
// only after every a_in passed this one.
void ShmColl::block_lane(BlockMove m, int root, int lane, int lanes, const char* src, char* dst, size_t count,
                         size_t stride, bool stream) {
  const bool to_all = m == BlockMove::kAllToAll;  // a piece for every rank
  const bool posts = m != BlockMove::kGather || rank_ != root;
  const bool reads = m != BlockMove::kGather || rank_ == root;
  const size_t area = (kTwoPiece / static_cast<size_t>(lanes)) & ~size_t(63);
  const size_t piece = to_all ? area / static_cast<size_t>(n_) : area;
  LW_CHECK(piece > 0, "the two-shot area holds a byte of every block");
  Slot* me = slot(rank_);
  char* my_res = me->two_res() + lane * area;
  // My own block's stripe in x, and where it goes in out (no copy when they are the same).
  const char* mine = to_all ? src + rank_ * stride : src;
  char* my_dst = dst ? dst + rank_ * stride : nullptr;
  for (size_t base = 0; base < count; base += piece) {
    const size_t cnt = std::min(piece, count - base);
    const uint32_t r = ++two_round_[lane];
    stamp(me->h().a_in[lane].stamp[r & 1]);
    publish(me->h().a_in[lane].v, r);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_in[lane].v, r, call_what(), true);
      check_line(q, slot(q)->h().a_in[lane].stamp[r & 1], true);
    }
    if (posts && !to_all) copy_bytes(my_res, src + base, cnt);
    for (int j = 0; posts && to_all && j < n_; ++j)
      if (j != rank_) copy_bytes(my_res + j * cnt, src + j * stride + base, cnt);
    if (posts) publish(me->h().a_res[lane].v, r);
    if (!reads) continue;
    if (my_dst != mine) copy_out(my_dst + base, mine + base, cnt, stream);
    for (int q = 0; q < n_; ++q) {
      if (q == rank_) continue;
      wait_ge(q, slot(q)->h().a_res[lane].v, r, call_what(), true);
      copy_out(dst + q * stride + base, slot(q)->two_res() + lane * area + (to_all ? rank_ * cnt : 0), cnt, stream);
    }
  }
}

}  // namespace linkwise
