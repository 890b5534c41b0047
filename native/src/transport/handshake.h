// The handshake frames as both ends build and read them: a hello (initiator)
// or its ack (acceptor), each a fixed part followed by the optional parts its
// flags announce. Used by the listener (non-blocking, from buffers) and by
// the initiator (blocking sockets). No state; any thread.
#ifndef DATADIST_TRANSPORT_HANDSHAKE_H_
#define DATADIST_TRANSPORT_HANDSHAKE_H_

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "transport/auth.h"
#include "transport/wire.h"

namespace datadist::handshake {

// One path's part of a hello or an ack: its number (paths/paths.h) and its
// bytes, which only that path reads.
struct Part {
  uint16_t path = 0;
  std::string bytes;
  bool operator==(const Part &other) const { return path == other.path && bytes == other.bytes; }
};
using Parts = std::vector<Part>;

// The bytes of path `path` in `parts`; nullptr when it has none.
inline const std::string *find_part(const Parts &parts, uint16_t path) {
  for (const Part &part : parts) {
    if (part.path == path) return &part.bytes;
  }
  return nullptr;
}

// A handshake frame's body: a fixed part T (Hello or HelloAck), then in this
// order the connections the acceptor grants (ack only, kGrantsConnections),
// the paths' parts (kPathParts) and the authentication bytes (a nonce in a
// hello, a proof in an ack; kAuthenticated).
template <typename T>
struct Greeting {
  static constexpr bool kIsHello = std::is_same_v<T, wire::Hello>;
  static constexpr size_t kAuthBytes = kIsHello ? auth::kNonceBytes : auth::kProofBytes;
  static constexpr size_t kMaxBytes = sizeof(T) + 2 * sizeof(uint32_t) +
                                      wire::kMaxPathParts * (sizeof(wire::PathPart) + wire::kMaxPathPartBytes) +
                                      kAuthBytes;
  T fixed{};
  uint32_t granted = 0;
  Parts parts;  // sent when not empty (kPathParts is set then)
  std::array<uint8_t, auth::kProofBytes> auth{};

  bool grants() const { return !kIsHello && (fixed.flags & wire::kGrantsConnections) != 0; }
  bool authenticated() const { return (fixed.flags & wire::kAuthenticated) != 0; }
  bool has_parts() const { return (fixed.flags & wire::kPathParts) != 0; }

  // The body as sent, without the authentication bytes when `with_auth` is
  // false; kPathParts follows `parts`.
  std::string bytes(bool with_auth = true) {
    fixed.flags = parts.empty() ? fixed.flags & ~uint32_t{wire::kPathParts} : fixed.flags | wire::kPathParts;
    std::string out(reinterpret_cast<const char *>(&fixed), sizeof(T));
    if (grants()) out.append(reinterpret_cast<const char *>(&granted), sizeof(granted));
    if (!parts.empty()) {
      const auto count = static_cast<uint32_t>(parts.size());
      out.append(reinterpret_cast<const char *>(&count), sizeof(count));
      for (const Part &part : parts) {
        const wire::PathPart head{part.path, 0, static_cast<uint32_t>(part.bytes.size())};
        out.append(reinterpret_cast<const char *>(&head), sizeof(head));
        out += part.bytes;
      }
    }
    if (with_auth && authenticated()) out.append(reinterpret_cast<const char *>(auth.data()), kAuthBytes);
    return out;
  }

  // Reads a whole body; false unless it is exactly what its flags announce
  // (at most kMaxPathParts parts, each of at most kMaxPathPartBytes, no path
  // twice).
  bool parse(const std::string &body) {
    if (body.size() < sizeof(T)) return false;
    std::memcpy(&fixed, body.data(), sizeof(T));
    size_t at = sizeof(T);
    auto take = [&](void *out, size_t size) {
      if (body.size() - at < size) return false;
      std::memcpy(out, body.data() + at, size);
      at += size;
      return true;
    };
    if (grants() && !take(&granted, sizeof(granted))) return false;
    parts.clear();
    if (has_parts()) {
      uint32_t count = 0;
      if (!take(&count, sizeof(count)) || count == 0 || count > wire::kMaxPathParts) return false;
      for (uint32_t i = 0; i < count; ++i) {
        wire::PathPart head{};
        if (!take(&head, sizeof(head)) || head.zero != 0 || head.length > wire::kMaxPathPartBytes ||
            body.size() - at < head.length || find_part(parts, head.path) != nullptr) {
          return false;
        }
        parts.push_back(Part{head.path, body.substr(at, head.length)});
        at += head.length;
      }
    }
    if (authenticated() && !take(auth.data(), kAuthBytes)) return false;
    return at == body.size();
  }
};

using Hello = Greeting<wire::Hello>;
using HelloAck = Greeting<wire::HelloAck>;

// The most connections a hello may ask for.
constexpr uint32_t kMaxConnections = 64;

// A whole frame: header and body (status for refusals).
std::string frame(wire::FrameType type, const std::string &body,
                  llm_datadist::Status status = llm_datadist::LLM_SUCCESS);

// A refusal: an ack with `status` that names nothing of this end.
std::string refusal(llm_datadist::Status status);

// The answer to a connection past the count the acceptor grants: an ack
// that names nothing but that count; the connection closes after it.
std::string surplus(uint32_t granted);

}  // namespace datadist::handshake

#endif  // DATADIST_TRANSPORT_HANDSHAKE_H_
