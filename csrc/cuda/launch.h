// Host-callable kernel launchers shared by gpu_engine.cu and the kernel files. Internal to
// csrc/cuda: included only from .cu files (needs cudaStream_t).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gpu_device.cuh"

namespace linkwise::cuda {

enum DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kF64 = 4, kI64 = 5 };
enum RedOp : int { kSum = 0, kProd = 1, kMin = 2, kMax = 3, kAvg = 4 };

size_t dtype_size(int dtype);

constexpr int kThreads = 512;

// The collective launchers take no epoch: kernels number their epochs on the device
// (gpu_device.cuh epoch_begin / epoch_end), so they can be captured in a CUDA graph.

// all_reduce of `count` elements that fit one in_slot, every rank pushing all of x.
void launch_oneshot(const DevComm& c, int dtype, int op, const void* x, void* out, size_t count,
                    int blocks, cudaStream_t s);

// LL kernels (ll_kernels.cu) for messages of 1..ll_max() bytes: return false (nothing
// launched) for other sizes. launch_oneshot / launch_broadcast (non scatter-allgather) try
// them first.
size_t ll_max();
// Tuning knobs: `name`'s value when LINKWISE_GPU_TUNE was set at start-up, else dflt.
int tune_int(const char* name, int dflt);
bool launch_ll_allreduce(const DevComm& c, int dtype, int op, const void* x, void* out,
                         size_t count, cudaStream_t s);
// Broadcast of root's src into every rank's x (src == x: in place; else the root copies src
// into its x in the same kernel; non-roots ignore src).
bool launch_ll_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root,
                         cudaStream_t s);

// Reduce-scatter (+ all-gather when `allgather`) of one piece; see reduce_kernels.cu.
void launch_twoshot(const DevComm& c, int dtype, int op, const void* x, size_t x_stride, void* out,
                    size_t out_stride, size_t count, size_t chunk, bool allgather,
                    int blocks, cudaStream_t s);

// scatter_allgather: root scatters n-1 chunks, the non-roots all-gather them (large sizes);
// else the root pushes everything to every peer (small sizes). Root's data comes from src
// (== x in place; otherwise the LL kernel copies it into x, or a copy on s precedes the flag
// kernels); non-roots ignore src. src and x are equal or do not overlap.
void launch_broadcast(const DevComm& c, const void* src, void* x, size_t n, int root, int blocks,
                      bool scatter_allgather, cudaStream_t s);
void launch_all_gather(const DevComm& c, const void* x, size_t n, void* out, size_t out_stride,
                       int blocks, cudaStream_t s);
void launch_all_to_all(const DevComm& c, const void* x, size_t x_stride, void* out,
                       size_t out_stride, size_t n, int blocks, cudaStream_t s);
void launch_send(const DevComm& c, const void* x, size_t n, int dst, int par, uint64_t ack_need,
                 int blocks, cudaStream_t s);
void launch_recv(const DevComm& c, void* x, size_t n, int src, int par, uint64_t data_need,
                 int blocks, cudaStream_t s);
void launch_barrier(const DevComm& c, cudaStream_t s);
// Loads the point-to-point, barrier and block-copy kernels now. Under CUDA's lazy module
// loading (the default since CUDA 12) a kernel is loaded at its first launch, and loading
// waits for the kernels running in the context: a recv kernel spinning for its data would
// then keep the matching send kernel of the same process from ever loading (a recv posted
// before its send deadlocked until the timeout, on two streams as on one). Returns the first
// CUDA error, cudaSuccess if none.
cudaError_t preload_copy_kernels();

// One slice reduced from registered user buffers (reg_reduce.cu): elements [0, len) of
// src[0..nsrc) (rank order) reduced into every dst[0..ndst). Not an epoch kernel: the caller
// brackets it with rendezvous (reg_engine.cu).
struct RegReduceArgs {
  const void* src[kMaxRanks];
  void* dst[kMaxRanks];
  int nsrc = 0, ndst = 0, nranks = 0;
  bool avg = false;
  size_t len = 0;
};
// variant: 2 = default (2 packs x 8 sources in flight per thread, kThreads threads); 1 and 4
// are tuning variants for float32/float16/bfloat16 sum (others take the default);
// reg_reduce_threads(variant) = threads per block of that variant.
void launch_reg_reduce(int dtype, int op, const RegReduceArgs& a, int blocks, int variant,
                       cudaStream_t s);
int reg_reduce_threads(int variant);

}  // namespace linkwise::cuda
