// libdatadist_ucx.so: ucx_plugin.h over UCP. Built only where UCX is found;
// the engine loads it at run time (transport/paths/ucx/ucx_loader.cpp).
#include "transport/paths/ucx/ucx_plugin.h"

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// An endpoint's error callback, shared with the callbacks queued for it so
// that a close in between silences them.
struct ErrorSink {
  datadist_ucx_ep_error_fn on_error = nullptr;
  void *arg = nullptr;
  bool closed = false;  // under the worker's mutex
};

}  // namespace

struct datadist_ucx_worker {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_address_t *address = nullptr;
  size_t address_length = 0;

  std::mutex mutex;  // guards all below
  std::vector<std::function<void()>> due;  // callbacks for the next progress
  std::set<datadist_ucx_ep *> eps;
  std::set<datadist_ucx_mem *> mems;
  std::set<datadist_ucx_ep *> closing;  // closed by the caller, UCX not done yet

  // Queues `fn` for progress. Called outside progress, the caller wakes the
  // worker after (wake() below), so that a thread asleep on the event fd
  // sees it.
  void defer(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mutex);
    due.push_back(std::move(fn));
  }

  // After a call into UCX outside progress (a post, a flush, a close): UCX
  // may leave work of its own for the next progress that no event on its fd
  // announces (a shared-memory copy that finished at once, a flush to
  // resume), and its callbacks may have queued ours. Either way a thread
  // asleep on the event fd has to progress the worker.
  void wake() { ucp_worker_signal(worker); }
};

struct datadist_ucx_mem {
  datadist_ucx_worker *worker = nullptr;
  ucp_mem_h memh = nullptr;
  void *rkey = nullptr;
  size_t rkey_length = 0;
};

struct datadist_ucx_ep {
  datadist_ucx_worker *worker = nullptr;
  ucp_ep_h ep = nullptr;
  std::shared_ptr<ErrorSink> sink;
};

struct datadist_ucx_rkey {
  ucp_rkey_h rkey = nullptr;
};

namespace {

// The ranges of one get, put or flush: done runs when the last completes,
// with the first failure.
struct Batch {
  datadist_ucx_worker *worker;
  size_t remaining;
  ucs_status_t status = UCS_OK;
  datadist_ucx_done_fn done;
  void *arg;

  // One range finished; true when it was the last. Under UCX's worker lock
  // or the posting thread's: the worker's mutex orders them.
  bool finish(ucs_status_t result) {
    std::lock_guard<std::mutex> lock(worker->mutex);
    if (result != UCS_OK && status == UCS_OK) status = result;
    return --remaining == 0;
  }
  void complete() {
    datadist_ucx_done_fn fn = done;
    void *a = arg;
    int s = status;
    datadist_ucx_worker *w = worker;
    delete this;
    w->defer([fn, a, s] { fn(a, s); });
  }
};

void on_request_done(void *request, ucs_status_t status, void *user_data) {
  auto *batch = static_cast<Batch *>(user_data);
  if (batch->finish(status)) batch->complete();
  ucp_request_free(request);
}

// A posted request: pending (its callback finishes it), or done at once
// (the poster wakes the worker once all are posted).
void account(Batch *batch, ucs_status_ptr_t request) {
  if (UCS_PTR_IS_PTR(request)) return;
  if (batch->finish(UCS_PTR_STATUS(request))) batch->complete();
}

void on_ep_error(void *arg, ucp_ep_h, ucs_status_t status) {
  auto *ep = static_cast<datadist_ucx_ep *>(arg);
  std::shared_ptr<ErrorSink> sink = ep->sink;
  ep->worker->defer(
      [sink, status, worker = ep->worker] {
        datadist_ucx_ep_error_fn fn;
        void *a;
        {
          std::lock_guard<std::mutex> lock(worker->mutex);
          if (sink->closed || sink->on_error == nullptr) return;
          fn = sink->on_error;
          a = sink->arg;
        }
        fn(a, status);
      });
}

void on_close_done(void *request, ucs_status_t, void *user_data) {
  auto *ep = static_cast<datadist_ucx_ep *>(user_data);
  {
    std::lock_guard<std::mutex> lock(ep->worker->mutex);
    ep->worker->closing.erase(ep);
  }
  delete ep;
  ucp_request_free(request);
}

const char *ucx_version() { return ucp_get_version_string(); }

const char *status_string(int status) {
  if (status == DATADIST_UCX_BUSY) return "busy: progress the worker before waiting";
  return ucs_status_string(static_cast<ucs_status_t>(status));
}

unsigned progress(datadist_ucx_worker *w) {
  unsigned n = ucp_worker_progress(w->worker);
  std::vector<std::function<void()>> due;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    due.swap(w->due);
  }
  for (auto &fn : due) fn();
  return n + static_cast<unsigned>(due.size());
}

