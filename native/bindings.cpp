// Python bindings for apex::SumTree (module apex.native).
//
// Each call validates all of its input with the GIL held and before touching the tree, so
// bad input raises ValueError / IndexError / TypeError and leaves the tree as it was. The
// batch loops then run with the GIL released, under a per-tree mutex so that threads
// sharing one tree cannot interleave half-done updates.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <mutex>
#include <string>

#include "sum_tree.hpp"

namespace py = pybind11;

namespace {

using IndexArray = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using FloatArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

struct LockedSumTree {
  explicit LockedSumTree(int64_t capacity) : tree(capacity) {}
  apex::SumTree tree;
  std::mutex mutex;
};

py::array as_vector(const py::handle& obj, const char* what) {
  py::array array = py::array::ensure(obj);
  if (!array) throw py::type_error(std::string(what) + " must be array-like");
  if (array.ndim() != 1) {
    throw py::value_error(std::string(what) + " must be a 1-D array, got " +
                          std::to_string(array.ndim()) + "-D");
  }
  return array;
}

IndexArray as_indices(const py::handle& obj, const char* what, int64_t capacity) {
  py::array array = as_vector(obj, what);
  const char kind = array.dtype().kind();
  if (array.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::type_error(std::string(what) + " must have an integer dtype, got " +
                         std::string(py::str(array.dtype())));
  }
  IndexArray indices = IndexArray::ensure(array);
  const int64_t* data = indices.data();
  for (py::ssize_t i = 0; i < indices.size(); ++i) {
    if (data[i] < 0 || data[i] >= capacity) {
      throw py::index_error(std::string(what) + "[" + std::to_string(i) + "] = " +
                            std::to_string(data[i]) + " is out of range [0, " +
                            std::to_string(capacity) + ")");
    }
  }
  return indices;
}

FloatArray as_floats(const py::handle& obj, const char* what) {
  py::array array = as_vector(obj, what);
  const char kind = array.dtype().kind();
  if (array.size() > 0 && kind != 'f' && kind != 'i' && kind != 'u') {
    throw py::type_error(std::string(what) + " must have a real dtype, got " +
                         std::string(py::str(array.dtype())));
  }
  return FloatArray::ensure(array);
}

void update(LockedSumTree& self, const py::handle& idx_obj, const py::handle& prio_obj) {
  IndexArray idx = as_indices(idx_obj, "idx", self.tree.capacity());
  FloatArray prio = as_floats(prio_obj, "prio");
  if (idx.size() != prio.size()) {
    throw py::value_error("idx and prio must have the same length, got " +
                          std::to_string(idx.size()) + " and " + std::to_string(prio.size()));
  }
  const double* p = prio.data();
  for (py::ssize_t i = 0; i < prio.size(); ++i) {
    if (!std::isfinite(p[i]) || p[i] < 0.0) {
      throw py::value_error("prio[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                            " is invalid: priorities must be finite and >= 0");
    }
  }
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(self.mutex);
  self.tree.update(idx.data(), p, idx.size());
}

void clear(LockedSumTree& self, const py::handle& idx_obj) {
  IndexArray idx = as_indices(idx_obj, "idx", self.tree.capacity());
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(self.mutex);
  self.tree.clear(idx.data(), idx.size());
}

py::array_t<int64_t> find_prefixsum(LockedSumTree& self, const py::handle& values_obj) {
  FloatArray values = as_floats(values_obj, "values");
  const py::ssize_t n = values.size();
  py::array_t<int64_t> out(n);
  const double* v = values.data();
  int64_t* out_data = out.mutable_data();
  py::ssize_t bad = -1;  // first value outside [0, total], found under the lock
  double total = 0.0;
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mutex);
    total = self.tree.total();
    for (py::ssize_t i = 0; i < n && bad < 0; ++i) {
      if (!(v[i] >= 0.0 && v[i] <= total)) bad = i;  // also rejects NaN
    }
    if (bad < 0 && n > 0 && total > 0.0) self.tree.find_prefixsum(v, out_data, n);
  }
  if (bad >= 0) {
    throw py::value_error("values[" + std::to_string(bad) + "] = " + std::to_string(v[bad]) +
                          " is outside [0, total] = [0, " + std::to_string(total) + "]");
  }
  if (n > 0 && total <= 0.0) {
    throw py::value_error("find_prefixsum on an empty tree: no leaf has a positive priority");
  }
  return out;
}

