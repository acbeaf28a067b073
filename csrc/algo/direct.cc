// Direct (linear and pairwise) algorithms: all-to-all, gather, scatter, and the
// dissemination barrier. Every receive is posted before any send, so eager messages land
// in place; buffers are borrowed for the call only.
#include <cstring>
#include <vector>

#include "algo/coll.h"
#include "core/copy.h"

namespace linkwise {

namespace {
template <class F>
void guarded(CollCtx& c, F&& f) {
  try {
    f();
  } catch (...) {
    c.abort_after_failure();
    throw;
  }
}
}  // namespace

// Pairwise exchange: in step s, send block (me+s) to rank me+s and receive block (me-s) from
// rank me-s. `in` and `out` must not overlap (the caller copies for in-place calls); with
// copy_own false, out's own block is left as it is (in place: it already holds it).
void pairwise_all_to_all(CollCtx& c, const void* in, void* out, size_t bb, bool copy_own) {
  const int n = c.size(), me = c.rank();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (bb && copy_own) copy_bytes(dst + me * bb, src + me * bb, bb);
  // Blocks of 0 bytes still go out (empty messages): a rank called with 0 elements against
  // others' data then meets their messages (another size: an error) instead of returning.
  if (n == 1) return;
  guarded(c, [&] {
    std::vector<std::shared_ptr<Request>> reqs;
    for (int s = 1; s < n; ++s) {
      const int from = (me - s + n) % n;
      reqs.push_back(c.irecv(from, dst + from * bb, bb, 0));
    }
    for (int s = 1; s < n; ++s) {
      const int to = (me + s) % n;
      reqs.push_back(c.isend(to, src + to * bb, bb, 0));
    }
    c.wait_all(reqs);
  });
}

// The root receives block r from rank r into out (its own block copied from in first: in
// may overlap out, and the receives could overwrite it).
void linear_gather(CollCtx& c, const void* in, void* out, size_t bb) {
  const int n = c.size(), me = c.rank(), root = c.params().root;
  guarded(c, [&] {
    if (me != root) {
      c.send(root, in, bb, 0);
      return;
    }
    char* dst = static_cast<char*>(out);
    if (bb && dst + me * bb != in) std::memmove(dst + me * bb, in, bb);
    std::vector<std::shared_ptr<Request>> reqs;
    for (int r = 0; r < n; ++r)
      if (r != root) reqs.push_back(c.irecv(r, dst + r * bb, bb, 0));
    c.wait_all(reqs);
  });
}

// The root sends block r of in to rank r; every rank receives its block into out.
void linear_scatter(CollCtx& c, const void* in, void* out, size_t bb) {
  const int n = c.size(), me = c.rank(), root = c.params().root;
  guarded(c, [&] {
    if (me != root) {
      c.recv(root, out, bb, 0);
      return;
    }
    const char* src = static_cast<const char*>(in);
    const char* o = static_cast<const char*>(out);
    // An out that overlaps in elsewhere than my own block would change blocks still being
    // sent: my block is copied once every send is done.
    const bool own_first = o == src + me * bb || o >= src + n * bb || src >= o + bb;
    std::vector<std::shared_ptr<Request>> reqs;
    for (int r = 0; r < n; ++r)
      if (r != root) reqs.push_back(c.isend(r, src + r * bb, bb, 0));
    if (bb && own_first && src + me * bb != out) std::memmove(out, src + me * bb, bb);
    c.wait_all(reqs);
    if (bb && !own_first) std::memmove(out, src + me * bb, bb);
  });
}

// Dissemination: in round k, tell rank me+2^k and hear from rank me-2^k. After
// ceil(log2 n) rounds every rank has (transitively) heard from every other.
void dissemination_barrier(CollCtx& c) {
  const int n = c.size(), me = c.rank();
  guarded(c, [&] {
    int round = 0;
    for (int d = 1; d < n; d <<= 1, ++round) {
      auto rq = c.irecv((me - d + n) % n, nullptr, 0, round);
      auto sq = c.isend((me + d) % n, nullptr, 0, round);
      c.wait(rq);
      c.wait(sq);
    }
  });
}

}  // namespace linkwise
