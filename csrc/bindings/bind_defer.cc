// linkwise._native._DeferWorkers: the native helper threads of the GPU plane's deferred
// receives (defer_workers.h), for linkwise/cuda/deferred.py; and _DeferTestTarget, a
// recording stand-in for the GPU engine, so tests/test_deferred_model.py checks the threads'
// contracts on machines without a GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/defer_workers.h"
#include "bindings/native_comm.h"
#include "core/status.h"
#ifdef LINKWISE_HAVE_CUDA
#include "cuda/gpu_engine.h"
#endif

namespace nb = nanobind;

namespace linkwise {
namespace {

#ifdef LINKWISE_HAVE_CUDA
class GpuTarget final : public DeferTarget {
 public:
  explicit GpuTarget(cuda::GpuEngine* e) : e_(e) {}
  void finish(uintptr_t event, uintptr_t x, size_t nbytes, int src, const std::string& desc) override {
    e_->recv_defer_finish(event, x, nbytes, src, desc);
  }
  void drop(uintptr_t event) override { e_->recv_defer_drop(event); }
  void abort(int src) override { e_->abort(src); }

 private:
  cuda::GpuEngine* e_;
};
#endif

// Records what the threads asked for. hold(True) makes finish wait until hold(False);
// fail_src makes finish for that source throw (as a failed mapping would).
class TestTarget final : public DeferTarget {
 public:
  // (event, x, nbytes, src, desc, finish had the GIL, time.monotonic() of the call)
  template <class Bytes>
  using Call = std::tuple<uintptr_t, uintptr_t, size_t, int, Bytes, bool, double>;
  void finish(uintptr_t event, uintptr_t x, size_t nbytes, int src, const std::string& desc) override {
    const bool had_gil = PyGILState_Check() == 1;
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return !held_; });
    if (src == fail_src) throw Error(ErrorKind::Invalid, "recv: test target refused source " + std::to_string(src));
    finished_.push_back({event, x, nbytes, src, desc, had_gil, t});
  }
  void drop(uintptr_t event) override {
    std::lock_guard<std::mutex> l(mu_);
    dropped_.push_back(event);
  }
  void abort(int src) override {
    std::lock_guard<std::mutex> l(mu_);
    aborted_.push_back(src);
  }
  void hold(bool on) {
    {
      std::lock_guard<std::mutex> l(mu_);
      held_ = on;
    }
    cv_.notify_all();
  }
  std::vector<Call<nb::bytes>> finished() {
    std::lock_guard<std::mutex> l(mu_);
    std::vector<Call<nb::bytes>> out;
    for (const auto& [ev, x, n, src, desc, gil, t] : finished_)
      out.emplace_back(ev, x, n, src, nb::bytes(desc.data(), desc.size()), gil, t);
    return out;
  }
  std::vector<uintptr_t> dropped() {
    std::lock_guard<std::mutex> l(mu_);
    return dropped_;
  }
  std::vector<int> aborted() {
    std::lock_guard<std::mutex> l(mu_);
    return aborted_;
  }
  int fail_src = -1;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  std::vector<Call<std::string>> finished_;
  std::vector<uintptr_t> dropped_;
  std::vector<int> aborted_;
};

// Members in this order: the workers go first (their close joins the threads), then the
// adapter, then the reference that keeps the target's Python object alive.
struct PyDeferWorkers {
  PyDeferWorkers(nb::object target, int nranks) : target_obj(std::move(target)) {
    DeferTarget* t = nullptr;
    if (nb::isinstance<TestTarget>(target_obj)) {
      t = nb::inst_ptr<TestTarget>(target_obj);
#ifdef LINKWISE_HAVE_CUDA
    } else if (nb::isinstance<cuda::GpuEngine>(target_obj)) {
      adapter = std::make_unique<GpuTarget>(nb::inst_ptr<cuda::GpuEngine>(target_obj));
      t = adapter.get();
#endif
    } else {
      throw nb::type_error("_DeferWorkers: the target must be a _GpuEngine or a _DeferTestTarget");
    }
    if (nranks < 1) throw nb::value_error("_DeferWorkers: nranks must be at least 1");
    workers = std::make_unique<DeferWorkers>(t, nranks);
    this->nranks = nranks;
  }
  ~PyDeferWorkers() {
    if (getpid() != maker) (void)workers.release();  // a forked child's copy (core/process_local.h)
  }
  nb::object target_obj;
  std::unique_ptr<DeferTarget> adapter;
  std::unique_ptr<DeferWorkers> workers;
  int nranks = 0;
  const pid_t maker = getpid();
};

void post(PyDeferWorkers& w, int src, nb::object request, nb::object x, nb::object msg, uintptr_t event,
          uintptr_t ptr, size_t nbytes) {
  if (src < 0 || src >= w.nranks) throw nb::value_error("_DeferWorkers.post: no such source");
  DeferWorkers::Item item;
  item.src = src;
  item.event = event;
  item.x = ptr;
  item.nbytes = nbytes;
  if (!request.is_none()) {
    if (!nb::isinstance<PyRequest>(request)) throw nb::type_error("_DeferWorkers.post: request must be a native Request");
    PyRequest* r = nb::inst_ptr<PyRequest>(request);
    Py_buffer view;
    if (PyObject_GetBuffer(msg.ptr(), &view, PyBUF_SIMPLE) != 0) throw nb::python_error();
    // msg stays referenced by the item (held below), so its memory outlives the view
    item.msg = static_cast<const uint8_t*>(view.buf);
    const Py_ssize_t len = view.len;
    PyBuffer_Release(&view);
    if (len < 1) throw nb::value_error("_DeferWorkers.post: the description buffer is empty");
    item.desc_bytes = static_cast<size_t>(len - 1);
    item.comm = r->native_comm();
    item.req = r->request();
    item.timeout_s = r->timeout;
  }
  PyObject* refs[3] = {x.ptr(), msg.ptr(), request.ptr()};
  for (int i = 0; i < 3; ++i) {
    Py_XINCREF(refs[i]);
    item.held[i] = refs[i];
  }
  w.workers->post(std::move(item));
}

}  // namespace

void bind_defer(nb::module_& m) {
  nb::class_<TestTarget>(m, "_DeferTestTarget")
      .def(nb::init<>())
      .def("hold", &TestTarget::hold, nb::call_guard<nb::gil_scoped_release>())
      .def("finished", &TestTarget::finished)
      .def("dropped", &TestTarget::dropped)
      .def("aborted", &TestTarget::aborted)
      .def_rw("fail_src", &TestTarget::fail_src);

  nb::class_<PyDeferWorkers>(m, "_DeferWorkers")
      .def(nb::init<nb::object, int>())
      .def("post", &post, nb::arg("src"), nb::arg("request").none(), nb::arg("x").none(), nb::arg("msg").none(),
           nb::arg("event"), nb::arg("ptr"), nb::arg("nbytes"),
           "Queues a deferred receive of src (request: the description's host Request, or None for "
           "the scratch receive); holds x, msg and request until it is enqueued or dropped.")
      .def("busy", [](PyDeferWorkers& w, int src) {
        if (src < 0 || src >= w.nranks) throw nb::value_error("_DeferWorkers.busy: no such source");
        return w.workers->busy(src);
      })
      .def("failed", [](PyDeferWorkers& w) { return w.workers->failed(); })
      .def("rethrow", [](PyDeferWorkers& w) { w.workers->rethrow(); })
      .def("close", [](PyDeferWorkers& w, double timeout_s) {
        {
          nb::gil_scoped_release r;
          w.workers->close(timeout_s);
        }
        w.workers->reap();
      });
}

}  // namespace linkwise
