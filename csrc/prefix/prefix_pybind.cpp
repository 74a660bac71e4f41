// kvcache._C._PrefixTree: the prefix cache called straight from Python, without torch's
// custom-class machinery. A call through torch.classes costs ~3.5 us before the tree does anything
// (boxing the arguments, matching the schema, wrapping the results), several times a match of a
// 2k-token prompt. Here the hot methods are CPython vectorcall functions of a plain CPython type
// (~25 ns a call, where a pybind11 dispatch costs ~185 ns), and the cost left is the results'.
//
// Both front ends share one RadixTree: torch.classes.kvcache.PrefixCache publishes its tree under an
// id (PrefixCache.core_id()) and _PrefixTree(id) holds it. kvcache.PrefixCache uses this path for
// match / insert (single and ragged), lock, unlock and evict.
//
// Ids come in as 1-D CPU tensors (int32 read in place, int64 range-checked into a copy), buffers of
// 32- or 64-bit integers (numpy arrays, array.array) or sequences of ints. Reading a tensor needs
// only the layout of torch's Python tensor object (THPVariable, header-only).
//
// Results go out as CPU tensors made here and wrapped by THPVariable_Wrap, as torch's own bindings
// do: ~0.5 us per tensor, most of a call. match_into(tokens, out) writes the blocks into a tensor of
// the caller's instead (a row of its block table), which costs no tensor.
//
// The GIL is released around the tree's work (other Python threads run meanwhile; the tree locks
// internally), except in a short match: when the tree's mutex is free it runs at once with the GIL
// held (try_match_*), since releasing and retaking the GIL costs about as much as the match; when
// not, the GIL is released before waiting, so nobody waits for the tree while holding the GIL.
// Namespaces arrive as a str, a kvcache.Namespace (its .key) or None (the default namespace).
// Errors have the messages and Python types of the torch class's: TypeError (dtypes), ValueError
// (shapes, bad values), IndexError (unknown ids, stale handles), RuntimeError "out of blocks".
#include "prefix/prefix_pybind.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <c10/core/InferenceMode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include "core/strcat.h"
#include "prefix/radix_tree.h"

namespace py = pybind11;

