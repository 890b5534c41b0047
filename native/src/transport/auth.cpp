#include "transport/auth.h"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace datadist::auth {

namespace {

// The few libcrypto entry points used, as OpenSSL 1.1 and 3.x export them.
struct Crypto {
  using Md = const void *(*)();
  using Hmac = unsigned char *(*)(const void *md, const void *key, int key_len, const unsigned char *data,
                                  size_t data_len, unsigned char *out, unsigned int *out_len);
  using Memcmp = int (*)(const void *a, const void *b, size_t len);
  Md sha256 = nullptr;
  Hmac hmac = nullptr;
  Memcmp memcmp = nullptr;
  std::string error;
};

const Crypto &crypto() {
  static const Crypto loaded = [] {
    Crypto c;
    void *lib = nullptr;
    for (const char *name : {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"}) {
      lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      c.error = "OpenSSL's libcrypto (libcrypto.so.3 or .so.1.1) cannot be loaded";
      return c;
    }
    c.sha256 = reinterpret_cast<Crypto::Md>(::dlsym(lib, "EVP_sha256"));
    c.hmac = reinterpret_cast<Crypto::Hmac>(::dlsym(lib, "HMAC"));
    c.memcmp = reinterpret_cast<Crypto::Memcmp>(::dlsym(lib, "CRYPTO_memcmp"));
    if (c.sha256 == nullptr || c.hmac == nullptr || c.memcmp == nullptr) {
      c.error = "OpenSSL's libcrypto lacks EVP_sha256, HMAC or CRYPTO_memcmp";
    }
    return c;
  }();
  return loaded;
}

}  // namespace

std::string unavailable() { return crypto().error; }

Proof prove(const std::string &secret, const char *label, const std::string &transcript) {
  const Crypto &c = crypto();
  std::string message(label);
  message.push_back('\0');
  message += transcript;
  Proof out{};
  unsigned int len = 0;
  c.hmac(c.sha256(), secret.data(), static_cast<int>(secret.size()),
         reinterpret_cast<const unsigned char *>(message.data()), message.size(), out.data(), &len);
  return out;
}

bool same(const Proof &a, const uint8_t *b) { return crypto().memcmp(a.data(), b, a.size()) == 0; }

void random_bytes(uint8_t *out, size_t n) {
  size_t done = 0;
  while (done < n) {
    const ssize_t got = ::getrandom(out + done, n - done, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      break;
    }
    done += static_cast<size_t>(got);
  }
}

}  // namespace datadist::auth
