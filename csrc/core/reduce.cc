// Reduction kernels: plain loops over __restrict-free pointers with the operation as a
// template functor, so that -O3 vectorises each (type, op) pair. In-place use (out == a) is
// the common case; GCC versions the loop with a runtime alias check, which is fine.
#include "core/reduce.h"

#include <algorithm>
#include <cstring>

#include "core/reduce_ops.h"
#include "core/status.h"

namespace linkwise {

namespace {

using namespace elem;  // the element operations (core/reduce_ops.h)

// Integer sum/prod wrap: do them in the unsigned type of the same width (no UB).
template <class T> struct Unsigned { using type = T; };
template <> struct Unsigned<int8_t> { using type = uint8_t; };
template <> struct Unsigned<int32_t> { using type = uint32_t; };
template <> struct Unsigned<int64_t> { using type = uint64_t; };

template <class T, class Op>
void loop(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::f(x[i], y[i]);
}

template <class T, class Op>
void int_arith(void* out, const void* a, const void* b, size_t n) {
  using U = typename Unsigned<T>::type;
  if constexpr (std::is_same_v<Op, Prod> && sizeof(U) < sizeof(unsigned)) {
    U* o = static_cast<U*>(out);
    const U* x = static_cast<const U*>(a);
    const U* y = static_cast<const U*>(b);
    for (size_t i = 0; i < n; ++i) o[i] = static_cast<U>(static_cast<unsigned>(x[i]) * static_cast<unsigned>(y[i]));
  } else {
    loop<U, Op>(out, a, b, n);
  }
}

// Half precision <-> float32 with integer bit operations only (vectorisable, no F16C needed).
inline float h2f(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7fffu;
  // Normal and subnormal: scale the 15-bit exponent/mantissa into float32 and multiply by
  // 2^112 (exact: subnormal halves become normal floats). Inf/NaN: force the float exponent.
  uint32_t bits = em << 13;
  float f;
  std::memcpy(&f, &bits, 4);
  f *= 5.192296858534828e+33f;  // 2^112
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (em >= 0x7c00u) u = 0x7f800000u | (em & 0x3ffu) << 13;
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f2h(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  uint16_t r;
  if (a > 0x7f800000u) {
    r = static_cast<uint16_t>(0x7e00u | ((a >> 13) & 0x3ffu));  // NaN stays NaN (quiet)
  } else if (a >= 0x477ff000u) {
    r = 0x7c00u;  // rounds to infinity (>= 65520)
  } else if (a < 0x38800000u) {
    // Subnormal half (or zero): add 0.5 to let the FPU round the mantissa to nearest-even.
    float g;
    std::memcpy(&g, &a, 4);
    g += 0.5f;
    uint32_t v;
    std::memcpy(&v, &g, 4);
    r = static_cast<uint16_t>(v - 0x3f000000u);
  } else {
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest-even
    r = static_cast<uint16_t>(a >> 13);
  }
  return static_cast<uint16_t>(r | sign);
}

template <class Op>
void half_loop(void* out, const void* a, const void* b, size_t n, bool bf16) {
  uint16_t* o = static_cast<uint16_t*>(out);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  if (bf16) {
    for (size_t i = 0; i < n; ++i) o[i] = float_to_bf16(Op::f(bf16_to_float(x[i]), bf16_to_float(y[i])));
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = f2h(Op::f(h2f(x[i]), h2f(y[i])));
  }
}

template <class T>
void dispatch_int(void* out, const void* a, const void* b, size_t n, RedOp op) {
  switch (op) {
    case RedOp::Sum: case RedOp::Avg: return int_arith<T, Sum>(out, a, b, n);
    case RedOp::Prod: return int_arith<T, Prod>(out, a, b, n);
    case RedOp::Min: return loop<T, Min>(out, a, b, n);
    case RedOp::Max: return loop<T, Max>(out, a, b, n);
    case RedOp::Band: return loop<T, Band>(out, a, b, n);
    case RedOp::Bor: return loop<T, Bor>(out, a, b, n);
    case RedOp::Bxor: return loop<T, Bxor>(out, a, b, n);
    default: break;
  }
  LW_CHECK(false, "reduction op in range");
}

template <class T>
void dispatch_float(void* out, const void* a, const void* b, size_t n, RedOp op) {
  switch (op) {
    case RedOp::Sum: case RedOp::Avg: return loop<T, Sum>(out, a, b, n);
    case RedOp::Prod: return loop<T, Prod>(out, a, b, n);
    case RedOp::Min: return loop<T, Min>(out, a, b, n);
    case RedOp::Max: return loop<T, Max>(out, a, b, n);
    default: break;
  }
  throw Error(ErrorKind::Type, std::string("reduction op ") + redop_str(op) +
                                   " is for integer arrays only; use sum, prod, min, max or avg on floats");
}

void dispatch_half(void* out, const void* a, const void* b, size_t n, RedOp op, bool bf16) {
  switch (op) {
    case RedOp::Sum: case RedOp::Avg: return half_loop<Sum>(out, a, b, n, bf16);
    case RedOp::Prod: return half_loop<Prod>(out, a, b, n, bf16);
    case RedOp::Min: return half_loop<Min>(out, a, b, n, bf16);
    case RedOp::Max: return half_loop<Max>(out, a, b, n, bf16);
    default: break;
  }
  dispatch_float<float>(out, a, b, 0, op);  // throws the float error
}

template <class T>
void div_int(void* buf, size_t n, int d) {
  T* p = static_cast<T*>(buf);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(d));
}

}  // namespace

float half_to_float(uint16_t h) { return h2f(h); }
uint16_t float_to_half(float f) { return f2h(f); }

size_t dtype_size(DType t) {
  static const size_t sizes[] = {1, 1, 4, 8, 2, 2, 4, 8};
  return sizes[static_cast<int>(t)];
}

const char* dtype_str(DType t) {
  static const char* names[] = {"int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64"};
  return names[static_cast<int>(t)];
}

const char* redop_str(RedOp op) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
  return names[static_cast<int>(op)];
}

