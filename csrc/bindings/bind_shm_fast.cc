// The latency entries of the shared-memory executor: all_reduce_fast, reduce_fast and
// broadcast_fast (the block collectives': bind_shm_fast_blocks.cc) take the Python layer's
// arguments as they come and make natively the tests that the Python fast paths made
// (fast_args.h): an exact NumPy array, a dtype and op the executor serves, a root in range,
// an out of the same dtype and size. Each test in Python cost 25-60 ns, ~0.3 us of a ~1.1 us
// 8-byte broadcast on the 2-core VM. What they do not
// serve they decline by returning NotImplemented (never a collective's result), before
// touching any shared state, so the caller takes the general path; the decision depends only
// on what every rank shares for a correct program (type, dtype, op, root, size), so all ranks
// decline alike; so does every call while LINKWISE_ALGO or LINKWISE_CHECK is set (fast_args.h's
// serving), since only the general path honours them. Argument errors of served calls (read-only or non-contiguous arrays, an out
// of another size) raise ValueError with the general path's messages, as the executor's
// plain entries do, after numbering the call as refused on this rank (comm._skip_call(),
// fast_args.h's refusing). Each entry takes the calling Communicator first: its timeout and
// its _skip_call.
#include <nanobind/nanobind.h>

#include "bindings/buffer.h"
#include "bindings/fast_args.h"
#include "bindings/shm_coll_py.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

using namespace fast;

nb::object all_reduce_fast(PyShmColl& s, nb::handle x, nb::handle op, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const int code = reduction_code(hx.view, op);
  if (code < 0) return declined();
  const bool in_place = out.is_none() || out.is(x);
  check_buffer(hx, in_place, "all_reduce", true);
  shm_all_reduce(s, hx, in_place ? nb::handle() : out, code, timeout);
  return nb::borrow(out.is_none() ? x : out);
}

nb::object reduce_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle op, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  const int rt = root_of(root, s.shm_.size());
  if (rt < 0) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const int code = reduction_code(hx.view, op);
  if (code < 0) return declined();
  // out is checked on every rank (only the root writes it): the same dtype and size as x, and
  // writable; anything else the general path explains.
  if (!out.is_none() && !out.is(x)) {
    HeldBuffer ho;
    if (!try_export_buffer(out, ho) || reduce_dtype(ho.view) != code >> 3 || ho.bytes() != hx.bytes() || ho.view.readonly)
      return declined();
  }
  const bool mine = s.shm_.rank() == rt, in_place = mine && (out.is_none() || out.is(x));
  check_buffer(hx, in_place, "reduce", true);
  shm_reduce(s, hx, in_place, mine && !in_place ? out : nb::handle(), code, rt, timeout);
  return nb::borrow(out.is_none() ? x : out);
}

nb::object broadcast_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  const int rt = root_of(root, s.shm_.size());
  if (rt < 0) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const Item ix = classify(hx.view);
  if (!ix.kind || hx.bytes() >= s.fast_bcast_max) return declined();
  if (out.is_none() || out.is(x)) {
    check_buffer(hx, true, "broadcast", true);
    shm_broadcast(s, hx, nullptr, rt, timeout);
    return nb::borrow(x);
  }
  // out= : the root's x is the source, out the destination on every rank.
  HeldBuffer ho;
  if (!try_export_buffer(out, ho)) return declined();
  if (!same_moved_item(hx.view, ho.view) || ho.bytes() != hx.bytes())
    return declined();  // the general path says what differs
  check_buffer(ho, true, "broadcast", true);
  if (s.shm_.rank() == rt) {
    check_buffer(hx, false, "broadcast", true);
    shm_broadcast(s, ho, &hx, rt, timeout);
  } else {
    hx.release();
    shm_broadcast(s, ho, nullptr, rt, timeout);
  }
  return nb::borrow(out);
}

}  // namespace

// Every argument taken from the caller is .none(): the entry declines a None (or any value it
// does not serve) and the general path refuses it, numbering the call as refused so the peers
// are told. nanobind's own TypeError for a None would skip that, leaving them waiting.
void bind_shm_fast(nb::class_<PyShmColl>& cls) {
  cls.def_static("enable_fast_entries", &enable,
                 "Import NumPy's C API for the fast entries, which serve exact numpy.ndarray arrays; until "
                 "then they decline every call (idempotent).")
      .def_rw("fast_bcast_max", &PyShmColl::fast_bcast_max,
              "broadcast_fast declines broadcasts of at least this many bytes.")
      .def(
          "all_reduce_fast",
          [](PyShmColl& s, nb::handle comm, nb::handle x, nb::handle op, nb::handle out) {
            return serving(comm, [&] { return all_reduce_fast(s, x, op, out, comm_timeout(comm)); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("op").none(), nb::arg("out").none(),
          "all_reduce of a NumPy array (in place, or into out), or NotImplemented where it does not serve it.")
      .def(
          "reduce_fast",
          [](PyShmColl& s, nb::handle comm, nb::handle x, nb::handle root, nb::handle op, nb::handle out) {
            return serving(comm, [&] { return reduce_fast(s, x, root, op, out, comm_timeout(comm)); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("op").none(), nb::arg("out").none(),
          "reduce of a NumPy array onto root (into x, or out, on the root), or NotImplemented where it does "
          "not serve it.")
      .def(
          "broadcast_fast",
          [](PyShmColl& s, nb::handle comm, nb::handle x, nb::handle root, nb::handle out) {
            return serving(comm, [&] { return broadcast_fast(s, x, root, out, comm_timeout(comm)); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none(),
          "broadcast of a NumPy array (in place, or from the root's x into out), or NotImplemented where it "
          "does not serve it.");
}

}  // namespace linkwise
