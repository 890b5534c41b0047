// A link's owner side: the peer's frames by type, resolved against this
// engine's caches and served by the link's paths, and the ordered
// transfers refused.
#include "transport/link.h"

#include "log.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

bool Link::handle_frame(Connection &conn, const FrameHeader &header, std::vector<uint8_t> &body) {
  const auto type = static_cast<FrameType>(header.type);
  switch (type) {
    case FrameType::kLookup: {
      wire::Request req;
      const std::string problem = wire::decode_request(body, req);
      if (!problem.empty()) {
        fail(LLM_LINK_FAILED, "malformed request from the peer (" + problem + "); closing the link");
        return false;
      }
      serve_lookup(conn, header, req);
      return !is_down();
    }
    case FrameType::kWrite:
    case FrameType::kRead:
    case FrameType::kWriteFrom:
    case FrameType::kReadInto: {
      // A write's bytes follow it (kWrite), or the frame names the peer's
      // memory (kWriteFrom, kReadInto).
      const bool write = type == FrameType::kWrite || type == FrameType::kWriteFrom;
      wire::Request req;
      std::string problem =
          wire::decode_request(body, req, type == FrameType::kWriteFrom || type == FrameType::kReadInto);
      if (problem.empty() && type == FrameType::kWrite && header.data_len != req.total_bytes) {
        problem = "data length does not match the ranges";
      }
      std::shared_ptr<DataPath> path;
      std::shared_ptr<const void> view;
      if (problem.empty()) path = path_serving(req);
      if (problem.empty() && !path) {
        problem = req.trailer.empty()
                      ? "a frame by reference, but this end cannot reach the peer's memory"
                      : "a frame by reference for path " + std::to_string(req.trailer_path) + ", which this link lacks";
      }
      if (problem.empty()) problem = path->read_trailer(req, view);
      if (!problem.empty()) {
        fail(LLM_LINK_FAILED, "malformed request from the peer (" + problem + "); closing the link");
        return false;
      }
      serve_by_path(conn, header, std::move(req), write, path, std::move(view));
      return !is_down();
    }
    case FrameType::kPathMessage: {
      bool ok = false;
      for (const auto &path : paths_) {
        if (path->takes(body, ok)) break;
      }
      if (!ok) {
        fail(LLM_LINK_FAILED, "a path message from the peer that no path of the link takes; closing the link");
        return false;
      }
      return true;
    }
    case FrameType::kWriteAck:
    case FrameType::kReadData:
    case FrameType::kLookupReply:
    case FrameType::kUnlinkAck:
      return take_answer(header, body, &conn);
    case FrameType::kUnlink: {
      // Forget the link first, so the peer's unlink returns with both ends gone.
      host_->detach(shared_from_this());
      OutFrame ack;
      ack.header = wire::make_header(FrameType::kUnlinkAck, header.op_id, 0, 0);
      ack.close_after = true;
      enqueue(conn, std::move(ack));
      return true;
    }
    default:
      fail(LLM_LINK_FAILED, "unexpected frame type " + std::to_string(header.type) + "; closing the link");
      return false;
  }
}

Status Link::resolve_in_group(const wire::Request &req, ResolvedTarget &target) {
  served_ops_.fetch_add(1, std::memory_order_relaxed);
  served_bytes_.fetch_add(req.total_bytes, std::memory_order_relaxed);
  const uint64_t group = req.target.group;
  if (group != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_groups_.has(group)) {
      target.why = "an earlier request of the same ordered transfer (an earlier layer) was refused";
      return llm_datadist::LLM_FAILED;
    }
  }
  Status st = resolve_request(host_->registry(), req, target);
  if (st == LLM_SUCCESS) st = take_uses(target);
  if (st != LLM_SUCCESS) refuse_group(group);
  return st;
}

