// Fuzz target: the listener's handshake (hello, challenge and proof) and the
// link it makes, fed from bytes. A real LinkManager listens on loopback
// with the caches of fuzz_support.h registered; each input is what one
// connection sends. After each input the harness checks that no byte the
// peer may not write changed and that no answer carried a byte it may not
// read; ASan, UBSan and LeakSanitizer report everything else.
//
// Input: one mode byte (bit 0: the listener requires a link secret), then
// the byte stream. The listener never offers the same-host path here: a
// hello could otherwise name any process of this host (fuzz_link covers
// same-host frames against a child process).
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "registry.h"
#include "transport/socket_util.h"
#include "transport/link_manager.h"

namespace {

using namespace datadist;
using namespace dd_fuzz;

constexpr uint64_t kListenerId = 1;
constexpr int kIdleMs = 20;  // a handshake waiting for more (another connection of its link) gives up

struct Listener {
  explicit Listener(bool with_secret)
      : transport(kListenerId, 2, registry, options(with_secret)) {
    add_caches(registry);
    require(transport.listen("127.0.0.1", 0) == llm_datadist::LLM_SUCCESS, "cannot listen");
  }
  static TransportOptions options(bool with_secret) {
    TransportOptions o;
    o.connections_per_peer = 1;
    o.user_timeout_ms = 1000;
    o.same_host = false;
    if (with_secret) o.auth_key = "fuzz link secret";
    return o;
  }
  Registry registry;
  LinkManager transport;
};

Listener &listener(bool with_secret) {
  static Listener plain(false);
  static Listener secret(true);
  return with_secret ? secret : plain;
}

}  // namespace

// libcrypto (loaded by transport/auth.cpp for HMAC) keeps state for each
// thread that used it, which LeakSanitizer sees at exit; nothing of the engine's.
extern "C" const char *__lsan_default_suppressions() { return "leak:libcrypto.so\n"; }

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  if (std::getenv("FUZZ_LOG") == nullptr) ::setenv("DATADIST_AIO_LOG", "off", 1);
  arena_init();
  listener(false);
  listener(true);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const bool with_secret = (data[0] & 1) != 0;
  ++data;
  --size;
  arena_reset();
  bool timed_out = false;
  const int fd = net::connect_tcp("127.0.0.1", listener(with_secret).transport.listen_port(), "", 2000, timed_out);
  require(fd >= 0, "cannot connect to the listener");
  const std::vector<uint8_t> answers = exchange(fd, data, size, kIdleMs);
  ::close(fd);
  if (std::getenv("FUZZ_LOG") != nullptr) trace(answers);
  check_arena("fuzz_listen", answers);
  return 0;
}
