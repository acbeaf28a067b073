// linkwise._native: the data plane as seen from Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include <cstdio>

#include "bindings/bindings.h"
#include "core/copy.h"
#include "core/status.h"
#include "core/wait.h"

namespace nb = nanobind;

namespace linkwise {

namespace {
// Ctrl-C in long waits (core/wait.h). Only the main thread runs Python's signal handlers, so
// only it checks; what a handler raised waits here (GIL held to touch it) for the translator.
unsigned long g_main_thread = 0;  // PyThread_get_thread_ident() of the main thread
PyObject *g_raised_type = nullptr, *g_raised_value = nullptr, *g_raised_trace = nullptr;

bool python_interrupted() {
  if (PyThread_get_thread_ident() != g_main_thread || !Py_IsInitialized()) return false;
  nb::gil_scoped_acquire gil;  // the waiting thread released it; this takes it back briefly
  if (PyErr_CheckSignals() == 0) return false;
  Py_XDECREF(g_raised_type);
  Py_XDECREF(g_raised_value);
  Py_XDECREF(g_raised_trace);
  PyErr_Fetch(&g_raised_type, &g_raised_value, &g_raised_trace);
  return true;
}

// Sets what python_interrupted() kept (KeyboardInterrupt if nothing is kept).
void raise_interrupt() {
  if (!g_raised_type) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    return;
  }
  PyErr_Restore(g_raised_type, g_raised_value, g_raised_trace);
  g_raised_type = g_raised_value = g_raised_trace = nullptr;
}

// The caller's rank from the "rank N: ..." that the engine's and the executor's messages
// start with; -1 when a message does not.
int rank_of(const char* what) {
  int rank = -1, end = 0;
  return std::sscanf(what, "rank %d:%n", &rank, &end) == 1 && end > 0 ? rank : -1;
}

// Sets the Python exception of e (not Interrupted).
void translate(const Error& e) {
  const char* cls = "LinkwiseError";
  switch (e.kind()) {
    case ErrorKind::Invalid: PyErr_SetString(PyExc_ValueError, e.what()); return;
    case ErrorKind::Type: PyErr_SetString(PyExc_TypeError, e.what()); return;
    case ErrorKind::Timeout: cls = "TimeoutError"; break;
    case ErrorKind::Peer: cls = "PeerError"; break;
    case ErrorKind::Aborted: cls = "CommAbortedError"; break;
    case ErrorKind::Internal: case ErrorKind::Interrupted: cls = "LinkwiseError"; break;
  }
  nb::object type = nb::module_::import_("linkwise.errors").attr(cls);
  nb::object exc = e.kind() == ErrorKind::Peer ? type(e.what(), rank_of(e.what()), e.peer()) : type(e.what());
  PyErr_SetObject(type.ptr(), exc.ptr());
}
}  // namespace

// Maps linkwise::Error to the classes of linkwise.errors (imported on first use). Making the
// exception runs Python code: a signal handler that raises meanwhile (Ctrl-C as the wait
// ended) wins, as it would in Python, rather than turning into a RuntimeError.
void bind_errors(nb::module_&) {
  g_main_thread = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  set_interrupt_check(&python_interrupted);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Interrupted) return raise_interrupt();
      try {
        translate(e);
      } catch (nb::python_error& raised) {
        raised.restore();
      }
    }
  });
}

}  // namespace linkwise

NB_MODULE(_native, m) {
  m.doc() = "linkwise data plane (C++)";
  // Objects still alive at interpreter exit are expected, not leaks: a communicator a daemon
  // thread may still be blocked in is left to the process exit (comm._close_all), and
  // nanobind's report of them (to stderr, per object and function) would only alarm users.
  nanobind::set_leak_warnings(false);
  linkwise::bind_errors(m);
  linkwise::bind_p2p(m);
  linkwise::bind_p2p_entries(m);
#ifdef LINKWISE_HAVE_CUDA
  linkwise::bind_cuda(m);
#endif
  linkwise::bind_shm_coll(m);  // before bind_coll: CollWorker.submit takes a ShmColl
  linkwise::bind_coll(m);
  linkwise::bind_solo(m);
  linkwise::bind_cma(m);
  linkwise::bind_reg_cache(m);
  linkwise::bind_defer(m);  // after bind_p2p and bind_cuda: takes their Request and _GpuEngine
  m.def("copy_detours", []() {
    const auto c = linkwise::copy_detours();
    return std::make_pair(c.vector_copies, c.cma_bounces);
  }, "(vector-loop copies, bounced CMA transfers) so far in this process: copies whose "
     "destination lay 1-31 bytes past the source modulo 4 KiB (core/copy.h)");
  m.def("set_copy_detour", &linkwise::set_copy_detour, nb::arg("mode"),
        "aliasing copies take the detours of core/copy.h: -1 by CPU (AMD), 0 never, 1 always");
  m.def("copy_detour_on", &linkwise::copy_detour_on);
  m.def("build_info", []() {
    nb::dict d;
#ifdef LINKWISE_HAVE_CUDA
    d["cuda"] = true;
    d["cuda_archs"] = LINKWISE_CUDA_ARCHS;  // CMAKE_CUDA_ARCHITECTURES, comma-separated
#else
    d["cuda"] = false;
#endif
#if defined(__clang__)
    d["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
    d["compiler"] = "gcc " __VERSION__;
#else
    d["compiler"] = "unknown";
#endif
    return d;
  });
}
