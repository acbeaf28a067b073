// Buffers from Python objects, through the buffer protocol.
//
// Contract: a HeldBuffer keeps the exporter's buffer acquired until it is released, which
// needs the GIL. Objects that only speak __dlpack__ are converted on the Python side.
#pragma once

#include <Python.h>
#include <nanobind/nanobind.h>

#include <cstdint>

namespace linkwise {

struct HeldBuffer {
  Py_buffer view{};
  bool held = false;
  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  ~HeldBuffer() { release(); }
  void release() {
    if (held) PyBuffer_Release(&view);
    held = false;
  }
  void* ptr() const { return view.buf; }
  size_t bytes() const { return static_cast<size_t>(view.len); }
  uint32_t dtype() const;
};

// Acquires obj's buffer. Raises TypeError when obj has no buffer protocol (the Python side
// then tries __dlpack__), ValueError when it is not contiguous or, for `writable`, read-only.
// c_order: the collectives' rule (the same as the Python layer's): C-contiguous only, so that
// a Fortran-order array is refused on every path, not accepted by the latency paths alone.
void acquire_buffer(nanobind::handle obj, bool writable, const char* op, HeldBuffer& out, bool c_order = false);

}  // namespace linkwise