namespace kvcache {
namespace {

// ---- the registry of published trees ------------------------------------------------------------

struct Registry {
  std::mutex mu;
  std::unordered_map<int64_t, std::weak_ptr<prefix::RadixTree>> trees;
  int64_t last_id = 0;
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: torch objects may outlive static destructors
  return *r;
}

// ---- Python objects used by every call ----------------------------------------------------------

/// Looked up once, when the module is imported (not lazily: a first call racing another thread
/// through an import could deadlock on the GIL); kept for good, like the module.
PyTypeObject* tensor_type = nullptr;  // torch._C.TensorBase: every tensor is laid out as a THPVariable

void look_up_torch_objects() {
  const py::module_ c = py::module_::import("torch._C");
  tensor_type = reinterpret_cast<PyTypeObject*>(py::object(c.attr("TensorBase")).release().ptr());
}

/// A new CPU tensor for the tree to fill (no GIL needed).
template <class T>
at::TensorBase new_tensor(int64_t n) {
  return at::detail::empty_cpu({n}, c10::CppTypeToScalarType<T>::value);
}

/// The Python tensor of `t` (same storage).
py::object to_python(const at::TensorBase& t) {
  PyObject* r = THPVariable_Wrap(t);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

template <class T>
py::object tensor_of(const std::vector<T>& v) {
  at::TensorBase t = new_tensor<T>(static_cast<int64_t>(v.size()));
  if (!v.empty()) std::memcpy(t.mutable_data_ptr(), v.data(), v.size() * sizeof(T));
  return to_python(t);
}

// ---- ids from Python -----------------------------------------------------------------------------

/// A 1-D array of integers from Python as T (int32_t: token or block ids; int64_t: offsets), read in
/// place when the object holds contiguous T, else converted into a range-checked copy. `what` names
/// the ids in dtype errors ("token ids"), or is null.
template <class T>
class IdArray {
 public:
  IdArray(py::handle obj, const char* name, const char* what) : name_(name), what_(what) {
    if (PyObject_TypeCheck(obj.ptr(), tensor_type)) {
      from_tensor(THPVariable_Unpack(obj.ptr()));
    } else if (PyObject_CheckBuffer(obj.ptr()) && PyObject_GetBuffer(obj.ptr(), &buffer_.view, PyBUF_RECORDS_RO) == 0) {
      from_buffer(buffer_.view);
    } else {
      PyErr_Clear();  // a buffer that refused the request is read as a sequence
      from_sequence(obj);
    }
  }
  IdArray(const IdArray&) = delete;
  IdArray& operator=(const IdArray&) = delete;

  const T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  [[noreturn]] void bad_dtype(const std::string& has) const {
    throw py::type_error(cat(name_, " must have dtype int32 or int64", what_ ? cat(" (", what_, ")") : std::string(),
                             " but has ", has));
  }

  template <class S>
  void convert(const S* src, int64_t stride) {
    copy_.resize(static_cast<size_t>(size_));
    for (int64_t i = 0; i < size_; ++i) {
      const S v = src[i * stride];
      if constexpr (sizeof(S) > sizeof(T)) {
        if (v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
          throw py::index_error(cat(name_, "[", i, "] = ", v, " does not fit in int", 8 * sizeof(T)));
        }
      }
      copy_[static_cast<size_t>(i)] = static_cast<T>(v);
    }
    data_ = copy_.data();
  }

  template <class S>
  void read(const S* src, int64_t stride) {
    if (std::is_same_v<S, T> && (stride == 1 || size_ <= 1)) {
      data_ = reinterpret_cast<const T*>(src);
    } else {
      convert(src, stride);
    }
  }

  void from_tensor(const at::Tensor& t) {
    const at::ScalarType dtype = t.scalar_type();
    if (dtype != at::kInt && dtype != at::kLong) bad_dtype(c10::toString(dtype));
    if (t.device().type() != c10::DeviceType::CPU || t.layout() != c10::kStrided) {
      std::ostringstream device;
      device << t.device();
      throw py::value_error(cat(name_, " must be a CPU tensor but is on ", device.str()));
    }
    if (t.dim() != 1) {
      std::ostringstream shape;
      shape << t.sizes();
      throw py::value_error(cat(name_, " must be a 1-D tensor but has shape ", shape.str()));
    }
    size_ = t.size(0);
    if (dtype == at::kInt) {
      read(t.const_data_ptr<int32_t>(), t.stride(0));
    } else {
      read(t.const_data_ptr<int64_t>(), t.stride(0));
    }
  }

  void from_buffer(const Py_buffer& view) {
    std::string_view format(view.format ? view.format : "B");
    if (!format.empty() && (format[0] == '@' || format[0] == '=' || format[0] == '<')) format.remove_prefix(1);
    const bool integer = format == "i" || format == "l" || format == "q";
    if (!integer || (view.itemsize != 4 && view.itemsize != 8)) bad_dtype(cat("format '", view.format, "'"));
    if (view.ndim != 1) {
      std::string shape = "[";
      for (int d = 0; d < view.ndim; ++d) shape += cat(d ? ", " : "", view.shape[d]);
      throw py::value_error(cat(name_, " must be a 1-D array but has shape ", shape, "]"));
    }
    size_ = view.shape[0];
    const int64_t stride = view.strides ? view.strides[0] : view.itemsize;
    if (stride % view.itemsize != 0) throw py::value_error(cat(name_, " has a stride that is not a whole element"));
    if (view.itemsize == 4) {
      read(static_cast<const int32_t*>(view.buf), stride / 4);
    } else {
      read(static_cast<const int64_t*>(view.buf), stride / 8);
    }
  }

  void from_sequence(py::handle obj) {
    const auto bad = [&] {
      PyErr_Clear();
      return py::type_error(cat(name_, " must be a 1-D tensor or a sequence of ints, got ", Py_TYPE(obj.ptr())->tp_name));
    };
    PyObject* seq = PySequence_Fast(obj.ptr(), "");
    if (!seq) throw bad();
    const py::object keep = py::reinterpret_steal<py::object>(seq);
    size_ = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    copy_.resize(static_cast<size_t>(size_));
    for (int64_t i = 0; i < size_; ++i) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
      if (v == -1 && PyErr_Occurred()) {  // not an int: name the element, not only the container
        PyErr_Clear();
        throw py::type_error(cat(name_, " must be a 1-D tensor or a sequence of ints, got an element ",
                                 py::repr(items[i]).cast<std::string>(), " (", Py_TYPE(items[i])->tp_name, ") at [",
                                 i, "]"));
      }
      if (overflow || v < std::numeric_limits<T>::min() || v > std::numeric_limits<T>::max()) {
        throw py::index_error(cat(name_, "[", i, "] = ", py::str(items[i]).cast<std::string>(), " does not fit in int",
                                  8 * sizeof(T)));
      }
      copy_[static_cast<size_t>(i)] = static_cast<T>(v);
    }
    data_ = copy_.data();
  }

  // A member, so that the buffer is released even when the constructor throws.
  struct Buffer {
    Py_buffer view{};
    ~Buffer() {
      if (view.obj) PyBuffer_Release(&view);
    }
  };

  const char* name_;
  const char* what_;
  Buffer buffer_;
  std::vector<T> copy_;
  const T* data_ = nullptr;
  int64_t size_ = 0;
};

/// Offsets [batch + 1] of a ragged batch (int32 or int64); their values are checked by the tree.
struct Offsets : IdArray<int64_t> {
  Offsets(py::handle obj, const char* name) : IdArray<int64_t>(obj, name, nullptr) {
    if (size() < 1) throw py::value_error(cat(name, " must have batch + 1 >= 1 entries"));
  }
  int64_t batch() const { return size() - 1; }
};

/// The tree's key of a namespace argument: a str is the key itself; an instance of `ns_type`
/// (kvcache.Namespace, if given) has it as `.key`; None is `default_key`. Resolving it here spares
/// the Python wrapper a frame per call.
std::string_view namespace_key(py::handle ns, PyObject* ns_type, PyObject* key_name, PyObject* default_key) {
  PyObject* key = ns.ptr();
  if (key == Py_None && default_key) {
    key = default_key;
  } else if (!PyUnicode_Check(key) && ns_type && PyObject_TypeCheck(key, reinterpret_cast<PyTypeObject*>(ns_type))) {
    key = PyObject_GetAttr(key, key_name);  // borrowed below: the Namespace (frozen) keeps its key alive
    if (!key) throw py::error_already_set();
    Py_DECREF(key);
  }
  Py_ssize_t n = 0;
  const char* s = PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &n) : nullptr;
  if (!s) {
    PyErr_Clear();
    throw py::type_error(cat("namespace must be a kvcache.Namespace or a str, got ", Py_TYPE(ns.ptr())->tp_name));
  }
  return {s, static_cast<size_t>(n)};
}

// ---- results --------------------------------------------------------------------------------------

/// The class results are made as: a tuple subclass without fields of its own (a NamedTuple such as
/// kvcache.Match) with `arity` fields, or None for plain tuples.
PyTypeObject* result_type(py::handle cls, const char* what, Py_ssize_t arity) {
  if (cls.is_none()) return nullptr;
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  const bool ok = PyType_Check(cls.ptr()) && PyType_IsSubtype(type, &PyTuple_Type) &&
                  type->tp_basicsize == PyTuple_Type.tp_basicsize && type->tp_itemsize == PyTuple_Type.tp_itemsize &&
                  py::hasattr(cls, "_fields") && py::len(cls.attr("_fields")) == static_cast<size_t>(arity);
  if (!ok) throw py::type_error(cat(what, " must be a NamedTuple class with ", arity, " fields, or None"));
  cls.inc_ref();  // kept as long as the process: these are module-level classes
  return type;
}

/// (items...) as an instance of `type`, or a plain tuple for null. Filled in place, as tuple.__new__
/// does for a subclass, without the argument tuples of a call: a NamedTuple's own __new__ is Python
/// code (~150 ns, a tenth of a match).
template <class... Items>
py::object as_result(PyTypeObject* type, Items&&... items) {
  PyObject* objs[] = {py::object(std::forward<Items>(items)).release().ptr()...};
  constexpr Py_ssize_t n = sizeof...(Items);
  PyObject* r = type ? type->tp_alloc(type, n) : PyTuple_New(n);
  if (!r) {
    for (PyObject* o : objs) Py_DECREF(o);
    throw py::error_already_set();
  }
  for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(r, i, objs[i]);  // steals the references
  return py::reinterpret_steal<py::object>(r);
}

/// Calls up to this many tokens run with the GIL held when the tree is free (try_match_*): releasing
/// and retaking it costs about as much as matching a few thousand tokens. Longer calls release it.
constexpr int64_t kShortCall = int64_t{1} << 16;

// ---- the caller's tensors ----------------------------------------------------------------------------

/// A tensor of the caller's that a call writes into (a block table, or one of its rows): a plain
/// strided CPU tensor of T with `dims` dimensions and any strides, writable here (an inference tensor
/// only inside torch.inference_mode()). Checked before the tree is touched, so a bad one changes
/// nothing; never resized, so a long match cannot spill into a neighbouring row.
template <class T>
class OutTensor {
 public:
  /// `name` names the argument in errors, `what` its contents ("block ids").
  OutTensor(py::handle obj, const char* name, const char* what, int64_t dims) : obj_(obj) {
    if (!PyObject_TypeCheck(obj.ptr(), tensor_type)) {
      throw py::type_error(cat(name, " must be a torch.Tensor, got ", Py_TYPE(obj.ptr())->tp_name));
    }
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    impl_ = t.unsafeGetTensorImpl();
    constexpr at::ScalarType dtype = c10::CppTypeToScalarType<T>::value;
    if (t.scalar_type() != dtype) {
      throw py::type_error(cat(name, " must have dtype int", 8 * sizeof(T), " (", what, ") but has ",
                               c10::toString(t.scalar_type())));
    }
    // A plain TensorImpl with storage: subclasses (functional, batched, nested, Python) hold no real data.
    const bool plain = typeid(*impl_) == typeid(c10::TensorImpl) && impl_->has_storage() &&
                       !impl_->key_set().has(c10::DispatchKey::Python);
    if (t.device().type() != c10::DeviceType::CPU || t.layout() != c10::kStrided || !plain) {
      std::ostringstream device;
      device << t.device();
      throw py::value_error(cat(name, " must be a plain strided CPU tensor but is on ", device.str()));
    }
    if (t.dim() != dims) {
      std::ostringstream shape;
      shape << t.sizes();
      throw py::value_error(cat(name, " must be a ", dims, "-D tensor but has shape ", shape.str()));
    }
    if (impl_->is_inference() && !c10::InferenceMode::is_enabled()) {
      throw py::value_error(cat(name, " is an inference tensor, which cannot be written outside torch.inference_mode()"));
    }
    data_ = t.mutable_data_ptr<T>();
    for (int64_t d = 0; d < dims; ++d) {
      sizes_[d] = t.size(d);
      strides_[d] = t.stride(d);
    }
    dims_ = dims;
  }