int arm(datadist_ucx_worker *w) {
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    if (!w->due.empty()) return DATADIST_UCX_BUSY;
  }
  ucs_status_t s = ucp_worker_arm(w->worker);
  if (s == UCS_ERR_BUSY) return DATADIST_UCX_BUSY;
  return s;
}

void ep_close(datadist_ucx_ep *ep, int force) {
  datadist_ucx_worker *w = ep->worker;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    ep->sink->closed = true;
    w->eps.erase(ep);
    w->closing.insert(ep);
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  param.cb.send = on_close_done;
  param.user_data = ep;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep->ep, &param);
  if (!UCS_PTR_IS_PTR(request)) {
    {
      std::lock_guard<std::mutex> lock(w->mutex);
      w->closing.erase(ep);
    }
    delete ep;
  }
  w->wake();  // a forced close fails the pending operations at once
}

int mem_unmap(datadist_ucx_mem *mem) {
  if (mem == nullptr) return UCS_ERR_INVALID_PARAM;
  datadist_ucx_worker *w = mem->worker;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    w->mems.erase(mem);
  }
  ucp_rkey_buffer_release(mem->rkey);
  ucs_status_t s = ucp_mem_unmap(w->context, mem->memh);
  delete mem;
  return s;
}

void worker_destroy(datadist_ucx_worker *w) {
  if (w == nullptr) return;
  std::vector<datadist_ucx_ep *> eps;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    eps.assign(w->eps.begin(), w->eps.end());
  }
  for (auto *ep : eps) ep_close(ep, 1);
  // Forced closes finish without the peer; bounded all the same.
  auto deadline = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    progress(w);
    std::lock_guard<std::mutex> lock(w->mutex);
    if ((w->closing.empty() && w->due.empty()) || Clock::now() > deadline) break;
  }
  std::vector<datadist_ucx_mem *> mems;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    mems.assign(w->mems.begin(), w->mems.end());
  }
  for (auto *mem : mems) mem_unmap(mem);
  ucp_worker_release_address(w->worker, w->address);
  ucp_worker_destroy(w->worker);
  ucp_cleanup(w->context);
  for (auto *ep : w->closing) delete ep;
  delete w;
}

// This engine's settings of UCX, each where the environment does not name it
// (UCX_<name> wins). It moves no rendezvous messages, and an infinite
// rendezvous threshold is what lets UCX (1.22 measured) put over tcp with
// zero copy on an endpoint that handles peer failure; otherwise it emulates
// the put. UCX emulates a get over tcp with fragments of the tcp segment
// size: 64 KiB ones carry an owner's read at 3x the speed of the 8 KiB
// default. Those two are set from UCX 1.16 on: 1.13 warns that they are
// invalid at every worker (and emulates both anyway); the versions between
// were not tried.
// The oldest UCP API this plugin is written for: UCX 1.13 (Debian 12's) is
// the oldest it is tested with.
constexpr unsigned kApiMajor = 1;
constexpr unsigned kApiMinor = 13;

void apply_defaults(ucp_config_t *config) {
  struct Default {
    const char *name;
    const char *value;
    unsigned since_minor;  // of UCX 1.x: an older one warns of the name at every worker
  };
  static const Default kDefaults[] = {
      {"RNDV_THRESH", "inf", 0},
      {"TCP_TX_SEG_SIZE", "64k", 16},
      {"TCP_RX_SEG_SIZE", "64k", 16},
  };
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  for (const Default &d : kDefaults) {
    const std::string env = std::string("UCX_") + d.name;
    if (major == 1 && minor < d.since_minor) continue;
    if (std::getenv(env.c_str()) == nullptr) ucp_config_modify(config, d.name, d.value);
  }
}

