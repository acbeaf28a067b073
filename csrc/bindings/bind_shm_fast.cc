// The latency entries of the shared-memory executor: all_reduce_fast, reduce_fast and
// broadcast_fast take the Python layer's arguments as they come and make natively the tests
// that the Python fast paths made (collectives.py): an exact NumPy array, a dtype and op the
// executor serves, a root in range, an out of the same dtype and size. Each test in Python
// cost 25-60 ns, ~0.3 us of a ~1.1 us 8-byte broadcast on the 2-core VM. What they do not
// serve they decline by returning NotImplemented (never a collective's result), before
// touching any shared state, so the caller takes the general path; the decision depends only
// on what every rank shares for a correct program (type, dtype, op, root, size), so all ranks
// decline alike. Argument errors of served calls (read-only or non-contiguous arrays, an out
// of another size) raise ValueError with the general path's messages, as the executor's
// plain entries do.
#include <nanobind/nanobind.h>

#include <cstring>

#include "bindings/buffer.h"
#include "bindings/shm_coll_py.h"

namespace nb = nanobind;

namespace linkwise {

namespace {

// numpy.ndarray, set once by set_fast_array_type (a strong reference, never dropped: the
// module lives as long as the interpreter). Null: every fast entry declines.
PyTypeObject* g_ndarray = nullptr;

bool is_array(nb::handle h) { return g_ndarray && Py_TYPE(h.ptr()) == g_ndarray; }

nb::object declined() { return nb::borrow(Py_NotImplemented); }

// One item of a buffer format as NumPy's dtype kinds see it: 'b' (bool), 'i', 'u', 'f', 'c';
// 0 for anything else (records, sub-arrays, strings, pointers). `native`: native byte order.
struct Item {
  char kind = 0;
  bool native = true;
};

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

// The executor's DType of a buffer (linkwise's dtypes but bfloat16, which NumPy does not
// export), or -1.
int reduce_dtype(const Py_buffer& v) {
  const Item it = classify(v);
  if (!it.native) return -1;
  const Py_ssize_t size = v.itemsize;
  if (it.kind == 'i') return size == 1 ? int(DType::I8) : size == 4 ? int(DType::I32) : size == 8 ? int(DType::I64) : -1;
  if (it.kind == 'u') return size == 1 ? int(DType::U8) : -1;
  if (it.kind == 'f') return size == 2 ? int(DType::F16) : size == 4 ? int(DType::F32) : size == 8 ? int(DType::F64) : -1;
  return -1;
}

// The RedOp named by op (a str), or -1.
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

bool bitwise_op(int op) { return op >= static_cast<int>(RedOp::Band); }
bool integer_dtype(int t) { return t == int(DType::I8) || t == int(DType::U8) || t == int(DType::I32) || t == int(DType::I64); }

nb::object all_reduce_fast(PyShmColl& s, nb::handle x, nb::handle op, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  const int oc = op_code(op);
  if (oc < 0) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const int t = reduce_dtype(hx.view);
  if (t < 0 || (bitwise_op(oc) && !integer_dtype(t))) return declined();
  const bool in_place = out.is_none() || out.is(x);
  check_buffer(hx, in_place, "all_reduce", true);
  shm_all_reduce(s, hx, in_place ? nb::handle() : out, t * 8 + oc, timeout);
  return nb::borrow(out.is_none() ? x : out);
}

// The root argument as an int in [0, size), or -1 (declined: the general path explains).
int root_of(PyShmColl& s, nb::handle root) {
  if (!PyLong_CheckExact(root.ptr())) return -1;
  const long r = PyLong_AsLong(root.ptr());
  if (r == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return r >= 0 && r < s.shm_.size() ? static_cast<int>(r) : -1;
}

nb::object reduce_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle op, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  const int rt = root_of(s, root), oc = op_code(op);
  if (rt < 0 || oc < 0) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const int t = reduce_dtype(hx.view);
  if (t < 0 || (bitwise_op(oc) && !integer_dtype(t))) return declined();
  // out is checked on every rank (only the root writes it): the same dtype and size as x, and
  // writable; anything else the general path explains.
  if (!out.is_none() && !out.is(x)) {
    HeldBuffer ho;
    if (!try_export_buffer(out, ho) || reduce_dtype(ho.view) != t || ho.bytes() != hx.bytes() || ho.view.readonly)
      return declined();
  }
  const bool mine = s.shm_.rank() == rt, in_place = mine && (out.is_none() || out.is(x));
  check_buffer(hx, in_place, "reduce", true);
  shm_reduce(s, hx, in_place, mine && !in_place ? out : nb::handle(), t * 8 + oc, rt, timeout);
  return nb::borrow(out.is_none() ? x : out);
}

nb::object broadcast_fast(PyShmColl& s, nb::handle x, nb::handle root, nb::handle out, double timeout) {
  if (!is_array(x) || !(out.is_none() || is_array(out))) return declined();
  const int rt = root_of(s, root);
  if (rt < 0) return declined();
  HeldBuffer hx;
  if (!try_export_buffer(x, hx)) return declined();
  const Item ix = classify(hx.view);
  if (!ix.kind || hx.bytes() >= s.fast_bcast_max) return declined();
  if (out.is_none() || out.is(x)) {
    check_buffer(hx, true, "broadcast", true);
    shm_broadcast(s, hx, nullptr, rt, timeout);
    return nb::borrow(x);
  }
  // out= : the root's x is the source, out the destination on every rank.
  HeldBuffer ho;
  if (!try_export_buffer(out, ho)) return declined();
  const Item io = classify(ho.view);
  if (io.kind != ix.kind || io.native != ix.native || ho.view.itemsize != hx.view.itemsize || ho.bytes() != hx.bytes())
    return declined();  // the general path says what differs
  check_buffer(ho, true, "broadcast", true);
  if (s.shm_.rank() == rt) {
    check_buffer(hx, false, "broadcast", true);
    shm_broadcast(s, ho, &hx, rt, timeout);
  } else {
    hx.release();
    shm_broadcast(s, ho, nullptr, rt, timeout);
  }
  return nb::borrow(out);
}

}  // namespace

void bind_shm_fast(nb::class_<PyShmColl>& cls) {
  cls.def_static(
         "set_fast_array_type",
         [](nb::handle type) {
           if (!PyType_Check(type.ptr())) throw nb::type_error("set_fast_array_type: expected a type");
           if (g_ndarray) return;
           Py_INCREF(type.ptr());
           g_ndarray = reinterpret_cast<PyTypeObject*>(type.ptr());
         },
         nb::arg("type"), "The array type the fast entries serve (numpy.ndarray; set once).")
      .def_rw("fast_bcast_max", &PyShmColl::fast_bcast_max,
              "broadcast_fast declines broadcasts of at least this many bytes.")
      .def("all_reduce_fast", &all_reduce_fast, nb::arg("x"), nb::arg("op"), nb::arg("out").none(),
           nb::arg("timeout"),
           "all_reduce of a NumPy array (in place, or into out), or NotImplemented where it does not serve it.")
      .def("reduce_fast", &reduce_fast, nb::arg("x"), nb::arg("root"), nb::arg("op"), nb::arg("out").none(),
           nb::arg("timeout"),
           "reduce of a NumPy array onto root (into x, or out, on the root), or NotImplemented where it does "
           "not serve it.")
      .def("broadcast_fast", &broadcast_fast, nb::arg("x"), nb::arg("root"), nb::arg("out").none(),
           nb::arg("timeout"),
           "broadcast of a NumPy array (in place, or from the root's x into out), or NotImplemented where it "
           "does not serve it.");
}

}  // namespace linkwise
