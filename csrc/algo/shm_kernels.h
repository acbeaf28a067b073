// Fused reduce-and-store kernels of the shared-memory collectives.
//
// reduce_store2(res, out, a, b, n, t, op, stream) writes res[i] = out[i] = a[i] OP b[i] in
// one pass: the executor keeps `res` (its reduced segment in the shared segment, read by the
// peers) and the caller's `out` from a single computation, instead of reducing into res and
// copying res to out afterwards. With `stream`, out is written with non-temporal stores
// (no read-for-ownership, for big outputs not read again soon); the caller issues one
// _mm_sfence() (stream_fence()) before publishing that the data is there.
// `res` may be `a` exactly and `out` may be `a` or `b` exactly (in place: element i is read
// before it is written); partial overlaps are not allowed, nor out == res.
//
// Returns false, having written nothing, when there is no fused kernel for the pair: float16
// and bfloat16 (their widening dominates), Avg (it divides afterwards), or an out pointer not
// aligned to the element size. The caller then uses reduce3 + copy_out.
// Bitwise contract: the element operations repeat core/reduce.cc's exactly (same functors,
// integer sum/prod wrap in the unsigned type), so a fused result equals reduce3's.
// Threading: pure functions; safe from any thread.
#pragma once

#include <cstddef>

#include "core/reduce.h"

namespace linkwise {

bool reduce_store2(void* res, void* out, const void* a, const void* b, size_t n, DType t, RedOp op, bool stream);

// reduce_many_store(res, out, v, k, n, t, op, stream) writes res[i] = out[i] = v[0][i] OP ...
// OP v[k-1][i] (folded left in input order, bitwise as reduce3 then reduce_into per input),
// reading a line of every input per step. 2 <= k <= kManyMax; `out` may be one of the v[q]
// exactly (each line is read before it is written), `res` none of them; res == out writes
// once. The same element operations and the same false return as reduce_store2.
constexpr int kManyMax = 64;
bool reduce_many_store(void* res, void* out, const char* const* v, int k, size_t n, DType t, RedOp op, bool stream);
void stream_fence();

}  // namespace linkwise
