// Python bindings of the point-to-point engine: NativeComm and Request.
//
// Every call that can block releases the GIL. Arrays are held (buffer acquired and the object
// referenced) by the Request until it completes, so Python may drop its own reference.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/unique_ptr.h>

#include <algorithm>
#include <exception>
#include <memory>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/native_comm.h"
#include "core/process_local.h"

namespace nb = nanobind;

namespace linkwise {

PyRequest::~PyRequest() {
  if (!req_->done() && !comm_->engine().cancel(*req_)) {
    // Still moving bytes into or out of the array: the communicator keeps the array until
    // the request is done, rather than let the engine touch freed memory.
    comm_->keep_dropped(req_, buf_, std::move(owner_));
  }
}

void PyRequest::wait_nogil(double timeout_s, double named_s) {
  comm_->engine().wait(*req_, timeout_s, req_->kind == Request::Kind::Send ? "send" : "recv", named_s);
}

size_t PyRequest::wait(double timeout_s, double named_s) {
  {
    nb::gil_scoped_release nogil;
    wait_nogil(timeout_s, named_s);
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

namespace {
// wait_all over send / receive requests only (else NotImplemented: _request.wait_all loops over
// the general wait()s). One GIL release for the lot; each request waits at most until its
// deadline, `timeout` (or its own timeout) after the call began, and is given up at it as its
// own wait() gives up. A failed request does not stop the others' waits, so that no array is
// let go while bytes still move; the first failure in list order is raised once all have ended.
// Ctrl-C (Interrupted) is raised at once, leaving the rest pending.
nb::object wait_all(nb::handle requests, std::optional<double> timeout) {
  if (!PyList_Check(requests.ptr())) throw nb::type_error("wait_all: requests must be a list");
  nb::list items = nb::borrow<nb::list>(requests);
  std::vector<nb::object> held;  // each request stays alive while the GIL is released, even if
  std::vector<PyRequest*> reqs;  // another thread empties the list meanwhile
  held.reserve(items.size());
  reqs.reserve(items.size());
  for (nb::handle item : items) {
    if (!nb::isinstance<PyRequest>(item)) return nb::borrow(Py_NotImplemented);
    held.push_back(nb::borrow(item));
    reqs.push_back(nb::inst_ptr<PyRequest>(item));
  }
  if (timeout) check_user_timeout(*timeout, "wait_all");
  std::exception_ptr first;
  {
    nb::gil_scoped_release nogil;
    const auto t0 = Clock::now();
    for (PyRequest* r : reqs) {
      const double whole = timeout ? *timeout : r->timeout;  // what a timeout's error names
      try {
        r->wait_nogil(std::max(0.0, whole - seconds_since(t0)), whole);
      } catch (const Error& e) {
        if (e.kind() == ErrorKind::Interrupted) {
          first = std::current_exception();
          break;
        }
        if (!first) first = std::current_exception();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
  }
  nb::list bytes;
  for (PyRequest* r : reqs) {
    r->let_go();
    bytes.append(r->nbytes());
  }
  if (first) std::rethrow_exception(first);
  return bytes;
}

// _request.await_request(req): what `await req` iterates (a strong reference, set once by
// set_request_awaiter and never dropped).
PyObject* g_awaiter = nullptr;
}  // namespace

void bind_p2p(nb::module_& m) {
  // The request isend / irecv return as they are (a Python wrapper around it cost ~0.6 us of a
  // ~3 us message, docs/benchmarks.md); linkwise.Request counts it as one of its kind.
  nb::class_<PyRequest>(m, "Request",
                        "A non-blocking send or receive: wait(), test(), done, nbytes, await. Keep the array "
                        "untouched until done.")
      .def(
          "wait",
          [](PyRequest& r, std::optional<double> timeout) {
            if (timeout) check_user_timeout(*timeout, "wait");
            return r.wait(timeout ? *timeout : r.timeout);
          },
          nb::arg("timeout") = nb::none(),
          "Block until done (GIL released), at most timeout seconds (default: the request's timeout); raise "
          "its error. Returns the bytes moved.")
      .def("_wait_now", [](PyRequest& r) { return r.wait(0.0); },
           "Finish it now: its error if done, else it is withdrawn as a timed-out wait's is (TimeoutError).")
      .def(
          "_wait_within",
          [](PyRequest& r, double left, double whole) { return r.wait(std::max(0.0, left), whole); },
          nb::arg("left"), nb::arg("whole"),
          "wait() for wait_all: at most `left` seconds (0: as _wait_now), its TimeoutError naming `whole`, the "
          "caller's timeout of which `left` remains.")
      .def("test", &PyRequest::test, "Progress once; True when done (raises its error if it failed).")
      .def("fileno", &PyRequest::fileno,
           "An eventfd that turns readable when the request is done. Only the engine's progress thread "
           "writes it, for asend / arecv requests (see driven); an isend / irecv request is progressed by "
           "test() and wait() alone, so poll those, or await the request.")
      .def_prop_ro("nbytes", &PyRequest::nbytes, "Bytes moved, once done.")
      .def_prop_ro("done", &PyRequest::done)
      .def_prop_ro("driven", &PyRequest::driven,
                   "True when the engine's progress thread completes it (asend/arecv); else only wait() and "
                   "test() progress it.")
      .def_rw("timeout", &PyRequest::timeout, "Seconds wait() and await wait when not told otherwise.")
      .def("__await__",
           [](nb::handle self) {
             if (!g_awaiter) throw nb::type_error("linkwise._request has not set the request awaiter");
             return nb::borrow(g_awaiter)(self);
           });
  m.def("wait_all", &wait_all, nb::arg("requests"), nb::arg("timeout") = nb::none(),
        "Wait for every send / receive request of the list (linkwise.wait_all's native path); returns their "
        "bytes moved, or NotImplemented where an item is another kind of request.");
  m.def(
      "set_request_awaiter",
      [](nb::handle fn) {
        if (g_awaiter) return;
        Py_INCREF(fn.ptr());
        g_awaiter = fn.ptr();
      },
      nb::arg("fn"), "fn(request) returns the iterator `await request` runs (set once).");

  nb::class_<NativeComm>(m, "NativeComm", "The native point-to-point engine of one communicator.")
      .def(nb::new_([](int rank, int size, double spin_us, size_t pull_threshold) {
             return make_process_local<NativeComm>(rank, size, spin_us, pull_threshold);
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
           }, nb::arg("obj").none(), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("recv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, double timeout) {
             return c.blocking(obj, peer, tag, false, timeout);
           }, nb::arg("obj").none(), nb::arg("peer"), nb::arg("tag"), nb::arg("timeout"))
      .def("sendrecv", &NativeComm::sendrecv, nb::arg("send_obj").none(), nb::arg("dst"), nb::arg("send_tag"),
           nb::arg("recv_obj").none(), nb::arg("src"), nb::arg("recv_tag"), nb::arg("timeout"))
      .def("sendrecv_replace", &NativeComm::sendrecv_replace, nb::arg("obj").none(), nb::arg("dst"),
           nb::arg("send_tag"), nb::arg("src"), nb::arg("recv_tag"), nb::arg("timeout"))
      .def("isend", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async, double timeout) {
             return c.post(obj, peer, tag, true, is_async, timeout);
           }, nb::arg("obj").none(), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async"), nb::arg("timeout"))
      .def("irecv", [](NativeComm& c, nb::handle obj, int peer, uint64_t tag, bool is_async, double timeout) {
             return c.post(obj, peer, tag, false, is_async, timeout);
           }, nb::arg("obj").none(), nb::arg("peer"), nb::arg("tag"), nb::arg("is_async"), nb::arg("timeout"))
      .def("describe_link", [](NativeComm& c, int peer) { return c.engine().describe_link(peer); })
      .def("peer_alive", [](NativeComm& c, int peer) { return c.engine().peer_alive(peer); },
           "False once peer's process is known to have exited or closed its link.")
      .def("abort",
           [](NativeComm& c, const std::string& why, bool notify, int blame, uint64_t stop_from) {
             if (notify) c.engine().abort_and_notify(why, blame, stop_from);
             else c.engine().abort(why);
           },
           nb::arg("why"), nb::arg("notify") = false, nb::arg("blame") = -1, nb::arg("stop_from") = 0,
           "fail every pending request and refuse new ones; with notify, also send the peers an abort notice "
           "(blame: the rank that died or failed, which the peers' PeerError names; -1: none) that stops their "
           "collectives numbered stop_from and up (0: all)")
      .def("close",
           [](NativeComm& c, const std::string& why) {
             c.engine().close(why);
             c.reap_dropped();  // every request failed: their arrays may go
           },
           nb::arg("why"),
           "abort(why), then close this side of every link: the peers raise PeerError naming this rank once "
           "they have read what it sent before")
      .def("notify_refused", [](NativeComm& c, uint64_t number) { c.engine().notify_refused(number); },
           nb::arg("number"),
           "this rank refused collective `number` (its arguments): the peers' receives of it from this rank fail")
      .def("refused_by", [](NativeComm& c, uint64_t number) { return c.engine().refused_by(number); },
           nb::arg("number"), "the lowest rank whose refusal notice of collective `number` was read; -1: none")
      .def("poll", [](NativeComm& c) { c.engine().poll(); }, nb::call_guard<nb::gil_scoped_release>(),
           "one progress pass over every link")
      .def_prop_ro("abort_reason", [](NativeComm& c) { return c.engine().abort_reason(); },
                   "why the communicator was aborted; empty while it was not")
      .def_prop_ro("abort_peer", [](NativeComm& c) { return c.engine().abort_peer(); },
                   "the rank whose death or failure aborted the communicator; -1: none (or not aborted)")
      .def("abort_reason_for", [](NativeComm& c, uint64_t number) { return c.engine().abort_reason(number); },
           nb::arg("number"),
           "why collective `number` cannot run (the communicator was aborted, or a peer's notice stopped "
           "collectives from a number at most it); empty while it may run")
      .def("abort_peer_for", [](NativeComm& c, uint64_t number) { return c.engine().abort_peer(number); },
           nb::arg("number"), "as abort_peer, for collective `number` (see abort_reason_for)");
}

}  // namespace linkwise
