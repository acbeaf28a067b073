// Python bindings of the shared-memory executor (algo/shm_coll.h): linkwise._native.ShmColl,
// whose blocking calls release the GIL while they wait (the small all_reduce starts with it
// held, see all_reduce below). Async calls go through bind_coll.cc's CollWorker instead.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <vector>

#include "bindings/bindings.h"
#include "bindings/buffer.h"
#include "bindings/shm_coll_py.h"
#include "core/process_local.h"

namespace nb = nanobind;

namespace linkwise {

// Without the staging, wrong sums from ~30000 elements; the message-based algorithms copy x
// into out first instead. (The executor's broadcast handles an overlapping out itself:
// test_coll_bcast_out.py.)
const void* unoverlapped_input(const void* x, size_t x_bytes, const void* out, size_t out_bytes,
                               std::vector<char>& staged, const void* x_may_be) {
  const char* a = static_cast<const char*>(x);
  const char* b = static_cast<const char*>(out);
  if (a == (x_may_be ? x_may_be : out) || a >= b + out_bytes || b >= a + x_bytes) return x;
  staged.assign(a, a + x_bytes);
  return staged.data();
}

ShmColl::CallKind exchange_kind(CollKind kind, size_t in_bytes, size_t out_bytes, const ShmColl& shm) {
  const size_t n = static_cast<size_t>(shm.size());
  switch (kind) {
    case CollKind::AllGather:
      if (out_bytes != in_bytes * n) throw Error(ErrorKind::Invalid, "all_gather: out must have size * len(x) elements");
      return ShmColl::kAllGather;
    case CollKind::ReduceScatter:
      if (out_bytes * n != in_bytes) throw Error(ErrorKind::Invalid, "reduce_scatter: x must have size * len(out) elements");
      return ShmColl::kReduceScatter;
    case CollKind::AllToAll:
      if (out_bytes != in_bytes || in_bytes % n)
        throw Error(ErrorKind::Invalid, "all_to_all: x and out need the same size, a multiple of the communicator size");
      return ShmColl::kAllToAll;
    default:
      throw Error(ErrorKind::Invalid, "the shared-memory exchange runs all_gather, reduce_scatter and "
                                      "all_to_all only");
  }
}

void shm_all_reduce(PyShmColl& s, HeldBuffer& hx, nb::handle out, int code, double timeout) {
  void* o = const_cast<void*>(hx.ptr());
  const void* in = hx.ptr();
  HeldBuffer ho;
  std::vector<char> staged;  // x, when out partly overlaps it
  if (out.is_valid()) {
    acquire_buffer(out, true, "all_reduce", ho, true);
    if (ho.bytes() != hx.bytes() || ho.dtype() != hx.dtype()) {
      const size_t xs = hx.view.itemsize, os = ho.view.itemsize;
      throw nb::value_error(("all_reduce: out must be a " + dtype_name(hx.dtype()) + " array of " +
                             std::to_string(hx.bytes() / (xs ? xs : 1)) + " elements, got " + dtype_name(ho.dtype()) +
                             " with " + std::to_string(ho.bytes() / (os ? os : 1)))
                                .c_str());
    }
    o = ho.ptr();
    in = unoverlapped_input(in, hx.bytes(), o, ho.bytes(), staged);
  }
  const DType t = static_cast<DType>(code >> 3);
  const size_t count = hx.bytes() / dtype_size(t);
  const RedOp rop = static_cast<RedOp>(code & 7);
  // Small messages start with the GIL held (releasing and retaking it cost ~0.1 us of a ~2 us
  // call in a same-build A/B, docs/benchmarks.md): done when the peers were already there (a
  // bounded spin), else the wait goes on without the GIL, so other threads run meanwhile.
  int started = -1;
  s.guarded([&] { started = s.shm_.all_reduce_start(in, o, count, t, rop, timeout); });
  if (started == 1) return;
  nb::gil_scoped_release nogil;
  if (started == 0) s.guarded([&] { s.shm_.all_reduce_finish(o, count, t, rop); });
  else s.guarded([&] { s.shm_.all_reduce(in, o, count, t, rop, timeout); });
}

void shm_reduce(PyShmColl& s, HeldBuffer& hx, bool in_place, nb::handle out, int code, int root, double timeout) {
  const void* in = hx.ptr();
  void* o = in_place ? const_cast<void*>(in) : nullptr;
  HeldBuffer ho;
  std::vector<char> staged;  // x, when out partly overlaps it
  if (out.is_valid() && !out.is_none()) {
    acquire_buffer(out, true, "reduce", ho, true);
    if (ho.bytes() != hx.bytes()) throw nb::value_error("reduce: out must have as many bytes as x");
    o = ho.ptr();
    in = unoverlapped_input(in, hx.bytes(), o, ho.bytes(), staged);
  }
  const DType t = static_cast<DType>(code >> 3);
  const size_t count = hx.bytes() / dtype_size(t);
  nb::gil_scoped_release nogil;
  s.guarded([&] { s.shm_.reduce(in, o, count, t, static_cast<RedOp>(code & 7), root, timeout); });
}

void shm_broadcast(PyShmColl& s, HeldBuffer& hb, HeldBuffer* hs, int root, double timeout) {
  if (hs && hs->bytes() != hb.bytes()) throw nb::value_error("broadcast: out must have as many bytes as x");
  const void* from = hs ? hs->ptr() : hb.ptr();
  nb::gil_scoped_release nogil;
  s.guarded([&] { s.shm_.broadcast(from, hb.ptr(), hb.bytes(), root, timeout); });
}

void bind_shm_coll(nb::module_& m) {
  nb::class_<PyShmColl> cls(m, "ShmColl", "Shared-memory collectives of a single-host communicator.");
  // The latency entries (*_fast) serve blocking calls only: an async call is queued on the
  // communicator's worker, in issue order, which an entry run at once would overtake. The
  // collectives read this (comm._fast_shm.serves_async) instead of asking for one rank.
  cls.attr("serves_async") = false;
  bind_shm_fast(cls);
  bind_shm_fast_blocks(cls);
  cls.def(nb::new_([](NativeComm& c, const std::string& name, bool create, double spin_us) {
             return make_process_local<PyShmColl>(c.shared_from_this(), name, create, spin_us);
           }),
           nb::arg("native"), nb::arg("name"), nb::arg("create"), nb::arg("spin_us"))
      .def("connect",
           [](PyShmColl& s, double timeout, bool cma, size_t ar_min, size_t bc_min, size_t chunk, size_t piece,
              size_t lane_min, int threads, size_t one_max) {
             ShmCollOptions o;
             o.enable = cma;
             o.ar_min = ar_min;
             o.bc_min = bc_min;
             o.chunk = chunk;
             o.piece = piece;
             o.lane_min = lane_min;
             o.threads = threads;
             o.one_max = one_max;
             nb::gil_scoped_release nogil;  // waits for every rank (a barrier through the segment)
             s.guarded([&] { s.shm_.connect(o, timeout); });
           },
           nb::arg("timeout"), nb::arg("cma"), nb::arg("ar_min"), nb::arg("bc_min"), nb::arg("chunk"),
           nb::arg("piece"), nb::arg("lane_min"), nb::arg("threads"), nb::arg("one_max"),
           "Learn the peers, probe single-copy (CMA) access, agree on its use with every rank.")
      .def_prop_ro("cma", [](PyShmColl& s) { return s.shm_.cma(); },
                   "True when large all_reduce/broadcast copy directly between ranks' buffers (CMA).")
      .def_prop_ro("cma_bcast_min", [](PyShmColl& s) { return s.shm_.cma_bcast_min(); },
                   "Broadcasts of at least this many bytes take the CMA path (agreed by all ranks).")
      .def_prop_ro("cma_calls",
                   [](PyShmColl& s) { return std::make_pair(s.shm_.cma_all_reduces(), s.shm_.cma_broadcasts()); },
                   "(all_reduces, broadcasts) that took the CMA path so far.")
      .def_prop_ro("lane_calls",
                   [](PyShmColl& s) { return std::make_pair(s.shm_.lane_all_reduces(), s.shm_.lane_broadcasts()); },
                   "(calls in the two-shot areas: all_reduces, reduces and the larger block collectives; "
                   "broadcasts) that ran on several lanes (helper threads) so far.")
      .def_prop_ro("one_shot_max", [](PyShmColl& s) { return s.shm_.one_shot_max(); },
                   "Largest all_reduce (bytes) that runs one-shot (rank 0's setting, agreed by all ranks).")
      .def_prop_ro("max_lanes", [](PyShmColl& s) { return s.shm_.max_lanes(); },
                   "Most lanes a message is cut into (rank 0's threads, at most 16; agreed by all ranks).")
      .def("unlink", [](PyShmColl& s) { s.shm_.unlink(); })
      .def("skip_call", [](PyShmColl& s) { s.shm_.skip_call(); },
           "a collective refused its arguments on this rank: number the calls as if it had run")
      .def("stop", [](PyShmColl& s) { s.shm_.stop(); },
           "this rank gives up on its collectives: its next call and every later one raise on every "
           "rank, and a call in progress here fails, as do peers waiting on it there")
      .def("mark_closed", [](PyShmColl& s) { s.shm_.mark_closed(); },
           "this rank closed its communicator: peers waiting on it raise PeerError naming it")
      .def_prop_ro("segment_name", [](PyShmColl& s) { return s.shm_.segment_name(); })
      .def("all_reduce",
           [](PyShmColl& s, nb::handle x, nb::handle out, int code, double timeout) {
             // code = dtype * 8 + op, validated by the caller for x's dtype; out may be x (in
             // place). Every check of out (same dtype and size as x, writable, contiguous)
             // happens here, with the messages of the general path.
             HeldBuffer hx;
             const bool in_place = out.is(x);
             acquire_buffer(x, in_place, "all_reduce", hx, true);
             shm_all_reduce(s, hx, in_place ? nb::handle() : out, code, timeout);
           },
           nb::arg("x"), nb::arg("out"), nb::arg("code"), nb::arg("timeout"))
      .def("reduce",
           [](PyShmColl& s, nb::handle x, nb::handle out, int code, int root, double timeout) {
             // out: the root's result (x itself: in place), None on every other rank (whose x
             // is only read); code = dtype * 8 + op, validated by the caller for x's dtype,
             // which also checked out against x (Communicator.reduce).
             HeldBuffer hx;
             const bool in_place = out.is(x);
             acquire_buffer(x, in_place, "reduce", hx, true);
             shm_reduce(s, hx, in_place, in_place ? nb::handle() : out, code, root, timeout);
           },
           nb::arg("x"), nb::arg("out").none(), nb::arg("code"), nb::arg("root"), nb::arg("timeout"),
           "reduce onto root: the all_reduce's protocols, the result written on root only.")
      .def("broadcast",
           [](PyShmColl& s, nb::handle buf, int root, double timeout, nb::handle src) {
             // src: the root's source (None: buf itself, in place), as many bytes as buf.
             HeldBuffer hb, hs;
             acquire_buffer(buf, true, "broadcast", hb, true);
             if (!src.is_none() && !src.is(buf)) acquire_buffer(src, false, "broadcast", hs, true);
             shm_broadcast(s, hb, hs.held ? &hs : nullptr, root, timeout);
           },
           nb::arg("buf"), nb::arg("root"), nb::arg("timeout"), nb::arg("src").none() = nb::none())
      .def("exchange",
           [](PyShmColl& s, int kind, nb::handle x, nb::handle out, int code, double timeout) {
             // kind: a CollKind code (all_gather, reduce_scatter, all_to_all); code = dtype * 8
             // + op (reduce_scatter; validated by the caller for x's dtype). out may be x.
             HeldPair b(x, out);
             const ShmColl::CallKind k = exchange_kind(static_cast<CollKind>(kind), b.send_bytes, b.recv_bytes, s.shm_);
             nb::gil_scoped_release nogil;
             s.guarded([&] {
               s.shm_.exchange(k, b.send, b.send_bytes, b.recv, static_cast<DType>(code >> 3),
                               static_cast<RedOp>(code & 7), timeout);
             });
           },
           nb::arg("kind"), nb::arg("x"), nb::arg("out"), nb::arg("code"), nb::arg("timeout"),
           "An all_gather, reduce_scatter or all_to_all (one one-shot round while x has at most 32 KiB, "
           "ShmColl::kOneMax; larger ones in two-shot or block rounds).")
      .def("gather",
           [](PyShmColl& s, nb::handle x, nb::handle out, int root, double timeout) {
             // out: root's (size * len(x) elements; the caller checked dtype and shape), None
             // elsewhere.
             HeldPair b(x, out);
             if (b.recv && b.recv_bytes != b.send_bytes * s.shm_.size())
               throw nb::value_error("gather: out must have size * len(x) elements");
             std::vector<char> staged;  // x, when it overlaps out other than as root's own block
             if (b.recv)
               b.send = unoverlapped_input(b.send, b.send_bytes, b.recv, b.recv_bytes, staged,
                                           static_cast<char*>(b.recv) + root * b.send_bytes);
             nb::gil_scoped_release nogil;
             s.guarded([&] { s.shm_.gather(b.send, b.send_bytes, b.recv, root, timeout); });
           },
           nb::arg("x"), nb::arg("out").none(), nb::arg("root"), nb::arg("timeout"),
           "A gather onto root (one one-shot round up to 32 KiB in all, else block rounds; the non-roots "
           "post and return).")
      .def("scatter",
           [](PyShmColl& s, nb::handle x, nb::handle out, int root, double timeout) {
             // x: root's (size * len(out) elements), None elsewhere; out: this rank's block.
             HeldPair b(x, out);
             if (b.send && b.send_bytes != b.recv_bytes * s.shm_.size())
               throw nb::value_error("scatter: x must have size * len(out) elements");
             nb::gil_scoped_release nogil;
             s.guarded([&] { s.shm_.scatter(b.send, b.recv, b.recv_bytes, root, timeout); });
           },
           nb::arg("x").none(), nb::arg("out"), nb::arg("root"), nb::arg("timeout"),
           "A small scatter from root (at most 32 KiB in all: one one-shot round; the root posts and "
           "returns).");

}

}  // namespace linkwise
