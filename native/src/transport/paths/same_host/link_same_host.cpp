// The same-host path, the owner's side: kWriteFrom and kReadInto frames name
// the initiator's memory, which this end copies with one kernel call
// (same_host.h); a frame with device exports or UCX keys goes to that path.
#include <cerrno>
#include <cstring>
#include <string>

#include "log.h"
#include "transport/link.h"
#include "transport/paths/same_host/same_host.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

void Link::serve_peer_copy(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  if (!req.exports.empty()) {
    serve_device_copy(conn, header, req, write);
    return;
  }
  if (!req.ucx_keys.empty()) {
    serve_ucx(conn, header, req, write);
    return;
  }
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  // The peer's own ranges, checked before any byte moves: a write reads
  // them, a read writes them.
  if (st == LLM_SUCCESS && !peer_memory_->mapped(req.segments, !write)) {
    st = refuse_served(req.target.group, llm_datadist::LLM_PARAM_INVALID, target.why,
                       std::string("the initiator's ") + (write ? "source" : "destination") + " memory is not mapped " +
                           (write ? "readable" : "writable") + " in its process",
                       "refused a same-host operation: ");
  }
  if (st == LLM_SUCCESS && initiator_gone(conn)) return;
  if (st == LLM_SUCCESS) {
    std::string why;
    if (target.device) staged_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
    const int error = target.device
                          ? peer_copy_staged(*target.device, target.iov, req.segments, write, why)
                          : same_host::copy_pairs(*peer_memory_, host_->copy_pool(), target.iov, req.segments, write);
    if (error == -1) {
      st = refuse_served(req.target.group, llm_datadist::LLM_FAILED, target.why,
                         std::string("copying ") + (write ? "into" : "out of") + " device memory on the peer failed: " + why);
    } else if (error == ESRCH) {
      fail(LLM_LINK_FAILED, "the peer process is gone");
      return;
    }
    if (error > 0) {
      // The peer's memory changed under the copy: its own operation fails.
      st = refuse_served(req.target.group, llm_datadist::LLM_PARAM_INVALID, target.why,
                         std::string("the same-host copy failed: ") + std::strerror(error));
    }
  }
  if (st == LLM_SUCCESS && !write) note_read(req);
  send_answer(conn, answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, target.why));
}

}  // namespace datadist