  int64_t size(int64_t d) const { return sizes_[d]; }
  /// The element at [i] (1-D) or [i, j] (2-D).
  T& at(int64_t i, int64_t j = 0) const { return data_[i * strides_[0] + j * strides_[1]]; }
  /// The first n entries of row i (of a 2-D tensor; of the tensor itself if 1-D) = values[0, n)
  void write_row(int64_t i, const T* values, int64_t n) const {
    T* row = &at(dims_ == 1 ? 0 : i);
    const int64_t stride = strides_[dims_ - 1];
    if (stride == 1) {
      if (n) std::memcpy(row, values, static_cast<size_t>(n) * sizeof(T));
    } else {
      for (int64_t k = 0; k < n; ++k) row[k * stride] = values[k];
    }
  }
  /// Whether this tensor's elements and `other`'s may share bytes (their spans overlap).
  template <class U>
  bool overlaps(const OutTensor<U>& other) const {
    const auto [a0, a1] = span();
    const auto [b0, b1] = other.span();
    return a0 < b1 && b0 < a1;
  }
  std::pair<uintptr_t, uintptr_t> span() const {
    uintptr_t last = 0;
    for (int64_t d = 0; d < dims_; ++d) {
      if (sizes_[d] == 0) return {0, 0};
      last += static_cast<uintptr_t>((sizes_[d] - 1) * strides_[d]);
    }
    const auto first = reinterpret_cast<uintptr_t>(data_);
    return {first, first + (last + 1) * sizeof(T)};
  }
  /// Marks an in-place write (autograd's version counter), as torch's own in-place ops do.
  void bump_version() const { impl_->bump_version(); }
  /// The Python tensor (a new reference).
  py::object object() const { return py::reinterpret_borrow<py::object>(obj_); }

