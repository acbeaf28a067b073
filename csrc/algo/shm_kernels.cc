#include "algo/shm_kernels.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/reduce_ops.h"

namespace linkwise {

namespace {

using namespace elem;  // the element operations (core/reduce_ops.h)

// 8-bit products through unsigned int (as reduce.cc), then truncated.
struct Prod8 {
  template <class T> static T f(T a, T b) { return static_cast<T>(static_cast<unsigned>(a) * static_cast<unsigned>(b)); }
};

template <class T, class Op>
void fused(char* res, char* out, const char* a, const char* b, size_t n, bool stream) {
  T* r = reinterpret_cast<T*>(res);
  T* o = reinterpret_cast<T*>(out);
  const T* x = reinterpret_cast<const T*>(a);
  const T* y = reinterpret_cast<const T*>(b);
  size_t i = 0;
#if defined(__SSE2__)
  if (stream) {
    constexpr size_t K = 64 / sizeof(T);
    for (; i < n && (reinterpret_cast<uintptr_t>(o + i) & 15); ++i) r[i] = o[i] = Op::f(x[i], y[i]);
    for (; i + K <= n; i += K) {
      alignas(16) T v[K];
      for (size_t k = 0; k < K; ++k) v[k] = Op::f(x[i + k], y[i + k]);
      std::memcpy(r + i, v, 64);
      const __m128i* s = reinterpret_cast<const __m128i*>(v);
      __m128i* d = reinterpret_cast<__m128i*>(o + i);
      _mm_stream_si128(d, _mm_load_si128(s));
      _mm_stream_si128(d + 1, _mm_load_si128(s + 1));
      _mm_stream_si128(d + 2, _mm_load_si128(s + 2));
      _mm_stream_si128(d + 3, _mm_load_si128(s + 3));
    }
  }
#endif
  for (; i < n; ++i) {
    const T v = Op::f(x[i], y[i]);
    r[i] = v;
    o[i] = v;
  }
}

template <class T>
bool by_op(void* res, void* out, const void* a, const void* b, size_t n, RedOp op, bool stream) {
  // Integer sum/prod wrap in the unsigned type (no signed overflow); floats stay as they are.
  using A = typename std::conditional_t<std::is_integral_v<T>, std::make_unsigned<T>, std::common_type<T>>::type;
  char* r = static_cast<char*>(res);
  char* o = static_cast<char*>(out);
  const char* x = static_cast<const char*>(a);
  const char* y = static_cast<const char*>(b);
  switch (op) {
    case RedOp::Sum: fused<A, Sum>(r, o, x, y, n, stream); return true;
    case RedOp::Prod:
      if constexpr (sizeof(T) == 1) fused<A, Prod8>(r, o, x, y, n, stream);
      else fused<A, Prod>(r, o, x, y, n, stream);
      return true;
    case RedOp::Min: fused<T, Min>(r, o, x, y, n, stream); return true;
    case RedOp::Max: fused<T, Max>(r, o, x, y, n, stream); return true;
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case RedOp::Band: fused<T, Band>(r, o, x, y, n, stream); return true;
      case RedOp::Bor: fused<T, Bor>(r, o, x, y, n, stream); return true;
      case RedOp::Bxor: fused<T, Bxor>(r, o, x, y, n, stream); return true;
      default: break;
    }
  }
  return false;
}

}  // namespace

bool reduce_store2(void* res, void* out, const void* a, const void* b, size_t n, DType t, RedOp op, bool stream) {
  if (reinterpret_cast<uintptr_t>(out) % dtype_size(t) || reinterpret_cast<uintptr_t>(res) % dtype_size(t))
    return false;
  switch (t) {
    case DType::I8: return by_op<int8_t>(res, out, a, b, n, op, stream);
    case DType::U8: return by_op<uint8_t>(res, out, a, b, n, op, stream);
    case DType::I32: return by_op<int32_t>(res, out, a, b, n, op, stream);
    case DType::I64: return by_op<int64_t>(res, out, a, b, n, op, stream);
    case DType::F32: return by_op<float>(res, out, a, b, n, op, stream);
    case DType::F64: return by_op<double>(res, out, a, b, n, op, stream);
    default: return false;
  }
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace linkwise
