// Python bindings of Cross Memory Attach (transport/shm/cma.h) for the Dask comm backend
// (linkwise/dask_comm.py), whose large frames between processes of one host are read straight
// out of the writer's memory:
//   cma_allow_peers()                 let processes of this uid read this one's memory;
//   cma_probe(pid, addr, expect)      True when `pid`'s 8 bytes at addr read as expect;
//   cma_read(pid, addr, out)          fills the writable buffer `out` from pid's memory at
//                                     addr (GIL released); PeerError when pid is gone.
// Ownership: the writer keeps the memory at addr alive and unchanged until the reader says it
// has copied it (the backend's ack); nothing here checks that.
#include <nanobind/nanobind.h>

#include "bindings/bindings.h"
#include "bindings/buffer.h"
#include "transport/shm/cma.h"

namespace nb = nanobind;

namespace linkwise {

void bind_cma(nb::module_& m) {
  m.def("cma_allow_peers", &cma_allow_peers);
  m.def("cma_probe", [](int64_t pid, uint64_t addr, uint64_t expect) {
    return cma_probe(pid, reinterpret_cast<const void*>(addr), expect);
  }, nb::arg("pid"), nb::arg("addr"), nb::arg("expect"));
  m.def("cma_read", [](int64_t pid, uint64_t addr, nb::handle out) {
    HeldBuffer dst;
    acquire_buffer(out, true, "cma_read", dst);
    nb::gil_scoped_release nogil;
    cma_read(pid, -1, dst.view.buf, addr, static_cast<size_t>(dst.view.len));
  }, nb::arg("pid"), nb::arg("addr"), nb::arg("out"));
}

}  // namespace linkwise