bool dtype_is_float(DType t) { return t == DType::F16 || t == DType::BF16 || t == DType::F32 || t == DType::F64; }

void reduce3(void* out, const void* a, const void* b, size_t n, DType t, RedOp op) {
  if (n == 0) return;
  switch (t) {
    case DType::I8: return dispatch_int<int8_t>(out, a, b, n, op);
    case DType::U8: return dispatch_int<uint8_t>(out, a, b, n, op);
    case DType::I32: return dispatch_int<int32_t>(out, a, b, n, op);
    case DType::I64: return dispatch_int<int64_t>(out, a, b, n, op);
    case DType::F16: return dispatch_half(out, a, b, n, op, false);
    case DType::BF16: return dispatch_half(out, a, b, n, op, true);
    case DType::F32: return dispatch_float<float>(out, a, b, n, op);
    case DType::F64: return dispatch_float<double>(out, a, b, n, op);
    default: break;
  }
  LW_CHECK(false, "dtype in range");
}

void avg_finish(void* buf, size_t n, DType t, int d) {
  if (d == 1 || n == 0) return;
  switch (t) {
    case DType::I8: return div_int<int8_t>(buf, n, d);
    case DType::U8: return div_int<uint8_t>(buf, n, d);
    case DType::I32: return div_int<int32_t>(buf, n, d);
    case DType::I64: return div_int<int64_t>(buf, n, d);
    case DType::F32: {
      float* p = static_cast<float*>(buf);
      const float inv = static_cast<float>(d);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / inv;
      return;
    }
    case DType::F64: {
      double* p = static_cast<double*>(buf);
      const double inv = static_cast<double>(d);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / inv;
      return;
    }
    case DType::F16: case DType::BF16: {
      uint16_t* p = static_cast<uint16_t*>(buf);
      const float dv = static_cast<float>(d);
      if (t == DType::BF16)
        for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / dv);
      else
        for (size_t i = 0; i < n; ++i) p[i] = f2h(h2f(p[i]) / dv);
      return;
    }
    default: break;
  }
  LW_CHECK(false, "dtype in range");
}

}  // namespace linkwise
