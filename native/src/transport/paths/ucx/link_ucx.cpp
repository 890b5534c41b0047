// The UCX path, the owner's side: a frame with UCX keys names the
// initiator's memory, which this end gets or puts to or from its own
// (ucx_path.h).
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "log.h"
#include "transport/link.h"
#include "transport/paths/ucx/ucx_path.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

void Link::serve_ucx(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  const FrameType type = write ? FrameType::kWriteAck : FrameType::kReadData;
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  if (st != LLM_SUCCESS) {
    send_answer(conn, answer(type, header.op_id, st, target.why));
    return;
  }
  // This end's memory as UCX's mappings. Where it cannot be had (device
  // memory this UCX does not reach), the initiator sends the frame again
  // inline: nothing has moved.
  std::vector<std::shared_ptr<ucx::Mapping>> mine;
  std::vector<datadist_ucx_mem *> mems(target.iov.size(), nullptr);
  std::string unmapped;
  bool mapped = true;
  if (target.entry) {
    mapped = ucx::local_maps(ucx_->worker(), *target.entry, target.iov, mine, mems, unmapped);
  } else if (target.device) {
    mapped = false;
    unmapped = "device memory named by address";
  }
  // The CUDA transports copy on this thread too.
  if (mapped && target.device) mapped = target.device->make_current(unmapped);
  if (!mapped) {
    send_answer(conn, answer(type, header.op_id, llm_datadist::LLM_FEATURE_NOT_ENABLED,
                             "this end's UCX cannot move its memory: " + unmapped));
    return;
  }
  // One get or put per key: this end's ranges (checked above) against the
  // initiator's, which the key bounds.
  std::vector<std::vector<datadist_ucx_range>> by_key(req.ucx_keys.size());
  for (size_t i = 0; i < req.segments.size(); ++i) {
    by_key[req.segment_key[i]].push_back({static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base)),
                                          req.segments[i].addr, req.segments[i].length, mems[i]});
  }
  struct Served {
    std::shared_ptr<Link> link;
    Connection *conn;
    uint64_t op_id;
    bool write;
    wire::Request req;
    std::shared_ptr<const void> pin;  // this end's cache, alive until UCX is done with it
    std::vector<std::shared_ptr<ucx::Mapping>> mine;  // and its mappings
    std::mutex mu;
    size_t left = 0;
    int status = 0;
    std::string why;
  };
  auto served = std::make_shared<Served>();
  served->link = shared_from_this();
  served->conn = &conn;
  served->op_id = header.op_id;
  served->write = write;
  served->req = req;
  served->pin = target.entry;
  served->mine = std::move(mine);
  // Settles the frame once every get (or every put and the flush) is done.
  auto finish = [served](int status, const std::string &why) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(served->mu);
      if (status != 0 && served->status == 0) {
        served->status = status;
        served->why = why;
      }
      last = --served->left == 0;
    }
    if (!last) return;
    Link &link = *served->link;
    if (!link.begin_work()) return;
    Status result = LLM_SUCCESS;
    std::string words;
    if (served->status != 0) {
      result = link.refuse_served(
          served->req.target.group, llm_datadist::LLM_FAILED, words,
          std::string("UCX could not ") + (served->write ? "read the initiator's memory: " : "write the initiator's memory: ") +
              (served->why.empty() ? link.ucx_->worker()->describe(served->status) : served->why));
    } else {
      link.ucx_bytes_served_.fetch_add(served->req.total_bytes, std::memory_order_relaxed);
      if (!served->write) link.note_read(served->req);
    }
    link.send_answer(*served->conn,
                     answer(served->write ? FrameType::kWriteAck : FrameType::kReadData, served->op_id, result, words));
    link.end_work();
  };
  size_t posts = 0;
  for (const auto &ranges : by_key) posts += ranges.empty() ? 0 : 1;
  served->left = posts + (write ? 0 : 1) + 1;  // the gets or puts, the flush, and this thread's hold
  std::string why;
  bool posted = true;
  for (size_t k = 0; k < by_key.size() && posted; ++k) {
    if (by_key[k].empty()) continue;
    posted = write ? ucx_->get(req.ucx_key_bytes[k], by_key[k], finish, why)
                   : ucx_->put(req.ucx_key_bytes[k], by_key[k], finish, why);
    if (!posted) {
      // This post and those never tried end here.
      size_t never = 0;
      for (size_t j = k; j < by_key.size(); ++j) never += by_key[j].empty() ? 0 : 1;
      for (size_t j = 0; j < never; ++j) finish(-1, why);
      if (!write) finish(-1, why);
    }
  }
  if (posted && !write && !ucx_->flush(finish, why)) finish(-1, why);
  finish(0, {});
}

}  // namespace datadist
