// libdatadist_ucx.so: ucx_plugin.h over UCP. Built only where UCX is found;
// the engine loads it at run time (transport/paths/ucx/ucx_loader.cpp).
#include "transport/paths/ucx/ucx_plugin.h"

#include <ucp/api/ucp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <unordered_map>
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

struct Batch;

// The head of the keys mem_map packs for peers, before UCX's own: the
// memory's type, so that the peer knows which of its ranges move as active
// messages (host to host, where it does that).
struct KeyHead {
  uint32_t memory_type;
  uint32_t zero;
};

// One range of a get or put moving as active messages (see "Host memory as
// active messages" below), known by a token the messages carry.
struct AmRange {
  datadist_ucx_ep *ep;
  Batch *batch;
  bool put;
  uint64_t local;   // get: where the bytes go
  uint64_t length;
  uint64_t moved = 0;  // bytes landed (get) or acknowledged (put)
};

}  // namespace

struct datadist_ucx_worker {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_address_t *address = nullptr;
  size_t address_length = 0;

  // Host-to-host ranges move as active messages, not as UCX's gets and puts:
  // set where none of the context's transports reads or writes a peer's
  // memory by itself (no RDMA), see "Host memory as active messages".
  bool am_rma = false;
  // The datatype the active messages' bytes go as (copied into UCX's
  // buffers, never zero copy: see am_send).
  ucp_datatype_t am_bytes = 0;

  std::mutex mutex;  // guards all below
  std::vector<std::function<void()>> due;  // callbacks for the next progress
  std::set<datadist_ucx_ep *> eps;
  std::set<datadist_ucx_mem *> mems;
  std::set<datadist_ucx_ep *> closing;  // closed by the caller, UCX not done yet
  std::unordered_map<uint64_t, AmRange> am_ranges;  // by token
  uint64_t next_token = 1;

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
  void *ucx_rkey = nullptr;  // UCX's packed key
  std::vector<uint8_t> rkey;  // what peers get: a KeyHead, then UCX's packed key
  uint64_t base = 0;
  uint64_t length = 0;
  int memory_type = DATADIST_UCX_HOST;
};

struct datadist_ucx_ep {
  datadist_ucx_worker *worker = nullptr;
  ucp_ep_h ep = nullptr;
  std::shared_ptr<ErrorSink> sink;
  // Host-to-host ranges go as UCX's own gets and puts: the endpoint has an
  // RDMA transport. Otherwise as active messages.
  bool native_host_rma = false;
  // Made with peer-failure handling (ep_create), which a forced close needs.
  bool handles_errors = true;
};

