#include "bindings.h"
#include "error_detail.h"
#include "log.h"
#include "transport/paths/ucx/ucx_loader.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "datadist_aio engine: handles and ids only; the Python package holds all policy.";
  datadist::bindings::bind_request(m);
  datadist::bindings::bind_engine(m);
  datadist::bindings::bind_buffer(m);
  datadist::bindings::bind_bench(m);
  m.def(
      "last_error_message", [] { return datadist::error_detail(); },
      "Why the last engine call of this thread refused its work; empty if it gave no reason.");
  m.def("capture_log", &datadist::capture_log, py::arg("on"),
        "Queue engine messages for wait_log (True) or print them to stderr (False).");
  m.def(
      "wait_log",
      [](int64_t timeout_ms) {
        uint64_t dropped = 0;
        std::vector<std::pair<datadist::LogLevel, std::string>> messages;
        {
          py::gil_scoped_release release;
          messages = datadist::wait_log(timeout_ms, dropped);
        }
        py::list out;
        for (auto &[level, text] : messages) out.append(py::make_tuple(static_cast<int>(level), text));
        return py::make_tuple(out, dropped);
      },
      py::arg("timeout_ms"),
      "Waits for queued engine messages; returns ([(level, message)], messages dropped since the last call).");
  m.def(
      "log_message",
      [](int level, const std::string &message) {
        datadist::log_message(static_cast<datadist::LogLevel>(level), message);
      },
      py::arg("level"), py::arg("message"), "Logs through the engine's path (used by tests).");
  m.def(
      "ucx_available",
      [] {
        std::string why;
        const datadist::ucx::Plugin *plugin = nullptr;
        {
          py::gil_scoped_release release;
          plugin = datadist::ucx::load_plugin(why);
        }
        if (plugin == nullptr) return std::make_pair(false, why);
        return std::make_pair(true, "UCX " + plugin->version + " from " + plugin->ucx_from + ", plugin " + plugin->path);
      },
      "Whether the UCX plugin and UCX load in this process: (True, what was loaded) or (False, why not). "
      "The first call decides for the life of the process.");
}
