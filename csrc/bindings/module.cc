// linkwise._native: the data plane as seen from Python.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>

#include "bindings/bindings.h"
#include "core/copy.h"
#include "core/status.h"

namespace nb = nanobind;

namespace linkwise {

// Maps linkwise::Error to the classes of linkwise.errors (imported on first use).
void bind_errors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::module_ errors = nb::module_::import_("linkwise.errors");
      const char* cls = "LinkwiseError";
      switch (e.kind()) {
        case ErrorKind::Invalid: PyErr_SetString(PyExc_ValueError, e.what()); return;
        case ErrorKind::Type: PyErr_SetString(PyExc_TypeError, e.what()); return;
        case ErrorKind::Timeout: cls = "TimeoutError"; break;
        case ErrorKind::Peer: cls = "PeerError"; break;
        case ErrorKind::Aborted: cls = "CommAbortedError"; break;
        case ErrorKind::Internal: cls = "LinkwiseError"; break;
      }
      nb::object type = errors.attr(cls);
      nb::object exc = e.kind() == ErrorKind::Peer ? type(e.what(), -1, e.peer()) : type(e.what());
      PyErr_SetObject(type.ptr(), exc.ptr());
    }
  });
}

}  // namespace linkwise

NB_MODULE(_native, m) {
  m.doc() = "linkwise data plane (C++)";
  linkwise::bind_errors(m);
  linkwise::bind_p2p(m);
#ifdef LINKWISE_HAVE_CUDA
  linkwise::bind_cuda(m);
#endif
  linkwise::bind_shm_coll(m);  // before bind_coll: CollWorker.submit takes a ShmColl
  linkwise::bind_coll(m);
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
