// Python bindings of the point-to-point engine: NativeComm and Request.
//
// Every call that can block releases the GIL. Arrays are held (buffer acquired and the object
// referenced) by the Request until it completes, so Python may drop its own reference.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>

#include <memory>

#include "bindings/bindings.h"
#include "bindings/buffer.h"
#include "p2p/engine.h"
#include "transport/shm/shm_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

class NativeComm;

class PyRequest {
 public:
  PyRequest(std::shared_ptr<NativeComm> comm, std::shared_ptr<Request> req, nb::object owner)
      : comm_(std::move(comm)), req_(std::move(req)), owner_(std::move(owner)) {}
  ~PyRequest();
  void wait(double timeout_s);
  bool test();
  int fileno() { return req_->event_fd(); }
  size_t nbytes() const { return req_->transferred(); }
  bool done() const { return req_->done(); }
  HeldBuffer& buffer() { return buf_; }

 private:
  std::shared_ptr<NativeComm> comm_;
  std::shared_ptr<Request> req_;
  nb::object owner_;
  HeldBuffer buf_;
};

class NativeComm : public std::enable_shared_from_this<NativeComm> {
 public:
  NativeComm(int rank, int size, double spin_us, size_t pull_threshold)
      : engine_(rank, size, EngineOptions{spin_us, pull_threshold}) {}

  void create_shm_inbox(const std::string& name, size_t ring_bytes) {
    LW_CHECK(!shm_, "one shared-memory inbox per communicator");
    shm_ = std::make_shared<ShmTransport>(name, engine_.rank(), engine_.size(), ring_bytes);
    engine_.add_transport(shm_);
  }
  void connect_shm(int peer, const std::string& name, int64_t pid) {
    LW_CHECK(shm_, "create_shm_inbox before connect_shm");
    engine_.set_link(peer, shm_->connect(peer, name, pid), shm_.get());
  }
  void unlink_shm() {
    if (shm_) shm_->unlink_name();
  }
  void adopt_tcp(int peer, int fd) {
    if (!tcp_) {
      tcp_ = std::make_shared<TcpTransport>();
      engine_.add_transport(tcp_);
    }
    engine_.set_link(peer, tcp_->adopt(peer, fd), tcp_.get());
  }

  std::unique_ptr<PyRequest> post(nb::handle obj, int peer, uint64_t tag, bool is_send, bool is_async) {
    auto held = std::make_unique<HeldBuffer>();
    acquire_buffer(obj, !is_send, is_send ? "send" : "recv", *held);
    std::shared_ptr<Request> req =
        is_send ? engine_.isend(peer, held->ptr(), held->bytes(), tag, held->dtype(), is_async)
                : engine_.irecv(peer, held->ptr(), held->bytes(), tag, held->dtype(), is_async);
    auto py = std::make_unique<PyRequest>(shared_from_this(), std::move(req), nb::borrow(obj));
    std::swap(py->buffer().view, held->view);
    py->buffer().held = held->held;
    held->held = false;
    return py;
  }

  // Blocking send/recv: no Request object crosses into Python (the latency path).
  size_t blocking(nb::handle obj, int peer, uint64_t tag, bool is_send, double timeout_s) {
    HeldBuffer held;
    acquire_buffer(obj, !is_send, is_send ? "send" : "recv", held);
    std::shared_ptr<Request> req;
    {
      nb::gil_scoped_release nogil;
      req = is_send ? engine_.isend(peer, held.ptr(), held.bytes(), tag, held.dtype(), false)
                    : engine_.irecv(peer, held.ptr(), held.bytes(), tag, held.dtype(), false);
      engine_.wait(*req, timeout_s, is_send ? "send" : "recv");
    }
    return req->transferred();
  }

  Engine& engine() { return engine_; }

 private:
  Engine engine_;
  std::shared_ptr<ShmTransport> shm_;
  std::shared_ptr<TcpTransport> tcp_;
};

PyRequest::~PyRequest() {
  if (!req_->done() && !comm_->engine().cancel(*req_)) {
    // Still moving bytes into or out of the array: keep the array alive for good rather
    // than let the engine touch freed memory.
    buf_.held = false;
    owner_.release();
  }
}

void PyRequest::wait(double timeout_s) {
  {
    nb::gil_scoped_release nogil;
    comm_->engine().wait(*req_, timeout_s, req_->kind == Request::Kind::Send ? "send" : "recv");
  }
  buf_.release();
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

}  // namespace

void bind_p2p(nb::module_& m) {
  nb::class_<PyRequest>(m, "Request", "A non-blocking operation; keep it until wait() or test() says done.")
      .def("wait", &PyRequest::wait, nb::arg("timeout"), "Block until done (GIL released); raise its error.")
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
      .def("adopt_tcp", &NativeComm::adopt_tcp, nb::arg("peer"), nb::arg("fd"))
      .def("send", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, double timeout) {
             return c.blocking(obj, peer, tag, true, timeout);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("recv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, double timeout) {
             return c.blocking(obj, peer, tag, false, timeout);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("isend", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async) {
             return c.post(obj, peer, tag, true, is_async);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async") = false)
      .def("irecv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async) {
             return c.post(obj, peer, tag, false, is_async);
           }, nb::arg("obj"), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async") = false)
      .def("describe_link", [](NativeComm& c, int peer) { return c.engine().describe_link(peer); })
      .def("abort", [](NativeComm& c, const std::string& why) { c.engine().abort(why); });
}

}  // namespace linkwise
