#include <pybind11/numpy.h>
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

// local_first, remote_first, count, per_layer
using SpanTuple = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>;
// kind, cache_id, req_id, model_id, prefix_id, slot
using NameTuple = std::tuple<uint8_t, int64_t, uint64_t, uint64_t, uint64_t, uint64_t>;
// peer id, remote ip, remote port, local ip
using LinkTuple = std::tuple<uint64_t, std::string, uint16_t, std::string>;
// cluster id, rank, ip, port (0: this member's listen port)
using CommTuple = std::tuple<uint64_t, uint32_t, std::string, uint16_t>;

LayerSpan make_span(const SpanTuple &t) {
  return LayerSpan{std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
}

// `rows`: a C-contiguous uint64 array of shape (n, 5), one row
// (src_block, src_offset, dst_block, dst_offset, length) per range, or
// (n, 8), each row followed by (count, src_stride, dst_stride).
std::vector<BlockRange> block_ranges(const py::array_t<uint64_t, py::array::c_style> &rows) {
  const py::ssize_t width = rows.ndim() == 2 ? rows.shape(1) : 0;
  if (width != 5 && width != 8) throw py::value_error("ranges must have shape (n, 5) or (n, 8)");
  std::vector<BlockRange> ranges(static_cast<size_t>(rows.shape(0)));
  const uint64_t *row = rows.data();
  for (BlockRange &r : ranges) {
    r = width == 5 ? BlockRange{row[0], row[1], row[2], row[3], row[4]}
                   : BlockRange{row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7]};
    row += width;
  }
  return ranges;
}

RemoteName make_name(const NameTuple &t) {
  RemoteName name;
  name.kind = std::get<0>(t);
  name.cache_id = std::get<1>(t);
  name.key = KeySpec{std::get<2>(t), std::get<3>(t), std::get<4>(t)};
  name.model_id = std::get<3>(t);
  name.slot = std::get<5>(t);
  return name;
}

// Block indices given from Python as a list or tuple of ints in [0, 2**64),
// or None for none where `none_ok`; an empty one only where `empty_ok`.
// False, with nothing raised, for anything else: the caller's own checks
// then say what was wrong.
bool block_list(py::handle given, bool none_ok, bool empty_ok, std::vector<uint64_t> &out) {
  if (given.is_none()) return none_ok && empty_ok;
  const bool is_list = PyList_Check(given.ptr());
  if (!is_list && !PyTuple_Check(given.ptr())) return false;
  const Py_ssize_t n = is_list ? PyList_GET_SIZE(given.ptr()) : PyTuple_GET_SIZE(given.ptr());
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject *item = is_list ? PyList_GET_ITEM(given.ptr(), i) : PyTuple_GET_ITEM(given.ptr(), i);
    if (!PyLong_Check(item)) return false;
    const unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (value == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
      PyErr_Clear();  // negative, or past 64 bits
      return false;
    }
    out[static_cast<size_t>(i)] = value;
  }
  return n > 0 || empty_ok;
}

// Runs `start` without the GIL; returns (status, request or None).
template <typename Start>
py::tuple start_request(Start &&start) {
  std::shared_ptr<Request> request;
  Status st;
  {
    py::gil_scoped_release release;
    st = start(request);
  }
  if (st != llm_datadist::LLM_SUCCESS) return py::make_tuple(st, py::none());
  return py::make_tuple(st, std::move(request));
}

}  // namespace