 private:
  py::handle obj_;
  c10::TensorImpl* impl_ = nullptr;
  T* data_ = nullptr;
  int64_t sizes_[2] = {0, 0}, strides_[2] = {0, 0}, dims_ = 1;
};

/// `out` of match_into: a 1-D int32 tensor (any stride, e.g. a row of a [batch, max_blocks] block
/// table) whose first entries receive the matched blocks; the rest is left as it was.
class OutRow : public OutTensor<int32_t> {
 public:
  OutRow(py::handle obj, int64_t max_ids, int64_t num_tokens, int64_t page)
      : OutTensor<int32_t>(obj, "out", "block ids", 1) {
    if (size(0) < max_ids) {
      throw py::value_error(cat("out has ", size(0), " entries but a match of ", num_tokens, " tokens may need ",
                                max_ids, " (ceil(", num_tokens, " / ", page, "))"));
    }
  }

  /// out[0, n) = ids[0, n)
  void write(const int32_t* ids, int64_t n) const {
    write_row(0, ids, n);
    if (n) bump_version();
  }
};

// ---- the calling convention --------------------------------------------------------------------------
// The hot methods are CPython vectorcall methods (METH_FASTCALL | METH_KEYWORDS) of a plain CPython
// type, not pybind11 functions: pybind11's dispatcher costs ~160 ns a call more (measured on Zen 3),
// a quarter of a whole match into a caller's tensor.

/// A method's parameters, all positional-or-keyword; the first `required` must be given.
struct Signature {
  const char* method;
  std::vector<const char*> names;
  size_t required;
  std::vector<PyObject*> interned = {};  // the names as interned str (kept for good), compared by address first
};

/// Binds a vectorcall's arguments to `sig`'s parameters (absent optional ones stay null), with
/// Python's own errors for too many, unknown, repeated or missing arguments.
template <size_t N>
std::array<PyObject*, N> bind(Signature& sig, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  std::array<PyObject*, N> out{};
  if (sig.interned.empty()) {
    for (const char* n : sig.names) {  // first call, under the GIL
      PyObject* name = PyUnicode_InternFromString(n);
      if (!name) throw py::error_already_set();
      sig.interned.push_back(name);
    }
  }
  if (nargs > static_cast<Py_ssize_t>(N)) {
    throw py::type_error(cat(sig.method, "() takes at most ", N, " arguments (", nargs, " given)"));
  }
  for (Py_ssize_t i = 0; i < nargs; ++i) out[static_cast<size_t>(i)] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    size_t i = 0;
    while (i < N && sig.interned[i] != name) ++i;
    if (i == N) {  // not interned the same way: compare the text
      for (i = 0; i < N && PyUnicode_Compare(sig.interned[i], name) != 0; ++i) {
      }
      if (PyErr_Occurred()) PyErr_Clear();
    }
    if (i == N) {
      throw py::type_error(cat(sig.method, "() got an unexpected keyword argument '", py::str(name).cast<std::string>(), "'"));
    }
    if (out[i]) throw py::type_error(cat(sig.method, "() got multiple values for argument '", sig.names[i], "'"));
    out[i] = args[nargs + k];
  }
  for (size_t i = 0; i < sig.required; ++i) {
    if (!out[i]) throw py::type_error(cat(sig.method, "() missing required argument '", sig.names[i], "'"));
  }
  return out;
}

