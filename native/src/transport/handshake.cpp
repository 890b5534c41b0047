#include "transport/handshake.h"

namespace datadist::handshake {

std::string frame(wire::FrameType type, const std::string &body, llm_datadist::Status status) {
  const wire::FrameHeader header = wire::make_header(type, 0, static_cast<uint32_t>(body.size()), 0, status);
  std::string out(reinterpret_cast<const char *>(&header), sizeof(header));
  return out + body;
}

std::string refusal(llm_datadist::Status status) { return frame(wire::FrameType::kHelloAck, HelloAck{}.bytes(), status); }

std::string surplus(uint32_t granted) {
  HelloAck ack;
  ack.fixed.flags = wire::kGrantsConnections;
  ack.granted = granted;
  return frame(wire::FrameType::kHelloAck, ack.bytes());
}

}  // namespace datadist::handshake