void bind_engine(py::module_ &m) {
  // Engine memory held for Python views: opaque, released with the object.
  struct MemoryPin {
    std::shared_ptr<const void> memory;
  };
  py::class_<MemoryPin>(m, "MemoryPin");

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
      .def(
          "pin_memory",
          [](const Engine &e, int64_t cache_id) -> std::optional<MemoryPin> {
            std::shared_ptr<const void> memory = e.pin_memory(cache_id);
            if (!memory) return std::nullopt;
            return MemoryPin{std::move(memory)};
          },
          py::arg("cache_id"))
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
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.copy_cache(dst_id, src_id, dst_slot, src_slot, offset, size, out);
            });
          },
          py::arg("dst_id"), py::arg("src_id"), py::arg("dst_slot"), py::arg("src_slot"), py::arg("offset"),
          py::arg("size"))
      .def(
          "copy_blocks",
          [](Engine &e, const ViewTuple &dst, const ViewTuple &src, const BlockPairs &pairs) {
            CacheView dst_view = make_view(dst);
            CacheView src_view = make_view(src);
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.copy_blocks(dst_view, src_view, pairs, out);
            });
          },
          py::arg("dst"), py::arg("src"), py::arg("pairs"))
      .def_property_readonly("listen_port", &Engine::listen_port)
      .def(
          "link_transport",
          [](const Engine &e, uint64_t peer) {
            std::string name;
            const Status st = e.link_transport(peer, name);
            return std::make_pair(static_cast<uint32_t>(st), name);
          },
          py::arg("peer"))
      .def(
          "link_security",
          [](const Engine &e, uint64_t peer) {
            std::string transport, cipher;
            bool encrypted = false, ktls = false;
            const Status st = e.link_security(peer, transport, encrypted, cipher, ktls);
            return py::make_tuple(static_cast<uint32_t>(st), transport, encrypted, cipher, ktls);
          },
          py::arg("peer"))
      .def("has_link", &Engine::has_link, py::arg("peer"))
      .def("listener_stats", &Engine::listener_stats)
      .def("link_stats", &Engine::link_stats, py::arg("peer"))
      .def("answer_counts", &Engine::answer_counts)
      .def("create_request", &Engine::create_request, py::arg("num_results"))
      .def(
          "watch_event",
          [](Engine &e, uint64_t event) {
            return start_request([&](std::shared_ptr<Request> &out) { return e.watch_event(event, out); });
          },
          py::arg("event"))
      .def("unwatch_event", &Engine::unwatch_event, py::arg("request_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "transfer_step",
          [](Engine &e, const std::shared_ptr<Request> &into, size_t result_index, int64_t src_id, uint64_t peer,
             uint32_t src_layer, uint32_t dst_layer, uint64_t src_slot, std::vector<uint64_t> src_blocks,
             std::vector<uint64_t> dst_blocks, uint64_t chunk_size, const NameTuple &dst,
             std::vector<uint64_t> dst_addrs, uint64_t group,
             const std::optional<py::array_t<uint64_t, py::array::c_style>> &ranges) {
            TransferStep step;
            if (ranges) step.ranges = block_ranges(*ranges);
            step.src_layer = src_layer;
            step.dst_layer = dst_layer;
            step.src_slot = src_slot;
            step.src_blocks = std::move(src_blocks);
            step.dst_blocks = std::move(dst_blocks);
            step.chunk_size = chunk_size;
            step.dst = make_name(dst);
            step.dst_addrs = std::move(dst_addrs);
            step.group = group;
            py::gil_scoped_release release;
            return e.transfer_step(into, result_index, src_id, peer, step);
          },
          py::arg("into"), py::arg("result_index"), py::arg("src_id"), py::arg("peer"), py::arg("src_layer"),
          py::arg("dst_layer"), py::arg("src_slot"), py::arg("src_blocks"), py::arg("dst_blocks"),
          py::arg("chunk_size"), py::arg("dst"), py::arg("dst_addrs"), py::arg("group"),
          py::arg("ranges") = py::none())
      .def(
          "link_clusters",
          [](Engine &e, const std::vector<LinkTuple> &targets, int timeout_ms) {
            std::vector<LinkTarget> list;
            for (const auto &[peer, rip, rport, lip] : targets) list.push_back({peer, rip, rport, lip});
            std::vector<Status> rets;
            Status st;
            {
              py::gil_scoped_release release;
              st = e.link_clusters(list, timeout_ms, rets);
            }
            return py::make_tuple(st, rets);
          },
          py::arg("targets"), py::arg("timeout_ms"))
      .def(
          "unlink_clusters",
          [](Engine &e, const std::vector<uint64_t> &peers, bool force, int timeout_ms) {
            std::vector<Status> rets;
            Status st;
            {
              py::gil_scoped_release release;
              st = e.unlink_clusters(peers, force, timeout_ms, rets);
            }
            return py::make_tuple(st, rets);
          },
          py::arg("peers"), py::arg("force"), py::arg("timeout_ms"))
      .def(
          "link_comm",
          [](Engine &e, const std::string &name, const std::vector<CommTuple> &members) {
            std::vector<CommMember> list;
            for (const auto &[cluster_id, rank, ip, port] : members) list.push_back({cluster_id, rank, ip, port});
            uint64_t comm_id = 0;
            Status st;
            {
              py::gil_scoped_release release;
              st = e.link_comm(name, list, comm_id);
            }
            return py::make_tuple(st, comm_id);
          },
          py::arg("name"), py::arg("members"))
      .def("unlink_comm", &Engine::unlink_comm, py::arg("comm_id"), py::call_guard<py::gil_scoped_release>())
      .def(
          "comm_state",
          [](const Engine &e, uint64_t comm_id) {
            CommState state = CommState::kFailed;
            const Status st = e.comm_state(comm_id, state);
            return py::make_tuple(st, static_cast<int32_t>(state));
          },
          py::arg("comm_id"))
      .def_property_readonly("options_recorded",
                             [](const Engine &e) {
                               const EngineOptions &o = e.options();
                               py::dict out;
                               out["link_total_time_s"] = o.link_total_time_s;
                               out["link_retry_count"] = o.link_retry_count;
                               out["rdma_service_level"] = o.rdma_service_level;
                               out["rdma_traffic_class"] = o.rdma_traffic_class;
                               out["enable_switch_role"] = o.enable_switch_role;
                               out["sync_kv_timeout_ms"] = o.sync_kv_timeout_ms;
                               return out;
                             })
      .def("switch_role", &Engine::switch_role, py::arg("role"), py::arg("listen_ip"), py::arg("listen_port"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "push_cache",
          [](Engine &e, int64_t src_id, uint64_t src_slot, uint64_t peer, int64_t dst_cache_id, uint64_t dst_slot,
             const SpanTuple &span) {
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.push_cache(src_id, src_slot, peer, dst_cache_id, dst_slot, make_span(span), out);
            });
          },
          py::arg("src_id"), py::arg("src_slot"), py::arg("peer"), py::arg("dst_cache_id"), py::arg("dst_slot"),
          py::arg("span"))
      .def(
          "push_blocks",
          [](Engine &e, int64_t src_id, uint64_t peer, uint64_t model_id, py::handle src_given, py::handle dst_given,
             const SpanTuple &span) -> py::object {
            std::vector<uint64_t> src_blocks, dst_blocks;
            if (!block_list(src_given, true, true, src_blocks) || !block_list(dst_given, false, false, dst_blocks)) {
              return py::none();
            }
            RemoteName dst;
            dst.kind = wire::kBlocksOfModel;
            dst.model_id = model_id;
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.push_blocks(src_id, peer, dst, src_blocks, dst_blocks, make_span(span), out);
            });
          },
          py::arg("src_id"), py::arg("peer"), py::arg("model_id"), py::arg("src_blocks"), py::arg("dst_blocks"),
          py::arg("span"))
      .def(
          "pull_cache",
          [](Engine &e, int64_t dst_id, uint64_t dst_slot, uint64_t peer, const NameTuple &src, int64_t size,
             const SpanTuple &span) {
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.pull_cache(dst_id, dst_slot, peer, make_name(src), size, make_span(span), out);
            });
          },
          py::arg("dst_id"), py::arg("dst_slot"), py::arg("peer"), py::arg("src"), py::arg("size"), py::arg("span"))
      .def(
          "pull_blocks",
          [](Engine &e, int64_t dst_id, uint64_t peer, const NameTuple &src, py::handle src_given,
             py::handle dst_given, const SpanTuple &span) -> py::object {
            std::vector<uint64_t> src_blocks, dst_blocks;
            if (!block_list(src_given, false, true, src_blocks) || !block_list(dst_given, false, false, dst_blocks)) {
              return py::none();
            }
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.pull_blocks(dst_id, peer, make_name(src), src_blocks, dst_blocks, make_span(span), out);
            });
          },
          py::arg("dst_id"), py::arg("peer"), py::arg("src"), py::arg("src_blocks"), py::arg("dst_blocks"),
          py::arg("span"))
      .def(
          "pull_ranges",
          // `ranges`: as block_ranges takes them.
          [](Engine &e, int64_t dst_id, uint64_t peer, const NameTuple &src,
             const py::array_t<uint64_t, py::array::c_style> &rows, const SpanTuple &span) {
            const std::vector<BlockRange> ranges = block_ranges(rows);
            return start_request([&](std::shared_ptr<Request> &out) {
              return e.pull_ranges(dst_id, peer, make_name(src), ranges, make_span(span), out);
            });
          },
          py::arg("dst_id"), py::arg("peer"), py::arg("src"), py::arg("ranges"), py::arg("span"));
}

}  // namespace datadist::bindings
