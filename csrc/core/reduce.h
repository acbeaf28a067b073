// Element-wise reduction kernels for the CPU collectives.
//
// Contract: reduce3(out, a, b, n) writes out[i] = a[i] OP b[i] for i < n. `out` may alias `a`
// or `b` exactly (in-place), but must not partially overlap either. Float16 and bfloat16 are
// widened to float32, combined, and rounded back to nearest-even, so one combination of two
// values gives the same bits on every rank. Bitwise ops exist for integer types only (the
// Python layer rejects them for floats). Integer sum/prod wrap around (two's complement).
//
// Threading: pure functions, no state; safe from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace linkwise {

enum class DType : int { I8 = 0, U8, I32, I64, F16, BF16, F32, F64, kCount };
enum class RedOp : int { Sum = 0, Prod, Min, Max, Avg, Band, Bor, Bxor, kCount };

size_t dtype_size(DType t);
const char* dtype_str(DType t);
const char* redop_str(RedOp op);
bool dtype_is_float(DType t);

// out = a OP b, element-wise over n elements of type t. Avg combines as Sum (see avg_finish).
void reduce3(void* out, const void* a, const void* b, size_t n, DType t, RedOp op);
// dst = dst OP src.
inline void reduce_into(void* dst, const void* src, size_t n, DType t, RedOp op) { reduce3(dst, dst, src, n, t, op); }
// Finishes an Avg: buf[i] = buf[i] / divisor (integers truncate toward zero).
void avg_finish(void* buf, size_t n, DType t, int divisor);

// Scalar conversions (exposed for tests and for reference code).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace linkwise
