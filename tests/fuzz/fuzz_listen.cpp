// Fuzz target: the listener's handshake (hello, challenge and proof) and the
// link it makes, fed from bytes. A real LinkManager listens on loopback
// with the caches of fuzz_support.h registered; each input is what one
// connection sends. After each input the harness checks that no byte the
// peer may not write changed and that no answer carried a byte it may not
// read; ASan, UBSan and LeakSanitizer report everything else.
//
// Input: one mode byte, then the byte stream. Mode bit 0: the listener
// requires a link secret. Bit 1: the listener also encrypts its links
// (TLS, tls.h); the harness first runs the authenticated handshake as a
// legitimate initiator would, so the input meets what follows it: with bit
// 2 clear, the acceptor's TLS handshake (the input is the initiator's side
// of it, from its ClientHello); with bit 2 set, the harness completes the
// TLS handshake and the input is then sent through it, as frames on the
// link's record path (bit 3: as raw bytes after the handshake instead,
// records the acceptor must refuse). The listener never offers the
// same-host path here: a hello could otherwise name any process of this
// host (fuzz_link covers same-host frames against a child process).
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "registry.h"
#include "transport/auth.h"
#include "transport/handshake.h"
#include "transport/link_manager.h"
#include "transport/socket_util.h"
#include "transport/tls.h"

namespace {

using namespace datadist;
using namespace dd_fuzz;

constexpr uint64_t kListenerId = 1;
constexpr int kIdleMs = 20;  // a handshake waiting for more (another connection of its link) gives up
constexpr uint64_t kHarnessId = 9;
constexpr const char *kSecret = "fuzz link secret";
constexpr uint8_t kWithSecret = 1, kEncrypted = 2, kThroughTls = 4, kRawAfterTls = 8;

struct Listener {
  Listener(bool with_secret, bool encrypt) : transport(kListenerId, 2, registry, options(with_secret, encrypt)) {
    add_caches(registry);
    require(transport.listen("127.0.0.1", 0) == llm_datadist::LLM_SUCCESS, "cannot listen");
  }
  static TransportOptions options(bool with_secret, bool encrypt) {
    TransportOptions o;
    o.connections_per_peer = 1;
    o.user_timeout_ms = 1000;
    o.paths.same_host = false;
    if (with_secret) o.auth_key = kSecret;
    o.encrypt = encrypt;
    return o;
  }
  Registry registry;
  LinkManager transport;
};

Listener &listener(uint8_t mode) {
  static Listener plain(false, false);
  static Listener secret(true, false);
  static Listener encrypted(true, true);
  if ((mode & kEncrypted) != 0) return encrypted;
  return (mode & kWithSecret) != 0 ? secret : plain;
}

// The authenticated handshake of an initiator that encrypts, up to its ack;
// the connection's TLS key, from what both ends said.
tls::Key greet(int fd) {
  static uint64_t link_nonce = 0;
  handshake::Hello hello;
  hello.fixed = {kHarnessId, kListenerId, ++link_nonce, 1, 0, 1, wire::kAuthenticated | wire::kEncrypted};
  auth::random_bytes(hello.auth.data(), auth::kNonceBytes);
  std::string transcript = hello.bytes();
  const std::string sent = handshake::frame(wire::FrameType::kHello, transcript);
  require(net::write_full(fd, sent.data(), sent.size()), "cannot send the hello");
  wire::FrameHeader header{};
  std::string nonce(auth::kNonceBytes, '\0');
  require(net::read_full(fd, &header, sizeof(header)) && header.type == static_cast<uint16_t>(wire::FrameType::kChallenge) &&
              header.body_len == nonce.size() && net::read_full(fd, nonce.data(), nonce.size()),
          "no challenge from the listener");
  transcript += nonce;
  const auth::Proof proof = auth::prove(kSecret, auth::kInitiatorLabel, transcript);
  const std::string proof_frame =
      handshake::frame(wire::FrameType::kProof, std::string(reinterpret_cast<const char *>(proof.data()), proof.size()));
  require(net::write_full(fd, proof_frame.data(), proof_frame.size()), "cannot send the proof");
  handshake::HelloAck ack;
  std::string body;
  const bool answered = net::read_full(fd, &header, sizeof(header));
  if (!answered || header.type != static_cast<uint16_t>(wire::FrameType::kHelloAck) || header.status != 0) {
    std::fprintf(stderr, "fuzz: no ack for the harness's link: %s, type %u, status %#x\n",
                 answered ? "answered" : net::errno_text().c_str(), header.type, header.status);
  }
  require(answered && header.type == static_cast<uint16_t>(wire::FrameType::kHelloAck) && header.status == 0 &&
              header.body_len <= handshake::HelloAck::kMaxBytes,
          "the listener refused the harness's link");
  body.resize(header.body_len);
  require(net::read_full(fd, body.data(), body.size()) && ack.parse(body) && (ack.fixed.flags & wire::kEncrypted) != 0,
          "a malformed ack");
  return tls::derive_key(kSecret, transcript + ack.bytes(false));
}

// As exchange(), through `session`: the input goes as plaintext, the answers
// come back decrypted, until nothing came for idle_ms.
std::vector<uint8_t> exchange_tls(tls::Session &session, int fd, const uint8_t *input, size_t size, int idle_ms) {
  std::vector<uint8_t> answers;
  std::vector<uint8_t> buf(64 * 1024);
  size_t sent = 0;
  bool writing = true;
  for (;;) {
    bool progress = false;
    if (writing && sent < size) {
      iovec rest{const_cast<uint8_t *>(input) + sent, size - sent};
      const ssize_t n = session.write_now(&rest, 1);
      if (n < 0) writing = false;  // the acceptor closed the link
      if (n > 0) sent += static_cast<size_t>(n);
      progress = n > 0;
    }
    if (writing && sent == size) {
      ::shutdown(fd, SHUT_WR);  // as exchange(): the link ends once it has read it all
      writing = false;
    }
    for (;;) {
      const ssize_t n = session.read_now(buf.data(), buf.size());
      if (n <= 0) {
        if (n == 0 || errno != EAGAIN) return answers;  // closed, or a record it refused
        break;
      }
      answers.insert(answers.end(), buf.begin(), buf.begin() + n);
      progress = true;
    }
    if (progress) continue;
    pollfd p{fd, static_cast<short>(POLLIN | (writing ? POLLOUT : 0)), 0};
    if (::poll(&p, 1, idle_ms) <= 0) break;
  }
  return answers;
}

}  // namespace

