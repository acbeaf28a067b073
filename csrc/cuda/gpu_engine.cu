// GpuEngine: scratch registration through CUDA IPC, and the host half of every operation:
// splitting into pieces that fit a slot, choosing blocks and algorithm (epochs are numbered on the device: gpu_device.cuh).
#include <cuda_runtime.h>

#include <time.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>

#include "core/status.h"
#include "core/wait.h"
#include "cuda/gpu_engine.h"
#include "cuda/engine_impl.h"
#include "cuda/launch.h"

namespace linkwise::cuda {

namespace {
size_t round_up(size_t a, size_t b) { return (a + b - 1) / b * b; }
}  // namespace

void GpuEngine::fail(const char* op, int err) const {
  throw Error(ErrorKind::Internal,
              "rank " + std::to_string(rank_) + ": GPU " + op + " failed on device " +
                  std::to_string(device_) + ": " +
                  cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void GpuEngine::check_launch(const char* op) const {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail(op, e);
}

GpuEngine::GpuEngine(int rank, int nranks, int device, size_t slot_bytes, double timeout_s)
    : rank_(rank), nranks_(nranks), device_(device), slot_bytes_(round_up(slot_bytes, 256)),
      timeout_s_(timeout_s) {
  if (nranks < 1 || nranks > kMaxRanks)
    throw Error(ErrorKind::Invalid, "GpuComm supports 1.." + std::to_string(kMaxRanks) +
                                        " ranks, not " + std::to_string(nranks));
  DeviceGuard g(device_);
  impl_ = new EngineImpl();
  size_t bytes = scratch_bytes(nranks, slot_bytes_);
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    delete impl_;
    impl_ = nullptr;
    fail("scratch allocation", e);
  }
  impl_->own = static_cast<char*>(p);
  EngineImpl* im = impl_;
  impl_->closer = make_process_local<IpcCloser>(device, im->close_gate, [im] { return engine_quiet(*im); });
  init_reg_cache(impl_->reg_cache, rank, *impl_->closer);
  init_reg_cache(impl_->p2p_cache, rank, *impl_->closer);
  void* hf = nullptr;
  e = cudaHostAlloc(&hf, sizeof(HostFlags), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) {
    cudaFree(p);
    delete impl_;
    impl_ = nullptr;
    fail("abort flag allocation (cudaHostAlloc mapped)", e);
  }
  impl_->flags = static_cast<HostFlags*>(hf);
  std::memset(hf, 0, sizeof(HostFlags));
  impl_->watch.attach(impl_->flags);
  LW_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&impl_->dev.host), hf, 0), "scratch setup");
  LW_CUDA(cudaMemset(p, 0, kControlBytes), "scratch setup");
  LW_CUDA(cudaDeviceSynchronize(), "scratch setup");
  LW_CUDA(preload_copy_kernels(), "kernel preload");  // before any of ours can spin (launch.h)
  LW_CUDA(preload_defer_kernels(), "kernel preload");
  DevComm& d = impl_->dev;
  d.rank = rank;
  d.nranks = nranks;
  d.slot_bytes = slot_bytes_;
  d.base[rank] = impl_->own;
  // clock64 ticks: the SM clock is at most ~2 GHz on the GPUs we target.
  d.spin_limit = static_cast<uint64_t>(timeout_s > 0 ? timeout_s * 2.0e9 : 1e18);
}

GpuEngine::~GpuEngine() { close(); }

void GpuEngine::close() {
  if (!impl_) return;
  DeviceGuard g(device_);
  cudaDeviceSynchronize();  // waits are bounded (timeout or abort), so this returns
  impl_->watch.stop();
  for (int r = 0; r < nranks_; ++r)
    if (impl_->opened[r]) cudaIpcCloseMemHandle(impl_->dev.base[r]);
  impl_->closer->finish();  // its thread stops before release_defer destroys what quiet() reads
  reg_release();
  release_defer(*impl_);
  impl_->closer->finish();  // the closes the caches posted just now, here (the device is idle)
  release_side(*impl_);
  if (impl_->prs_own) cudaFree(impl_->prs_own);
  cudaFree(impl_->own);
  cudaFreeHost(impl_->flags);
  delete impl_;
  impl_ = nullptr;
}

std::string GpuEngine::ipc_handle() const {
  DeviceGuard g(device_);
  cudaIpcMemHandle_t h;
  LW_CUDA(cudaIpcGetMemHandle(&h, impl_->own), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void GpuEngine::open_peers(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != nranks_)
    throw Error(ErrorKind::Invalid, "open_peers: expected one handle per rank");
  DeviceGuard g(device_);
  for (int r = 0; r < nranks_; ++r) {
    if (r == rank_) continue;
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t))
      throw Error(ErrorKind::Invalid, "open_peers: malformed IPC handle from rank " + std::to_string(r));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      throw Error(ErrorKind::Peer, "rank " + std::to_string(rank_) + ": cannot map rank " +
                                       std::to_string(r) + "'s GPU memory (cudaIpcOpenMemHandle: " +
                                       cudaGetErrorString(e) +
                                       "); the GPUs may lack peer access (try LINKWISE_P2P_DISABLE=1)",
                  r);
    impl_->dev.base[r] = static_cast<char*>(p);
    impl_->opened[r] = true;
  }
}

