// One bind_<area>() per area of the data plane, all called from module.cc's NB_MODULE.
#pragma once

#include <nanobind/nanobind.h>

namespace linkwise {
void bind_errors(nanobind::module_& m);
void bind_p2p(nanobind::module_& m);
void bind_p2p_entries(nanobind::module_& m);  // comm.isend / comm.irecv (bind_p2p_entries.cc)
#ifdef LINKWISE_HAVE_CUDA
void bind_cuda(nanobind::module_& m);
#endif
void bind_shm_coll(nanobind::module_& m);
void bind_coll(nanobind::module_& m);
void bind_solo(nanobind::module_& m);  // SoloColl: one-rank latency entries (bind_solo.cc)
void bind_cma(nanobind::module_& m);
void bind_reg_cache(nanobind::module_& m);
void bind_defer(nanobind::module_& m);  // _DeferWorkers, _DeferTestTarget (bind_defer.cc)  // _RegCacheModel, for tests (bind_reg_cache.cc)
}  // namespace linkwise
