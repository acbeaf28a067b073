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

// res[i] = out[i] = v[0][i] OP v[1][i] OP ... OP v[k-1][i], folded left in input order (the
// order of reduce3 + reduce_into, so the bits match). One 64-byte line of every input per step:
// the loads of all k inputs are in flight together, where a pass per input waits on one
// stream at a time (the inputs are lines other cores wrote a moment before).
template <class T, class Op>
void fused_many(char* res, char* out, const char* const* v, int k, size_t n, bool stream) {
  // A line of 64 bytes as four 16-byte GCC vectors: the same element operation per lane
  // (Min/Max's select, wrapping integer arithmetic), so the result matches the scalar kernels
  // bit for bit. An 8-bit product wraps in its 8-bit lane, as Prod8's truncation does.
  using V [[gnu::vector_size(16)]] = T;
  using VOp = std::conditional_t<std::is_same_v<Op, Prod8>, Prod, Op>;
  constexpr size_t K = 64 / sizeof(T), KV = 16 / sizeof(T);
  auto load = [](const T* p) {
    V x;
    std::memcpy(&x, p, 16);
    return x;
  };
  const T* in[kManyMax];
  for (int q = 0; q < k; ++q) in[q] = reinterpret_cast<const T*>(v[q]);
  T* r = reinterpret_cast<T*>(res);
  T* o = reinterpret_cast<T*>(out);
  size_t i = 0;
  for (; i + K <= n; i += K) {
    V acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = VOp::f(load(in[0] + i + j * KV), load(in[1] + i + j * KV));
    for (int q = 2; q < k; ++q)
      for (int j = 0; j < 4; ++j) acc[j] = VOp::f(acc[j], load(in[q] + i + j * KV));
    std::memcpy(r + i, acc, 64);
    if (o == r) continue;
#if defined(__SSE2__)
    if (stream && !(reinterpret_cast<uintptr_t>(o + i) & 15)) {
      __m128i* d = reinterpret_cast<__m128i*>(o + i);
      for (int j = 0; j < 4; ++j) _mm_stream_si128(d + j, reinterpret_cast<__m128i>(acc[j]));
      continue;
    }
#endif
    std::memcpy(o + i, acc, 64);
  }
  for (; i < n; ++i) {
    T a = Op::f(in[0][i], in[1][i]);
    for (int q = 2; q < k; ++q) a = Op::f(a, in[q][i]);
    r[i] = a;
    o[i] = a;
  }
}

// Both kernels as types, so one dispatch serves them: Kernel<A, Op>::run(args...).
template <class A, class Op>
struct Pair {
  static void run(char* res, char* out, const char* a, const char* b, size_t n, bool stream) {
    fused<A, Op>(res, out, a, b, n, stream);
  }
};
template <class A, class Op>
struct Many {
  static void run(char* res, char* out, const char* const* v, int k, size_t n, bool stream) {
    fused_many<A, Op>(res, out, v, k, n, stream);
  }
};

// Runs Kernel<A, Op> for element type T and op; false when there is no kernel for the pair.
template <template <class, class> class Kernel, class T, class... Args>
bool by_op(RedOp op, Args... args) {
  // Integer sum/prod wrap in the unsigned type (no signed overflow); floats stay as they are.
  using A = typename std::conditional_t<std::is_integral_v<T>, std::make_unsigned<T>, std::common_type<T>>::type;
  switch (op) {
    case RedOp::Sum: Kernel<A, Sum>::run(args...); return true;
    case RedOp::Prod:
      if constexpr (sizeof(T) == 1) Kernel<A, Prod8>::run(args...);
      else Kernel<A, Prod>::run(args...);
      return true;
    case RedOp::Min: Kernel<T, Min>::run(args...); return true;
    case RedOp::Max: Kernel<T, Max>::run(args...); return true;
    default: break;
  }
  if constexpr (std::is_integral_v<T>) {
    switch (op) {
      case RedOp::Band: Kernel<T, Band>::run(args...); return true;
      case RedOp::Bor: Kernel<T, Bor>::run(args...); return true;
      case RedOp::Bxor: Kernel<T, Bxor>::run(args...); return true;
      default: break;
    }
  }
  return false;
}

template <template <class, class> class Kernel, class... Args>
bool by_type(DType t, RedOp op, Args... args) {
  switch (t) {
    case DType::I8: return by_op<Kernel, int8_t>(op, args...);
    case DType::U8: return by_op<Kernel, uint8_t>(op, args...);
    case DType::I32: return by_op<Kernel, int32_t>(op, args...);
    case DType::I64: return by_op<Kernel, int64_t>(op, args...);
    case DType::F32: return by_op<Kernel, float>(op, args...);
    case DType::F64: return by_op<Kernel, double>(op, args...);
    default: return false;
  }
}

}  // namespace

bool reduce_store2(void* res, void* out, const void* a, const void* b, size_t n, DType t, RedOp op, bool stream) {
  if (reinterpret_cast<uintptr_t>(out) % dtype_size(t) || reinterpret_cast<uintptr_t>(res) % dtype_size(t))
    return false;
  return by_type<Pair>(t, op, static_cast<char*>(res), static_cast<char*>(out), static_cast<const char*>(a),
                       static_cast<const char*>(b), n, stream);
}

bool reduce_many_store(void* res, void* out, const char* const* v, int k, size_t n, DType t, RedOp op, bool stream) {
  const size_t es = dtype_size(t);
  if (k < 2 || k > kManyMax || reinterpret_cast<uintptr_t>(out) % es || reinterpret_cast<uintptr_t>(res) % es)
    return false;
  for (int q = 0; q < k; ++q)
    if (reinterpret_cast<uintptr_t>(v[q]) % es) return false;
  return by_type<Many>(t, op, static_cast<char*>(res), static_cast<char*>(out), v, k, n, stream);
}

void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

}  // namespace linkwise