// libcrypto (loaded by transport/auth.cpp for HMAC) and libssl (tls.cpp)
// keep state for each thread that used them, which LeakSanitizer sees at
// exit; nothing of the engine's.
extern "C" const char *__lsan_default_suppressions() { return "leak:libcrypto.so\nleak:libssl.so\n"; }

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  if (std::getenv("FUZZ_LOG") == nullptr) ::setenv("DATADIST_AIO_LOG", "off", 1);
  arena_init();
  require(tls::unavailable().empty(), "fuzz_listen needs OpenSSL's libssl");
  listener(0);
  listener(kWithSecret);
  listener(kEncrypted);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  ++data;
  --size;
  arena_reset();
  bool timed_out = false;
  const int fd = net::connect_tcp("127.0.0.1", listener(mode).transport.listen_port(), "", 2000, timed_out);
  require(fd >= 0, "cannot connect to the listener");
  std::vector<uint8_t> answers;
  if ((mode & kEncrypted) == 0) {
    answers = exchange(fd, data, size, kIdleMs);
  } else {
    net::set_receive_timeout(fd, 8000);  // a loaded host under ASan can take a while to admit the link
    const tls::Key key = greet(fd);
    if ((mode & kThroughTls) == 0) {
      answers = exchange(fd, data, size, kIdleMs);  // the input meets the acceptor's TLS handshake
    } else {
      std::string why;
      std::unique_ptr<tls::Session> session = tls::Session::create(fd, false, key, why);
      require(session != nullptr, "cannot make a TLS session");
      require(session->handshake_until(std::chrono::steady_clock::now() + std::chrono::seconds(2)),
              "the TLS handshake with the listener failed");
      if ((mode & kRawAfterTls) != 0) {
        answers = exchange(fd, data, size, kIdleMs);  // records the acceptor must refuse: nothing readable comes
      } else {
        answers = exchange_tls(*session, fd, data, size, kIdleMs);
      }
    }
  }
  ::close(fd);
  if (std::getenv("FUZZ_LOG") != nullptr) trace(answers);
  check_arena("fuzz_listen", answers);
  return 0;
}
