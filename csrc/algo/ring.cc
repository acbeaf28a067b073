// Ring algorithms: reduce-scatter, all-gather, and all-reduce = reduce-scatter + all-gather.
//
// Ring order comes from the Schedule (p.order; identity when empty). The position `pos` of
// this rank in the ring names its neighbours left = order[pos-1] and right = order[pos+1].
// The buffer is cut into n "virtual segments" j = 0..n-1 (any partition will do):
//
//   reduce-scatter step s (0..n-2): send seg pos-s to right, receive seg pos-s-1 from left
//                                    into scratch and reduce it into the buffer;
//   all-gather     step s (0..n-2): send seg pos+1-s to right, receive seg pos-s from left
//                                    straight into the buffer.
//
// After reduce-scatter, position pos holds seg pos+1 fully reduced; the segment received at
// any step is the one sent at the next, so one unified loop pipelines the whole thing.
// Pipelining: each segment moves in chunks of p.chunk_bytes; chunk k of step t+1 leaves as
// soon as chunk k of step t has arrived (and been reduced), while receives for steps t+1 and
// t+2 are already posted (two scratch buffers alternate by step parity). Every rank ends
// with bitwise the same all-reduce result because each final segment is computed once, by
// one rank, and then only copied.
#include <algorithm>
#include <cstring>
#include <vector>

#include "algo/coll.h"
#include "core/copy.h"

