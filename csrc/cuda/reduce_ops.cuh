// Element types and reduction operators shared by the reduction kernels (reduce_kernels.cu,
// reg_reduce.cu): accumulation type (float16/bfloat16 in float32), the four operators, a
// 16-byte pack, and the runtime (dtype, op) -> template dispatch. Device code; internal.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/launch.h"

namespace linkwise::cuda {
namespace {

template <typename T> struct AccT { using type = T; };
template <> struct AccT<__half> { using type = float; };
template <> struct AccT<__nv_bfloat16> { using type = float; };

template <typename T> __device__ __forceinline__ typename AccT<T>::type up(T v) { return v; }
template <> __device__ __forceinline__ float up<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float up<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T down(typename AccT<T>::type v) { return v; }
template <> __device__ __forceinline__ __half down<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 down<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

struct OpSum { template <typename A> __device__ A operator()(A a, A b) const { return a + b; } };
struct OpProd { template <typename A> __device__ A operator()(A a, A b) const { return a * b; } };
// NaN propagates as in np.minimum / np.maximum (and the CPU's core/reduce_ops.h), whatever the order.
struct OpMin { template <typename A> __device__ A operator()(A a, A b) const { return (b < a || b != b) ? b : a; } };
struct OpMax { template <typename A> __device__ A operator()(A a, A b) const { return (a < b || b != b) ? b : a; } };

template <typename T> union Pack {
  static constexpr int kN = 16 / sizeof(T);
  uint4 u;
  T v[kN];
};

// Calls F<T, Op>::run(args...) for the runtime dtype and op.
template <template <typename, class> class F, typename... Args>
void dispatch(int dtype, int op, Args&&... args) {
  auto by_op = [&](auto tag) {
    using T = decltype(tag);
    switch (op) {
      case kSum: case kAvg: F<T, OpSum>::run(args...); break;
      case kProd: F<T, OpProd>::run(args...); break;
      case kMin: F<T, OpMin>::run(args...); break;
      case kMax: F<T, OpMax>::run(args...); break;
    }
  };
  switch (dtype) {
    case kF32: by_op(float{}); break;
    case kF16: by_op(__half{}); break;
    case kBF16: by_op(__nv_bfloat16{}); break;
    case kI32: by_op(int32_t{}); break;
    case kF64: by_op(double{}); break;
    case kI64: by_op(int64_t{}); break;
  }
}

}  // namespace
}  // namespace linkwise::cuda
