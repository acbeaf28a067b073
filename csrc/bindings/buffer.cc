#include "bindings/buffer.h"

#include <string>

#include "p2p/engine.h"

namespace nb = nanobind;

namespace linkwise {

uint32_t HeldBuffer::dtype() const { return dtype_code(view.format, static_cast<size_t>(view.itemsize)); }

namespace {

// True when a buffer format (struct module syntax) has Python object items ('O'), outside the
// field names of a structured type (written between colons). Their bytes are pointers into
// this process: another process that used them would crash.
bool holds_objects(const char* format) {
  bool in_name = false;
  for (const char* c = format ? format : ""; *c; ++c) {
    if (*c == ':') in_name = !in_name;
    else if (!in_name && *c == 'O') return true;
  }
  return false;
}

}  // namespace

bool try_export_buffer(nb::handle obj, HeldBuffer& out) {
  if (PyObject_GetBuffer(obj.ptr(), &out.view, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    return false;
  }
  out.held = true;
  if (holds_objects(out.view.format)) {
    out.release();
    return false;
  }
  return true;
}

void acquire_buffer(nb::handle obj, bool writable, const char* op, HeldBuffer& out, bool c_order) {
  if (PyObject_GetBuffer(obj.ptr(), &out.view, PyBUF_RECORDS_RO) != 0) {
    // Say why the export failed (NumPy refuses datetime64, for one): the object may well be
    // an array.
    std::string why;
    PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
    PyErr_Fetch(&type, &value, &trace);
    if (value) {
      if (PyObject* text = PyObject_Str(value)) {
        if (const char* utf8 = PyUnicode_AsUTF8(text)) why = std::string(" (its buffer export failed: ") + utf8 + ")";
        Py_DECREF(text);
      }
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    PyErr_Clear();
    throw nb::type_error((std::string(op) + ": expected an array with the buffer protocol or __dlpack__, got " +
                          std::string(nb::type_name(obj.type()).c_str()) + why)
                             .c_str());
  }
  out.held = true;
  if (holds_objects(out.view.format)) {
    out.release();
    throw nb::type_error((std::string(op) + ": the array holds Python objects (dtype object), whose bytes are "
                                            "pointers into this process; send numbers, or pickle the objects "
                                            "into a byte array first")
                             .c_str());
  }
  check_buffer(out, writable, op, c_order);
}

void check_buffer(HeldBuffer& out, bool writable, const char* op, bool c_order) {
  if (writable && out.view.readonly) {
    out.release();
    throw nb::value_error((std::string(op) + ": the array to write into is read-only; pass a writable array "
                                             "(for NumPy: x.copy() or x.setflags(write=True))")
                              .c_str());
  }
  if (c_order && !PyBuffer_IsContiguous(&out.view, 'C')) {
    out.release();
    throw nb::value_error(
        (std::string(op) + ": the array is not C-contiguous; pass np.ascontiguousarray(x) (or torch's x.contiguous())")
            .c_str());
  }
  if (!PyBuffer_IsContiguous(&out.view, 'A')) {
    out.release();
    throw nb::value_error((std::string(op) + ": the array is not contiguous; pass np.ascontiguousarray(x) "
                                             "(or torch's x.contiguous())")
                              .c_str());
  }
}

void hold(nanobind::handle x, nanobind::handle out, HeldBuffer& hx, HeldBuffer& ho, const void*& s, size_t& sb, void*& r,
          size_t& rb) {
  if (!x.is_none()) {
    acquire_buffer(x, false, "collective input", hx, true);
    s = hx.ptr();
    sb = hx.bytes();
  }
  if (!out.is_none()) {
    acquire_buffer(out, true, "collective output", ho, true);
    r = ho.ptr();
    rb = ho.bytes();
  }
}

}  // namespace linkwise
