// Link authentication: HMAC-SHA256 from OpenSSL's libcrypto, loaded when a
// link secret is first used, so the engine builds and runs without OpenSSL
// until a secret is set.
//
// The handshake with a secret (see link_manager.cpp): the initiator's hello
// carries a fresh nonce, the acceptor answers with a fresh nonce of its own
// (kChallenge) before revealing anything, the initiator proves the secret
// over the whole exchange (kProof), and the acceptor's ack proves it back.
// Each proof is bound to its direction, so neither can be reflected, and to
// both nonces, so none can be replayed. The secret never crosses the wire.
//
// Threads: every function may be called from any thread.
#ifndef DATADIST_TRANSPORT_AUTH_H_
#define DATADIST_TRANSPORT_AUTH_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace datadist::auth {

constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;
using Proof = std::array<uint8_t, kProofBytes>;

// Empty when HMAC-SHA256 can be had; otherwise why not.
std::string unavailable();

// HMAC-SHA256(secret, label || transcript). Call only when unavailable() is empty.
Proof prove(const std::string &secret, const char *label, const std::string &transcript);
// Constant-time comparison.
bool same(const Proof &a, const uint8_t *b);
// Bytes from the kernel's random source.
void random_bytes(uint8_t *out, size_t n);

inline constexpr const char *kInitiatorLabel = "datadist_aio link v1 initiator";
inline constexpr const char *kAcceptorLabel = "datadist_aio link v1 acceptor";

}  // namespace datadist::auth

#endif  // DATADIST_TRANSPORT_AUTH_H_
