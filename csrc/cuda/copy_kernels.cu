// Data-movement kernels over peer memory: broadcast, all_gather, all_to_all, send/recv, and a
// barrier. Collectives are epochs (parity epoch&1); send/recv use per-pair counters. Flag and
// layout contracts: gpu_device.cuh.
#include "cuda/kernel_util.cuh"
#include "cuda/launch.h"

namespace linkwise::cuda {
namespace {

// The last step of all_gather and all_to_all: every peer q's slice [lo, hi) of its piece, which
// it pushed into our slot `slot(q)`, goes to out + q*out_stride. Whole block.
template <class Slot>
__device__ __forceinline__ void pull_peer_slices(const DevComm& c, char* out, size_t out_stride,
                                                 size_t lo, size_t hi, Slot slot) {
  for (int q = 0; q < c.nranks; ++q) {
    if (q == c.rank) continue;
    char* d = out + q * out_stride + lo;
    copy_bytes(&d, 1, slot(q) + lo, hi - lo);
  }
}

// Broadcast. Roles: blocks alike, each owning one slice of x.
// Root pipeline: start flags -> push slice into in_slot[root] of every peer -> signal ready[0].
// Peer pipeline: wait ready[0][block][root] -> copy the slice from our in_slot[root] into x.
__device__ __forceinline__ void bcast_body(DevComm c, char* x, size_t n, int root,
                                                         uint64_t epoch) {
  announce_start(c, epoch);
  const int par = epoch & 1;
  size_t lo, hi;
  block_slice(n, 16, &lo, &hi);
  if (c.rank == root) {
    wait_peers_started(c, epoch);
    char* dsts[kMaxRanks];
    int nd = 0;
    for (int p = 0; p < c.nranks; ++p)
      if (p != root) dsts[nd++] = c.in_slot(p, par, root) + lo;
    copy_bytes(dsts, nd, x + lo, hi - lo);
    signal_all(c, 0, epoch);
  } else {
    if (threadIdx.x == 0) wait_ge(c, &c.ctrl(c.rank)->ready[0][blockIdx.x][root], epoch);
    __syncthreads();
    char* d = x + lo;
    copy_bytes(&d, 1, c.in_slot(c.rank, par, root) + lo, hi - lo);
  }
}

// Broadcast for large pieces: scatter then all-gather among the non-roots, so the root sends
// each byte once and every link carries about S/(n-1). Chunk i of x (i = 0..n-2) belongs to
// the i-th non-root rank. Roles: blocks alike, owning the same sub-slice of every chunk.
// Root pipeline: start flags -> push sub-slice of chunk idx(p) into in_slot[root] of every
// non-root p -> signal ready[0]. Non-root p pipeline: start flags -> wait ready[0] from root
// -> copy its sub-slice from in_slot[root] into x and push it into gather_slot[p] of every
// other non-root -> signal ready[1] to them -> wait their ready[1] -> copy their sub-slices
// from our gather_slots into x.
__device__ __forceinline__ void bcast_sag_body(DevComm c, char* x, size_t n,
                                                             int root, uint64_t epoch) {
  announce_start(c, epoch);
  wait_peers_started(c, epoch);
  const int par = epoch & 1;
  const int m = c.nranks - 1;
  size_t chunk = (n + m - 1) / m;
  chunk = (chunk + 15) / 16 * 16;
  size_t lo, hi;
  block_slice(chunk, 16, &lo, &hi);
  auto idx = [&](int p) { return p < root ? p : p - 1; };
  auto clen = [&](int i) -> size_t {  // bytes of chunk i inside [lo, hi)
    size_t s = static_cast<size_t>(i) * chunk;
    size_t l = s < n ? n - s : 0;
    l = l < chunk ? l : chunk;
    return l > lo ? (l < hi ? l : hi) - lo : 0;
  };
  if (c.rank == root) {
    for (int p = 0; p < c.nranks; ++p) {
      if (p == root) continue;
      char* d = c.in_slot(p, par, root) + lo;
      copy_bytes(&d, 1, x + idx(p) * chunk + lo, clen(idx(p)));
    }
    signal_all(c, 0, epoch);
    return;
  }
  const int me = idx(c.rank);
  if (threadIdx.x == 0) wait_ge(c, &c.ctrl(c.rank)->ready[0][blockIdx.x][root], epoch);
  __syncthreads();
  char* dsts[kMaxRanks];
  int nd = 0;
  dsts[nd++] = x + me * chunk + lo;
  for (int p = 0; p < c.nranks; ++p)
    if (p != root && p != c.rank) dsts[nd++] = c.gather_slot(p, par, c.rank) + lo;
  copy_bytes(dsts, nd, c.in_slot(c.rank, par, root) + lo, clen(me));
  __syncthreads();
  if (threadIdx.x < c.nranks && threadIdx.x != c.rank && threadIdx.x != root) {
    __threadfence_system();
    st_release_sys(&c.ctrl(threadIdx.x)->ready[1][blockIdx.x][c.rank], epoch);
  }
  if (threadIdx.x < c.nranks && threadIdx.x != c.rank && threadIdx.x != root)
    wait_ge(c, &c.ctrl(c.rank)->ready[1][blockIdx.x][threadIdx.x], epoch);
  __syncthreads();
  for (int q = 0; q < c.nranks; ++q) {
    if (q == root || q == c.rank) continue;
    char* d = x + idx(q) * chunk + lo;
    copy_bytes(&d, 1, c.gather_slot(c.rank, par, q) + lo, clen(idx(q)));
  }
}

// all_gather of one piece: each rank contributes x[0, n); rank q's lands at out + q*out_stride.
// Roles: blocks alike, each owning one slice. Pipeline: start flags -> push slice into
// gather_slot[rank] of every peer and into our own out -> signal/wait ready[0] -> copy every
// peer's slice from our gather_slots into out.
__device__ __forceinline__ void gather_body(DevComm c, const char* x, size_t n,
                                                          char* out, size_t out_stride,
                                                          uint64_t epoch) {
  announce_start(c, epoch);
  wait_peers_started(c, epoch);
  const int par = epoch & 1;
  size_t lo, hi;
  block_slice(n, 16, &lo, &hi);
  char* dsts[kMaxRanks];
  int nd = 0;
  dsts[nd++] = out + c.rank * out_stride + lo;
  for (int p = 0; p < c.nranks; ++p)
    if (p != c.rank) dsts[nd++] = c.gather_slot(p, par, c.rank) + lo;
  copy_bytes(dsts, nd, x + lo, hi - lo);
  signal_all(c, 0, epoch);
  wait_all(c, 0, epoch);
  pull_peer_slices(c, out, out_stride, lo, hi, [&](int q) { return c.gather_slot(c.rank, par, q); });
}

// all_to_all of one piece: block p of x (x + p*x_stride, n bytes) goes to rank p, landing at
// out + rank*out_stride there. Roles and pipeline as gather_kernel, through in_slots.
__device__ __forceinline__ void alltoall_body(DevComm c, const char* x,
                                                            size_t x_stride, char* out,
                                                            size_t out_stride, size_t n,
                                                            uint64_t epoch) {
  announce_start(c, epoch);
  wait_peers_started(c, epoch);
  const int par = epoch & 1;
  size_t lo, hi;
  block_slice(n, 16, &lo, &hi);
  for (int p = 0; p < c.nranks; ++p) {
    char* d = p == c.rank ? out + p * out_stride + lo : c.in_slot(p, par, c.rank) + lo;
    copy_bytes(&d, 1, x + p * x_stride + lo, hi - lo);
  }
  signal_all(c, 0, epoch);
  wait_all(c, 0, epoch);
  pull_peer_slices(c, out, out_stride, lo, hi, [&](int q) { return c.in_slot(c.rank, par, q); });
}

// One point-to-point piece, from the side of one block (send and recv are mirror images).
// Pipeline per block: wait until our counter `*wait_ctr` reaches `need` (send: p2p_ack[dst],
// dst consumed the piece that last used this parity; recv: p2p_data[src], every block of the
// sender's piece landed) -> copy this block's slice src -> dst -> red.release.sys
// `*post_ctr` += 1 on the peer (send: p2p_data[rank] on dst, the slice is there; recv:
// p2p_ack[rank] on src, our reads of the slot are done), after __threadfence_system.
__device__ __forceinline__ void p2p_piece(const DevComm& c, const uint64_t* wait_ctr, uint64_t need,
                                          char* dst, const char* src, size_t n, uint64_t* post_ctr) {
  if (threadIdx.x == 0) wait_ge(c, wait_ctr, need);
  __syncthreads();
  size_t lo, hi;
  block_slice(n, 16, &lo, &hi);
  char* d = dst + lo;
  copy_bytes(&d, 1, src + lo, hi - lo);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    red_release_sys_add(post_ctr, 1);
  }
}

// send of one piece to `dst` through p2p_slot[rank] of parity `par` there.
__global__ void __launch_bounds__(kThreads) send_kernel(DevComm c, const char* x, size_t n, int dst,
                                                        int par, uint64_t ack_need) {
  p2p_piece(c, &c.ctrl(c.rank)->p2p_ack[dst], ack_need, c.p2p_slot(dst, par, c.rank), x, n,
            &c.ctrl(dst)->p2p_data[c.rank]);
}

// recv of one piece from `src` out of our p2p_slot[src] of parity `par`.
__global__ void __launch_bounds__(kThreads) recv_kernel(DevComm c, char* x, size_t n, int src,
                                                        int par, uint64_t data_need) {
  p2p_piece(c, &c.ctrl(c.rank)->p2p_data[src], data_need, x, c.p2p_slot(c.rank, par, src), n,
            &c.ctrl(src)->p2p_ack[c.rank]);
}

// Barrier: one block; signal ready[0][0] to every peer, wait for every peer's.
__device__ __forceinline__ void barrier_body(DevComm c, uint64_t epoch) {
  announce_start(c, epoch);
  signal_all(c, 0, epoch);
  wait_all(c, 0, epoch);
}

// Kernels: each body above is one epoch, numbered on the device (gpu_device.cuh epoch_begin /
// epoch_end) so that launches can be captured in a CUDA graph and replayed.
__global__ void __launch_bounds__(kThreads) bcast_kernel(DevComm c, char* x, size_t n, int root) {
  bcast_body(c, x, n, root, epoch_begin(c));
  epoch_end(c);
}
__global__ void __launch_bounds__(kThreads) bcast_sag_kernel(DevComm c, char* x, size_t n, int root) {
  bcast_sag_body(c, x, n, root, epoch_begin(c));
  epoch_end(c);
}
__global__ void __launch_bounds__(kThreads) gather_kernel(DevComm c, const char* x, size_t n,
                                                          char* out, size_t out_stride) {
  gather_body(c, x, n, out, out_stride, epoch_begin(c));
  epoch_end(c);
}
__global__ void __launch_bounds__(kThreads) alltoall_kernel(DevComm c, const char* x,
                                                            size_t x_stride, char* out,
                                                            size_t out_stride, size_t n) {
  alltoall_body(c, x, x_stride, out, out_stride, n, epoch_begin(c));
  epoch_end(c);
}
__global__ void barrier_kernel(DevComm c) {
  barrier_body(c, epoch_begin(c));
  epoch_end(c);
}

}  // namespace

