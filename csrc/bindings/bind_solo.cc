// The latency entries of a one-rank communicator (linkwise._native.SoloColl): the same
// names and arguments as the shared-memory executor's (bind_shm_fast.cc,
// bind_shm_fast_blocks.cc), so that comm._fast_shm may hold either, but no executor behind
// them: with one rank every collective's result is a copy of x (an all_reduce or
// reduce_scatter of one rank, avg on integers included, is x as the general path's
// run_collective leaves it), so an entry that serves a call copies x into out, or nothing
// in place. The general path took ~6-10 us a call for that on the 2-core VM
// (docs/benchmarks.md, thirty-fifth session).
//
// Contract: an entry serves only calls that the general path would run without an error,
// and returns NotImplemented for every other (never raising an argument error itself), so
// the general path makes each check and raises its own message, numbering the refusal as
// before. It serves: exact NumPy arrays, C-contiguous, writable where the result goes, of a
// dtype moved as it is (bool, integers, floats, complex; reductions: linkwise's reduction
// dtypes and ops, bitwise ops on integers only), root 0, an out of x's dtype and the size
// the kind needs. It declines every call while LINKWISE_ALGO, LINKWISE_CHECK or
// LINKWISE_CHUNK_SIZE is in the environment (set to anything): the general path parses them
// (a bad value raises on every call) and LINKWISE_CHECK numbers a check exchange.
// Threading: called with the GIL held; large copies release it, as the general path does.
#include <nanobind/nanobind.h>

#include <cstring>

#include "algo/coll.h"
#include "bindings/bindings.h"
#include "bindings/buffer.h"
#include "bindings/fast_args.h"
#include "core/copy.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

using namespace fast;

struct SoloColl {};

// Copies from this size on run with the GIL released (a release and retake cost ~0.1-0.2 us).
constexpr size_t kNoGilCopyMin = size_t{64} << 10;

// x's and out's buffers as the general path accepts them: C-contiguous (NumPy's own test, as
// _coll_args._as_array makes it), and not read-only where the call writes.
bool usable(const HeldBuffer& h, bool written) {
  return PyBuffer_IsContiguous(&h.view, 'C') && !(written && h.view.readonly);
}

// out's bytes become x's (they may overlap: memmove's semantics, as run_collective stages
// an overlapping x).
void copy_into(void* dst, const void* src, size_t bytes) {
  if (!bytes || dst == src) return;
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  const bool overlap = s < d + bytes && d < s + bytes;
  if (bytes < kNoGilCopyMin) {
    if (overlap) std::memmove(d, s, bytes);
    else copy_bytes(d, s, bytes);
    return;
  }
  nb::gil_scoped_release nogil;
  if (overlap) std::memmove(d, s, bytes);
  else copy_bytes(d, s, bytes);
}

bool forced() { return general_path_forced(/*or_chunk_size=*/true); }

bool arrays(nb::handle x, nb::handle out) { return is_array(x) && (out.is_none() || is_array(out)); }

// A collective whose one-rank result is x itself in out: the caller's out (of x's moved item,
// `want` bytes, writable), x (out is x, or out None where `in_place`), or a new array
// (make(), out None otherwise). `code_needed`: x must be reducible with op, and out of the
// same reduction dtype (all_reduce, reduce, reduce_scatter); a reducible dtype is always one
// classify() knows, and two buffers of one reduction dtype always hold the same moved item,
// so the checks below are the reductions' own too.
template <class Make>
nb::object copied(nb::handle x, nb::handle out, bool in_place, int code_needed, nb::handle op, Make make) {
  if (!arrays(x, out)) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx) || !classify(hx.view).kind) return declined();
  int code = -1;
  if (code_needed && (code = reduction_code(hx.view, op)) < 0) return declined();
  if (out.is(x) || (out.is_none() && in_place)) return usable(hx, true) ? nb::borrow(x) : declined();
  if (!usable(hx, false)) return declined();
  if (out.is_none()) {
    NewArray a = make(hx);
    copy_into(a.data, hx.ptr(), hx.bytes());
    return std::move(a.array);
  }
  HeldBuffer ho;
  if (!try_export_buffer(out, ho) || !same_moved_item(hx.view, ho.view) || ho.bytes() != hx.bytes() ||
      !usable(ho, true) || (code >= 0 && reduce_dtype(ho.view) != code >> 3))
    return declined();
  copy_into(ho.ptr(), hx.ptr(), hx.bytes());
  return nb::borrow(out);
}

