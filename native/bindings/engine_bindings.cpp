#include <pybind11/stl.h>

#include <optional>
#include <tuple>

#include "bindings.h"
#include "engine.h"

namespace py = pybind11;

namespace datadist::bindings {

namespace {

using KeyTuple = std::tuple<uint64_t, uint64_t, uint64_t>;  // req_id, model_id, prefix_id
// cache_id, num_tensors, shape, data_type, placement, addrs
using ViewTuple = std::tuple<int64_t, uint32_t, std::vector<int64_t>, int32_t, uint32_t, std::vector<uintptr_t>>;

CacheSpec make_spec(uint32_t num_tensors, std::vector<int64_t> shape, int32_t data_type, uint32_t placement,
                    bool is_blocks) {
  CacheSpec spec;
  spec.num_tensors = num_tensors;
  spec.shape = std::move(shape);
  spec.data_type = data_type;
  spec.placement = static_cast<Placement>(placement);
  spec.is_blocks = is_blocks;
  return spec;
}

std::vector<KeySpec> make_keys(const std::vector<KeyTuple> &keys) {
  std::vector<KeySpec> out;
  out.reserve(keys.size());
  for (const auto &[req_id, model_id, prefix_id] : keys) out.push_back({req_id, model_id, prefix_id});
  return out;
}

CacheView make_view(const ViewTuple &t) {
  CacheView view;
  view.cache_id = std::get<0>(t);
  view.spec = make_spec(std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), true);
  view.addrs = std::get<5>(t);
  return view;
}

// Status plus the started request (None unless the status is success).
py::tuple started(Status st, std::shared_ptr<Request> request) {
  if (st != llm_datadist::LLM_SUCCESS) return py::make_tuple(st, py::none());
  return py::make_tuple(st, std::move(request));
}

}  // namespace

void bind_engine(py::module_ &m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init<uint64_t>(), py::arg("cluster_id"))
      .def("initialize", &Engine::initialize, py::arg("options"), py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Engine::finalize, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("initialized", &Engine::initialized)
      .def_property_readonly("cluster_id", &Engine::cluster_id)
      .def_property_readonly("sync_kv_timeout_ms", [](const Engine &e) { return e.options().sync_kv_timeout_ms; })
      .def_property_readonly("engine_threads", [](const Engine &e) { return e.options().engine_threads; })
      .def_property_readonly("has_host_pool", [](const Engine &e) { return e.options().host_pool.has_value(); })
      .def("requests_in_flight", &Engine::requests_in_flight)
      .def("completion_fd", [](const Engine &e) { return e.completions()->fd(); })
      .def("drain_completions",
           [](const Engine &e) {
             std::vector<Completion> done;
             {
               py::gil_scoped_release release;
               done = e.completions()->drain();
             }
             py::list out(done.size());
             for (size_t i = 0; i < done.size(); ++i) {
               out[i] = py::make_tuple(done[i].request_id, done[i].status);
             }
             return out;
           })
      .def(
          "register_cache",
          [](Engine &e, uint32_t num_tensors, std::vector<int64_t> shape, int32_t data_type, uint32_t placement,
             bool is_blocks, const std::vector<uintptr_t> &addrs, const std::vector<KeyTuple> &keys,
             std::optional<uint64_t> blocks_model_id, bool remote_accessible) {
            int64_t cache_id = -1;
            CacheSpec spec = make_spec(num_tensors, std::move(shape), data_type, placement, is_blocks);
            Status st;
            {
              py::gil_scoped_release release;
              st = e.register_cache(spec, addrs, make_keys(keys), blocks_model_id, remote_accessible, cache_id);
            }
            return py::make_tuple(st, cache_id);
          },
          py::arg("num_tensors"), py::arg("shape"), py::arg("data_type"), py::arg("placement"),
          py::arg("is_blocks"), py::arg("addrs"), py::arg("keys"), py::arg("blocks_model_id"),
          py::arg("remote_accessible"))
      .def(
          "allocate_cache",
          [](Engine &e, uint32_t num_tensors, std::vector<int64_t> shape, int32_t data_type, uint32_t placement,
             bool is_blocks, const std::vector<KeyTuple> &keys, std::optional<uint64_t> blocks_model_id) {
            int64_t cache_id = -1;
            std::vector<uintptr_t> addrs;
            CacheSpec spec = make_spec(num_tensors, std::move(shape), data_type, placement, is_blocks);
            Status st;
            {
              py::gil_scoped_release release;
              st = e.allocate_cache(spec, make_keys(keys), blocks_model_id, cache_id, addrs);
            }
            return py::make_tuple(st, cache_id, addrs);
          },
          py::arg("num_tensors"), py::arg("shape"), py::arg("data_type"), py::arg("placement"),
          py::arg("is_blocks"), py::arg("keys"), py::arg("blocks_model_id"))
      .def("deallocate_cache", &Engine::deallocate_cache, py::arg("cache_id"),
           py::call_guard<py::gil_scoped_release>())
      .def("unregister_cache", &Engine::unregister_cache, py::arg("cache_id"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "remove_cache_key",
          [](Engine &e, uint64_t req_id, uint64_t model_id, uint64_t prefix_id) {
            return e.remove_cache_key({req_id, model_id, prefix_id});
          },
          py::arg("req_id"), py::arg("model_id"), py::arg("prefix_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "copy_cache",
          [](Engine &e, int64_t dst_id, int64_t src_id, uint64_t dst_slot, uint64_t src_slot, uint64_t offset,
             int64_t size) {
            std::shared_ptr<Request> request;
            Status st;
            {
              py::gil_scoped_release release;
              st = e.copy_cache(dst_id, src_id, dst_slot, src_slot, offset, size, request);
            }
            return started(st, std::move(request));
          },
          py::arg("dst_id"), py::arg("src_id"), py::arg("dst_slot"), py::arg("src_slot"), py::arg("offset"),
          py::arg("size"))
      .def(
          "copy_blocks",
          [](Engine &e, const ViewTuple &dst, const ViewTuple &src, const BlockPairs &pairs) {
            CacheView dst_view = make_view(dst);
            CacheView src_view = make_view(src);
            std::shared_ptr<Request> request;
            Status st;
            {
              py::gil_scoped_release release;
              st = e.copy_blocks(dst_view, src_view, pairs, request);
            }
            return started(st, std::move(request));
          },
          py::arg("dst"), py::arg("src"), py::arg("pairs"));
}

}  // namespace datadist::bindings
