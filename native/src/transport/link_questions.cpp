// A link's questions to the peer (lookups, probes, unlink) and the
// owner's answer to a lookup.
#include "transport/link.h"

#include <cstring>

namespace datadist {

using llm_datadist::LLM_SUCCESS;
using llm_datadist::LLM_TIMEOUT;
using wire::FrameHeader;
using wire::FrameType;

std::shared_ptr<Link::LookupState> Link::send_question(FrameType type, const std::vector<uint8_t> &body,
                                                      Clock::time_point deadline) {
  auto state = std::make_shared<LookupState>();
  OutFrame out;
  out.body = body;
  out.header = wire::make_header(type, 0, static_cast<uint32_t>(out.body.size()), 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_ || is_down()) {
      state->status = down_reason_;
      state->done = true;
      return state;
    }
    out.op_id = next_op_++;
    OpenOp &op = open_[out.op_id];
    op.deadline = deadline;
    op.lookup = state;
    op.answer_type = type == FrameType::kLookup ? FrameType::kLookupReply : FrameType::kUnlinkAck;
  }
  out.header.op_id = out.op_id;
  host_->deadline_at(deadline);
  enqueue(next_connection(), std::move(out));
  return state;
}

bool Link::probe(Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (is_down() || (probe_ && !probe_->done)) return false;
  }
  // A cache id no registry hands out: the owner answers "not found".
  wire::Target target{};
  target.kind = wire::kById;
  target.cache_id = -1;
  auto state = send_question(FrameType::kLookup, wire::encode_request(target, {}), deadline);
  std::lock_guard<std::mutex> lock(mu_);
  probe_ = state;
  return !state->done;
}

Status Link::ask(FrameType type, const std::vector<uint8_t> &body, int timeout_ms, wire::LookupReply *reply) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto state = send_question(type, body, deadline);
  std::unique_lock<std::mutex> lock(mu_);
  if (!answered_cv_.wait_until(lock, deadline, [&] { return state->done; })) return LLM_TIMEOUT;
  if (reply != nullptr) *reply = state->reply;
  return state->status;
}

Status Link::lookup(const wire::Target &target, wire::LookupReply &reply, int timeout_ms) {
  return ask(FrameType::kLookup, wire::encode_request(target, {}), timeout_ms, &reply);
}

Status Link::request_unlink(int timeout_ms) {
  closing_.store(true, std::memory_order_release);
  return ask(FrameType::kUnlink, {}, timeout_ms, nullptr);
}

void Link::unlink_answered() {
  std::vector<uint64_t> asked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto &entry : open_) {
      if (entry.second.lookup && entry.second.answer_type == FrameType::kUnlinkAck) asked.push_back(entry.first);
    }
  }
  for (uint64_t op_id : asked) mark(op_id, true, true, LLM_SUCCESS);
}

void Link::serve_lookup(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  ResolvedTarget target;
  Status st = find_target(host_->registry(), req.target, target);
  wire::LookupReply reply{};
  if (st == LLM_SUCCESS) {
    const CacheEntry &entry = *target.entry;
    reply.cache_id = entry.id;
    reply.num_tensors = static_cast<uint32_t>(entry.addrs.size());
    reply.remote_accessible = entry.remote_accessible ? 1 : 0;
    reply.slot_size = entry.geometry.slot_size;
    reply.num_slots = entry.geometry.num_slots;
    reply.bound_slot = target.bound_slot;
  }
  OutFrame out;
  out.body.resize(sizeof(reply));
  std::memcpy(out.body.data(), &reply, sizeof(reply));
  out.header = wire::make_header(FrameType::kLookupReply, header.op_id, sizeof(reply), 0, st);
  enqueue(conn, std::move(out));
}

}  // namespace datadist