Status Link::take_uses(ResolvedTarget &target) {
  const std::weak_ptr<Link> weak = shared_from_this();
  for (const std::shared_ptr<CacheEntry> &entry : target.pins) {
    // Memory the engine allocated is held by the pin itself; only the
    // caller's is waited for.
    if (!entry->caller_owned()) continue;
    const int64_t id = entry->id;
    auto cut = [weak, id] {
      if (auto link = weak.lock()) {
        link->fail(LLM_LINK_FAILED, "cache " + std::to_string(id) +
                                        " was unregistered while the peer's operation on it was still running; "
                                        "closing the link");
      }
    };
    std::shared_ptr<MemoryUse> use = MemoryUse::take(entry, std::move(cut));
    if (!use) {
      target.uses.clear();
      target.why = "cache " + std::to_string(id) + " was unregistered as the request came";
      return llm_datadist::LLM_KV_CACHE_NOT_EXIST;
    }
    target.uses.push_back(std::move(use));
  }
  return LLM_SUCCESS;
}

void Link::refuse_group(uint64_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  refused_groups_.add(group);
}

Status Link::refuse_served(uint64_t group, Status status, std::string &out, std::string why, const char *context) {
  out = std::move(why);
  log_warning("link to cluster " + std::to_string(peer_id_) + ": " + context + out);
  refuse_group(group);
  return status;
}

bool Link::initiator_gone(const Connection &conn) {
  if (!net::peer_closed(conn.fd)) return false;
  fail(LLM_LINK_FAILED, "the peer closed the link before its operation was served");
  return true;
}

size_t Link::refused_group_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_groups_.size();
}

std::shared_ptr<DataPath> Link::path_serving(const wire::Request &req) const {
  for (const auto &path : paths_) {
    if (path->carries_bytes() != req.by_reference && path->serves(req)) return path;
  }
  return nullptr;
}

void Link::serve_by_path(Connection &conn, const FrameHeader &header, wire::Request req, bool write,
                         const std::shared_ptr<DataPath> &path, std::shared_ptr<const void> view) {
  auto frame = std::make_shared<ServedFrame>();
  frame->req = std::move(req);
  frame->write = write;
  frame->view = std::move(view);
  const Status st = resolve_in_group(frame->req, frame->target);
  if (st != LLM_SUCCESS) {
    OutFrame refusal = answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, frame->target.why);
    if (header.data_len == 0) {
      send_answer(conn, std::move(refusal));
      return;
    }
    // The bytes that follow go nowhere; the refusal once they are read.
    auto sent = std::make_shared<OutFrame>(std::move(refusal));
    Connection *c = &conn;
    expect_data(conn, {}, header.data_len, [this, c, sent] {
      send_answer(*c, std::move(*sent));
      return true;
    });
    return;
  }
  if (path->checks_initiator_first() && initiator_gone(conn)) return;
  const bool counted = path->reap_waits();  // else: counted only while answered
  if (counted && !begin_work()) return;  // being reaped: the peer's operation ends with the link
  std::shared_ptr<Link> self = shared_from_this();
  frame->keep = self;
  const uint64_t op_id = header.op_id;
  Connection *c = &conn;
  ServedFrame *served = frame.get();
  DataPath *by = path.get();
  frame->done = [self, c, op_id, served, by, counted](Moved moved) {
    if (!counted && !self->begin_work()) return;  // reaped meanwhile: no answer
    self->end_served(*c, op_id, *served, *by, std::move(moved));
    self->end_work();
  };
  ConnectionData data(*this, conn);
  if (path->carries_bytes()) frame->data = &data;
  path->serve(std::move(frame));
}

void Link::end_served(Connection &conn, uint64_t op_id, const ServedFrame &frame, DataPath &path, Moved moved) {
  if (moved.peer_gone) {
    fail(LLM_LINK_FAILED, "the peer process is gone");
    return;
  }
  Status st = moved.status;
  std::string words;
  if (st != LLM_SUCCESS && moved.again_inline) {
    words = std::move(moved.why);  // not a refusal of the transfer
  } else if (st != LLM_SUCCESS) {
    st = refuse_served(frame.req.target.group, st, words, std::move(moved.why), moved.context);
  } else if (!frame.write) {
    note_read(frame.req);
  }
  OutFrame out = answer(frame.write ? FrameType::kWriteAck : FrameType::kReadData, op_id, st, words);
  if (st == LLM_SUCCESS && !frame.write && moved.data_bytes != 0) {
    out.header.data_len = moved.data_bytes;
    out.data = std::move(moved.data);
    out.device = std::move(moved.device);
    out.path = &path;
    out.pin = std::move(moved.pin);
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
