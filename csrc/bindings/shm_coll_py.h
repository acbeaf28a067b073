// The shared-memory executor as the Python bindings hold it: bind_shm_coll.cc binds it as
// linkwise._native.ShmColl, bind_coll.cc's async worker runs its calls in issue order.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "algo/coll.h"
#include "algo/shm_coll.h"
#include "bindings/buffer.h"
#include "bindings/native_comm.h"

namespace linkwise {

// The shared-memory fast path of one communicator (see algo/shm_coll.h). A failure aborts
// the communicator's engine too, as a failed p2p collective does. Made by make_shared (as
// NativeComm), so shared_from_this() is owned from C++ alone (no Python reference inside): the
// async worker may drop the last reference without the GIL, also at interpreter shutdown.
class PyShmColl : public std::enable_shared_from_this<PyShmColl> {
 public:
  PyShmColl(std::shared_ptr<NativeComm> comm, const std::string& name, bool create, double spin_us)
      : comm_(std::move(comm)),
        shm_(name, create, comm_->engine().rank(), comm_->engine().size(), spin_us) {
    // A point-to-point collective that fails (here or, by notice, on a peer) stops this
    // executor too, from the failing rank's next call: a peer may be waiting here for a call
    // that rank will never make, while the calls before it still run (a late rank needs them).
    comm_->engine().set_failure_hook([this](int blame, bool own) {
      if (own) shm_.stop(blame);
      else shm_.stop_on_notice(blame);
    });
  }
  ~PyShmColl() { comm_->engine().set_failure_hook(nullptr); }  // the engine outlives us (comm_)
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      // The point-to-point collectives stop too, here and (by notice) on the peers, so none
      // waits for this rank until the timeout: from the first one this rank has not started
      // (it ran the earlier ones before this call; a late peer still needs them). The
      // failure hook only re-marks this executor.
      comm_->engine().abort_and_notify("a shared-memory collective failed on this rank",
                                       e.kind() == ErrorKind::Peer ? e.peer() : -1,
                                       comm_->engine().next_collective());
      throw;
    }
  }
  std::shared_ptr<NativeComm> comm_;
  ShmColl shm_;
  // broadcast_fast declines broadcasts of at least this many bytes (set once attached: the
  // two-rank ones that go point-to-point as one single-copy message; the same on every rank).
  size_t fast_bcast_max = SIZE_MAX;
};

// The shared-memory all-reduce and reduce read x while they write out (the peers' too, at
// once), so an out that partly overlaps x (not x itself) would corrupt inputs still to be
// read; a gather's root copies peers' blocks into out around its own. Returns x, or a copy
// of it staged in `staged` when out overlaps it and x is not at `x_may_be` (out itself when
// nullptr; a gather passes its own block of out).
const void* unoverlapped_input(const void* x, size_t x_bytes, const void* out, size_t out_bytes,
                               std::vector<char>& staged, const void* x_may_be = nullptr);

// The executor's all_reduce of x (acquired, checked) into out, or in place when out is an
// empty handle; checks out (ValueError as the general path). code = dtype * 8 + op.
void shm_all_reduce(PyShmColl& s, HeldBuffer& hx, nanobind::handle out, int code, double timeout);

// The executor's reduce of x (acquired, checked; writable when in_place, on the root) onto
// root: into x (in_place), into out on the root (checked here), nowhere on the others (out
// empty or None).
void shm_reduce(PyShmColl& s, HeldBuffer& hx, bool in_place, nanobind::handle out, int code, int root,
                double timeout);

// The executor's broadcast into hb (acquired writable, C-contiguous) from *hs on the root
// (nullptr: hb itself, in place); hs must have as many bytes as hb (ValueError).
void shm_broadcast(PyShmColl& s, HeldBuffer& hb, HeldBuffer* hs, int root, double timeout);

// The latency entries (bind_shm_fast.cc): all_reduce_fast, reduce_fast, broadcast_fast; and
// (bind_shm_fast_blocks.cc) exchange_fast, gather_fast, scatter_fast.
void bind_shm_fast(nanobind::class_<PyShmColl>& cls);
void bind_shm_fast_blocks(nanobind::class_<PyShmColl>& cls);

// The executor's kind for a small all_gather / reduce_scatter / all_to_all, after checking
// that out has the size that kind needs for in_bytes of x (ValueError, as the general path).
ShmColl::CallKind exchange_kind(CollKind kind, size_t in_bytes, size_t out_bytes, const ShmColl& shm);

}  // namespace linkwise