bool root_zero(nb::handle root) { return root_of(root, 1) == 0; }

// copied()'s make for the collectives whose out defaults to x (in_place): never called.
NewArray nothing_made(const HeldBuffer&) { return NewArray(); }

}  // namespace

void bind_solo(nb::module_& m) {
  nb::class_<SoloColl> cls(m, "SoloColl",
                          "The latency entries of a one-rank communicator: the shared-memory executor's entry "
                          "names, each a copy of x (or nothing, in place), or NotImplemented where the general "
                          "path must run the call (csrc/bindings/bind_solo.cc).");
  // Async calls too (ShmColl's is false): one rank waits for no one, so an async call is done
  // when issued (its request complete at once) and has no queue to overtake. The collectives'
  // general path runs a one-rank async call at once for the same reason and reads this too.
  cls.attr("serves_async") = true;
  cls.def("__init__",
           [](SoloColl* s) {
             enable();  // NumPy's C API and os.environ's dict, as the executor's entries
             new (s) SoloColl();
           })
      .def(
          "all_reduce_fast",
          [](SoloColl&, nb::handle, nb::handle x, nb::handle op, nb::handle out) {
            return forced() ? declined() : copied(x, out, true, 1, op, nothing_made);
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("op").none(), nb::arg("out").none())
      .def(
          "reduce_fast",
          [](SoloColl&, nb::handle, nb::handle x, nb::handle root, nb::handle op, nb::handle out) {
            return forced() || !root_zero(root) ? declined() : copied(x, out, true, 1, op, nothing_made);
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("op").none(),
          nb::arg("out").none())
      .def(
          "broadcast_fast",
          [](SoloColl&, nb::handle, nb::handle x, nb::handle root, nb::handle out) {
            if (forced() || !root_zero(root)) return declined();
            return copied(x, out, true, 0, nb::handle(), nothing_made);
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none())
      .def(
          "exchange_fast",
          [](SoloColl&, nb::handle, int kind, nb::handle x, nb::handle out, nb::handle op) {
            if (forced()) return declined();
            const CollKind k = static_cast<CollKind>(kind);
            if (k == CollKind::AllGather)
              return copied(x, out, false, 0, op, [&](const HeldBuffer& h) { return new_gathered(x, h.view, 1); });
            if (k == CollKind::ReduceScatter)
              return copied(x, out, false, 1, op, [&](const HeldBuffer& h) { return new_block(x, h.view, 1); });
            if (k == CollKind::AllToAll)
              return copied(x, out, true, 0, op, nothing_made);
            return declined();
          },
          nb::arg("comm"), nb::arg("kind"), nb::arg("x").none(), nb::arg("out").none(), nb::arg("op").none())
      .def(
          "gather_fast",
          [](SoloColl&, nb::handle, nb::handle x, nb::handle root, nb::handle out) {
            if (forced() || !root_zero(root)) return declined();
            return copied(x, out, false, 0, nb::handle(),
                          [&](const HeldBuffer& h) { return new_gathered(x, h.view, 1); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none())
      .def(
          "scatter_fast",
          [](SoloColl&, nb::handle, nb::handle x, nb::handle root, nb::handle out) {
            if (forced() || !root_zero(root)) return declined();
            return copied(x, out, false, 0, nb::handle(), [&](const HeldBuffer& h) { return new_block(x, h.view, 1); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none())
      .def(
          "all_reduce",
          [](SoloColl&, nb::handle x, nb::handle out, int, double) -> nb::object {
            // The bfloat16 latency path's call (_coll_fast), on uint16 views of x and out (out
            // is x in place): copied()'s checks and copy, and None where it serves the call, as
            // the executor's all_reduce returns.
            if (forced() || !is_array(out)) return declined();
            nb::object served = copied(x, out, true, 0, nb::handle(), nothing_made);
            return served.is(Py_NotImplemented) ? served : nb::none();
          },
          nb::arg("x").none(), nb::arg("out").none(), nb::arg("code"), nb::arg("timeout"),
          "x's bits into out (nothing when out is x): a one-rank all_reduce of bfloat16 uint16 views; "
          "NotImplemented where the general path must run it.");
}

}  // namespace linkwise