bool truthy(PyObject* obj) {
  if (!obj) return false;
  const int r = PyObject_IsTrue(obj);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

int64_t as_int64(PyObject* obj, const Signature& sig, size_t arg) {
  if (!PyLong_Check(obj)) {
    throw py::type_error(cat(sig.method, "() argument '", sig.names[arg], "' must be int, not ", Py_TYPE(obj)->tp_name));
  }
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

/// Runs a method body, turning C++ exceptions into Python's as pybind11 would: the messages and
/// types of the torch class's errors (IndexError, ValueError, TypeError, RuntimeError "out of blocks").
template <class F>
PyObject* guarded(F&& body) noexcept {
  try {
    return body().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {  // prefix::OutOfBlocks among them
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in kvcache._C._PrefixTree");
  }
  return nullptr;
}

// ---- the fast path --------------------------------------------------------------------------------

class PrefixTree {
 public:
  PrefixTree(int64_t id, py::handle match_type, py::handle insert_type, py::handle ragged_type, py::handle ns_type,
             py::handle default_ns, py::handle into_type, py::handle ragged_into_type)
      : match_type_(result_type(match_type, "match_type", 3)),
        insert_type_(result_type(insert_type, "insert_type", 2)),
        ragged_type_(result_type(ragged_type, "ragged_match_type", 4)),
        into_type_(result_type(into_type, "match_into_type", 2)),
        ragged_into_type_(result_type(ragged_into_type, "ragged_match_into_type", 2)),
        key_name_(py::reinterpret_steal<py::object>(PyUnicode_InternFromString("key"))) {
    Registry& r = registry();
    {
      std::lock_guard<std::mutex> g(r.mu);
      auto it = r.trees.find(id);
      if (it != r.trees.end()) tree_ = it->second.lock();
    }
    if (!tree_) throw py::value_error(cat("core_id = ", id, " names no live torch.classes.kvcache.PrefixCache"));
    if (!ns_type.is_none()) {
      if (!PyType_Check(ns_type.ptr())) throw py::type_error("namespace_type must be a class, or None");
      ns_type_ = py::reinterpret_borrow<py::object>(ns_type);
    }
    if (!default_ns.is_none()) {
      default_key_ = py::reinterpret_borrow<py::object>(default_ns);
      namespace_key(default_ns, ns_type_.ptr(), key_name_.ptr(), nullptr);  // checked once, here
      if (!PyUnicode_Check(default_key_.ptr())) default_key_ = default_ns.attr("key");
    }
  }

  // match(tokens, namespace=None, lock=False)
  //   -> (matched tokens, blocks [ceil(length / page_size)] int32 tensor, node handle)
  py::object match(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"match", {"tokens", "namespace", "lock"}, 1};
    const auto a = bind<3>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const std::string_view key = resolve(a[1]);
    thread_local std::vector<int32_t> blocks;  // reused: no allocation per call
    int64_t node = 0;
    const int64_t length = match_blocks(t, key, truthy(a[2]), &blocks, &node);
    return as_result(match_type_, py::int_(length), tensor_of(blocks), py::int_(node));
  }

  // cached_length(tokens, namespace=None) -> the tokens match() would find, with nothing changed (no recency,
  // no counters, no host load)
  py::object cached_length(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"cached_length", {"tokens", "namespace"}, 1};
    const auto a = bind<2>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const std::string_view key = resolve(a[1]);
    int64_t length = 0;
    {
      py::gil_scoped_release nogil;
      length = tree_->cached_length(key, t.data(), t.size());
    }
    return py::int_(length);
  }

  // match_into(tokens, out, namespace=None, lock=False) -> (matched tokens, node handle), the blocks
  // written to out[0, ceil(length / page_size)): the same match with no tensor made (~0.5 us less)
  py::object match_into(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"match_into", {"tokens", "out", "namespace", "lock"}, 2};
    const auto a = bind<4>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const int64_t page = tree_->page_size();
    OutRow out(a[1], (t.size() + page - 1) / page, t.size(), page);
    const std::string_view key = resolve(a[2]);
    thread_local std::vector<int32_t> blocks;
    int64_t node = 0;
    const int64_t length = match_blocks(t, key, truthy(a[3]), &blocks, &node);
    out.write(blocks.data(), static_cast<int64_t>(blocks.size()));
    return as_result(into_type_, py::int_(length), py::int_(node));
  }

  // insert(tokens, blocks, namespace=None, lock=False) -> (tokens that were already cached, node handle)
  py::object insert(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"insert", {"tokens", "blocks", "namespace", "lock"}, 2};
    const auto a = bind<4>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const IdArray<int32_t> b(a[1], "blocks", "block ids");
    const std::string_view key = resolve(a[2]);
    const bool lock = truthy(a[3]);
    prefix::InsertResult r;
    {
      py::gil_scoped_release nogil;
      r = tree_->insert(key, t.data(), t.size(), b.data(), b.size(), lock);
    }
    return as_result(insert_type_, py::int_(r.prefix_length), py::int_(r.node));
  }

  // match_ragged(tokens, cu_lens, namespace=None, lock=False)
  //   -> (lengths [batch] int64, blocks [sum of pages] int32, cu_blocks [batch + 1] int64, nodes [batch] int64)
  py::object match_ragged(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"match_ragged", {"tokens", "cu_lens", "namespace", "lock"}, 2};
    const auto a = bind<4>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const Offsets cu(a[1], "cu_lens");
    const std::string_view key = resolve(a[2]);
    const bool lock = truthy(a[3]);
    at::TensorBase lengths = new_tensor<int64_t>(cu.batch()), cu_blocks = new_tensor<int64_t>(cu.batch() + 1);
    at::TensorBase nodes = new_tensor<int64_t>(cu.batch());
    thread_local std::vector<int32_t> blocks;
    blocks.clear();
    const prefix::Ragged ragged{t.data(), t.size(), cu.data(), cu.batch()};
    int64_t* out[] = {lengths.mutable_data_ptr<int64_t>(), cu_blocks.mutable_data_ptr<int64_t>(),
                      nodes.mutable_data_ptr<int64_t>()};
    if (t.size() > kShortCall || !tree_->try_match_ragged(key, ragged, lock, out[0], &blocks, out[1], out[2])) {
      py::gil_scoped_release nogil;
      tree_->match_ragged(key, ragged, lock, out[0], &blocks, out[1], out[2]);
    }
    return as_result(ragged_type_, to_python(lengths), tensor_of(blocks), to_python(cu_blocks), to_python(nodes));
  }

  // match_ragged_into(tokens, cu_lens, out, namespace=None, lock=False, lengths=None, nodes=None)
  //   -> (lengths [batch] int64, nodes [batch] int64): match_ragged, sequence i's blocks written to the first
  //   entries of row i of out (a [batch, >= its pages] int32 block table, any strides); lengths and nodes
  //   written to the given [batch] int64 tensors, or to new ones. Everything is checked before the match.
  py::object match_ragged_into(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"match_ragged_into", {"tokens", "cu_lens", "out", "namespace", "lock", "lengths", "nodes"}, 3};
    const auto a = bind<7>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const Offsets cu(a[1], "cu_lens");
    const int64_t batch = cu.batch(), page = tree_->page_size();
    const prefix::Ragged ragged{t.data(), t.size(), cu.data(), batch};
    prefix::check_ragged(ragged, "cu_lens", "len(tokens)");
    const OutTensor<int32_t> out(a[2], "out", "block ids", 2);
    if (out.size(0) != batch) {
      throw py::value_error(cat("out has ", out.size(0), " rows but the batch has ", batch, " sequences"));
    }
    for (int64_t i = 0; i < batch; ++i) {
      const int64_t n = ragged.length(i), need = (n + page - 1) / page;
      if (out.size(1) < need) {
        throw py::value_error(cat("out has ", out.size(1), " columns but sequence ", i, " has ", n,
                                  " tokens, whose match may need ", need, " (ceil(", n, " / ", page, "))"));
      }
    }
    std::optional<OutTensor<int64_t>> given[2];  // lengths, nodes
    const char* names[2] = {"lengths", "nodes"};
    const char* whats[2] = {"matched tokens", "node handles"};
    for (int k = 0; k < 2; ++k) {
      PyObject* obj = a[5 + k];
      if (!obj || obj == Py_None) continue;
      given[k].emplace(obj, names[k], whats[k], 1);
      if (given[k]->size(0) != batch) {
        throw py::value_error(cat(names[k], " has ", given[k]->size(0), " entries but the batch has ", batch, " sequences"));
      }
      if (given[k]->overlaps(out)) throw py::value_error(cat(names[k], " and out overlap in memory"));
    }
    if (given[0] && given[1] && given[0]->overlaps(*given[1])) throw py::value_error("lengths and nodes overlap in memory");
    const std::string_view key = resolve(a[3]);
    const bool lock = truthy(a[4]);
    // Results not given are made before the match: nothing after it can fail with the tree changed (locks taken).
    at::TensorBase fresh[2];
    for (int k = 0; k < 2; ++k) {
      if (!given[k]) fresh[k] = new_tensor<int64_t>(batch);
    }
    thread_local std::vector<int32_t> blocks;
    thread_local std::vector<int64_t> scratch;  // lengths [batch], cu_blocks [batch + 1], nodes [batch]
    blocks.clear();
    scratch.resize(static_cast<size_t>(3 * batch + 1));
    int64_t *lengths = scratch.data(), *cu_blocks = lengths + batch, *nodes = cu_blocks + batch + 1;
    if (t.size() > kShortCall || !tree_->try_match_ragged(key, ragged, lock, lengths, &blocks, cu_blocks, nodes)) {
      py::gil_scoped_release nogil;
      tree_->match_ragged(key, ragged, lock, lengths, &blocks, cu_blocks, nodes);
    }
    for (int64_t i = 0; i < batch; ++i) out.write_row(i, blocks.data() + cu_blocks[i], cu_blocks[i + 1] - cu_blocks[i]);
    if (!blocks.empty()) out.bump_version();
    py::object results[2];
    const int64_t* values[2] = {lengths, nodes};
    for (int k = 0; k < 2; ++k) {
      if (given[k]) {
        for (int64_t i = 0; i < batch; ++i) given[k]->at(i) = values[k][i];
        if (batch) given[k]->bump_version();
        results[k] = given[k]->object();
      } else {
        if (batch) std::memcpy(fresh[k].mutable_data_ptr<int64_t>(), values[k], static_cast<size_t>(batch) * sizeof(int64_t));
        results[k] = to_python(fresh[k]);
      }
    }
    return as_result(ragged_into_type_, std::move(results[0]), std::move(results[1]));
  }

  // insert_ragged(tokens, cu_lens, blocks, cu_blocks, namespace=None, lock=False)
  //   -> (prefix lengths [batch] int64, nodes [batch] int64); every sequence is checked before the first is inserted
  py::object insert_ragged(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"insert_ragged", {"tokens", "cu_lens", "blocks", "cu_blocks", "namespace", "lock"}, 4};
    const auto a = bind<6>(sig, args, nargs, kwnames);
    const IdArray<int32_t> t(a[0], "tokens", "token ids");
    const Offsets cu(a[1], "cu_lens");
    const IdArray<int32_t> b(a[2], "blocks", "block ids");
    const Offsets cub(a[3], "cu_blocks");
    const std::string_view key = resolve(a[4]);
    const bool lock = truthy(a[5]);
    at::TensorBase prefix_lengths = new_tensor<int64_t>(cu.batch()), nodes = new_tensor<int64_t>(cu.batch());
    {
      py::gil_scoped_release nogil;
      tree_->insert_ragged(key, prefix::Ragged{t.data(), t.size(), cu.data(), cu.batch()},
                           prefix::Ragged{b.data(), b.size(), cub.data(), cub.batch()}, lock,
                           prefix_lengths.mutable_data_ptr<int64_t>(), nodes.mutable_data_ptr<int64_t>());
    }
    return as_result(nullptr, to_python(prefix_lengths), to_python(nodes));
  }

  // evict(num_blocks) -> device blocks freed
  py::object evict(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    static Signature sig{"evict", {"num_blocks"}, 1};
    const int64_t n = as_int64(bind<1>(sig, args, nargs, kwnames)[0], sig, 0);
    int64_t freed = 0;
    {
      py::gil_scoped_release nogil;
      freed = tree_->evict(n);
    }
    return py::int_(freed);
  }

  // lock(node) / unlock(node)
  py::object lock(PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, bool unlock) {
    static Signature lock_sig{"lock", {"node"}, 1}, unlock_sig{"unlock", {"node"}, 1};
    Signature& sig = unlock ? unlock_sig : lock_sig;
    const int64_t node = as_int64(bind<1>(sig, args, nargs, kwnames)[0], sig, 0);
    {
      py::gil_scoped_release nogil;
      unlock ? tree_->unlock(node) : tree_->lock(node);
    }
    return py::none();
  }

 private:
  /// The match itself, into `*blocks` (cleared first): at once with the GIL held when the tree is free
  /// and the call short, else with the GIL released.
  int64_t match_blocks(const IdArray<int32_t>& t, std::string_view key, bool lock, std::vector<int32_t>* blocks,
                       int64_t* node) {
    blocks->clear();
    int64_t length = 0;
    if (t.size() > kShortCall || !tree_->try_match_into(key, t.data(), t.size(), lock, blocks, node, &length)) {
      py::gil_scoped_release nogil;
      length = tree_->match_into(key, t.data(), t.size(), lock, blocks, node);
    }
    return length;
  }

  std::string_view resolve(PyObject* ns) const {
    return namespace_key(ns ? ns : Py_None, ns_type_.ptr(), key_name_.ptr(), default_key_.ptr());
  }

  PyTypeObject *match_type_, *insert_type_, *ragged_type_, *into_type_, *ragged_into_type_;
  py::object key_name_, ns_type_, default_key_;  // "key"; kvcache.Namespace and the default's key, or null
  std::shared_ptr<prefix::RadixTree> tree_;
};

