// Frames whose device memory follows them on the connection: their path
// stages the bytes through pinned host buffers (paths/inline/), a chunk's
// copy overlapping the socket, on a thread of the I/O loop's blocking pool
// (the copies may wait); the link sends the chunks, and pads or fails a
// frame whose copy failed.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device/cuda_driver.h"
#include "device/staging.h"
#include "log.h"
#include "transport/link.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using wire::FrameType;

void Link::write_staged(Connection &conn, OutFrame frame) {
  const bool go_on = finish_staged(conn, frame);
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.busy = false;
    if (go_on && !conn.queue.empty()) arm_locked(conn);
  }
  end_work();
}

namespace {

// Zeros that keep a frame whole after its device copy failed mid-send.
constexpr size_t kPadBytes = 64 * 1024;

}  // namespace

bool Link::finish_staged(Connection &conn, OutFrame &frame) {
  const std::shared_ptr<cuda::Device> device = frame.device;  // outlives the copier and its pool buffers
  const uint64_t total = frame.header.data_len;
  bool header_out = false;
  // The header and body leave with the first chunk, once its copy has run.
  auto sink = [&](const uint8_t *bytes, size_t n) {
    iovec iov[3];
    size_t count = 0;
    if (!header_out) {
      iov[count++] = {&frame.header, sizeof(frame.header)};
      if (!frame.body.empty()) iov[count++] = {frame.body.data(), frame.body.size()};
    }
    iov[count++] = {const_cast<uint8_t *>(bytes), n};
    header_out = true;
    return send_all(conn, iov, count);
  };
  const staging::Result result = frame.path->send_device(*device, frame.data, frame.op_id == 0, sink);
  if (result.outcome == staging::Outcome::kDone) return after_send(frame, true);
  if (result.outcome == staging::Outcome::kIoFailed) return after_send(frame, false);
  const std::string why = "copying out of device memory failed: " + result.why;
  log_warning("link to cluster " + std::to_string(peer_id_) + ": " + why);
  if (frame.op_id == 0) {
    // The answer to a read: its status left with its header.
    if (header_out) {
      fail(LLM_LINK_FAILED, why + ", after part of a read's data was sent");
      return false;
    }
    OutFrame failed = answer(FrameType::kReadData, frame.header.op_id, llm_datadist::LLM_FAILED,
                             "copying out of device memory on the peer failed: " + result.why);
    std::vector<iovec> iov = frame_bytes(failed);
    return after_send(failed, send_all(conn, iov.data(), iov.size()));
  }
  // A write: it fails here. Once its header is out, the peer gets the frame
  // whole (zeros for the rest), and its answer cannot make it a success.
  fail_here(frame.op_id, llm_datadist::LLM_FAILED, why);
  if (!header_out) {
    mark(frame.op_id, true, true, llm_datadist::LLM_FAILED);
    return true;
  }
  const std::vector<uint8_t> zeros(static_cast<size_t>(std::min<uint64_t>(kPadBytes, total - result.moved)));
  bool ok = true;
  for (uint64_t left = total - result.moved; left > 0 && ok;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, zeros.size()));
    iovec pad{const_cast<uint8_t *>(zeros.data()), n};
    ok = send_all(conn, &pad, 1);
    left -= n;
  }
  return after_send(frame, ok);
}

}  // namespace datadist
