// Element operations of the CPU reductions, shared by core/reduce.cc and the shared-memory
// executor's fused kernels (algo/shm_kernels.cc): both must combine elements identically so
// that every path gives bitwise the same result. Callers pass integer sum/prod in the unsigned
// type of the same width (wrap-around, no signed overflow).
#pragma once

namespace linkwise::elem {

struct Sum { template <class T> static T f(T a, T b) { return a + b; } };
struct Prod { template <class T> static T f(T a, T b) { return a * b; } };
struct Min { template <class T> static T f(T a, T b) { return b < a ? b : a; } };
struct Max { template <class T> static T f(T a, T b) { return a < b ? b : a; } };
struct Band { template <class T> static T f(T a, T b) { return a & b; } };
struct Bor { template <class T> static T f(T a, T b) { return a | b; } };
struct Bxor { template <class T> static T f(T a, T b) { return a ^ b; } };

}  // namespace linkwise::elem