// ---- the Python type ------------------------------------------------------------------------------

struct TreeObject {
  PyObject_HEAD
  PrefixTree* tree;  // owned
};

PrefixTree& tree_of(PyObject* self) { return *reinterpret_cast<TreeObject*>(self)->tree; }

template <py::object (PrefixTree::*Method)(PyObject* const*, Py_ssize_t, PyObject*)>
PyObject* method(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] { return (tree_of(self).*Method)(args, nargs, kwnames); });
}

template <bool Unlock>
PyObject* lock_method(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return guarded([&] { return tree_of(self).lock(args, nargs, kwnames, Unlock); });
}

PyObject* tree_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  static const char* names[] = {"core_id", "match_type", "insert_type", "ragged_match_type", "namespace_type",
                                "default_namespace", "match_into_type", "ragged_match_into_type", nullptr};
  long long id = 0;
  PyObject* types[7] = {Py_None, Py_None, Py_None, Py_None, Py_None, Py_None, Py_None};
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|OOOOOOO:_PrefixTree", const_cast<char**>(names), &id, &types[0],
                                   &types[1], &types[2], &types[3], &types[4], &types[5], &types[6])) {
    return nullptr;
  }
  PyObject* self = type->tp_alloc(type, 0);
  if (!self) return nullptr;
  reinterpret_cast<TreeObject*>(self)->tree = nullptr;
  PyObject* ok = guarded([&] {
    reinterpret_cast<TreeObject*>(self)->tree = new PrefixTree(id, types[0], types[1], types[2], types[3], types[4], types[5],
                                                                types[6]);
    return py::none();
  });
  if (!ok) {
    Py_DECREF(self);
    return nullptr;
  }
  Py_DECREF(ok);
  return self;
}

