// The argument tests of the shared-memory executor's latency entries (bind_shm_fast.cc,
// bind_shm_fast_blocks.cc), made natively because each test in Python cost 25-60 ns of a
// ~1 us call. Every test here reads only what every rank shares for a correct program (the
// array type, dtype, op, root, sizes), so ranks decline alike. The GIL is held throughout.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>

#include <utility>

#include "bindings/buffer.h"
#include "core/status.h"

namespace linkwise::fast {

// The calling communicator's `timeout` (seconds).
double comm_timeout(nanobind::handle comm);

// comm._skip_call(): a collective refused on this rank numbers its call as if it had run, as
// the general path's refusals do (collectives._skips_on_argument_error). An error it raises
// is reported as unraisable (the refusal's own error is the one to see).
void skip_call(nanobind::handle comm);

// Runs an entry's body; where it throws what Python sees as ValueError or TypeError (the
// argument checks: read-only or non-contiguous arrays, an out of another size), calls
// skip_call(comm) first. Other failures (the executor's: a peer gone, a timeout) stop the
// communicator's collectives anyway; so does the executor's mismatch, a ValueError numbered
// here as a refusal too, harmlessly (it stopped the executor from that call first, so
// ShmColl::skip_call publishes nothing, and the engine, aborted, sends no refusal notice).
// The GIL is held where it catches.
template <class F>
nanobind::object refusing(nanobind::handle comm, F&& body) {
  try {
    return body();
  } catch (const nanobind::builtin_exception& e) {
    if (e.type() == nanobind::exception_type::value_error || e.type() == nanobind::exception_type::type_error)
      skip_call(comm);
    throw;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Invalid || e.kind() == ErrorKind::Type) skip_call(comm);
    throw;
  } catch (nanobind::python_error& e) {
    if (e.matches(PyExc_ValueError) || e.matches(PyExc_TypeError)) skip_call(comm);
    throw;
  }
}

// The entries' "not served here: take the general path" (NotImplemented).
nanobind::object declined();

// True while LINKWISE_ALGO or LINKWISE_CHECK is in the environment, set to anything (even
// empty): the general path honours them, so the entries decline. Two lookups in os.environ's
// own dict (bytes keys on POSIX, what os.environ[...] = ... updates), ~20 ns; false before
// enable(). or_chunk_size: LINKWISE_CHUNK_SIZE too (the one-rank entries, bind_solo.cc, leave
// such calls to the general path, which parses it on every call).
bool general_path_forced(bool or_chunk_size = false);

// An entry's body run as refusing() runs it, unless general_path_forced() (then declined()).
template <class F>
nanobind::object serving(nanobind::handle comm, F&& body) {
  if (general_path_forced()) return declined();
  return refusing(comm, std::forward<F>(body));
}

// Imports NumPy's C API and finds os.environ's dict (idempotent). Until then every entry
// declines (is_array is false).
void enable();

// x is exactly a numpy.ndarray (no subclass), once enable() ran.
bool is_array(nanobind::handle x);

// One item of a buffer format as NumPy's dtype kinds see it: 'b' (bool), 'i', 'u', 'f', 'c';
// 0 for anything else (records, sub-arrays, strings, pointers). `native`: native byte order.
struct Item {
  char kind = 0;
  bool native = true;
};
Item classify(const Py_buffer& v);

// The same item (kind, byte order, size) in both buffers, and one NumPy moves as it is.
bool same_moved_item(const Py_buffer& a, const Py_buffer& b);

// The executor's DType of a buffer (linkwise's dtypes but bfloat16, which NumPy does not
// export), or -1.
int reduce_dtype(const Py_buffer& v);

// The RedOp named by op (an exact str), or -1.
int op_code(nanobind::handle op);

// dtype * 8 + op for a reduction of v with op, or -1 where the executor has none (bitwise
// ops on integers only).
int reduction_code(const Py_buffer& v, nanobind::handle op);

// root as an exact int in [0, size), or -1 (declined: the general path explains).
int root_of(nanobind::handle root, int size);

// Elements of the exported buffer.
inline Py_ssize_t elements(const Py_buffer& v) { return v.itemsize ? v.len / v.itemsize : 0; }

// An array made for a call's output: new, C-contiguous, writable, of x's dtype, uninitialised
// (as numpy.empty); `data`/`bytes` are its memory, owned by `array`.
struct NewArray {
  nanobind::object array;
  void* data = nullptr;
  size_t bytes = 0;
};

// The NewArray for x (an exact ndarray, exported as v): `size` stacked arrays of x's shape
// (all_gather, gather: a shape (k, m) gives (size * k, m), a 0-d one (size,)), or one rank's
// block of x split into `size` (reduce_scatter, scatter: along the first axis where it
// divides, else flat). The same shapes as _coll_args.gathered_shape / block_shape.
NewArray new_gathered(nanobind::handle x, const Py_buffer& v, int size);
NewArray new_block(nanobind::handle x, const Py_buffer& v, int size);

}  // namespace linkwise::fast
