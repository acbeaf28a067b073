// run_collective: checks buffer sizes, does the local copies a collective needs, and hands
// the work to one algorithm family. The algorithm choice (p.algo) and the shape (order,
// parent, children, chunk) were made on the Python side; Auto falls back to the defaults.
#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "algo/coll.h"
#include "core/copy.h"

namespace linkwise {

namespace {

// Out-of-place broadcasts from this size on overlap the root's copy into out with the
// sends (a thread costs tens of microseconds: far below the copy of a megabyte or more).
constexpr size_t kRootCopyOverlapMin = size_t{1} << 20;

void need(bool ok, const std::string& what) {
  if (!ok) throw Error(ErrorKind::Invalid, what);
}

}  // namespace

void CollCtx::size_mismatch(const Request& r) const {
  static const char* const kNames[] = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                       "all_to_all", "gather", "scatter", "barrier"};
  const int k = static_cast<int>(p_.kind);
  throw Error(ErrorKind::Invalid,
              "rank " + std::to_string(rank()) + ": " + (k >= 0 && k < 9 ? kNames[k] : "collective") +
                  " received " + std::to_string(r.transferred()) + " bytes from rank " + std::to_string(r.peer) +
                  " where " + std::to_string(r.bytes) +
                  " were expected: the ranks called it with different sizes, dtypes or roots; call each "
                  "collective with the same arguments on every rank (LINKWISE_CHECK=1 compares them first)",
              -1);
}

char* coll_scratch(ScratchSlot slot, size_t bytes) {
  thread_local std::vector<char> pools[kNumSlots];
  std::vector<char>& v = pools[slot];
  if (v.size() < bytes) {
    v = std::vector<char>();            // free first: no two copies at once
    v.resize(std::max<size_t>(bytes, 4096));
  }
  return v.data();
}

void run_collective(Engine& engine, const CollParams& p, const void* send, size_t send_bytes, void* recv,
                    size_t recv_bytes) {
  // The size every rank passes for this kind (a block for the per-rank-block collectives).
  size_t call_bytes = send_bytes;
  if (p.kind == CollKind::Broadcast || p.kind == CollKind::ReduceScatter || p.kind == CollKind::Scatter)
    call_bytes = recv_bytes;
  else if (p.kind == CollKind::Barrier)
    call_bytes = 0;
  // An x that overlaps out without being it (out = x shifted by an element, say): the
  // algorithms read x while out fills (all_to_all's received blocks, reduce's partial sums),
  // so they read a copy of x instead. In place (send == recv) is each kind's own case below.
  std::vector<char> staged;
  const char* sx = static_cast<const char*>(send);
  const char* rx = static_cast<const char*>(recv);
  if (sx && rx && sx != rx && send_bytes && recv_bytes && sx < rx + recv_bytes && rx < sx + send_bytes) {
    staged.assign(sx, sx + send_bytes);
    send = staged.data();
  }
  engine.note_collective(p.seq);
  CollCtx c(engine, p, call_bytes);
  const int n = engine.size(), me = engine.rank();
  const size_t es = dtype_size(p.dtype);
  // The local copies below never overlap: an x that overlaps out without being it was staged
  // above, and all_gather's own block of out (me * send_bytes on) lies past an x that is out.
  // So copy_bytes (memcpy's contract, and the aliasing detour of core/copy.h) serves them.
  auto copy = [](void* dst, const void* src, size_t bytes) {
    if (bytes && dst != src) copy_bytes(dst, src, bytes);
  };
  switch (p.kind) {
    case CollKind::AllReduce: {
      need(send_bytes == recv_bytes, "all_reduce: out must have as many bytes as x");
      copy(recv, send, send_bytes);
      const size_t count = send_bytes / es;
      if (n == 1) return;
      if (count == 0) ring_all_reduce(c, recv, 0);  // empty messages (see ring.cc): meets a rank with data
      else if (p.algo == Algo::Tree) rd_all_reduce(c, recv, count);
      else if (p.algo == Algo::Direct) direct_all_reduce(c, recv, count);
      else ring_all_reduce(c, recv, count);
      return;
    }
    case CollKind::Broadcast: {
      const char* s = static_cast<const char*>(send);
      char* r = static_cast<char*>(recv);
      if (me == p.root && n > 1 && s && r && s != r && send_bytes >= kRootCopyOverlapMin &&
          (s + send_bytes <= r || r + recv_bytes <= s)) {
        // A large out-of-place broadcast: the root sends from x (tree_broadcast only reads a
        // root's buffer) while a helper thread copies x into out, instead of copying first
        // (2 ranks, 8 MiB on the 2-core VM: 2.7 ms out of place against 0.6 in place).
        std::thread copier([=] { copy_bytes(r, s, send_bytes); });
        try {
          tree_broadcast(c, const_cast<char*>(s), recv_bytes);
        } catch (...) {
          copier.join();
          throw;
        }
        copier.join();
        return;
      }
      if (me == p.root) copy(recv, send, send_bytes);
      tree_broadcast(c, recv, recv_bytes);
      return;
    }
    case CollKind::Reduce:
      tree_reduce(c, send, recv, send_bytes / es);
      return;
    case CollKind::AllGather: {
      need(recv_bytes == send_bytes * n, "all_gather: out must have size * len(x) elements");
      copy(static_cast<char*>(recv) + me * send_bytes, send, send_bytes);
      if (n > 1) ring_all_gather(c, recv, send_bytes);
      return;
    }
    case CollKind::ReduceScatter: {
      need(send_bytes == recv_bytes * n, "reduce_scatter: x must have size * len(out) elements");
      const size_t m = recv_bytes / es;
      if (n == 1) {
        copy(recv, send, recv_bytes);
        return;
      }
      char* work = coll_scratch(kDispatchCopy, send_bytes);
      if (send_bytes) copy_bytes(work, send, send_bytes);
      ring_reduce_scatter(c, work, m, recv);
      return;
    }
    case CollKind::AllToAll: {
      need(send_bytes == recv_bytes && send_bytes % n == 0, "all_to_all: x and out need the same size, a multiple of the communicator size");
      if (send == recv && n > 1 && send_bytes) {
        // In place: only the blocks that go to peers are saved (this rank's own block stays
        // where it is): (n-1)/n of x copied once, where a copy of all of x and then of the
        // own block back cost (n+1)/n (2 ranks, 16 MiB: ~2x the out-of-place time).
        const size_t bb = send_bytes / n;
        char* tmp = coll_scratch(kDispatchCopy, send_bytes);
        const char* x = static_cast<const char*>(send);
        copy_bytes(tmp, x, me * bb);
        copy_bytes(tmp + (me + 1) * bb, x + (me + 1) * bb, send_bytes - (me + 1) * bb);
        pairwise_all_to_all(c, tmp, recv, bb, false);
      } else {
        pairwise_all_to_all(c, send, recv, send_bytes / n);
      }
      return;
    }
    case CollKind::Gather:
      linear_gather(c, send, recv, send_bytes);
      return;
    case CollKind::Scatter:
      linear_scatter(c, send, recv, recv_bytes);
      return;
    case CollKind::Barrier:
      dissemination_barrier(c);
      return;
    default:
      break;
  }
  throw Error(ErrorKind::Invalid, "unknown collective kind");
}

}  // namespace linkwise
