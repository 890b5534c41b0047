#include <pybind11/stl.h>

#include <optional>

#include "bindings.h"
#include "request.h"

namespace py = pybind11;

namespace datadist::bindings {

void bind_request(py::module_ &m) {
  py::class_<Request, std::shared_ptr<Request>>(m, "Request")
      .def_property_readonly("id", &Request::id)
      .def_property_readonly("num_results", &Request::num_results)
      .def("done", &Request::done)
      .def("outcome", &Request::outcome)
      .def("completed_at",
           [](const Request &r) -> std::optional<double> {
             double at = r.completed_at();
             return at < 0 ? std::nullopt : std::optional<double>(at);
           })
      .def("wait", &Request::wait, py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("cancel", [](Request &r) { return r.cancel(kCancelledStatus); })
      .def("cancelled", &Request::cancelled)
      .def("results", &Request::results)
      .def("messages", &Request::messages)
      .def("watch", &Request::watch)
      .def("hold", [](Request &r) { r.hold(); })
      .def("release", &Request::release, py::arg("result_index"), py::arg("status"), py::arg("skipped") = false,
           py::arg("message") = std::string())
      .def("cancel_requested", &Request::cancel_requested)
      .def("cancel_reason", &Request::cancel_reason);
}

}  // namespace datadist::bindings
