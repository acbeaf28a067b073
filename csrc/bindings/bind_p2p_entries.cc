// comm.isend, irecv, sendrecv and sendrecv_replace, made natively as methods of
// linkwise.Communicator (comm.py puts them on the class when it first loads this module). The
// Python methods' frame and argument tests cost 0.3-0.6 us of a 1-2 us message
// (docs/benchmarks.md, twenty-sixth session).
//
// A plain call (peers and tags exact ints in range, no stream, the communicator open, arrays
// with the buffer protocol) runs here; any other goes to the general path (comm._post, or the
// Python definitions of sendrecv and sendrecv_replace, kept as comm._sendrecv /
// comm._sendrecv_replace), which converts DLPack and CUDA arrays or says what is wrong. The GIL
// is held throughout.
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
enum Name { kClosed, kSize, kTimeout, kNative, kPost, kSendrecv, kSendrecvReplace, kNames };
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

// The tests of a plain call: no stream, the communicator open, peers and tags exact ints in
// range, the timeout None (the communicator's) or a number. Fills peers / tags / seconds and
// returns comm._native (a NativeComm), or an invalid object (not plain: take the general
// path, which explains). The caller holds the object while it uses the NativeComm: a close()
// from another thread, while the call waits without the GIL, drops comm's reference.
template <size_t N>
nb::object plain(nb::handle comm, const nb::handle (&peer_args)[N], const nb::handle (&tag_args)[N],
                  nb::handle timeout, nb::handle stream, long long (&peers)[N], long long (&tags)[N],
                  double& seconds) {
  if (!stream.is_none()) return {};
  for (size_t i = 0; i < N; ++i)
    if (!PyLong_CheckExact(peer_args[i].ptr()) || !PyLong_CheckExact(tag_args[i].ptr())) return {};
  if (!(timeout.is_none() || PyFloat_CheckExact(timeout.ptr()) || PyLong_CheckExact(timeout.ptr()))) return {};
  if (attr(comm, kClosed).ptr() != Py_False) return {};
  const long long size = PyLong_AsLongLong(attr(comm, kSize).ptr());
  if (size == -1 && PyErr_Occurred()) throw nb::python_error();
  for (size_t i = 0; i < N; ++i) {
    peers[i] = index_in(peer_args[i], size);
    tags[i] = index_in(tag_args[i], kMaxTag + 1);
    if (peers[i] < 0 || tags[i] < 0) return {};
  }
  seconds = PyFloat_AsDouble(timeout.is_none() ? attr(comm, kTimeout).ptr() : timeout.ptr());
  if (seconds == -1.0 && PyErr_Occurred()) throw nb::python_error();
  nb::object native = attr(comm, kNative);
  if (!nb::isinstance<NativeComm>(native)) return {};
  return native;
}

// Runs body(native); None where it is not plain, or where the array is not one the native
// layer takes (TypeError: DLPack and CUDA arrays, which the general path converts).
template <size_t N, class Body>
nb::object run_plain(nb::handle comm, const nb::handle (&peer_args)[N], const nb::handle (&tag_args)[N],
                     nb::handle timeout, nb::handle stream, Body&& body) {
  long long peers[N], tags[N];
  double seconds = 0;
  nb::object native = plain(comm, peer_args, tag_args, timeout, stream, peers, tags, seconds);
  if (!native.is_valid()) return nb::none();
  try {
    return body(nb::cast<NativeComm&>(native), peers, tags, seconds);
  } catch (const nb::builtin_exception& e) {
    // The buffer export's TypeError, raised before anything was posted. Not the engine's
    // Error(Type) (a message of another dtype): sendrecv had sent its message by then, and
    // the general path would send it again.
    if (e.type() != nb::exception_type::type_error) throw;
  }
  return nb::none();
}

nb::object post_entry(nb::handle comm, nb::handle x, nb::handle peer, nb::handle tag, nb::handle timeout,
                      nb::handle stream, bool is_send) {
  nb::object req = run_plain<1>(comm, {peer}, {tag}, timeout, stream, [&](NativeComm& n, auto& p, auto& t, double s) {
    return nb::cast(n.post(x, static_cast<int>(p[0]), static_cast<uint64_t>(t[0]), is_send, false, s));
  });
  if (!req.is_none()) return req;
  return attr(comm, kPost)(x, peer, tag, is_send, false, timeout, stream);
}
}  // namespace