int GpuEngine::blocks_for(size_t bytes, size_t per_block) const {
  size_t b = (bytes + per_block - 1) / per_block;
  size_t cap = static_cast<size_t>(max_blocks < kMaxBlocks ? max_blocks : kMaxBlocks);
  if (b < 1) b = 1;
  return static_cast<int>(b < cap ? b : cap);
}

void GpuEngine::all_reduce(uintptr_t x, uintptr_t out, size_t count, int dtype, int op,
                           uintptr_t stream, int algo) {
  size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "all_reduce: unsupported dtype code");
  if (count == 0) return;
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const char* xp = reinterpret_cast<const char*>(x);
  char* op_ = reinterpret_cast<char*>(out);
  size_t bytes = count * es, V = 16 / es;
  size_t slot_elems = slot_bytes_ / es / V * V;
  if (nranks_ == 1) {
    if (x != out) LW_CUDA(cudaMemcpyAsync(op_, xp, bytes, cudaMemcpyDeviceToDevice, s), "all_reduce");
    return;
  }
  if (algo == 0) algo = bytes <= oneshot_max && bytes <= slot_bytes_ ? 1 : 2;
  if (algo == 1) {
    for (size_t off = 0; off < count; off += slot_elems) {
      size_t n = count - off < slot_elems ? count - off : slot_elems;
      launch_oneshot(impl_->dev, dtype, op, xp + off * es, op_ + off * es, n,
                     blocks_for(n * es, 16 * 1024), s);
      check_launch("all_reduce");
    }
    return;
  }
  size_t piece = slot_elems * nranks_;
  for (size_t off = 0; off < count; off += piece) {
    size_t n = count - off < piece ? count - off : piece;
    size_t chunk = round_up((n + nranks_ - 1) / nranks_, V);
    launch_twoshot(impl_->dev, dtype, op, xp + off * es, chunk, op_ + off * es, chunk, n, chunk,
                   true, blocks_for(chunk * es, 16 * 1024), s);
    check_launch("all_reduce");
  }
}

void GpuEngine::reduce_scatter(uintptr_t x, uintptr_t out, size_t m, int dtype, int op,
                               uintptr_t stream) {
  size_t es = dtype_size(dtype);
  if (es == 0) throw Error(ErrorKind::Type, "reduce_scatter: unsupported dtype code");
  if (m == 0) return;
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const char* xp = reinterpret_cast<const char*>(x);
  char* op_ = reinterpret_cast<char*>(out);
  if (nranks_ == 1) {
    if (x != out) LW_CUDA(cudaMemcpyAsync(op_, xp, m * es, cudaMemcpyDeviceToDevice, s), "reduce_scatter");
    return;
  }
  size_t V = 16 / es, slot_elems = slot_bytes_ / es / V * V;
  for (size_t off = 0; off < m; off += slot_elems) {
    size_t n = m - off < slot_elems ? m - off : slot_elems;
    launch_twoshot(impl_->dev, dtype, op, xp + off * es, m, op_ + off * es, 0, n * nranks_, n,
                   false, blocks_for(n * es, 16 * 1024), s);
    check_launch("reduce_scatter");
  }
}

void GpuEngine::broadcast(uintptr_t x, size_t nbytes, int root, uintptr_t stream) {
  broadcast_from(x, x, nbytes, root, stream);
}

void GpuEngine::broadcast_from(uintptr_t src, uintptr_t x, size_t nbytes, int root,
                               uintptr_t stream) {
  if (root < 0 || root >= nranks_) throw Error(ErrorKind::Invalid, "broadcast: root out of range");
  if (nbytes == 0) return;
  if (nranks_ == 1) {
    if (src != x) copy_async(x, src, nbytes, stream);
    return;
  }
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  char* xp = reinterpret_cast<char*>(x);
  const char* sp = reinterpret_cast<const char*>(src);
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    size_t n = nbytes - off < slot_bytes_ ? nbytes - off : slot_bytes_;
    bool sag = nranks_ > 2 && nbytes >= bcast_sag_min;
    size_t per = sag ? (n + nranks_ - 2) / (nranks_ - 1) : n;  // bytes a block slices
    launch_broadcast(impl_->dev, sp + off, xp + off, n, root, blocks_for(per, 16 * 1024), sag, s);
    check_launch("broadcast");
  }
}

template <class Launch>
void GpuEngine::per_slot_piece(const char* x, char* out, size_t bytes, uintptr_t stream,
                               const char* what, Launch launch) {
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  for (size_t off = 0; off < bytes; off += slot_bytes_) {
    size_t n = bytes - off < slot_bytes_ ? bytes - off : slot_bytes_;
    if (nranks_ == 1) {
      LW_CUDA(cudaMemcpyAsync(out + off, x + off, n, cudaMemcpyDeviceToDevice, s), what);
      continue;
    }
    launch(off, n, s);
    check_launch(what);
  }
}