void tree_dealloc(PyObject* self) {
  delete reinterpret_cast<TreeObject*>(self)->tree;
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // instances of heap types hold their type
}

#define KVC_FASTCALL(f) reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(f)), METH_FASTCALL | METH_KEYWORDS
PyMethodDef tree_methods[] = {
    {"match", KVC_FASTCALL(method<&PrefixTree::match>),
     "match($self, /, tokens, namespace=None, lock=False)\n--\n\n(matched tokens, blocks, node)"},
    {"cached_length", KVC_FASTCALL(method<&PrefixTree::cached_length>),
     "cached_length($self, /, tokens, namespace=None)\n--\n\nthe tokens match would find, nothing changed"},
    {"match_into", KVC_FASTCALL(method<&PrefixTree::match_into>),
     "match_into($self, /, tokens, out, namespace=None, lock=False)\n--\n\n"
     "(matched tokens, node); the blocks written to the first entries of out (a 1-D int32 CPU tensor)"},
    {"insert", KVC_FASTCALL(method<&PrefixTree::insert>),
     "insert($self, /, tokens, blocks, namespace=None, lock=False)\n--\n\n(tokens already cached, node)"},
    {"match_ragged", KVC_FASTCALL(method<&PrefixTree::match_ragged>),
     "match_ragged($self, /, tokens, cu_lens, namespace=None, lock=False)\n--\n\n(lengths, blocks, cu_blocks, nodes)"},
    {"match_ragged_into", KVC_FASTCALL(method<&PrefixTree::match_ragged_into>),
     "match_ragged_into($self, /, tokens, cu_lens, out, namespace=None, lock=False, lengths=None, nodes=None)\n--\n\n"
     "(lengths, nodes); sequence i's blocks written to the first entries of out[i] (a 2-D int32 CPU tensor)"},
    {"insert_ragged", KVC_FASTCALL(method<&PrefixTree::insert_ragged>),
     "insert_ragged($self, /, tokens, cu_lens, blocks, cu_blocks, namespace=None, lock=False)\n--\n\n"
     "(prefix lengths, nodes)"},
    {"evict", KVC_FASTCALL(method<&PrefixTree::evict>), "evict($self, /, num_blocks)\n--\n\ndevice blocks freed"},
    {"lock", KVC_FASTCALL(lock_method<false>), "lock($self, /, node)\n--\n\npins the node and its ancestors"},
    {"unlock", KVC_FASTCALL(lock_method<true>), "unlock($self, /, node)\n--\n\nundoes one lock"},
    {nullptr, nullptr, 0, nullptr}};