void bind_p2p_entries(nb::module_& m) {
  const char* names[kNames] = {"_closed", "size", "timeout", "_native", "_post", "_sendrecv", "_sendrecv_replace"};
  for (int i = 0; i < kNames; ++i)
    if (!(g_names[i] = PyUnicode_InternFromString(names[i]))) throw nb::python_error();  // kept for good
  m.def(
      "comm_isend",
      [](nb::handle self, nb::handle x, nb::handle dst, nb::handle tag, nb::handle timeout, nb::handle stream) {
        return post_entry(self, x, dst, tag, timeout, stream, true);
      },
      nb::is_method(), nb::arg("x").none(), nb::arg("dst").none(), nb::arg("tag").none() = 0, nb::kw_only(),
      nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Start sending x to rank dst; the returned request's wait()/test() finish it.\n\n"
      "A CUDA array is enqueued on `stream` (else its current stream) as send() does; the request "
      "(linkwise._request.GpuRequest) waits for a CUDA event recorded after it.");
  m.def(
      "comm_irecv",
      [](nb::handle self, nb::handle x, nb::handle src, nb::handle tag, nb::handle timeout, nb::handle stream) {
        return post_entry(self, x, src, tag, timeout, stream, false);
      },
      nb::is_method(), nb::arg("x").none(), nb::arg("src").none(), nb::arg("tag").none() = 0, nb::kw_only(),
      nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Start receiving into x from rank src; the returned request's wait()/test() finish it (CUDA "
      "arrays: as isend).");
  m.def(
      "comm_sendrecv",
      [](nb::handle self, nb::handle x, nb::handle dst, nb::handle out, nb::handle src, nb::handle send_tag,
         nb::handle recv_tag, nb::handle timeout, nb::handle stream) {
        nb::object n = run_plain<2>(self, {dst, src}, {send_tag, recv_tag}, timeout, stream,
                                    [&](NativeComm& c, auto& p, auto& t, double s) {
                                      return nb::cast(c.sendrecv(x, static_cast<int>(p[0]), t[0], out,
                                                                 static_cast<int>(p[1]), t[1], s));
                                    });
        if (!n.is_none()) return n;
        return attr(self, kSendrecv)(x, dst, out, src, send_tag, recv_tag, nb::arg("timeout") = timeout,
                                     nb::arg("stream") = stream);
      },
      nb::is_method(), nb::arg("x").none(), nb::arg("dst").none(), nb::arg("out").none(), nb::arg("src").none(),
      nb::arg("send_tag").none() = 0, nb::arg("recv_tag").none() = 0, nb::kw_only(), nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Send x to rank dst while receiving into out from rank src (MPI_Sendrecv); returns the bytes received. "
      "One call: no deadlock when every rank of a ring calls it at once.\n\n"
      "Host arrays go in one native call; CUDA arrays through the GPU plane, enqueued on `stream` (else the "
      "array's current stream) like send and recv (linkwise.cuda.sendrecv).");
  m.def(
      "comm_sendrecv_replace",
      [](nb::handle self, nb::handle x, nb::handle dst, nb::handle src, nb::handle send_tag, nb::handle recv_tag,
         nb::handle timeout, nb::handle stream) {
        nb::object n = run_plain<2>(self, {dst, src}, {send_tag, recv_tag}, timeout, stream,
                                    [&](NativeComm& c, auto& p, auto& t, double s) {
                                      return nb::cast(c.sendrecv_replace(x, static_cast<int>(p[0]), t[0],
                                                                         static_cast<int>(p[1]), t[1], s));
                                    });
        if (!n.is_none()) return n;
        return attr(self, kSendrecvReplace)(x, dst, src, send_tag, recv_tag, nb::arg("timeout") = timeout,
                                            nb::arg("stream") = stream);
      },
      nb::is_method(), nb::arg("x").none(), nb::arg("dst").none(), nb::arg("src").none(),
      nb::arg("send_tag").none() = 0, nb::arg("recv_tag").none() = 0, nb::kw_only(), nb::arg("timeout") = nb::none(), nb::arg("stream") = nb::none(),
      "Send x to rank dst, then hold in x what rank src sent (MPI_Sendrecv_replace); returns the bytes "
      "received. The message from src may be shorter than x (the rest of x keeps what it held) but not "
      "longer (ValueError, as for recv).\n\n"
      "A copy of x is sent while the receive lands in x: one extra copy of x, as MPI makes (into memory the "
      "communicator keeps for it, up to 16 MiB). A CUDA array (torch, cupy, DLPack) is copied on `stream` "
      "(else its current stream) and exchanged as sendrecv does; its message must be x's size, as for GPU send "
      "and recv. One known only by __cuda_array_interface__ raises TypeError (nothing could allocate its copy).");
}

}  // namespace linkwise
