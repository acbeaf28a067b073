#include "bindings/buffer.h"

#include <string>

#include "p2p/engine.h"

namespace nb = nanobind;

namespace linkwise {

uint32_t HeldBuffer::dtype() const { return dtype_code(view.format, static_cast<size_t>(view.itemsize)); }

void acquire_buffer(nb::handle obj, bool writable, const char* op, HeldBuffer& out, bool c_order) {
  if (PyObject_GetBuffer(obj.ptr(), &out.view, PyBUF_RECORDS_RO) != 0) {
    PyErr_Clear();
    throw nb::type_error((std::string(op) + ": expected an array with the buffer protocol or __dlpack__, got " +
                          std::string(nb::type_name(obj.type()).c_str()))
                             .c_str());
  }
  out.held = true;
  if (writable && out.view.readonly) {
    out.release();
    throw nb::value_error((std::string(op) + ": the array to write into is read-only; pass a writable array "
                                             "(for NumPy: x.copy() or x.setflags(write=True))")
                              .c_str());
  }
  if (c_order && !PyBuffer_IsContiguous(&out.view, 'C')) {
    out.release();
    throw nb::value_error((std::string(op) + ": the array is not C-contiguous; pass np.ascontiguousarray(x)").c_str());
  }
  if (!PyBuffer_IsContiguous(&out.view, 'A')) {
    out.release();
    throw nb::value_error((std::string(op) + ": the array is not contiguous; pass np.ascontiguousarray(x) "
                                             "(or torch's x.contiguous())")
                              .c_str());
  }
}

}  // namespace linkwise
