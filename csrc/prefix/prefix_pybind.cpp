// kvcache._C._PrefixTree: the prefix cache called straight from Python, without torch's
// custom-class machinery. A call through torch.classes costs ~3.5 us before the tree does anything
// (boxing the arguments, matching the schema, wrapping the results), several times a match of a
// 2k-token prompt; here the same call costs a pybind11 dispatch plus one tensor per result.
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
// do. Making them is most of the cost of a call.
//
// The GIL is released around the tree's work (other Python threads run meanwhile; the tree locks
// internally), except in a short match: when the tree's mutex is free it runs at once with the GIL
// held (try_match_*), since releasing and retaking the GIL costs about as much as the match; when
// not, the GIL is released before waiting, so nobody waits for the tree while holding the GIL.
// Namespaces arrive as a str, a kvcache.Namespace (its .key) or None (the default namespace). Errors have the messages and Python types of the torch class's: TypeError (dtypes),
// ValueError (shapes, bad values), IndexError (unknown ids, stale handles), RuntimeError "out of blocks".
#include "prefix/prefix_pybind.h"

#include <ATen/EmptyTensor.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
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
      if (v == -1 && PyErr_Occurred()) throw bad();
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

// ---- the fast path --------------------------------------------------------------------------------

class PrefixTree {
 public:
  PrefixTree(int64_t id, py::handle match_type, py::handle insert_type, py::handle ragged_type, py::handle ns_type,
             py::handle default_ns)
      : match_type_(result_type(match_type, "match_type", 3)),
        insert_type_(result_type(insert_type, "insert_type", 2)),
        ragged_type_(result_type(ragged_type, "ragged_match_type", 4)),
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

  // -> (matched tokens, blocks [ceil(length / page_size)] int32 tensor, node handle)
  py::object match(py::handle tokens, py::handle ns, bool lock) {
    const IdArray<int32_t> t(tokens, "tokens", "token ids");
    const std::string_view key = resolve(ns);
    thread_local std::vector<int32_t> blocks;  // reused: no allocation per call
    blocks.clear();
    int64_t length = 0, node = 0;
    if (t.size() > kShortCall || !tree_->try_match_into(key, t.data(), t.size(), lock, &blocks, &node, &length)) {
      py::gil_scoped_release nogil;
      length = tree_->match_into(key, t.data(), t.size(), lock, &blocks, &node);
    }
    return as_result(match_type_, py::int_(length), tensor_of(blocks), py::int_(node));
  }

  // -> (tokens that were already cached, node handle)
  py::object insert(py::handle tokens, py::handle blocks, py::handle ns, bool lock) {
    const IdArray<int32_t> t(tokens, "tokens", "token ids");
    const IdArray<int32_t> b(blocks, "blocks", "block ids");
    const std::string_view key = resolve(ns);
    prefix::InsertResult r;
    {
      py::gil_scoped_release nogil;
      r = tree_->insert(key, t.data(), t.size(), b.data(), b.size(), lock);
    }
    return as_result(insert_type_, py::int_(r.prefix_length), py::int_(r.node));
  }

  // -> (lengths [batch] int64, blocks [sum of pages] int32, cu_blocks [batch + 1] int64, nodes [batch] int64)
  py::object match_ragged(py::handle tokens, py::handle cu_lens, py::handle ns, bool lock) {
    const IdArray<int32_t> t(tokens, "tokens", "token ids");
    const Offsets cu(cu_lens, "cu_lens");
    const std::string_view key = resolve(ns);
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

  // -> (prefix lengths [batch] int64, nodes [batch] int64); every sequence is checked before the first is inserted
  py::object insert_ragged(py::handle tokens, py::handle cu_lens, py::handle blocks, py::handle cu_blocks,
                           py::handle ns, bool lock) {
    const IdArray<int32_t> t(tokens, "tokens", "token ids");
    const IdArray<int32_t> b(blocks, "blocks", "block ids");
    const Offsets cu(cu_lens, "cu_lens");
    const Offsets cub(cu_blocks, "cu_blocks");
    const std::string_view key = resolve(ns);
    at::TensorBase prefix_lengths = new_tensor<int64_t>(cu.batch()), nodes = new_tensor<int64_t>(cu.batch());
    {
      py::gil_scoped_release nogil;
      tree_->insert_ragged(key, prefix::Ragged{t.data(), t.size(), cu.data(), cu.batch()},
                           prefix::Ragged{b.data(), b.size(), cub.data(), cub.batch()}, lock,
                           prefix_lengths.mutable_data_ptr<int64_t>(), nodes.mutable_data_ptr<int64_t>());
    }
    return as_result(nullptr, to_python(prefix_lengths), to_python(nodes));
  }

  int64_t evict(int64_t num_blocks) {
    py::gil_scoped_release nogil;
    return tree_->evict(num_blocks);
  }
  void lock(int64_t node) {
    py::gil_scoped_release nogil;
    tree_->lock(node);
  }
  void unlock(int64_t node) {
    py::gil_scoped_release nogil;
    tree_->unlock(node);
  }

 private:
  std::string_view resolve(py::handle ns) const {
    return namespace_key(ns, ns_type_.ptr(), key_name_.ptr(), default_key_.ptr());
  }

  PyTypeObject *match_type_, *insert_type_, *ragged_type_;
  py::object key_name_, ns_type_, default_key_;  // "key"; kvcache.Namespace and the default's key, or null
  std::shared_ptr<prefix::RadixTree> tree_;
};

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
  py::class_<PrefixTree>(m, "_PrefixTree",
                         "Fast path of a torch.classes.kvcache.PrefixCache's tree (use kvcache.PrefixCache)")
      .def(py::init<int64_t, py::handle, py::handle, py::handle, py::handle, py::handle>(), py::arg("core_id"),
           py::arg("match_type") = py::none(), py::arg("insert_type") = py::none(),
           py::arg("ragged_match_type") = py::none(), py::arg("namespace_type") = py::none(),
           py::arg("default_namespace") = py::none())
      // The signatures of kvcache.PrefixCache's methods, which are these when bound to an instance.
      .def("match", &PrefixTree::match, py::arg("tokens"), py::arg("namespace") = py::none(), py::arg("lock") = false)
      .def("insert", &PrefixTree::insert, py::arg("tokens"), py::arg("blocks"), py::arg("namespace") = py::none(),
           py::arg("lock") = false)
      .def("match_ragged", &PrefixTree::match_ragged, py::arg("tokens"), py::arg("cu_lens"),
           py::arg("namespace") = py::none(), py::arg("lock") = false)
      .def("insert_ragged", &PrefixTree::insert_ragged, py::arg("tokens"), py::arg("cu_lens"), py::arg("blocks"),
           py::arg("cu_blocks"), py::arg("namespace") = py::none(), py::arg("lock") = false)
      .def("evict", &PrefixTree::evict)
      .def("lock", &PrefixTree::lock)
      .def("unlock", &PrefixTree::unlock);
}

}  // namespace kvcache