namespace linkwise {

namespace {

struct Ring {
  int n, pos, left, right;
};

Ring make_ring(CollCtx& c) {
  const auto& order = c.params().order;
  Ring r{c.size(), 0, 0, 0};
  if (order.empty()) {
    r.pos = c.rank();
  } else {
    LW_CHECK(static_cast<int>(order.size()) == r.n, "ring order is a permutation of the ranks");
    r.pos = static_cast<int>(std::find(order.begin(), order.end(), c.rank()) - order.begin());
    LW_CHECK(r.pos < r.n, "this rank is in the ring order");
  }
  auto at = [&](int i) { i = ((i % r.n) + r.n) % r.n; return order.empty() ? i : order[i]; };
  r.left = at(r.pos - 1);
  r.right = at(r.pos + 1);
  return r;
}

inline int mod(int a, int n) { return ((a % n) + n) % n; }

// The unified pipelined loop. seg_off/seg_len: element offset and length of virtual segment
// j within `work`. avg_div > 1 finishes an Avg on the owned segment before all-gather.
void ring_run(CollCtx& c, const Ring& R, char* work, const std::vector<size_t>& seg_off,
              const std::vector<size_t>& seg_len, size_t esize, bool do_rs, bool do_ag, int avg_div) {
  const int n = R.n;
  const CollParams& p = c.params();
  const int nrs = do_rs ? n - 1 : 0;
  const int T = nrs + (do_ag ? n - 1 : 0);
  if (T == 0) return;
  const size_t ce = std::max<size_t>(1, p.chunk_bytes / esize);
  size_t max_seg = 0;
  for (size_t l : seg_len) max_seg = std::max(max_seg, l);
  char* scratch[2] = {nullptr, nullptr};
  if (do_rs) {
    scratch[0] = coll_scratch(kRingA, std::max<size_t>(1, max_seg * esize));
    scratch[1] = coll_scratch(kRingB, std::max<size_t>(1, max_seg * esize));
  }

  auto seg_send = [&](int t) { return t < nrs ? mod(R.pos - t, n) : mod(R.pos + 1 - (t - nrs), n); };
  auto seg_recv = [&](int t) { return t < nrs ? mod(R.pos - t - 1, n) : mod(R.pos - (t - nrs), n); };
  // An empty segment still moves one empty chunk: a rank called with 0 elements against
  // others' data then meets their messages (another size: an error) instead of returning.
  auto nchunks = [&](int j) { return std::max<size_t>(1, (seg_len[j] + ce - 1) / ce); };
  auto chunk_len = [&](int j, size_t k) { return std::min(ce, seg_len[j] - k * ce); };

  std::vector<std::shared_ptr<Request>> sends;
  std::vector<std::shared_ptr<Request>> recvs[3];  // by step % 3: posted two steps ahead
  auto post_recvs = [&](int t) {
    if (t >= T) return;
    const int j = seg_recv(t);
    auto& rs = recvs[t % 3];
    rs.clear();
    for (size_t k = 0; k < nchunks(j); ++k) {
      const size_t bytes = chunk_len(j, k) * esize;
      char* dst = t < nrs ? scratch[t % 2] + k * ce * esize : work + (seg_off[j] + k * ce) * esize;
      rs.push_back(c.irecv(R.left, dst, bytes, t));
    }
  };
  try {
    post_recvs(0);
    post_recvs(1);
    {
      const int j = seg_send(0);
      for (size_t k = 0; k < nchunks(j); ++k)
        sends.push_back(c.isend(R.right, work + (seg_off[j] + k * ce) * esize, chunk_len(j, k) * esize, 0));
    }
    for (int t = 0; t < T; ++t) {
      const int j = seg_recv(t);
      auto& rs = recvs[t % 3];
      for (size_t k = 0; k < rs.size(); ++k) {
        c.wait(rs[k]);
        const size_t len = chunk_len(j, k);
        char* mine = work + (seg_off[j] + k * ce) * esize;
        if (t < nrs) {
          reduce_into(mine, scratch[t % 2] + k * ce * esize, len, p.dtype, p.op);
          if (t == nrs - 1 && avg_div > 1) avg_finish(mine, len, p.dtype, avg_div);
        }
        if (t + 1 < T) sends.push_back(c.isend(R.right, mine, len * esize, t + 1));
      }
      rs.clear();
      post_recvs(t + 2);
    }
    c.wait_all(sends);
  } catch (...) {
    c.abort_after_failure();  // no request may still point into scratch or work
    throw;
  }
}

}  // namespace

void ring_all_reduce(CollCtx& c, void* buf, size_t count) {
  Ring R = make_ring(c);
  const CollParams& p = c.params();
  std::vector<size_t> off(R.n), len(R.n);
  for (int j = 0; j < R.n; ++j) {
    off[j] = part_off(count, R.n, j);
    len[j] = part_off(count, R.n, j + 1) - off[j];
  }
  ring_run(c, R, static_cast<char*>(buf), off, len, dtype_size(p.dtype), true, true,
           p.op == RedOp::Avg ? R.n : 1);
}

// work: n blocks of block_count elements (rank b's block at b*block_count), overwritten.
// out: this rank's reduced block.
void ring_reduce_scatter(CollCtx& c, void* work, size_t block_count, void* out) {
  Ring R = make_ring(c);
  const CollParams& p = c.params();
  const size_t es = dtype_size(p.dtype);
  std::vector<size_t> off(R.n), len(R.n, block_count);
  const auto& order = p.order;
  for (int j = 0; j < R.n; ++j) {
    const int i = mod(j - 1, R.n);
    off[j] = static_cast<size_t>(order.empty() ? i : order[i]) * block_count;
  }
  ring_run(c, R, static_cast<char*>(work), off, len, es, true, false, 1);
  const char* mine = static_cast<const char*>(work) + static_cast<size_t>(c.rank()) * block_count * es;
  if (out != mine && block_count) copy_bytes(out, mine, block_count * es);
  if (p.op == RedOp::Avg) avg_finish(out, block_count, p.dtype, R.n);
}

// out: n blocks of block_bytes; this rank's own block must already be in place.
void ring_all_gather(CollCtx& c, void* out, size_t block_bytes) {
  Ring R = make_ring(c);
  const auto& order = c.params().order;
  std::vector<size_t> off(R.n), len(R.n, block_bytes);
  for (int j = 0; j < R.n; ++j) {
    const int i = mod(j - 1, R.n);
    off[j] = static_cast<size_t>(order.empty() ? i : order[i]) * block_bytes;
  }
  ring_run(c, R, static_cast<char*>(out), off, len, 1, false, true, 1);
}

}  // namespace linkwise
