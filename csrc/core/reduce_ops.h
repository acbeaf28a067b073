// Element operations of the CPU reductions, shared by core/reduce.cc and the shared-memory
// executor's fused kernels (algo/shm_kernels.cc): both must combine elements identically so
// that every path gives bitwise the same result. Callers pass integer sum/prod in the unsigned
// type of the same width (wrap-around, no signed overflow).
#pragma once

#include <type_traits>

namespace linkwise::elem {

// x != x: true for a NaN (per lane for GCC vectors), never for integers.
template <class T>
auto unordered(T x) {
  if constexpr (std::is_integral_v<T>) return false;
  else return x != x;
}

struct Sum { template <class T> static T f(T a, T b) { return a + b; } };
struct Prod { template <class T> static T f(T a, T b) { return a * b; } };
// Min and Max propagate NaN as np.minimum / np.maximum do: a NaN in any input gives NaN
// whatever the order of combination, so every algorithm (and every rank) gets the same.
struct Min { template <class T> static T f(T a, T b) { return (b < a) | unordered(b) ? b : a; } };
struct Max { template <class T> static T f(T a, T b) { return (a < b) | unordered(b) ? b : a; } };
struct Band { template <class T> static T f(T a, T b) { return a & b; } };
struct Bor { template <class T> static T f(T a, T b) { return a | b; } };
struct Bxor { template <class T> static T f(T a, T b) { return a ^ b; } };

}  // namespace linkwise::elem