void GpuEngine::all_gather(uintptr_t x, uintptr_t out, size_t nbytes, uintptr_t stream) {
  if (nbytes == 0) return;
  const char* xp = reinterpret_cast<const char*>(x);
  char* op_ = reinterpret_cast<char*>(out);
  per_slot_piece(xp, op_, nbytes, stream, "all_gather", [&](size_t off, size_t n, cudaStream_t s) {
    launch_all_gather(impl_->dev, xp + off, n, op_ + off, nbytes, blocks_for(n, 16 * 1024), s);
  });
}

void GpuEngine::all_to_all(uintptr_t x, uintptr_t out, size_t m, uintptr_t stream) {
  if (m == 0) return;
  const char* xp = reinterpret_cast<const char*>(x);
  char* op_ = reinterpret_cast<char*>(out);
  per_slot_piece(xp, op_, m, stream, "all_to_all", [&](size_t off, size_t n, cudaStream_t s) {
    launch_all_to_all(impl_->dev, xp + off, m, op_ + off, m, n, blocks_for(n, 16 * 1024), s);
  });
}

void GpuEngine::send(uintptr_t x, size_t nbytes, int dst, uintptr_t stream) {
  if (dst < 0 || dst >= nranks_ || dst == rank_)
    throw Error(ErrorKind::Invalid, "send: destination must be another rank of the communicator");
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  const char* xp = reinterpret_cast<const char*>(x);
  EngineImpl& im = *impl_;
  P2pPiece piece{im, s};  // may wait for dst's receive (ipc_closer.h)
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    size_t n = nbytes - off < slot_bytes_ ? nbytes - off : slot_bytes_;
    int blocks = blocks_for(n, 64 * 1024);
    uint64_t k = im.send_pieces[dst]++;
    uint64_t need = k >= 2 ? im.send_ring[dst][k & 1] : 0;
    launch_send(im.dev, xp + off, n, dst, static_cast<int>(k & 1), need, blocks, s);
    check_launch("send");
    im.send_cum[dst] += blocks;
    im.send_ring[dst][k & 1] = im.send_cum[dst];
  }
}

void GpuEngine::recv(uintptr_t x, size_t nbytes, int src, uintptr_t stream) {
  if (src < 0 || src >= nranks_ || src == rank_)
    throw Error(ErrorKind::Invalid, "recv: source must be another rank of the communicator");
  DeviceGuard g(device_);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  char* xp = reinterpret_cast<char*>(x);
  EngineImpl& im = *impl_;
  P2pPiece piece{im, s};  // waits for src's send (ipc_closer.h)
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    size_t n = nbytes - off < slot_bytes_ ? nbytes - off : slot_bytes_;
    int blocks = blocks_for(n, 64 * 1024);
    uint64_t k = im.recv_pieces[src]++;
    im.recv_cum[src] += blocks;
    launch_recv(im.dev, xp + off, n, src, static_cast<int>(k & 1), im.recv_cum[src], blocks, s);
    check_launch("recv");
  }
}

void GpuEngine::barrier(uintptr_t stream) {
  if (nranks_ == 1) return;
  DeviceGuard g(device_);
  launch_barrier(impl_->dev, reinterpret_cast<cudaStream_t>(stream));
  check_launch("barrier");
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void GpuEngine::synchronize(uintptr_t stream) {
  DeviceGuard g(device_);
  cudaError_t e = cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    if (impl_ && impl_->watch.tripped()) check();  // the peer's death is the cause
    fail("synchronize", e);
  }
}

// Failures (watch_peers, abort, refuse, check, ...): engine_failures.cu.

// -- events for requests (GpuRequest in _request.py) -----------------------------------------
bool GpuEngine::event_query(uintptr_t ev) {
  DeviceGuard g(device_);
  cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(ev));
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) {
    if (impl_ && impl_->watch.tripped()) check();
    fail("request", e);
  }
  return true;
}

bool GpuEngine::event_wait(uintptr_t ev, double timeout_s) {
  // Polls with a growing nap (2..500 us) rather than cudaEventSynchronize so that the timeout
  // holds; device waits are bounded anyway (gpu_device.cuh), so this rarely runs long.
  auto t0 = std::chrono::steady_clock::now();
  double checked = 0;  // when (seconds after t0) Ctrl-C was last looked for
  long nap_ns = 0;
  for (;;) {
    if (event_query(ev)) return true;
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited >= timeout_s) return false;
    if (waited - checked >= 0.1) {  // core/wait.h: the work stays queued on its stream
      checked = waited;
      if (interrupted()) throw_interrupted(rank_, "a GPU request's wait");
    }
    nap_ns = nap_ns ? (nap_ns < 500000 ? nap_ns * 2 : 500000) : 2000;
    timespec ts{0, nap_ns};
    nanosleep(&ts, nullptr);
  }
}

void GpuEngine::event_destroy(uintptr_t ev) { cudaEventDestroy(reinterpret_cast<cudaEvent_t>(ev)); }

}  // namespace linkwise::cuda