int worker_create(datadist_ucx_worker **out) {
  if (out == nullptr) return UCS_ERR_INVALID_PARAM;
  *out = nullptr;
  ucp_config_t *config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);  // UCX_* of the environment
  if (s != UCS_OK) return s;
  apply_defaults(config);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  params.mt_workers_shared = 0;  // one worker per context
  auto *w = new (std::nothrow) datadist_ucx_worker();
  if (w == nullptr) {
    ucp_config_release(config);
    return UCS_ERR_NO_MEMORY;
  }
  // The API version this plugin needs, not that of the headers it was built
  // with (ucp_init's): built against the libucx-cu12 wheel's newer headers,
  // it runs on an older system UCX too, which would warn of the headers'.
  s = ucp_init_version(kApiMajor, kApiMinor, &params, config, &w->context);
  ucp_config_release(config);
  if (s != UCS_OK) {
    delete w;
    return s;
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  s = ucp_worker_create(w->context, &wp, &w->worker);
  if (s != UCS_OK) {
    ucp_cleanup(w->context);
    delete w;
    return s;
  }
  ucp_worker_attr_t attr{};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
  s = ucp_worker_query(w->worker, &attr);
  if (s == UCS_OK && attr.thread_mode != UCS_THREAD_MODE_MULTI) s = UCS_ERR_UNSUPPORTED;  // UCX built single-threaded
  if (s == UCS_OK) s = ucp_worker_get_address(w->worker, &w->address, &w->address_length);
  if (s != UCS_OK) {
    ucp_worker_destroy(w->worker);
    ucp_cleanup(w->context);
    delete w;
    return s;
  }
  *out = w;
  return UCS_OK;
}

int worker_address(datadist_ucx_worker *w, const void **address, size_t *length) {
  if (w == nullptr || address == nullptr || length == nullptr) return UCS_ERR_INVALID_PARAM;
  *address = w->address;
  *length = w->address_length;
  return UCS_OK;
}

int event_fd(datadist_ucx_worker *w, int *fd) {
  if (w == nullptr || fd == nullptr) return UCS_ERR_INVALID_PARAM;
  return ucp_worker_get_efd(w->worker, fd);
}

int one_sided_network(datadist_ucx_worker *w) {
  if (w == nullptr) return 0;
  // UCP names its transports only in its printed description of the
  // context: one "resource" line per transport and device, ending in
  // "-- <transport>/<device>".
  char *text = nullptr;
  size_t size = 0;
  FILE *out = open_memstream(&text, &size);
  if (out == nullptr) return 0;
  ucp_context_print_info(w->context, out);
  std::fclose(out);
  int found = 0;
  std::istringstream lines(std::string(text, size));
  std::free(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t mark = line.find("-- ");
    if (line.find("resource") == std::string::npos || mark == std::string::npos) continue;
    const std::string tl = line.substr(mark + 3, line.find('/', mark) - mark - 3);
    if (tl.rfind("rc", 0) == 0 || tl.rfind("dc", 0) == 0 || tl == "srd") found = 1;
  }
  return found;
}

int reaches_cuda(datadist_ucx_worker *w) {
  if (w == nullptr) return 0;
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(w->context, &attr) != UCS_OK) return 0;
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0 ? 1 : 0;
}

int mem_map(datadist_ucx_worker *w, void *address, size_t length, int memory_type, datadist_ucx_mem **out,
            const void **rkey, size_t *rkey_length) {
  if (w == nullptr || address == nullptr || length == 0 || out == nullptr || rkey == nullptr ||
      rkey_length == nullptr || (memory_type != DATADIST_UCX_HOST && memory_type != DATADIST_UCX_CUDA)) {
    return UCS_ERR_INVALID_PARAM;
  }
  if (memory_type == DATADIST_UCX_CUDA && reaches_cuda(w) == 0) return UCS_ERR_UNSUPPORTED;
  *out = nullptr;
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = length;
  params.memory_type = memory_type == DATADIST_UCX_CUDA ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  auto *mem = new (std::nothrow) datadist_ucx_mem();
  if (mem == nullptr) return UCS_ERR_NO_MEMORY;
  mem->worker = w;
  ucs_status_t s = ucp_mem_map(w->context, &params, &mem->memh);
  if (s != UCS_OK) {
    delete mem;
    return s;
  }
  s = ucp_rkey_pack(w->context, mem->memh, &mem->rkey, &mem->rkey_length);
  if (s != UCS_OK) {
    ucp_mem_unmap(w->context, mem->memh);
    delete mem;
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    w->mems.insert(mem);
  }
  *out = mem;
  *rkey = mem->rkey;
  *rkey_length = mem->rkey_length;
  return UCS_OK;
}

int ep_create(datadist_ucx_worker *w, const void *address, size_t length, datadist_ucx_ep_error_fn on_error,
              void *error_arg, datadist_ucx_ep **out) {
  if (w == nullptr || address == nullptr || length == 0 || out == nullptr) return UCS_ERR_INVALID_PARAM;
  *out = nullptr;
  auto *ep = new (std::nothrow) datadist_ucx_ep();
  if (ep == nullptr) return UCS_ERR_NO_MEMORY;
  ep->worker = w;
  ep->sink = std::make_shared<ErrorSink>();
  ep->sink->on_error = on_error;
  ep->sink->arg = error_arg;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = static_cast<const ucp_address_t *>(address);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its operations
  params.err_handler.cb = on_ep_error;
  params.err_handler.arg = ep;
  ucs_status_t s = ucp_ep_create(w->worker, &params, &ep->ep);
  if (s != UCS_OK) {
    delete ep;
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    w->eps.insert(ep);
  }
  *out = ep;
  return UCS_OK;
}

