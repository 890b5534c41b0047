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

#include "transport/auth.h"
#include "transport/wire.h"

namespace datadist::handshake {

// A handshake frame's body: a fixed part T (Hello or HelloAck), then in this
// order the same-host info (kOffersSameHost), the connections the acceptor
// grants (ack only, kGrantsConnections), the initiator's local socket (hello
// only, kLocalSocket), its answer socket (hello only, kAnswerSocket), the
// sender's UCX worker address (kOffersUcx) and the authentication bytes (a nonce in a hello, a
// proof in an ack; kAuthenticated).
template <typename T>
struct Greeting {
  static constexpr bool kIsHello = std::is_same_v<T, wire::Hello>;
  static constexpr size_t kAuthBytes = kIsHello ? auth::kNonceBytes : auth::kProofBytes;
  static constexpr size_t kMaxBytes = sizeof(T) + sizeof(wire::SameHostInfo) + 2 * sizeof(uint32_t) + kAuthBytes +
                                      sizeof(uint32_t) + wire::kMaxUcxAddress;
  T fixed{};
  wire::SameHostInfo same_host{};
  uint32_t granted = 0;
  uint32_t local_socket = 0;  // the initiator's descriptor number
  uint32_t answer_socket = 0;  // likewise, of the link's answer socket
  std::array<uint8_t, auth::kProofBytes> auth{};
  std::string ucx_address;  // the sender's UCX worker (kOffersUcx)

  bool offers_same_host() const { return (fixed.flags & wire::kOffersSameHost) != 0; }
  bool grants() const { return !kIsHello && (fixed.flags & wire::kGrantsConnections) != 0; }
  bool authenticated() const { return (fixed.flags & wire::kAuthenticated) != 0; }
  bool local_socket_flag() const { return (fixed.flags & wire::kLocalSocket) != 0; }
  // A hello names a local socket only beside its same-host info.
  bool names_socket() const { return kIsHello && offers_same_host() && local_socket_flag(); }
  bool answer_socket_flag() const { return (fixed.flags & wire::kAnswerSocket) != 0; }
  // And an answer socket only beside a local socket.
  bool names_answer_socket() const { return names_socket() && answer_socket_flag(); }
  bool offers_ucx() const { return (fixed.flags & wire::kOffersUcx) != 0; }

  // The body as sent, without the authentication bytes when `with_auth` is false.
  std::string bytes(bool with_auth = true) const {
    std::string out(reinterpret_cast<const char *>(&fixed), sizeof(T));
    if (offers_same_host()) out.append(reinterpret_cast<const char *>(&same_host), sizeof(same_host));
    if (grants()) out.append(reinterpret_cast<const char *>(&granted), sizeof(granted));
    if (names_socket()) out.append(reinterpret_cast<const char *>(&local_socket), sizeof(local_socket));
    if (names_answer_socket()) out.append(reinterpret_cast<const char *>(&answer_socket), sizeof(answer_socket));
    if (offers_ucx()) {
      const auto length = static_cast<uint32_t>(ucx_address.size());
      out.append(reinterpret_cast<const char *>(&length), sizeof(length));
      out += ucx_address;
    }
    if (with_auth && authenticated()) out.append(reinterpret_cast<const char *>(auth.data()), kAuthBytes);
    return out;
  }

  // Reads a whole body; false unless it is exactly what its flags announce.
  bool parse(const std::string &body) {
    if (body.size() < sizeof(T)) return false;
    std::memcpy(&fixed, body.data(), sizeof(T));
    const size_t before_ucx = sizeof(T) + (offers_same_host() ? sizeof(same_host) : 0) +
                              (grants() ? sizeof(granted) : 0) + (names_socket() ? sizeof(local_socket) : 0) +
                              (names_answer_socket() ? sizeof(answer_socket) : 0);
    uint32_t ucx_length = 0;
    if (offers_ucx()) {
      if (body.size() < before_ucx + sizeof(ucx_length)) return false;
      std::memcpy(&ucx_length, body.data() + before_ucx, sizeof(ucx_length));
      if (ucx_length == 0 || ucx_length > wire::kMaxUcxAddress) return false;
    }
    const size_t expected = before_ucx + (offers_ucx() ? sizeof(ucx_length) + ucx_length : 0) +
                            (authenticated() ? kAuthBytes : 0);
    if (body.size() != expected) return false;
    size_t at = sizeof(T);
    // Each optional part in order, when its flags announce it.
    auto take = [&](bool present, void *part, size_t size) {
      if (!present) return;
      std::memcpy(part, body.data() + at, size);
      at += size;
    };
    take(offers_same_host(), &same_host, sizeof(same_host));
    take(grants(), &granted, sizeof(granted));
    take(names_socket(), &local_socket, sizeof(local_socket));
    take(names_answer_socket(), &answer_socket, sizeof(answer_socket));
    if (offers_ucx()) {
      ucx_address.assign(body.data() + at + sizeof(ucx_length), ucx_length);
      at += sizeof(ucx_length) + ucx_length;
    }
    take(authenticated(), auth.data(), kAuthBytes);
    return true;
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
