// The latency entries of the block collectives: exchange_fast (a small all_gather,
// reduce_scatter or all_to_all), gather_fast and scatter_fast. As bind_shm_fast.cc's entries
// they take the Python layer's arguments as they come, test them natively (fast_args.h) and
// return NotImplemented, before touching any shared state, where they do not serve a call:
// anything but exact NumPy arrays of a dtype moved as it is (bool, integers, floats,
// complex), more than the executor's one-shot area (ShmColl::kOneMax) in all, a size that
// does not split into equal blocks, an out of another dtype or size (read-only, for gather and
// scatter). They make the out the general path would make when the caller passed none (of the
// gathered or block shape, _coll_args.gathered_shape / block_shape; fast_args.h).
// Argument errors of served calls (read-only or non-contiguous arrays) raise ValueError with
// the general path's messages, the call numbered as refused here (bind_shm_fast.cc). The Python tests they replace cost ~1.3 us of a ~2.3 us 8-byte
// all_gather on the 2-core VM (docs/benchmarks.md).
#include <nanobind/nanobind.h>

#include <utility>
#include <vector>

#include "algo/coll.h"
#include "bindings/buffer.h"
#include "bindings/fast_args.h"
#include "bindings/shm_coll_py.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

using namespace fast;

// A moved item and at most the one-shot area's bytes once times `factor`.
bool small_moved(const HeldBuffer& h, size_t factor) {
  return classify(h.view).kind && h.bytes() * factor <= ShmColl::kOneMax;
}

// A call's output: the caller's out (its buffer held while the call runs), x itself (in
// place), or an array made here. The entries return `array` by moving it while the GIL is
// released (no reference count changes); `held` is released after the GIL is taken again.
struct Output {
  nb::object array;
  HeldBuffer held;  // the caller's out only
  void* data = nullptr;
  size_t bytes = 0;
  void made(NewArray a) {
    array = std::move(a.array);
    data = a.data;
    bytes = a.bytes;
  }
  void alias(nb::handle x, const HeldBuffer& hx) {
    array = nb::borrow(x);
    data = hx.ptr();
    bytes = hx.bytes();
  }
  // The caller's out, exported (false where it has no buffer: declined).
  bool take(nb::handle out) {
    if (!try_export_buffer(out, held)) return false;
    array = nb::borrow(out);
    data = held.ptr();
    bytes = held.bytes();
    return true;
  }
  // x's item, `want` bytes, and (`writable`) not read-only; else declined.
  bool fits(const HeldBuffer& hx, size_t want, bool writable) const {
    return same_moved_item(hx.view, held.view) && bytes == want && !(writable && held.view.readonly);
  }
  void check() {
    if (held.held) check_buffer(held, true, "collective output", true);
  }
};

nb::object exchange_fast(PyShmColl& s, int kind, nb::handle x, nb::handle out, nb::handle op, double timeout) {
  const CollKind k = static_cast<CollKind>(kind);
  if (k != CollKind::AllGather && k != CollKind::ReduceScatter && k != CollKind::AllToAll) return declined();
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx) || !small_moved(hx, 1)) return declined();
  const int n = s.shm_.size();
  if (k != CollKind::AllGather && elements(hx.view) % n) return declined();
  int code = 0;  // dtype * 8 + op: reduce_scatter only
  if (k == CollKind::ReduceScatter && (code = reduction_code(hx.view, op)) < 0) return declined();
  const size_t want = k == CollKind::AllGather ? hx.bytes() * n : k == CollKind::ReduceScatter ? hx.bytes() / n : hx.bytes();
  Output o;
  const bool in_place = out.is(x) || (out.is_none() && k == CollKind::AllToAll);
  if (in_place) o.alias(x, hx);
  else if (out.is_none()) o.made(k == CollKind::AllGather ? new_gathered(x, hx.view, n) : new_block(x, hx.view, n));
  else if (!o.take(out) || !o.fits(hx, want, false)) return declined();  // the general path says what differs
  if (o.bytes != want) return declined();  // out is x, where a block size differs from x's
  check_buffer(hx, in_place, in_place ? "collective output" : "collective input", true);
  o.check();
  const ShmColl::CallKind ck = exchange_kind(k, hx.bytes(), o.bytes, s.shm_);
  nb::gil_scoped_release nogil;
  s.guarded([&] {
    s.shm_.exchange(ck, hx.ptr(), hx.bytes(), o.data, static_cast<DType>(code >> 3), static_cast<RedOp>(code & 7),
                    timeout);
  });
  return std::move(o.array);
}

