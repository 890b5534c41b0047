// The raw TCP baseline of the benchmark (datadist_aio.bench), beside the
// engine so that it is built with the same compiler and flags.
#include "../bench/raw_tcp.h"
#include "bindings.h"

namespace py = pybind11;

namespace datadist::bindings {

namespace {

// (pointer, size) of a C-contiguous buffer; the caller keeps the object alive.
std::pair<char *, size_t> raw_buffer(const py::buffer &buffer, bool writable) {
  py::buffer_info info = buffer.request(writable);
  if (info.ndim > 0 && info.strides.back() != info.itemsize) {
    throw py::value_error("expected a C-contiguous buffer");
  }
  return {static_cast<char *>(info.ptr), static_cast<size_t>(info.size * info.itemsize)};
}

}  // namespace

void bind_bench(py::module_ &m) {
  py::class_<bench::RawTcpSink>(m, "RawTcpSink")
      .def(py::init([](const std::string &ip, const py::buffer &dest, int streams, bool busy_poll) {
             auto [ptr, len] = raw_buffer(dest, true);
             return std::make_unique<bench::RawTcpSink>(ip, ptr, len, streams, busy_poll);
           }),
           py::arg("ip"), py::arg("dest"), py::arg("streams"), py::arg("busy_poll") = false, py::keep_alive<1, 3>())
      .def_property_readonly("port", &bench::RawTcpSink::port)
      .def_property_readonly("address", &bench::RawTcpSink::address)
      .def("close", &bench::RawTcpSink::close, py::call_guard<py::gil_scoped_release>());
  py::class_<bench::RawTcpSource>(m, "RawTcpSource")
      .def(py::init([](const std::string &ip, uint16_t port, const py::buffer &src, int streams, bool busy_poll) {
             auto [ptr, len] = raw_buffer(src, false);
             py::gil_scoped_release release;
             return std::make_unique<bench::RawTcpSource>(ip, port, ptr, len, streams, busy_poll);
           }),
           py::arg("ip"), py::arg("port"), py::arg("src"), py::arg("streams"), py::arg("busy_poll") = false,
           py::keep_alive<1, 4>())
      .def("send_round", &bench::RawTcpSource::send_round, py::call_guard<py::gil_scoped_release>())
      .def("close", &bench::RawTcpSource::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace datadist::bindings
