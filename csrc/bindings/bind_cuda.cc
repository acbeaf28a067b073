// linkwise._native._GpuEngine: the CUDA data plane (csrc/cuda/gpu_engine.h) for
// linkwise.cuda.GpuComm. Private: arrays are unpacked to (device pointer, count, dtype code)
// on the Python side (linkwise/cuda/arrays.py), which handles __cuda_array_interface__,
// __dlpack__ and torch tensors; the stream arrives as a cudaStream_t integer. Every call
// only enqueues GPU work, but still releases the GIL (cudaIpcOpenMemHandle and the first
// launches can take milliseconds).
#ifdef LINKWISE_HAVE_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings/bindings.h"
#include "cuda/gpu_engine.h"
#include "cuda/stage_channel.h"
#include "cuda/stage_reduce.h"

#include <cuda_runtime.h>

namespace nb = nanobind;

namespace linkwise {

void bind_cuda(nb::module_& m) {
  using linkwise::cuda::GpuEngine;
  using rel = nb::call_guard<nb::gil_scoped_release>;
  m.def("cuda_device_count", &linkwise::cuda::device_count, rel());
  // True while `stream` (a cudaStream_t integer) is being captured into a CUDA graph.
  m.def("cuda_stream_capturing", [](uintptr_t stream) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &st);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return e == cudaErrorStreamCaptureImplicit;  // legacy stream touched during a capture
    }
    return st != cudaStreamCaptureStatusNone;
  });
  using linkwise::cuda::StageChannel;
  nb::class_<StageChannel>(m, "_StageChannel")
      .def(nb::init<const std::string&, bool, int, int, size_t, int, double, const GpuEngine*>(),
           nb::arg("name"), nb::arg("create"), nb::arg("readers"), nb::arg("slots"),
           nb::arg("slot_bytes"), nb::arg("device"), nb::arg("timeout"),
           nb::arg("engine").none() = nb::none(), nb::keep_alive<1, 9>(), rel())
      .def_prop_ro("name", &StageChannel::name)
      .def("unlink", &StageChannel::unlink, rel())
      .def("stop", &StageChannel::stop, nb::arg("code"))
      .def("write", &StageChannel::write, rel())
      .def("read", &StageChannel::read, rel())
      .def_prop_ro("slot_bytes", &StageChannel::slot_bytes)
      .def_prop_ro("slots", &StageChannel::slots);
  using linkwise::cuda::StageReduce;
  nb::class_<StageReduce>(m, "_StageReduce")
      .def(nb::init<int, int, int, size_t, int, double, const GpuEngine*, const std::string&>(),
           nb::arg("rank"), nb::arg("size"), nb::arg("slots"), nb::arg("slot_bytes"),
           nb::arg("device"), nb::arg("timeout"), nb::arg("engine").none(), nb::arg("label"),
           nb::keep_alive<1, 8>(), rel())
      .def_prop_ro("name", &StageReduce::name)
      .def("attach", &StageReduce::attach, rel())
      .def("unlink", &StageReduce::unlink, rel())
      .def("all_reduce", &StageReduce::all_reduce, rel())
      .def_prop_ro("slot_bytes", &StageReduce::slot_bytes);
  nb::class_<GpuEngine>(m, "_GpuEngine")
      .def(nb::init<int, int, int, size_t, double>(), nb::arg("rank"), nb::arg("size"),
           nb::arg("device"), nb::arg("slot_bytes"), nb::arg("timeout"), rel())
      .def("ipc_handle", [](const GpuEngine& e) { std::string h = e.ipc_handle(); return nb::bytes(h.data(), h.size()); })
      .def("open_peers", [](GpuEngine& e, const std::vector<nb::bytes>& hs) {
             std::vector<std::string> v;
             for (const auto& h : hs) v.emplace_back(h.c_str(), h.size());
             nb::gil_scoped_release r;
             e.open_peers(v);
           })
      .def("close", &GpuEngine::close, rel())
      .def("all_reduce", &GpuEngine::all_reduce, rel())
      .def("reduce_scatter", &GpuEngine::reduce_scatter, rel())
      .def("broadcast", &GpuEngine::broadcast, rel())
      .def("broadcast_from", &GpuEngine::broadcast_from, rel())
      // The eager fast path (linkwise/cuda/fast.py): the failure check (check(): PeerError /
      // TimeoutError once recorded; CommAbortedError after close) and the operation in one call.
      .def("all_reduce_fast",
           [](GpuEngine& e, uintptr_t x, uintptr_t out, size_t count, int dtype, int op,
              uintptr_t stream) {
             e.check_open("all_reduce");
             e.all_reduce(x, out, count, dtype, op, stream, 0);
           }, rel())
      .def("broadcast_fast",
           [](GpuEngine& e, uintptr_t src, uintptr_t x, size_t nbytes, int root,
              uintptr_t stream) {
             e.check_open("broadcast");
             e.broadcast_from(src, x, nbytes, root, stream);
           }, rel())
      .def("all_gather", &GpuEngine::all_gather, rel())
      .def("all_to_all", &GpuEngine::all_to_all, rel())
      .def("send", &GpuEngine::send, rel())
      .def("recv", &GpuEngine::recv, rel())
      .def("barrier", &GpuEngine::barrier, rel())
      .def("reg_describe", [](const GpuEngine& e, uintptr_t p) {
             std::string d;
             { nb::gil_scoped_release r; d = e.reg_describe(p); }
             return nb::bytes(d.data(), d.size());
           })
      .def("reg_map", [](GpuEngine& e, const std::vector<nb::bytes>& ds, int slot) {
             std::vector<std::string> v;
             for (const auto& d : ds) v.emplace_back(d.c_str(), d.size());
             nb::gil_scoped_release r;
             e.reg_map(v, slot);
           })
      .def("reg_cached", &GpuEngine::reg_cached)
      .def("reg_cache_stats", &GpuEngine::reg_cache_stats)
      .def("reg_cache_limits", &GpuEngine::reg_cache_limits)
      .def("all_gather_reg", &GpuEngine::all_gather_reg, rel())
      .def("broadcast_reg", &GpuEngine::broadcast_reg, rel())
      .def("send_reg", &GpuEngine::send_reg, rel())
      .def("recv_defer_begin", &GpuEngine::recv_defer_begin, rel())
      .def("recv_now",
           [](GpuEngine& e, uintptr_t x, size_t nbytes, int src, uintptr_t stream, const nb::bytes& d) {
             std::string desc(d.c_str(), d.size());
             nb::gil_scoped_release r;
             e.recv_now(x, nbytes, src, stream, desc);
           })
      .def("all_reduce_reg", &GpuEngine::all_reduce_reg, rel())
      .def("reduce_scatter_reg", &GpuEngine::reduce_scatter_reg, rel())
      .def("pchain_trace", &GpuEngine::pchain_trace, rel())
      .def("all_reduce_rsag_reg", &GpuEngine::all_reduce_rsag_reg, rel())
      .def("all_reduce_prs_reg", &GpuEngine::all_reduce_prs_reg, rel())
      .def("prs_scratch", &GpuEngine::prs_scratch, rel())
      .def_static("host_alloc", &GpuEngine::host_alloc, rel())
      .def_static("host_free", &GpuEngine::host_free, rel())
      .def("copy_async", &GpuEngine::copy_async, rel())
      .def("event_record", &GpuEngine::event_record, rel())
      .def("sendrecv_fork", &GpuEngine::sendrecv_fork, rel())
      .def("sendrecv_join", &GpuEngine::sendrecv_join, rel())
      .def("event_sync", &GpuEngine::event_sync, rel())
      .def("synchronize", &GpuEngine::synchronize, rel())
      .def("error_code", &GpuEngine::error_code)
      .def("check", &GpuEngine::check)
      .def("refuse", &GpuEngine::refuse, rel())
      .def("note_stop", &GpuEngine::note_stop, nb::arg("code"))
      .def("stop_code", &GpuEngine::stop_code, nb::arg("failed"))
      .def("watch_peers", &GpuEngine::watch_peers, rel())
      .def("abort", &GpuEngine::abort, nb::arg("peer") = -1)
      .def("event_query", &GpuEngine::event_query, rel())
      .def("event_wait", &GpuEngine::event_wait, rel())
      .def_static("event_destroy", &GpuEngine::event_destroy)
      .def_prop_ro("device", &GpuEngine::device)
      .def_prop_ro("slot_bytes", &GpuEngine::slot_bytes)
      .def_prop_ro("closed", &GpuEngine::closed)
      .def_rw("oneshot_max", &GpuEngine::oneshot_max)
      .def_rw("bcast_sag_min", &GpuEngine::bcast_sag_min)
      .def_rw("max_blocks", &GpuEngine::max_blocks)
      .def_rw("reg_blocks", &GpuEngine::reg_blocks);
}

}  // namespace linkwise
#endif  // LINKWISE_HAVE_CUDA