void launch_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root, int blocks,
                      bool scatter_allgather, cudaStream_t s) {
  if (!scatter_allgather && launch_ll_broadcast(c, src, x, n, root, s)) return;
  if (c.rank == root && src != x)  // a failed copy surfaces in the caller's check_launch
    cudaMemcpyAsync(x, src, n, cudaMemcpyDeviceToDevice, s);
  if (scatter_allgather)
    bcast_sag_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<char*>(x), n, root);
  else
    bcast_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<char*>(x), n, root);
}
void launch_all_gather(const DevComm& c, const void* x, size_t n, void* out, size_t out_stride,
                       int blocks, cudaStream_t s) {
  gather_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<const char*>(x), n,
                                            static_cast<char*>(out), out_stride);
}
void launch_all_to_all(const DevComm& c, const void* x, size_t x_stride, void* out,
                       size_t out_stride, size_t n, int blocks, cudaStream_t s) {
  alltoall_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<const char*>(x), x_stride,
                                              static_cast<char*>(out), out_stride, n);
}
void launch_send(const DevComm& c, const void* x, size_t n, int dst, int par, uint64_t ack_need,
                 int blocks, cudaStream_t s) {
  send_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<const char*>(x), n, dst, par, ack_need);
}
void launch_recv(const DevComm& c, void* x, size_t n, int src, int par, uint64_t data_need,
                 int blocks, cudaStream_t s) {
  recv_kernel<<<blocks, kThreads, 0, s>>>(c, static_cast<char*>(x), n, src, par, data_need);
}
void launch_barrier(const DevComm& c, cudaStream_t s) {
  barrier_kernel<<<1, 32, 0, s>>>(c);
}
cudaError_t preload_copy_kernels() {
  const void* kernels[] = {reinterpret_cast<const void*>(send_kernel),
                           reinterpret_cast<const void*>(recv_kernel),
                           reinterpret_cast<const void*>(barrier_kernel),
                           reinterpret_cast<const void*>(bcast_kernel),
                           reinterpret_cast<const void*>(bcast_sag_kernel),
                           reinterpret_cast<const void*>(gather_kernel),
                           reinterpret_cast<const void*>(alltoall_kernel)};
  for (const void* k : kernels) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, k);  // loads the kernel's module function
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace linkwise::cuda
