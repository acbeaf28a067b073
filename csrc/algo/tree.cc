// Rooted and small-message algorithms: pipelined tree broadcast and reduce (a chain is the
// tree whose nodes have one child each), recursive doubling and direct (one-shot) all-reduce.
//
// Tree shape comes from the Schedule as (parent, children) for this rank; the root has
// parent -1. Broadcast: a node receives chunk k from its parent and forwards it to every
// child while chunk k+1 is still arriving (all receives are posted up front, into the
// destination itself, so nothing is staged). Reduce: a node combines its own chunk with each
// child's chunk (children in Schedule order) and sends the partial result to its parent.
// The input of reduce is never written; only the root's `out` is.
#include <algorithm>
#include <cstring>
#include <vector>

#include "algo/coll.h"
#include "core/copy.h"

namespace linkwise {

void tree_broadcast(CollCtx& c, void* buf, size_t bytes) {
  const CollParams& p = c.params();
  const size_t ce = std::max<size_t>(1, p.chunk_bytes);
  // At least one (maybe empty) chunk: a rank called with 0 bytes against others' data then
  // meets their first chunk (another size: an error) instead of returning at once.
  const size_t K = std::max<size_t>(1, (bytes + ce - 1) / ce);
  char* b = static_cast<char*>(buf);
  std::vector<std::shared_ptr<Request>> recvs, sends;
  try {
    if (p.parent >= 0)
      for (size_t k = 0; k < K; ++k) recvs.push_back(c.irecv(p.parent, b + k * ce, std::min(ce, bytes - k * ce), 0));
    for (size_t k = 0; k < K; ++k) {
      if (p.parent >= 0) c.wait(recvs[k]);
      for (int child : p.children) sends.push_back(c.isend(child, b + k * ce, std::min(ce, bytes - k * ce), 0));
    }
    c.wait_all(sends);
  } catch (...) {
    c.abort_after_failure();
    throw;
  }
}

void tree_reduce(CollCtx& c, const void* in, void* out, size_t count) {
  const CollParams& p = c.params();
  const size_t es = dtype_size(p.dtype);
  const size_t bytes = count * es;
  const bool root = p.parent < 0;
  const size_t nch = p.children.size();
  if (nch == 0 && root) {  // a single rank
    if (out != in) copy_bytes(out, in, bytes);
    if (p.op == RedOp::Avg) avg_finish(out, count, p.dtype, c.size());
    return;
  }
  const size_t ce = std::max<size_t>(1, p.chunk_bytes / es);
  const size_t K = std::max<size_t>(1, (count + ce - 1) / ce);  // one empty chunk for 0 elements (as broadcast)
  char* scratch = coll_scratch(kTreeChildren, nch * bytes);
  char* acc = root ? static_cast<char*>(out) : coll_scratch(kTreeAcc, bytes);  // unused at a leaf
  const char* src = static_cast<const char*>(in);
  std::vector<std::shared_ptr<Request>> recvs(nch * K), sends;
  try {
    for (size_t k = 0; k < K; ++k)
      for (size_t i = 0; i < nch; ++i)
        recvs[k * nch + i] = c.irecv(p.children[i], scratch + i * bytes + k * ce * es,
                                     std::min(ce, count - k * ce) * es, 0);
    for (size_t k = 0; k < K; ++k) {
      const size_t off = k * ce * es, len = std::min(ce, count - k * ce);
      for (size_t i = 0; i < nch; ++i) {
        c.wait(recvs[k * nch + i]);
        const char* theirs = scratch + i * bytes + off;
        if (i == 0) reduce3(acc + off, src + off, theirs, len, p.dtype, p.op);
        else reduce_into(acc + off, theirs, len, p.dtype, p.op);
      }
      // A leaf sends its input as is (chunked like everyone else: the parent posts by chunk).
      if (!root) sends.push_back(c.isend(p.parent, (nch ? acc : src) + off, len * es, 0));
      else if (p.op == RedOp::Avg) avg_finish(acc + off, len, p.dtype, c.size());
    }
    c.wait_all(sends);
  } catch (...) {
    c.abort_after_failure();
    throw;
  }
}

// Recursive doubling over the largest power of two p <= n; ranks p..n-1 first fold into
// ranks 0..n-p-1 and get the result back at the end. Every combination is op(lower rank's
// value, higher rank's value), so both partners compute the same bits and all ranks agree.
void rd_all_reduce(CollCtx& c, void* buf, size_t count) {
  const CollParams& p = c.params();
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(p.dtype), bytes = count * es;
  if (count == 0 || n == 1) return;
  int pw = 1;
  while (pw * 2 <= n) pw *= 2;
  const int rem = n - pw;
  char* tmp = coll_scratch(kDoublingTmp, bytes);
  try {
    if (r >= pw) {
      c.send(r - pw, buf, bytes, 0);
      c.recv(r - pw, buf, bytes, 1);  // the finished result (Avg already divided)
      return;
    }
    if (r < rem) {
      c.recv(r + pw, tmp, bytes, 0);
      reduce_into(buf, tmp, count, p.dtype, p.op);
    }
    int step = 2;
    for (int mask = 1; mask < pw; mask <<= 1, ++step) {
      const int peer = r ^ mask;
      auto rq = c.irecv(peer, tmp, bytes, step);
      auto sq = c.isend(peer, buf, bytes, step);
      c.wait(rq);
      c.wait(sq);
      if (r < peer) reduce3(buf, buf, tmp, count, p.dtype, p.op);
      else reduce3(buf, tmp, buf, count, p.dtype, p.op);
    }
    if (p.op == RedOp::Avg) avg_finish(buf, count, p.dtype, n);
    if (r < rem) c.send(r + pw, buf, bytes, 1);
  } catch (...) {
    c.abort_after_failure();
    throw;
  }
}

// One shot: every rank sends its whole buffer to every other and combines all n in rank
// order 0..n-1 (the same order everywhere, hence the same bits). For small messages.
void direct_all_reduce(CollCtx& c, void* buf, size_t count) {
  const CollParams& p = c.params();
  const int n = c.size(), me = c.rank();
  const size_t es = dtype_size(p.dtype), bytes = count * es;
  if (count == 0 || n == 1) return;
  char* slots = coll_scratch(kDirectSlots, static_cast<size_t>(n) * bytes);
  std::vector<std::shared_ptr<Request>> reqs;
  try {
    for (int i = 1; i < n; ++i) {
      const int from = (me - i + n) % n;
      reqs.push_back(c.irecv(from, slots + from * bytes, bytes, 0));
    }
    for (int i = 1; i < n; ++i) reqs.push_back(c.isend((me + i) % n, buf, bytes, 0));
    c.wait_all(reqs);  // our sends are done too: buf may now be overwritten
    auto val = [&](int i) { return i == me ? static_cast<char*>(buf) : slots + i * bytes; };
    char* acc = me == 0 ? static_cast<char*>(buf) : slots;
    for (int i = 1; i < n; ++i) reduce_into(acc, val(i), count, p.dtype, p.op);
    if (acc != buf) copy_bytes(buf, acc, bytes);
    if (p.op == RedOp::Avg) avg_finish(buf, count, p.dtype, n);
  } catch (...) {
    c.abort_after_failure();
    throw;
  }
}

}  // namespace linkwise
