#include <pybind11/stl.h>

#include "bindings.h"
#include "cache_geometry.h"

namespace py = pybind11;

namespace datadist::bindings {

namespace {

// (address, size in bytes) of a writable C-contiguous buffer.
py::tuple buffer_address(const py::object &obj) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
    PyErr_Clear();
    throw py::type_error("expected a writable C-contiguous buffer, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  py::tuple out = py::make_tuple(reinterpret_cast<uintptr_t>(view.buf), static_cast<uint64_t>(view.len));
  PyBuffer_Release(&view);
  return out;
}

}  // namespace

void bind_buffer(py::module_ &m) {
  m.def("buffer_address", &buffer_address, py::arg("buffer"));
  m.def("data_type_size", &data_type_size, py::arg("data_type"));
}

}  // namespace datadist::bindings