int rkey_unpack(datadist_ucx_ep *ep, const void *buffer, size_t length, datadist_ucx_rkey **out) {
  if (ep == nullptr || buffer == nullptr || length == 0 || out == nullptr) return UCS_ERR_INVALID_PARAM;
  *out = nullptr;
  auto *rkey = new (std::nothrow) datadist_ucx_rkey();
  if (rkey == nullptr) return UCS_ERR_NO_MEMORY;
  ucs_status_t s = ucp_ep_rkey_unpack(ep->ep, buffer, &rkey->rkey);
  if (s != UCS_OK) {
    delete rkey;
    return s;
  }
  *out = rkey;
  return UCS_OK;
}

void rkey_destroy(datadist_ucx_rkey *rkey) {
  if (rkey == nullptr) return;
  ucp_rkey_destroy(rkey->rkey);
  delete rkey;
}

int transfer(bool is_put, datadist_ucx_ep *ep, datadist_ucx_rkey *rkey, const datadist_ucx_range *ranges,
             size_t count, datadist_ucx_done_fn done, void *arg) {
  if (ep == nullptr || rkey == nullptr || done == nullptr || (count > 0 && ranges == nullptr)) {
    return UCS_ERR_INVALID_PARAM;
  }
  for (size_t i = 0; i < count; ++i) {
    if (ranges[i].length == 0 || ranges[i].local == 0) return UCS_ERR_INVALID_PARAM;
  }
  auto *batch = new (std::nothrow) Batch{ep->worker, count + 1, UCS_OK, done, arg};
  if (batch == nullptr) return UCS_ERR_NO_MEMORY;
  size_t i = 0;
  for (; i < count; ++i) {
    const datadist_ucx_range &r = ranges[i];
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = on_request_done;
    param.user_data = batch;
    if (r.local_mem != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = r.local_mem->memh;
    }
    void *local = reinterpret_cast<void *>(static_cast<uintptr_t>(r.local));
    ucs_status_ptr_t request = is_put ? ucp_put_nbx(ep->ep, local, r.length, r.remote, rkey->rkey, &param)
                                      : ucp_get_nbx(ep->ep, local, r.length, r.remote, rkey->rkey, &param);
    if (UCS_PTR_IS_ERR(request)) {
      // The ranges not posted fail with it; those posted still finish.
      for (size_t rest = i; rest < count; ++rest) account(batch, request);
      break;
    }
    account(batch, request);
  }
  datadist_ucx_worker *w = ep->worker;
  account(batch, UCS_STATUS_PTR(UCS_OK));  // the guard: all posted
  w->wake();
  return UCS_OK;
}

int get(datadist_ucx_ep *ep, datadist_ucx_rkey *rkey, const datadist_ucx_range *ranges, size_t count,
        datadist_ucx_done_fn done, void *arg) {
  return transfer(false, ep, rkey, ranges, count, done, arg);
}

int put(datadist_ucx_ep *ep, datadist_ucx_rkey *rkey, const datadist_ucx_range *ranges, size_t count,
        datadist_ucx_done_fn done, void *arg) {
  return transfer(true, ep, rkey, ranges, count, done, arg);
}

int ep_flush(datadist_ucx_ep *ep, datadist_ucx_done_fn done, void *arg) {
  if (ep == nullptr || done == nullptr) return UCS_ERR_INVALID_PARAM;
  auto *batch = new (std::nothrow) Batch{ep->worker, 1, UCS_OK, done, arg};
  if (batch == nullptr) return UCS_ERR_NO_MEMORY;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = on_request_done;
  param.user_data = batch;
  account(batch, ucp_ep_flush_nbx(ep->ep, &param));
  ep->worker->wake();
  return UCS_OK;
}

const datadist_ucx_plugin_v1 kPlugin = {
    DATADIST_UCX_ABI_VERSION,
    sizeof(datadist_ucx_plugin_v1),
    ucx_version,
    status_string,
    worker_create,
    worker_destroy,
    worker_address,
    event_fd,
    arm,
    progress,
    one_sided_network,
    reaches_cuda,
    mem_map,
    mem_unmap,
    ep_create,
    rkey_unpack,
    rkey_destroy,
    get,
    put,
    ep_flush,
    ep_close,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const datadist_ucx_plugin_v1 *datadist_ucx_plugin_v1_get(void) {
  return &kPlugin;
}
