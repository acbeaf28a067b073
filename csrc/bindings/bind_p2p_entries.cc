// comm.isend and comm.irecv, made natively as methods of linkwise.Communicator (comm.py puts
// them on the class when it first loads this module). The Python methods' frame and argument
// tests cost 0.3-0.6 us of a 1-2 us message (docs/benchmarks.md, twenty-sixth session).
//
// A plain call (peer and tag exact ints in range, no stream, the communicator open, an array
// with the buffer protocol) posts here; any other goes to comm._post, the general path, which
// converts DLPack and CUDA arrays or says what is wrong. The GIL is held throughout.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>

#include "bindings/bindings.h"
#include "bindings/native_comm.h"

namespace nb = nanobind;

namespace linkwise {

namespace {
constexpr long long kMaxTag = (1LL << 62) - 1;  // comm.MAX_TAG

// The attribute names, interned once: a name made afresh each call is hashed each time and
// misses the type's attribute cache (~0.2 us a lookup, measured).
enum Name { kClosed, kSize, kTimeout, kNative, kPost, kNames };
PyObject* g_names[kNames] = {};

nb::object attr(nb::handle obj, Name name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), g_names[name]);
  if (!v) throw nb::python_error();
  return nb::steal(v);
}

// peer as an exact int in [0, size), or -1.
long long index_in(nb::handle peer, long long size) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(peer.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return !overflow && v >= 0 && v < size ? v : -1;
}

// The request of a plain call posted natively, or None (not plain: take the general path).
nb::object post_plain(nb::handle comm, nb::handle x, nb::handle peer, nb::handle tag, nb::handle timeout,
                      nb::handle stream, bool is_send) {
  if (!stream.is_none() || !PyLong_CheckExact(peer.ptr()) || !PyLong_CheckExact(tag.ptr())) return nb::none();
  if (!(timeout.is_none() || PyFloat_CheckExact(timeout.ptr()) || PyLong_CheckExact(timeout.ptr()))) return nb::none();
  if (attr(comm, kClosed).ptr() != Py_False) return nb::none();
  const long long size = PyLong_AsLongLong(attr(comm, kSize).ptr());
  if (size == -1 && PyErr_Occurred()) throw nb::python_error();
  const long long p = index_in(peer, size);
  const long long t = index_in(tag, kMaxTag + 1);
  if (p < 0 || t < 0) return nb::none();
  const double seconds = PyFloat_AsDouble(timeout.is_none() ? attr(comm, kTimeout).ptr() : timeout.ptr());
  if (seconds == -1.0 && PyErr_Occurred()) throw nb::python_error();
  NativeComm& native = nb::cast<NativeComm&>(attr(comm, kNative));
  try {
    return nb::cast(native.post(x, static_cast<int>(p), static_cast<uint64_t>(t), is_send, false, seconds));
  } catch (const nb::builtin_exception& e) {
    if (e.type() != nb::exception_type::type_error) throw;
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Type) throw;
  }
  return nb::none();  // not an array this path takes (DLPack, CUDA): the general path's
}

nb::object post_entry(nb::handle comm, nb::handle x, nb::handle peer, nb::handle tag, nb::handle timeout,
                      nb::handle stream, bool is_send) {
  nb::object req = post_plain(comm, x, peer, tag, timeout, stream, is_send);
  if (!req.is_none()) return req;
  return attr(comm, kPost)(x, peer, tag, is_send, false, timeout, stream);
}
}  // namespace

void bind_p2p_entries(nb::module_& m) {
  const char* names[kNames] = {"_closed", "size", "timeout", "_native", "_post"};
  for (int i = 0; i < kNames; ++i)
    if (!(g_names[i] = PyUnicode_InternFromString(names[i]))) throw nb::python_error();  // kept for good
  m.def(
      "comm_isend",
      [](nb::handle self, nb::handle x, nb::handle dst, nb::handle tag, nb::handle timeout, nb::handle stream) {
        return post_entry(self, x, dst, tag, timeout, stream, true);
      },
      nb::is_method(), nb::arg("x"), nb::arg("dst"), nb::arg("tag") = 0, nb::kw_only(),
      nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Start sending x to rank dst; the returned request's wait()/test() finish it.\n\n"
      "A CUDA array is enqueued on `stream` (else its current stream) as send() does; the request "
      "(linkwise._request.GpuRequest) waits for a CUDA event recorded after it.");
  m.def(
      "comm_irecv",
      [](nb::handle self, nb::handle x, nb::handle src, nb::handle tag, nb::handle timeout, nb::handle stream) {
        return post_entry(self, x, src, tag, timeout, stream, false);
      },
      nb::is_method(), nb::arg("x"), nb::arg("src"), nb::arg("tag") = 0, nb::kw_only(),
      nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Start receiving into x from rank src; the returned request's wait()/test() finish it (CUDA "
      "arrays: as isend).");
}

}  // namespace linkwise
