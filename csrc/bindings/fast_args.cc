// The latency entries' argument tests (fast_args.h).
#include "bindings/fast_args.h"

#include <cstring>

#include "algo/coll.h"

namespace nb = nanobind;

namespace linkwise::fast {

namespace {
PyTypeObject* g_array_type = nullptr;  // numpy.ndarray
PyObject* g_empty = nullptr;           // numpy.empty
PyObject* g_dtype_name = nullptr;      // "dtype", interned

bool integer_dtype(int t) { return t == int(DType::I8) || t == int(DType::U8) || t == int(DType::I32) || t == int(DType::I64); }

// numpy.empty(shape, x.dtype); steals shape.
nb::object new_array(nb::handle x, PyObject* shape) {
  nb::object owned_shape = nb::steal(shape);
  if (!shape) throw nb::python_error();
  nb::object dtype = nb::steal(PyObject_GetAttr(x.ptr(), g_dtype_name));
  if (!dtype.is_valid()) throw nb::python_error();
  PyObject* args[] = {shape, dtype.ptr()};
  PyObject* a = PyObject_Vectorcall(g_empty, args, 2, nullptr);
  if (!a) throw nb::python_error();
  return nb::steal(a);
}

// A tuple of n items whose first is `first` and the rest v's shape[1:].
PyObject* shape_with_first(const Py_buffer& v, Py_ssize_t first) {
  const int n = v.ndim > 0 ? v.ndim : 1;
  PyObject* t = PyTuple_New(n);
  if (!t) return nullptr;
  for (int i = 0; i < n; ++i) {
    PyObject* d = PyLong_FromSsize_t(i == 0 ? first : v.shape[i]);
    if (!d) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, i, d);
  }
  return t;
}
}  // namespace

void set_array_type(nb::handle type, nb::handle empty) {
  if (!PyType_Check(type.ptr()) || !PyCallable_Check(empty.ptr()))
    throw nb::type_error("set_fast_array_type: expected an array type and the function that makes one");
  if (g_array_type) return;
  g_dtype_name = PyUnicode_InternFromString("dtype");
  if (!g_dtype_name) throw nb::python_error();
  Py_INCREF(empty.ptr());
  g_empty = empty.ptr();
  Py_INCREF(type.ptr());
  g_array_type = reinterpret_cast<PyTypeObject*>(type.ptr());
}

bool is_array(nb::handle x) { return g_array_type && Py_TYPE(x.ptr()) == g_array_type; }

nb::object declined() { return nb::borrow(Py_NotImplemented); }

Item classify(const Py_buffer& v) {
  Item it;
  const char* f = v.format ? v.format : "B";
  if (*f == '@' || *f == '=') {
    ++f;
  } else if (*f == '<' || *f == '>' || *f == '!') {
    it.native = (*f == '<') == (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__);
    ++f;
  }
  const bool complex = *f == 'Z';
  if (complex) ++f;
  const char c = *f;
  if (!c || f[1]) return it;  // no item, or more than one character
  if (complex) {
    if (std::strchr("fdg", c)) it.kind = 'c';
  } else if (c == '?') {
    it.kind = 'b';
  } else if (std::strchr("bhilqn", c)) {
    it.kind = 'i';
  } else if (std::strchr("BHILQN", c)) {
    it.kind = 'u';
  } else if (std::strchr("efdg", c)) {
    it.kind = 'f';
  }
  return it;
}

bool same_moved_item(const Py_buffer& a, const Py_buffer& b) {
  const Item ia = classify(a), ib = classify(b);
  return ia.kind && ia.kind == ib.kind && ia.native == ib.native && a.itemsize == b.itemsize;
}

int reduce_dtype(const Py_buffer& v) {
  const Item it = classify(v);
  if (!it.native) return -1;
  const Py_ssize_t size = v.itemsize;
  if (it.kind == 'i') return size == 1 ? int(DType::I8) : size == 4 ? int(DType::I32) : size == 8 ? int(DType::I64) : -1;
  if (it.kind == 'u') return size == 1 ? int(DType::U8) : -1;
  if (it.kind == 'f') return size == 2 ? int(DType::F16) : size == 4 ? int(DType::F32) : size == 8 ? int(DType::F64) : -1;
  return -1;
}

int op_code(nb::handle op) {
  static const char* const kNames[] = {"sum", "prod", "min", "max", "avg", "band", "bor", "bxor"};
  static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(RedOp::kCount), "one name per op");
  if (!PyUnicode_CheckExact(op.ptr())) return -1;
  const char* name = PyUnicode_AsUTF8(op.ptr());
  if (!name) {
    PyErr_Clear();
    return -1;
  }
  for (int i = 0; i < static_cast<int>(RedOp::kCount); ++i)
    if (std::strcmp(name, kNames[i]) == 0) return i;
  return -1;
}

int reduction_code(const Py_buffer& v, nb::handle op) {
  const int oc = op_code(op), t = reduce_dtype(v);
  if (oc < 0 || t < 0 || (oc >= static_cast<int>(RedOp::Band) && !integer_dtype(t))) return -1;
  return t * 8 + oc;
}

int root_of(nb::handle root, int size) {
  if (!PyLong_CheckExact(root.ptr())) return -1;
  const long r = PyLong_AsLong(root.ptr());
  if (r == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return r >= 0 && r < size ? static_cast<int>(r) : -1;
}

nb::object new_gathered(nb::handle x, const Py_buffer& v, int size) {
  return new_array(x, shape_with_first(v, size * (v.ndim > 0 ? v.shape[0] : 1)));
}

nb::object new_block(nb::handle x, const Py_buffer& v, int size) {
  if (v.ndim > 0 && v.shape[0] % size == 0) return new_array(x, shape_with_first(v, v.shape[0] / size));
  return new_array(x, Py_BuildValue("(n)", elements(v) / size));
}

}  // namespace linkwise::fast
