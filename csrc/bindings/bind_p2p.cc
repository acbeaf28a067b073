// Python bindings of the point-to-point engine: NativeComm and Request.
//
// Every call that can block releases the GIL. Arrays are held (buffer acquired and the object
// referenced) by the Request until it completes, so Python may drop its own reference.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/unique_ptr.h>

#include <memory>

#include "bindings/bindings.h"
#include "bindings/native_comm.h"

namespace nb = nanobind;

namespace linkwise {

PyRequest::~PyRequest() {
  if (!req_->done() && !comm_->engine().cancel(*req_)) {
    // Still moving bytes into or out of the array: keep the array alive for good rather
    // than let the engine touch freed memory.
    buf_.held = false;
    owner_.release();
  }
}

size_t PyRequest::wait(double timeout_s) {
  {
    nb::gil_scoped_release nogil;
    comm_->engine().wait(*req_, timeout_s, req_->kind == Request::Kind::Send ? "send" : "recv");
  }
  buf_.release();
  return req_->transferred();
}

bool PyRequest::test() {
  bool done;
  {
    nb::gil_scoped_release nogil;
    done = comm_->engine().test(*req_);
  }
  if (done) {
    buf_.release();
    req_->rethrow();
  }
  return done;
}

void bind_p2p(nb::module_& m) {
  nb::class_<PyRequest>(m, "Request", "A non-blocking operation; keep it until wait() or test() says done.")
      .def("wait", &PyRequest::wait, nb::arg("timeout"), "Block until done (GIL released); raise its error. Returns the bytes moved.")
      .def("test", &PyRequest::test, "Progress once; True when done (raises its error if it failed).")
      .def("fileno", &PyRequest::fileno, "An eventfd that turns readable when the request is done.")
      .def_prop_ro("nbytes", &PyRequest::nbytes, "Bytes moved, once done.")
      .def_prop_ro("done", &PyRequest::done);

  nb::class_<NativeComm>(m, "NativeComm", "The native point-to-point engine of one communicator.")
      .def(nb::new_([](int rank, int size, double spin_us, size_t pull_threshold) {
             return std::make_shared<NativeComm>(rank, size, spin_us, pull_threshold);
           }),
           nb::arg("rank"), nb::arg("size"), nb::arg("spin_us"), nb::arg("pull_threshold"))
      .def("create_shm_inbox", &NativeComm::create_shm_inbox, nb::arg("name"), nb::arg("ring_bytes"))
      .def("connect_shm", &NativeComm::connect_shm, nb::arg("peer"), nb::arg("name"), nb::arg("pid"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("unlink_shm", &NativeComm::unlink_shm)
      .def("shm_inbox_name", &NativeComm::shm_inbox_name)
      .def("adopt_tcp", &NativeComm::adopt_tcp, nb::arg("peer"), nb::arg("fd"))
      .def("send", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, double timeout) {
             return c.blocking(obj, peer, tag, true, timeout);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("recv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, double timeout) {
             return c.blocking(obj, peer, tag, false, timeout);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("sendrecv", &NativeComm::sendrecv, nb::arg("send_obj"), nb::arg("dst"), nb::arg("send_tag"),
           nb::arg("recv_obj"), nb::arg("src"), nb::arg("recv_tag"), nb::arg("timeout"))
      .def("isend", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async) {
             return c.post(obj, peer, tag, true, is_async);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async") = false)
      .def("irecv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async) {
             return c.post(obj, peer, tag, false, is_async);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async") = false)
      .def("describe_link", [](NativeComm& c, int peer) { return c.engine().describe_link(peer); })
      .def("abort", [](NativeComm& c, const std::string& why) { c.engine().abort(why); })
      .def("poll", [](NativeComm& c) { c.engine().poll(); }, nb::call_guard<nb::gil_scoped_release>(),
           "one progress pass over every link")
      .def_prop_ro("abort_reason", [](NativeComm& c) { return c.engine().abort_reason(); },
                   "why the communicator was aborted; empty while it was not");
}

}  // namespace linkwise