#undef KVC_FASTCALL

PyType_Slot tree_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(tree_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(tree_dealloc)},
    {Py_tp_methods, tree_methods},
    {Py_tp_doc, const_cast<char*>(
                    "_PrefixTree(core_id, match_type=None, insert_type=None, ragged_match_type=None, "
                    "namespace_type=None, default_namespace=None, match_into_type=None, "
                    "ragged_match_into_type=None)\n--\n\n"
                    "Fast path of a torch.classes.kvcache.PrefixCache's tree (use kvcache.PrefixCache)")},
    {0, nullptr}};

PyType_Spec tree_spec = {"kvcache._C._PrefixTree", sizeof(TreeObject), 0, Py_TPFLAGS_DEFAULT, tree_slots};

}  // namespace

int64_t publish_prefix_tree(std::shared_ptr<prefix::RadixTree> tree) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.trees.emplace(++r.last_id, std::move(tree));
  return r.last_id;
}

void unpublish_prefix_tree(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.trees.erase(id);
}

void register_prefix_pybind(py::module_& m) {
  look_up_torch_objects();
  PyObject* type = PyType_FromSpec(&tree_spec);
  if (!type) throw py::error_already_set();
  m.add_object("_PrefixTree", py::reinterpret_steal<py::object>(type));
}

}  // namespace kvcache
