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
// c_order: C-contiguous only (the Python layer's rule too), what every collective and
// point-to-point call asks: a Fortran-order array's bytes are its elements in another order
// than a C-order receiver's (they arrived transposed), and the latency paths must refuse what
// the general ones do.
void acquire_buffer(nanobind::handle obj, bool writable, const char* op, HeldBuffer& out, bool c_order = false);

// acquire_buffer in two steps, for callers that decide from the format whether they serve the
// object at all (bind_shm_fast.cc): the export alone, false (no Python error set, nothing
// held) where obj has no buffer or holds Python objects; then acquire_buffer's checks of an
// exported buffer (ValueError; the buffer is released when one fails).
bool try_export_buffer(nanobind::handle obj, HeldBuffer& out);
void check_buffer(HeldBuffer& out, bool writable, const char* op, bool c_order);

// The collectives' pair: acquires x (read) and out (write), C-contiguous; either may be None
// (left as it was). Sets send/send_bytes and recv/recv_bytes from what it acquired.
void hold(nanobind::handle x, nanobind::handle out, HeldBuffer& hx, HeldBuffer& ho, const void*& send,
          size_t& send_bytes, void*& recv, size_t& recv_bytes);

// hold() for one call's scope: the buffers stay acquired while the object lives.
struct HeldPair {
  HeldBuffer hx, ho;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t send_bytes = 0, recv_bytes = 0;
  HeldPair(nanobind::handle x, nanobind::handle out) { hold(x, out, hx, ho, send, send_bytes, recv, recv_bytes); }
};

}  // namespace linkwise