py::tuple sample(LockedSumTree& self, int64_t n, const py::handle& rng) {
  if (n < 0) throw py::value_error("n must be >= 0, got " + std::to_string(n));
  // Looked up once and never released: a static py::object would be destroyed after the
  // interpreter has gone.
  static const py::handle generator_type =
      py::object(py::module_::import("numpy.random").attr("Generator")).release();
  if (!py::isinstance(rng, generator_type)) {
    throw py::type_error("rng must be a numpy.random.Generator (numpy.random.default_rng())");
  }
  FloatArray uniforms = as_floats(rng.attr("random")(n), "rng.random(n)");
  py::array_t<int64_t> idx(n);
  py::array_t<double> prio(n);
  const double* u = uniforms.data();
  int64_t* idx_data = idx.mutable_data();
  double* prio_data = prio.mutable_data();
  bool empty = false;
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mutex);
    empty = !(self.tree.total() > 0.0);
    if (!empty && n > 0) self.tree.sample(u, idx_data, prio_data, n);
  }
  if (empty && n > 0) {
    throw py::value_error("cannot sample from an empty tree: no leaf has a positive priority");
  }
  return py::make_tuple(idx, prio);
}

py::array_t<double> get(LockedSumTree& self, const py::handle& idx_obj) {
  IndexArray idx = as_indices(idx_obj, "idx", self.tree.capacity());
  py::array_t<double> out(idx.size());
  const int64_t* i = idx.data();
  double* out_data = out.mutable_data();
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(self.mutex);
    self.tree.get(i, out_data, idx.size());
  }
  return out;
}

template <double (apex::SumTree::*Read)() const>
double read_locked(LockedSumTree& self) {
  py::gil_scoped_release release;  // never wait for the tree's mutex while holding the GIL
  std::lock_guard<std::mutex> lock(self.mutex);
  return (self.tree.*Read)();
}

}  // namespace

PYBIND11_MODULE(native, m) {
  m.doc() = "Native data structures for apex (see native/sum_tree.hpp).";

  py::class_<LockedSumTree>(m, "SumTree",
                            "Sum tree and min tree over `capacity` priorities, batched.")
      .def(py::init([](int64_t capacity) {
             if (capacity < 1) {
               throw py::value_error("SumTree capacity must be >= 1, got " +
                                     std::to_string(capacity));
             }
             return new LockedSumTree(capacity);
           }),
           py::arg("capacity"))
      .def("update", &update, py::arg("idx"), py::arg("prio"),
           "Set leaf idx[i] to prio[i] (finite, >= 0); a repeated index: the last one wins.")
      .def("clear", &clear, py::arg("idx"),
           "Return leaves to never set: priority 0, no longer part of min.")
      .def("find_prefixsum", &find_prefixsum, py::arg("values"),
           "Leaf i with cumsum[i-1] <= v < cumsum[i] for each v in [0, total].")
      .def("sample", &sample, py::arg("n"), py::arg("rng"),
           "Stratified sample of n leaves proportional to priority: (indices, priorities).")
      .def("get", &get, py::arg("idx"), "Priorities of the given leaves (0 if never set).")
      .def_property_readonly("total", &read_locked<&apex::SumTree::total>,
                             "Sum of all priorities.")
      .def_property_readonly("min", &read_locked<&apex::SumTree::min>,
                             "Smallest priority over leaves given one (+inf before any).")
      .def_property_readonly("capacity", [](LockedSumTree& self) { return self.tree.capacity(); })
      .def_property_readonly("nbytes", [](LockedSumTree& self) { return self.tree.nbytes(); },
                             "Bytes held by the two trees.")
      .def("__len__", [](LockedSumTree& self) { return self.tree.capacity(); })
      .def("__repr__", [](LockedSumTree& self) {
        return "SumTree(capacity=" + std::to_string(self.tree.capacity()) + ")";
      });
}
