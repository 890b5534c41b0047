// Inline frames, the owner's side: a kWrite frame's bytes come after its
// header, a kRead's answer carries them (staged where the cache is device
// memory, link_staged.cpp).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "log.h"
#include "transport/link.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

void Link::serve_write(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  auto target = std::make_shared<ResolvedTarget>();  // its pins hold the memory until the data are in
  const Status st = resolve_in_group(req, *target);
  const uint64_t op_id = header.op_id;
  const uint64_t group = req.target.group;
  Connection *c = &conn;
  if (st == LLM_SUCCESS && target->device) {
    staged_bytes_served_.fetch_add(header.data_len, std::memory_order_relaxed);
    const uint64_t bytes = header.data_len;
    hand_off(conn, [this, c, target, op_id, group, bytes] {
      bool ok = true;
      std::string why;
      Status status = LLM_SUCCESS;
      if (!receive_staged(c->in, *target->device, target->iov, bytes, true, ok, why) && ok) {
        status = refuse_served(group, llm_datadist::LLM_FAILED, target->why,
                               "copying into device memory on the peer failed: " + why);
      }
      if (!ok) {
        fail(LLM_LINK_FAILED, "connection closed by the peer");
        return false;
      }
      send_answer(*c, answer(FrameType::kWriteAck, op_id, status, target->why));
      return true;
    });
    return;
  }
  std::vector<iovec> to;
  if (st == LLM_SUCCESS) to = target->iov;
  expect_data(conn, std::move(to), st == LLM_SUCCESS ? 0 : header.data_len, [this, c, target, op_id, st] {
    send_answer(*c, answer(FrameType::kWriteAck, op_id, st, target->why));
    return true;
  });
}

void Link::serve_read(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  OutFrame out = answer(FrameType::kReadData, header.op_id, st, target.why);
  if (st == LLM_SUCCESS) {
    note_read(req);
    out.header.data_len = req.total_bytes;
    out.data = std::move(target.iov);
    if (target.device) staged_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
    out.device = std::move(target.device);
    out.pin = std::make_shared<std::vector<std::shared_ptr<CacheEntry>>>(std::move(target.pins));
  }
  send_answer(conn, std::move(out));
}

void Link::note_read(const wire::Request &req) {
  if ((req.target.flags & wire::kReleaseKey) == 0) return;
  std::vector<uint32_t> tensors;
  for (const wire::Range &r : req.ranges) tensors.push_back(r.tensor);
  host_->registry().note_pulled({req.target.req_id, req.target.model_id, req.target.prefix_id}, tensors);
}

}  // namespace datadist