struct datadist_ucx_rkey {
  ucp_rkey_h rkey = nullptr;
  int memory_type = DATADIST_UCX_HOST;  // of the peer's memory it covers
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
    return finish_locked(result);
  }
  bool finish_locked(ucs_status_t result) {
    if (result != UCS_OK && status == UCS_OK) status = result;
    return --remaining == 0;
  }
  void complete() {
    datadist_ucx_worker *w = worker;
    std::lock_guard<std::mutex> lock(w->mutex);
    complete_locked();
  }
  // Queues done for the next progress and goes; under the worker's mutex.
  void complete_locked() {
    datadist_ucx_done_fn fn = done;
    void *a = arg;
    int s = status;
    worker->due.push_back([fn, a, s] { fn(a, s); });
    delete this;
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

// Host memory as active messages. Where no transport of the context reads
// or writes a peer's memory by itself (tcp, shared memory), UCX emulates a
// get or a put with messages of its own and answers them from inside its
// progress: the process whose memory is read sends the bytes back, the one
// written acknowledges. When the peer has died meanwhile, that answer's send
// fails and UCX aborts the process ("unexpected error" in
// ucp_request_try_send, under ucp_get_req_handler or ucp_put_handler; seen
// with 1.13.1 and 1.22.0), which is the survivor. So the plugin moves
// host-to-host ranges itself, as active messages whose sends are ordinary
// requests (a failed one completes with its error, as any send):
// - get: kAmGetReq {token, address, length} to the peer, which answers with
//   kAmGetData {token, offset, length, status} chunks of the bytes, each
//   copied to the range's local memory;
// - put: kAmPutData {token, address, offset, length} chunks, each answered
//   with kAmPutAck {token, offset, length, status} once copied.
// A peer reads and writes only inside host memory it mapped (a range
// outside gets an error status back). A range is known by its token until
// it is done or its endpoint closes: a close fails the endpoint's ranges at
// once, and bytes that come for a token no longer known are dropped, so
// nothing lands in this process's memory after a range's completion.
// Messages go with UCX's reply flag: UCX drops those for an endpoint this
// end has closed.
constexpr unsigned kAmGetReq = 1;
constexpr unsigned kAmGetData = 2;
constexpr unsigned kAmPutData = 3;
constexpr unsigned kAmPutAck = 4;
constexpr uint64_t kAmChunk = 256 * 1024;

struct AmHeader {
  uint64_t token;
  uint64_t address;
  uint64_t offset;
  uint64_t length;
  int64_t status;
};

// A send in flight, with the header UCX reads until it is done.
// The bytes of an active message as UCX packs them (see kBytesOps).
struct PackState {
  const uint8_t *bytes;
  size_t length;
};

struct AmSend {
  datadist_ucx_worker *worker;
  AmHeader header;
  bool fails_range;  // this end's own range's message: its failure fails the range
  PackState pack;    // handed to UCX as the message's one element
};

// Ends range `token` with `status` where it is still known; under the
// worker's mutex.
void am_range_failed_locked(datadist_ucx_worker *w, uint64_t token, ucs_status_t status) {
  auto it = w->am_ranges.find(token);
  if (it == w->am_ranges.end()) return;
  Batch *batch = it->second.batch;
  w->am_ranges.erase(it);
  if (batch->finish_locked(status)) batch->complete_locked();
}

// Bytes of range `token` landed or acknowledged; under the worker's mutex.
void am_range_moved_locked(datadist_ucx_worker *w, std::unordered_map<uint64_t, AmRange>::iterator it,
                           uint64_t bytes) {
  AmRange &range = it->second;
  range.moved += bytes;
  if (range.moved < range.length) return;
  Batch *batch = range.batch;
  w->am_ranges.erase(it);
  if (batch->finish_locked(UCS_OK)) batch->complete_locked();
}

void am_sent(void *request, ucs_status_t status, void *user_data) {
  auto *send = static_cast<AmSend *>(user_data);
  if (status != UCS_OK && send->fails_range) {
    std::lock_guard<std::mutex> lock(send->worker->mutex);
    am_range_failed_locked(send->worker, send->header.token, status);
  }
  delete send;
  if (request != nullptr) ucp_request_free(request);
}

// The bytes of an active message, as a generic datatype: UCX copies them
// into its own buffers as it sends (bcopy) and never sends them with zero
// copy. UCX's TCP transport (1.13.1 and 1.22.0 alike) completes a zero-copy
// send twice when the connection fails under it, which trips its assertion
// "comp->count > 0" in the survivor's progress (an abort, met once in 8
// runs of the peer-failure cases over UCX before this).
//
// The message's one element is the AmSend's own PackState, so packing
// allocates nothing: UCX 1.13 drops a send purged by a failed endpoint
// without calling `finish`, and a state allocated in `start_pack` leaked
// there. The AmSend outlives every pack, as UCX packs before it completes
// the send.
void *bytes_start_pack(void *, const void *buffer, size_t) { return const_cast<void *>(buffer); }
void *bytes_start_unpack(void *, void *, size_t) { return nullptr; }  // never received as such
size_t bytes_packed_size(void *state) { return static_cast<PackState *>(state)->length; }
size_t bytes_pack(void *state, size_t offset, void *dest, size_t max_length) {
  const auto *s = static_cast<PackState *>(state);
  const size_t n = offset < s->length ? std::min(max_length, s->length - offset) : 0;
  std::memcpy(dest, s->bytes + offset, n);
  return n;
}
ucs_status_t bytes_unpack(void *, size_t, const void *, size_t) { return UCS_ERR_UNSUPPORTED; }
void bytes_finish(void *) {}

const ucp_generic_dt_ops_t kBytesOps = {bytes_start_pack, bytes_start_unpack, bytes_packed_size,
                                         bytes_pack,       bytes_unpack,       bytes_finish};

// Sends one active message; never under the worker's mutex (a send that
// fails at once ends its range here).
void am_send(datadist_ucx_worker *w, ucp_ep_h ep, unsigned id, const AmHeader &header, const void *data,
             size_t length, bool fails_range) {
  auto *send = new (std::nothrow) AmSend{w, header, fails_range, {static_cast<const uint8_t *>(data), length}};
  if (send == nullptr) {
    if (fails_range) {
      std::lock_guard<std::mutex> lock(w->mutex);
      am_range_failed_locked(w, header.token, UCS_ERR_NO_MEMORY);
    }
    return;
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
  param.cb.send = am_sent;
  param.user_data = send;
  if (length > 0) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    param.datatype = w->am_bytes;
  }
  const void *payload = length > 0 ? static_cast<const void *>(&send->pack) : nullptr;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(ep, id, &send->header, sizeof(send->header), payload, length > 0 ? 1 : 0, &param);
  if (UCS_PTR_IS_PTR(request)) return;
  am_sent(nullptr, UCS_PTR_STATUS(request), send);
}

// Whether [address, address + length) lies inside host memory this worker
// mapped; under the worker's mutex.
bool mapped_host_locked(datadist_ucx_worker *w, uint64_t address, uint64_t length) {
  for (const datadist_ucx_mem *mem : w->mems) {
    if (mem->memory_type == DATADIST_UCX_HOST && address >= mem->base && length <= mem->length &&
        address - mem->base <= mem->length - length) {
      return true;
    }
  }
  return false;
}

// A message's header, and whether it came whole (not announced for a
// rendezvous, which this engine never asks for) with an endpoint to answer.
bool am_parse(const void *header, size_t header_length, size_t length, const ucp_am_recv_param_t *param,
              AmHeader &out) {
  if (header_length != sizeof(AmHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 ||
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) {
    return false;
  }
  std::memcpy(&out, header, sizeof(out));
  return length == 0 || length == out.length;
}

ucs_status_t am_status(int64_t status) { return status < 0 ? static_cast<ucs_status_t>(status) : UCS_ERR_IO_ERROR; }

// The peer asks for the bytes of one of its gets.
ucs_status_t on_am_get_req(void *arg, const void *header, size_t header_length, void *, size_t length,
                           const ucp_am_recv_param_t *param) {
  auto *w = static_cast<datadist_ucx_worker *>(arg);
  AmHeader h{};
  if (!am_parse(header, header_length, 0, param, h) || length != 0) return UCS_OK;
  bool ok;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    ok = h.length > 0 && mapped_host_locked(w, h.address, h.length);
  }
  if (!ok) {
    am_send(w, param->reply_ep, kAmGetData, AmHeader{h.token, 0, 0, 0, UCS_ERR_INVALID_ADDR}, nullptr, 0, false);
    return UCS_OK;
  }
  for (uint64_t offset = 0; offset < h.length; offset += kAmChunk) {
    const uint64_t n = std::min(kAmChunk, h.length - offset);
    am_send(w, param->reply_ep, kAmGetData, AmHeader{h.token, 0, offset, n, 0},
            reinterpret_cast<const void *>(static_cast<uintptr_t>(h.address + offset)), n, false);
  }
  return UCS_OK;
}

// Bytes of one of this end's gets.
ucs_status_t on_am_get_data(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param) {
  auto *w = static_cast<datadist_ucx_worker *>(arg);
  AmHeader h{};
  const bool whole = am_parse(header, header_length, length, param, h);
  if (header_length != sizeof(AmHeader)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  std::lock_guard<std::mutex> lock(w->mutex);
  auto it = w->am_ranges.find(h.token);
  if (it == w->am_ranges.end() || it->second.put) return UCS_OK;  // ended: dropped
  AmRange &range = it->second;
  if (h.status != 0 || !whole || h.length == 0 || h.offset > range.length || h.length > range.length - h.offset) {
    am_range_failed_locked(w, h.token, h.status != 0 ? am_status(h.status) : UCS_ERR_MESSAGE_TRUNCATED);
    return UCS_OK;
  }
  std::memcpy(reinterpret_cast<void *>(static_cast<uintptr_t>(range.local + h.offset)), data, length);
  am_range_moved_locked(w, it, length);
  return UCS_OK;
}

// Bytes of one of the peer's puts, into this end's memory.
ucs_status_t on_am_put_data(void *arg, const void *header, size_t header_length, void *data, size_t length,
                            const ucp_am_recv_param_t *param) {
  auto *w = static_cast<datadist_ucx_worker *>(arg);
  AmHeader h{};
  if (header_length != sizeof(AmHeader) || (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) == 0) return UCS_OK;
  int64_t status = UCS_OK;
  if (!am_parse(header, header_length, length, param, h) || length == 0) {
    std::memcpy(&h, header, sizeof(h));
    status = UCS_ERR_MESSAGE_TRUNCATED;
  } else {
    std::lock_guard<std::mutex> lock(w->mutex);
    if (mapped_host_locked(w, h.address, h.length)) {
      std::memcpy(reinterpret_cast<void *>(static_cast<uintptr_t>(h.address)), data, length);
    } else {
      status = UCS_ERR_INVALID_ADDR;
    }
  }
  am_send(w, param->reply_ep, kAmPutAck, AmHeader{h.token, 0, h.offset, h.length, status}, nullptr, 0, false);
  return UCS_OK;
}

// The peer copied a chunk of one of this end's puts.
ucs_status_t on_am_put_ack(void *arg, const void *header, size_t header_length, void *, size_t,
                           const ucp_am_recv_param_t *) {
  auto *w = static_cast<datadist_ucx_worker *>(arg);
  AmHeader h{};
  if (header_length != sizeof(AmHeader)) return UCS_OK;
  std::memcpy(&h, header, sizeof(h));
  std::lock_guard<std::mutex> lock(w->mutex);
  auto it = w->am_ranges.find(h.token);
  if (it == w->am_ranges.end() || !it->second.put) return UCS_OK;
  if (h.status != 0) {
    am_range_failed_locked(w, h.token, am_status(h.status));
    return UCS_OK;
  }
  am_range_moved_locked(w, it, h.length);
  return UCS_OK;
}

ucs_status_t set_am_handlers(datadist_ucx_worker *w) {
  const struct {
    unsigned id;
    ucp_am_recv_callback_t cb;
  } handlers[] = {{kAmGetReq, on_am_get_req}, {kAmGetData, on_am_get_data}, {kAmPutData, on_am_put_data},
                  {kAmPutAck, on_am_put_ack}};
  for (const auto &h : handlers) {
    ucp_am_handler_param_t param{};
    param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    param.id = h.id;
    param.flags = UCP_AM_FLAG_WHOLE_MSG;
    param.cb = h.cb;
    param.arg = w;
    const ucs_status_t s = ucp_worker_set_am_recv_handler(w->worker, &param);
    if (s != UCS_OK) return s;
  }
  return UCS_OK;
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

// Closes `ep` at once (`force`, which UCX allows only with peer-failure
// handling) or once what is posted on it has gone (a flush).
void close_endpoint(datadist_ucx_ep *ep, bool force) {
  datadist_ucx_worker *w = ep->worker;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    ep->sink->closed = true;
    w->eps.erase(ep);
    w->closing.insert(ep);
    // Its ranges moving as active messages end now; what comes for them later is dropped.
    std::vector<uint64_t> tokens;
    for (const auto &entry : w->am_ranges) {
      if (entry.second.ep == ep) tokens.push_back(entry.first);
    }
    for (uint64_t token : tokens) am_range_failed_locked(w, token, UCS_ERR_CANCELED);
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force && ep->handles_errors ? UCP_EP_CLOSE_FLAG_FORCE : 0;
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

// A forced close is asked for where a link fails. An endpoint whose host
// ranges move as active messages flushes instead: forced at both ends of a
// TCP connection whose send a frozen peer cut short, UCX's TCP transport
// frees the endpoint under its own send handler (docs/design.md, "Limits";
// tools/ucx_close_race.c), and a flushing close at either end prevents it.
// Its ranges fail on return all the same, and UCX drops the peer's
// messages on it from the close on, flushing or not: a frozen owner's late
// puts into the survivor's memory do not land
// (test_peer_frozen_mid_operation_then_resumed[ucx]). Only an endpoint with
// RDMA, whose gets and puts UCX moves without this end's help, is closed at
// once.
void ep_close(datadist_ucx_ep *ep, int force) { close_endpoint(ep, force != 0 && ep->native_host_rma); }

int mem_unmap(datadist_ucx_mem *mem) {
  if (mem == nullptr) return UCS_ERR_INVALID_PARAM;
  datadist_ucx_worker *w = mem->worker;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    w->mems.erase(mem);
  }
  ucp_rkey_buffer_release(mem->ucx_rkey);
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
  for (auto *ep : eps) close_endpoint(ep, true);
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
  if (w->am_bytes != 0) ucp_dt_destroy(w->am_bytes);
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

int one_sided_network(datadist_ucx_worker *w);

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
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
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
  if (s == UCS_OK) s = ucp_dt_create_generic(&kBytesOps, nullptr, &w->am_bytes);
  if (s == UCS_OK) s = set_am_handlers(w);
  if (s == UCS_OK) s = ucp_worker_get_address(w->worker, &w->address, &w->address_length);
  if (s != UCS_OK) {
    ucp_worker_destroy(w->worker);
    if (w->am_bytes != 0) ucp_dt_destroy(w->am_bytes);
    ucp_cleanup(w->context);
    delete w;
    return s;
  }
  w->am_rma = one_sided_network(w) == 0;
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
  size_t ucx_length = 0;
  s = ucp_rkey_pack(w->context, mem->memh, &mem->ucx_rkey, &ucx_length);
  if (s != UCS_OK) {
    ucp_mem_unmap(w->context, mem->memh);
    delete mem;
    return s;
  }
  mem->base = reinterpret_cast<uintptr_t>(address);
  mem->length = length;
  mem->memory_type = memory_type;
  const KeyHead head{static_cast<uint32_t>(memory_type), 0};
  mem->rkey.resize(sizeof(head) + ucx_length);
  std::memcpy(mem->rkey.data(), &head, sizeof(head));
  std::memcpy(mem->rkey.data() + sizeof(head), mem->ucx_rkey, ucx_length);
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    w->mems.insert(mem);
  }
  *out = mem;
  *rkey = mem->rkey.data();
  *rkey_length = mem->rkey.size();
  return UCS_OK;
}

// How the endpoint's gets and puts reach the peer (DATADIST_UCX_RMA_*), by
// the transports UCX chose for it; asked of UCX from 1.14 on (NONE where it
// cannot say: a worker with RDMA then takes every endpoint for one, see
// ep_create). FENCED: an RDMA transport (rc, dc, srd), whose gets and puts
// run in the NIC and need nothing of the peer's process; the peer's unmap
// ends them. DIRECT: cma, xpmem, knem or cuda_ipc, which need nothing of the
// peer either but are this process's own system calls or mappings into the
// peer's memory: they go on after the peer closed its endpoint (a process
// frozen mid-operation that resumes after the peer's operations timed out).
// A PEER-mode endpoint never has those (UCX 1.22 takes tcp between two
// processes of one host then), so the link's own endpoint is FENCED or NONE.
int endpoint_rma(ucp_ep_h ep) {
#if UCP_API_MAJOR > 1 || (UCP_API_MAJOR == 1 && UCP_API_MINOR >= 14)
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  if (major == 1 && minor < 14) return DATADIST_UCX_RMA_NONE;  // built with newer headers than the UCX loaded
  ucp_transport_entry_t entries[32]{};
  ucp_ep_attr_t attr{};
  attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
  attr.transports.entries = entries;
  attr.transports.num_entries = 32;
  attr.transports.entry_size = sizeof(ucp_transport_entry_t);
  if (ucp_ep_query(ep, &attr) != UCS_OK) return DATADIST_UCX_RMA_NONE;
  bool direct = false, tcp = false;
  for (unsigned i = 0; i < attr.transports.num_entries && i < 32; ++i) {
    const std::string tl = entries[i].transport_name != nullptr ? entries[i].transport_name : "";
    if (tl.rfind("rc", 0) == 0 || tl.rfind("dc", 0) == 0 || tl == "srd") return DATADIST_UCX_RMA_FENCED;
    direct = direct || tl == "cma" || tl == "xpmem" || tl == "knem" || tl == "cuda_ipc";
    tcp = tcp || tl == "tcp";
  }
  return direct && !tcp ? DATADIST_UCX_RMA_DIRECT : DATADIST_UCX_RMA_NONE;
#else
  (void)ep;
  return DATADIST_UCX_RMA_NONE;
#endif
}

// Whether endpoint_rma() can tell (UCX 1.14 on, and headers that know it).
bool endpoint_query_works() {
#if UCP_API_MAJOR > 1 || (UCP_API_MAJOR == 1 && UCP_API_MINOR >= 14)
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  return major > 1 || minor >= 14;
#else
  return false;
#endif
}

// An endpoint to `address` with `params`' error handling (the address is
// filled in here), known to the worker until closed.
int new_ep(datadist_ucx_worker *w, const void *address, ucp_ep_params_t &params, datadist_ucx_ep *ep,
           datadist_ucx_ep **out) {
  params.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = static_cast<const ucp_address_t *>(address);
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
  params.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its operations
  params.err_handler.cb = on_ep_error;
  params.err_handler.arg = ep;
  const int s = new_ep(w, address, params, ep, out);
  if (s == UCS_OK) {
    ep->native_host_rma =
        !w->am_rma && (endpoint_rma(ep->ep) == DATADIST_UCX_RMA_FENCED || !endpoint_query_works());
  }
  return s;
}

int ep_create_direct(datadist_ucx_worker *w, const void *address, size_t length, datadist_ucx_ep **out) {
  if (w == nullptr || address == nullptr || length == 0 || out == nullptr) return UCS_ERR_INVALID_PARAM;
  *out = nullptr;
  auto *ep = new (std::nothrow) datadist_ucx_ep();
  if (ep == nullptr) return UCS_ERR_NO_MEMORY;
  ep->worker = w;
  ep->sink = std::make_shared<ErrorSink>();
  ep->native_host_rma = true;
  ep->handles_errors = false;
  ucp_ep_params_t params{};
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  return new_ep(w, address, params, ep, out);
}

int ep_rma(datadist_ucx_ep *ep) { return ep == nullptr ? DATADIST_UCX_RMA_NONE : endpoint_rma(ep->ep); }

int rkey_unpack(datadist_ucx_ep *ep, const void *buffer, size_t length, datadist_ucx_rkey **out) {
  if (ep == nullptr || buffer == nullptr || length <= sizeof(KeyHead) || out == nullptr) return UCS_ERR_INVALID_PARAM;
  *out = nullptr;
  KeyHead head{};
  std::memcpy(&head, buffer, sizeof(head));
  if ((head.memory_type != DATADIST_UCX_HOST && head.memory_type != DATADIST_UCX_CUDA) || head.zero != 0) {
    return UCS_ERR_INVALID_PARAM;
  }
  auto *rkey = new (std::nothrow) datadist_ucx_rkey();
  if (rkey == nullptr) return UCS_ERR_NO_MEMORY;
  rkey->memory_type = static_cast<int>(head.memory_type);
  ucs_status_t s = ucp_ep_rkey_unpack(ep->ep, static_cast<const uint8_t *>(buffer) + sizeof(head), &rkey->rkey);
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

// One range of a get or put as active messages.
void am_transfer(bool is_put, datadist_ucx_ep *ep, Batch *batch, const datadist_ucx_range &r) {
  datadist_ucx_worker *w = ep->worker;
  uint64_t token;
  {
    std::lock_guard<std::mutex> lock(w->mutex);
    token = w->next_token++;
    w->am_ranges.emplace(token, AmRange{ep, batch, is_put, r.local, r.length});
  }
  if (!is_put) {
    am_send(w, ep->ep, kAmGetReq, AmHeader{token, r.remote, 0, r.length, 0}, nullptr, 0, true);
    return;
  }
  for (uint64_t offset = 0; offset < r.length; offset += kAmChunk) {
    const uint64_t n = std::min(kAmChunk, r.length - offset);
    am_send(w, ep->ep, kAmPutData, AmHeader{token, r.remote + offset, offset, n, 0},
            reinterpret_cast<const void *>(static_cast<uintptr_t>(r.local + offset)), n, true);
  }
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
    const bool local_host = r.local_mem == nullptr || r.local_mem->memory_type == DATADIST_UCX_HOST;
    if (!ep->native_host_rma && local_host && rkey->memory_type == DATADIST_UCX_HOST) {
      am_transfer(is_put, ep, batch, r);
      continue;
    }
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
    ep_create_direct,
    ep_rma,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const datadist_ucx_plugin_v1 *datadist_ucx_plugin_v1_get(void) {
  return &kPlugin;
}
