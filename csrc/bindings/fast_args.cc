// The latency entries' argument tests (fast_args.h).
#include "bindings/fast_args.h"

// The NumPy C API, in this file only (its function table is static to it, filled by
// enable()): numpy.empty through Python cost ~280 ns and the new array's first buffer
// export ~190 ns more (NumPy builds its format string then), of a ~1.2 us all_gather.
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <cstring>

#include "algo/coll.h"

namespace nb = nanobind;

namespace linkwise::fast {

namespace {
PyTypeObject* g_array_type = nullptr;  // numpy.ndarray, once enable() imported NumPy's C API
PyObject* g_timeout_name = nullptr;    // "timeout", interned
PyObject* g_skip_name = nullptr;       // "_skip_call", interned
PyObject* g_environ = nullptr;         // os.environ._data (a dict; a strong reference, kept for good)
PyObject* g_algo_key = nullptr;        // os.environ._data's keys for LINKWISE_ALGO and LINKWISE_CHECK
PyObject* g_check_key = nullptr;
PyObject* g_chunk_key = nullptr;       // ... and for LINKWISE_CHUNK_SIZE

bool integer_dtype(int t) { return t == int(DType::I8) || t == int(DType::U8) || t == int(DType::I32) || t == int(DType::I64); }

// A new C-ordered array of x's dtype (x: an exact ndarray) with dims[0..nd).
NewArray new_array(nb::handle x, int nd, const npy_intp* dims) {
  PyArray_Descr* descr = PyArray_DESCR(reinterpret_cast<PyArrayObject*>(x.ptr()));
  Py_INCREF(descr);  // stolen by PyArray_NewFromDescr, also when it fails
  PyObject* a = PyArray_NewFromDescr(&PyArray_Type, descr, nd, const_cast<npy_intp*>(dims), nullptr, nullptr, 0,
                                     nullptr);
  if (!a) throw nb::python_error();
  auto* arr = reinterpret_cast<PyArrayObject*>(a);
  return {nb::steal(a), PyArray_DATA(arr), static_cast<size_t>(PyArray_NBYTES(arr))};
}

// v's shape with its first extent replaced (a 0-d v: the one extent `first`).
NewArray new_with_first(nb::handle x, const Py_buffer& v, Py_ssize_t first) {
  npy_intp dims[NPY_MAXDIMS];
  const int nd = v.ndim > 0 ? v.ndim : 1;
  if (nd > NPY_MAXDIMS) throw nb::value_error("too many dimensions");
  dims[0] = first;
  for (int i = 1; i < nd; ++i) dims[i] = v.shape[i];
  return new_array(x, nd, dims);
}
}  // namespace

void enable() {
  if (g_array_type) return;
  if (_import_array() < 0) throw nb::python_error();  // also NumPy 1.x's headers
  g_timeout_name = PyUnicode_InternFromString("timeout");
  g_skip_name = PyUnicode_InternFromString("_skip_call");
  if (!g_timeout_name || !g_skip_name) throw nb::python_error();
  // os.environ keeps its variables in _data, keyed by os.environ.encodekey(name) (bytes on
  // POSIX); the keys are made by that same function, so the lookups match what it stores.
  nb::object environ = nb::module_::import_("os").attr("environ");
  g_algo_key = environ.attr("encodekey")("LINKWISE_ALGO").release().ptr();
  g_check_key = environ.attr("encodekey")("LINKWISE_CHECK").release().ptr();
  g_chunk_key = environ.attr("encodekey")("LINKWISE_CHUNK_SIZE").release().ptr();
  g_environ = nb::object(environ.attr("_data")).release().ptr();
  if (!PyDict_Check(g_environ)) throw nb::type_error("os.environ._data is not a dict");
  g_array_type = &PyArray_Type;
}

bool general_path_forced(bool or_chunk_size) {
  if (!g_environ) return false;
  const int algo = PyDict_Contains(g_environ, g_algo_key);
  const int check = algo == 0 ? PyDict_Contains(g_environ, g_check_key) : 0;
  const int chunk = or_chunk_size && algo == 0 && check == 0 ? PyDict_Contains(g_environ, g_chunk_key) : 0;
  if (algo < 0 || check < 0 || chunk < 0) throw nb::python_error();
  return algo > 0 || check > 0 || chunk > 0;
}

double comm_timeout(nb::handle comm) {
  if (!g_timeout_name) throw nb::type_error("the fast entries serve nothing before enable_fast_entries()");
  nb::object t = nb::steal(PyObject_GetAttr(comm.ptr(), g_timeout_name));
  if (!t.is_valid()) throw nb::python_error();
  const double v = PyFloat_AsDouble(t.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw nb::python_error();
  return v;
}

void skip_call(nb::handle comm) {
  if (!g_skip_name) return;  // no entry served anything yet (enable() not called)
  PyObject* r = PyObject_CallMethodNoArgs(comm.ptr(), g_skip_name);
  if (r) Py_DECREF(r);
  else PyErr_WriteUnraisable(comm.ptr());
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

NewArray new_gathered(nb::handle x, const Py_buffer& v, int size) {
  return new_with_first(x, v, size * (v.ndim > 0 ? v.shape[0] : 1));
}

NewArray new_block(nb::handle x, const Py_buffer& v, int size) {
  if (v.ndim > 0 && v.shape[0] % size == 0) return new_with_first(x, v, v.shape[0] / size);
  const npy_intp flat = elements(v) / size;
  return new_array(x, 1, &flat);
}

}  // namespace linkwise::fast