nb::object gather_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle out, double timeout) {
  const int n = s.shm_.size(), rt = root_of(root, n);
  if (rt < 0 || !is_array(x) || !(out.is_none() || is_array(out))) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx) || !small_moved(hx, n)) return declined();
  if (s.shm_.rank() != rt) {
    if (!out.is_none()) return declined();  // checked on the general path, as on the root
    check_buffer(hx, false, "collective input", true);
    {
      nb::gil_scoped_release nogil;
      s.guarded([&] { s.shm_.gather(hx.ptr(), hx.bytes(), nullptr, rt, timeout); });
    }
    return nb::none();  // a reference count taken with the GIL held again
  }
  Output o;
  if (out.is_none()) o.made(new_gathered(x, hx.view, n));
  else if (!o.take(out) || !o.fits(hx, hx.bytes() * n, true)) return declined();
  check_buffer(hx, false, "collective input", true);
  o.check();
  std::vector<char> staged;  // x, when it overlaps out other than as the root's own block
  const void* in = unoverlapped_input(hx.ptr(), hx.bytes(), o.data, o.bytes, staged,
                                      static_cast<char*>(o.data) + rt * hx.bytes());
  nb::gil_scoped_release nogil;
  s.guarded([&] { s.shm_.gather(in, hx.bytes(), o.data, rt, timeout); });
  return std::move(o.array);
}

nb::object scatter_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle out, double timeout) {
  const int n = s.shm_.size(), rt = root_of(root, n);
  if (rt < 0 || !(out.is_none() || is_array(out))) return declined();
  HeldBuffer hx;
  Output o;
  if (s.shm_.rank() == rt) {
    if (!is_array(x) || !try_export_buffer(x, hx) || !small_moved(hx, 1) || elements(hx.view) % n) return declined();
    if (out.is_none()) o.made(new_block(x, hx.view, n));
    else if (!o.take(out) || !o.fits(hx, hx.bytes() / n, true)) return declined();
    check_buffer(hx, false, "collective input", true);
  } else {
    // A non-root's x (whose shape may size out) takes the general path.
    if (!x.is_none() || out.is_none() || !o.take(out) || !small_moved(o.held, n) || o.held.view.readonly)
      return declined();
  }
  o.check();
  nb::gil_scoped_release nogil;
  s.guarded([&] { s.shm_.scatter(hx.held ? hx.ptr() : nullptr, o.data, o.bytes, rt, timeout); });
  return std::move(o.array);
}

}  // namespace

// As in bind_shm_fast: the caller's arguments are .none(), declined here, refused there.
void bind_shm_fast_blocks(nb::class_<PyShmColl>& cls) {
  cls.def(
         "exchange_fast",
         [](PyShmColl& s, nb::handle comm, int kind, nb::handle x, nb::handle out, nb::handle op) {
           return serving(comm, [&] { return exchange_fast(s, kind, x, out, op, comm_timeout(comm)); });
         },
         nb::arg("comm"), nb::arg("kind"), nb::arg("x").none(), nb::arg("out").none(), nb::arg("op").none(),
         "A small all_gather, reduce_scatter (with op) or all_to_all of NumPy arrays (kind: a CollKind code; "
         "out made where None, x itself for all_to_all), or NotImplemented where it does not serve it.")
      .def(
          "gather_fast",
          [](PyShmColl& s, nb::handle comm, nb::handle x, nb::handle root, nb::handle out) {
            return serving(comm, [&] { return gather_fast(s, x, root, out, comm_timeout(comm)); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none(),
          "A small gather onto root (out made there where None; None returned elsewhere), or NotImplemented "
          "where it does not serve it.")
      .def(
          "scatter_fast",
          [](PyShmColl& s, nb::handle comm, nb::handle x, nb::handle root, nb::handle out) {
            return serving(comm, [&] { return scatter_fast(s, x, root, out, comm_timeout(comm)); });
          },
          nb::arg("comm"), nb::arg("x").none(), nb::arg("root").none(), nb::arg("out").none(),
          "A small scatter from root's x (None elsewhere) into out (made on the root where None), or "
          "NotImplemented where it does not serve it.");
}

}  // namespace linkwise
