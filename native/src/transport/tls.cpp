#include "transport/tls.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "transport/auth.h"

namespace datadist::tls {

namespace {

// OpenSSL's values for what is used here (stable since 1.1.1).
constexpr int kTls13 = 0x0304;
constexpr int kCtrlMode = 33;
constexpr int kCtrlReadAhead = 41;
constexpr int kCtrlMinProto = 123;
constexpr int kCtrlMaxProto = 124;
constexpr long kModePartialWrite = 0x1;
constexpr long kModeMovingBuffer = 0x2;
constexpr uint64_t kOpEnableKtls = uint64_t{1} << 3;  // 3.0 and later
constexpr uint64_t kOpIgnoreUnexpectedEof = uint64_t{1} << 7;  // 3.0 and later
constexpr uint64_t kOpNoTicket = uint64_t{1} << 14;
constexpr uint64_t kOpMiddleboxCompat = uint64_t{1} << 20;
constexpr int kBioGetKtlsSend = 73;
constexpr int kBioGetKtlsRecv = 76;
constexpr int kErrorWantRead = 2;
constexpr int kErrorWantWrite = 3;
constexpr int kErrorSyscall = 5;
constexpr int kErrorZeroReturn = 6;
constexpr int kFiletypePem = 1;
constexpr int kVerifyPeer = 0x01;
constexpr int kVerifyFailIfNoPeerCert = 0x02;
constexpr long kVerifyOk = 0;
// TLS_AES_128_GCM_SHA256 on the wire.
constexpr unsigned char kSuiteId[2] = {0x13, 0x01};
// The PSK's identity: one key per connection, so the name only says what it is.
constexpr char kIdentity[] = "datadist_aio link";
// What an acceptor with certificates sends once it has checked the
// initiator's (Session::confirm_).
constexpr uint8_t kConfirmByte = 0xc5;
// Pieces shorter than a record are gathered into one.
constexpr size_t kRecordBytes = 16384;
// What one read from the socket may take (read ahead): four records and
// their overhead per call.
constexpr size_t kReadBufferBytes = 4 * kRecordBytes + 1024;

using PskUse = int (*)(void *ssl, const void *md, const unsigned char **id, size_t *id_len, void **session);
using PskFind = int (*)(void *ssl, const unsigned char *id, size_t id_len, void **session);

// The libssl entry points used, as OpenSSL 1.1.1 and 3.x export them.
struct Ssl {
  const void *(*client_method)() = nullptr;
  const void *(*server_method)() = nullptr;
  void *(*ctx_new)(const void *method) = nullptr;
  long (*ctx_ctrl)(void *ctx, int cmd, long larg, void *parg) = nullptr;
  uint64_t (*ctx_set_options)(void *ctx, uint64_t op) = nullptr;
  uint64_t (*ctx_clear_options)(void *ctx, uint64_t op) = nullptr;
  int (*ctx_set_ciphersuites)(void *ctx, const char *str) = nullptr;
  int (*ctx_set_num_tickets)(void *ctx, size_t n) = nullptr;
  void (*ctx_set_read_buffer_len)(void *ctx, size_t len) = nullptr;
  void *(*ssl_new)(void *ctx) = nullptr;
  void (*ssl_free)(void *ssl) = nullptr;
  int (*set_fd)(void *ssl, int fd) = nullptr;
  int (*set_ex_data)(void *ssl, int idx, void *data) = nullptr;
  void *(*get_ex_data)(const void *ssl, int idx) = nullptr;
  void (*set_psk_use)(void *ssl, PskUse cb) = nullptr;
  void (*set_psk_find)(void *ssl, PskFind cb) = nullptr;
  int (*connect)(void *ssl) = nullptr;
  int (*accept)(void *ssl) = nullptr;
  int (*read_ex)(void *ssl, void *buf, size_t num, size_t *got) = nullptr;
  int (*write_ex)(void *ssl, const void *buf, size_t num, size_t *written) = nullptr;
  int (*get_error)(const void *ssl, int ret) = nullptr;
  int (*has_pending)(const void *ssl) = nullptr;
  const void *(*current_cipher)(const void *ssl) = nullptr;
  const char *(*cipher_standard_name)(const void *cipher) = nullptr;
  const void *(*cipher_find)(void *ssl, const unsigned char *ptr) = nullptr;
  void *(*session_new)() = nullptr;
  void (*session_free)(void *session) = nullptr;
  int (*session_set1_master_key)(void *session, const unsigned char *in, size_t len) = nullptr;
  int (*session_set_cipher)(void *session, const void *cipher) = nullptr;
  int (*session_set_protocol_version)(void *session, int version) = nullptr;
  void *(*get_wbio)(const void *ssl) = nullptr;
  void *(*get_rbio)(const void *ssl) = nullptr;
  long (*bio_ctrl)(void *bio, int cmd, long larg, void *parg) = nullptr;
  void (*ctx_free)(void *ctx) = nullptr;
  int (*ctx_use_chain_file)(void *ctx, const char *file) = nullptr;
  int (*ctx_use_key_file)(void *ctx, const char *file, int type) = nullptr;
  int (*ctx_check_key)(const void *ctx) = nullptr;
  int (*ctx_load_verify)(void *ctx, const char *ca_file, const char *ca_path) = nullptr;
  void (*ctx_set_verify)(void *ctx, int mode, void *callback) = nullptr;
  long (*get_verify_result)(const void *ssl) = nullptr;
  const char *(*verify_error_string)(long n) = nullptr;
  unsigned long (*err_get)() = nullptr;
  void (*err_clear)() = nullptr;
  const char *(*err_reason)(unsigned long e) = nullptr;
  unsigned long (*version_num)() = nullptr;
  void *client_ctx = nullptr;
  void *server_ctx = nullptr;
  std::string error;
};

template <typename F>
void bind(void *lib, F &fn, const char *name, std::string &missing) {
  fn = reinterpret_cast<F>(::dlsym(lib, name));
  if (fn == nullptr) missing += missing.empty() ? name : std::string(", ") + name;
}

void *make_context(const Ssl &s, bool server, std::string &why) {
  void *ctx = s.ctx_new(server ? s.server_method() : s.client_method());
  if (ctx == nullptr) {
    why = "SSL_CTX_new failed";
    return nullptr;
  }
  const bool v3 = s.version_num() >= 0x30000000UL;
  s.ctx_ctrl(ctx, kCtrlMinProto, kTls13, nullptr);
  s.ctx_ctrl(ctx, kCtrlMaxProto, kTls13, nullptr);
  s.ctx_ctrl(ctx, kCtrlMode, kModePartialWrite | kModeMovingBuffer, nullptr);
  s.ctx_ctrl(ctx, kCtrlReadAhead, 1, nullptr);
  s.ctx_set_read_buffer_len(ctx, kReadBufferBytes);
  s.ctx_set_options(ctx, kOpNoTicket | (v3 ? kOpEnableKtls | kOpIgnoreUnexpectedEof : 0));
  s.ctx_clear_options(ctx, kOpMiddleboxCompat);
  s.ctx_set_num_tickets(ctx, 0);
  if (s.ctx_set_ciphersuites(ctx, kCipherSuite) != 1) {
    why = std::string("libssl refuses the cipher suite ") + kCipherSuite;
  }
  return why.empty() ? ctx : nullptr;
}

const Ssl &ssl() {
  static const Ssl loaded = [] {
    Ssl s;
    if (!auth::unavailable().empty()) {
      s.error = auth::unavailable();
      return s;
    }
    void *lib = nullptr;
    for (const char *name : {"libssl.so.3", "libssl.so.1.1", "libssl.so"}) {
      lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      s.error = "OpenSSL's libssl (libssl.so.3 or .so.1.1) cannot be loaded";
      return s;
    }
    std::string missing;
    bind(lib, s.client_method, "TLS_client_method", missing);
    bind(lib, s.server_method, "TLS_server_method", missing);
    bind(lib, s.ctx_new, "SSL_CTX_new", missing);
    bind(lib, s.ctx_ctrl, "SSL_CTX_ctrl", missing);
    bind(lib, s.ctx_set_options, "SSL_CTX_set_options", missing);
    bind(lib, s.ctx_clear_options, "SSL_CTX_clear_options", missing);
    bind(lib, s.ctx_set_ciphersuites, "SSL_CTX_set_ciphersuites", missing);
    bind(lib, s.ctx_set_num_tickets, "SSL_CTX_set_num_tickets", missing);
    bind(lib, s.ctx_set_read_buffer_len, "SSL_CTX_set_default_read_buffer_len", missing);
    bind(lib, s.ssl_new, "SSL_new", missing);
    bind(lib, s.ssl_free, "SSL_free", missing);
    bind(lib, s.set_fd, "SSL_set_fd", missing);
    bind(lib, s.set_ex_data, "SSL_set_ex_data", missing);
    bind(lib, s.get_ex_data, "SSL_get_ex_data", missing);
    bind(lib, s.set_psk_use, "SSL_set_psk_use_session_callback", missing);
    bind(lib, s.set_psk_find, "SSL_set_psk_find_session_callback", missing);
    bind(lib, s.connect, "SSL_connect", missing);
    bind(lib, s.accept, "SSL_accept", missing);
    bind(lib, s.read_ex, "SSL_read_ex", missing);
    bind(lib, s.write_ex, "SSL_write_ex", missing);
    bind(lib, s.get_error, "SSL_get_error", missing);
    bind(lib, s.has_pending, "SSL_has_pending", missing);
    bind(lib, s.current_cipher, "SSL_get_current_cipher", missing);
    bind(lib, s.cipher_standard_name, "SSL_CIPHER_standard_name", missing);
    bind(lib, s.cipher_find, "SSL_CIPHER_find", missing);
    bind(lib, s.session_new, "SSL_SESSION_new", missing);
    bind(lib, s.session_free, "SSL_SESSION_free", missing);
    bind(lib, s.session_set1_master_key, "SSL_SESSION_set1_master_key", missing);
    bind(lib, s.session_set_cipher, "SSL_SESSION_set_cipher", missing);
    bind(lib, s.session_set_protocol_version, "SSL_SESSION_set_protocol_version", missing);
    bind(lib, s.get_wbio, "SSL_get_wbio", missing);
    bind(lib, s.get_rbio, "SSL_get_rbio", missing);
    // libcrypto's, found through libssl's own dependency on it.
    bind(lib, s.bio_ctrl, "BIO_ctrl", missing);
    bind(lib, s.ctx_free, "SSL_CTX_free", missing);
    bind(lib, s.ctx_use_chain_file, "SSL_CTX_use_certificate_chain_file", missing);
    bind(lib, s.ctx_use_key_file, "SSL_CTX_use_PrivateKey_file", missing);
    bind(lib, s.ctx_check_key, "SSL_CTX_check_private_key", missing);
    bind(lib, s.ctx_load_verify, "SSL_CTX_load_verify_locations", missing);
    bind(lib, s.ctx_set_verify, "SSL_CTX_set_verify", missing);
    bind(lib, s.get_verify_result, "SSL_get_verify_result", missing);
    bind(lib, s.verify_error_string, "X509_verify_cert_error_string", missing);
    bind(lib, s.err_get, "ERR_get_error", missing);
    bind(lib, s.err_clear, "ERR_clear_error", missing);
    bind(lib, s.err_reason, "ERR_reason_error_string", missing);
    bind(lib, s.version_num, "OpenSSL_version_num", missing);
    if (!missing.empty()) {
      s.error = "OpenSSL's libssl lacks " + missing + " (TLS 1.3 with external PSKs needs OpenSSL 1.1.1 or later)";
      return s;
    }
    std::string why;
    s.client_ctx = make_context(s, false, why);
    if (s.client_ctx != nullptr) s.server_ctx = make_context(s, true, why);
    if (s.server_ctx == nullptr) s.error = "OpenSSL cannot set up TLS 1.3: " + why;
    return s;
  }();
  return loaded;
}

// A TLS 1.3 session of `key` for the handshake of `ssl_object` (the caller owns it).
void *psk_session(void *ssl_object, const Key &key) {
  const Ssl &s = ssl();
  const void *cipher = s.cipher_find(ssl_object, kSuiteId);
  if (cipher == nullptr) return nullptr;
  void *session = s.session_new();
  if (session == nullptr) return nullptr;
  if (s.session_set1_master_key(session, key.data(), key.size()) != 1 || s.session_set_cipher(session, cipher) != 1 ||
      s.session_set_protocol_version(session, kTls13) != 1) {
    s.session_free(session);
    return nullptr;
  }
  return session;
}

// The OpenSSL error queue's first reason, else `fallback`; the queue is emptied.
std::string error_text(const char *fallback) {
  const Ssl &s = ssl();
  std::string text;
  while (unsigned long e = s.err_get()) {
    if (!text.empty()) continue;
    const char *reason = s.err_reason(e);
    text = reason != nullptr ? reason : "error " + std::to_string(e);
  }
  return text.empty() ? fallback : text;
}

}  // namespace

// The PSK callbacks find their session through the SSL object's app data.
struct Callbacks {
  static int use(void *ssl_object, const void *, const unsigned char **id, size_t *id_len, void **session) {
    auto *self = static_cast<Session *>(ssl().get_ex_data(ssl_object, 0));
    if (self == nullptr) return 0;
    *session = psk_session(ssl_object, self->key_);
    if (*session == nullptr) return 0;
    *id = reinterpret_cast<const unsigned char *>(kIdentity);
    *id_len = sizeof(kIdentity) - 1;
    return 1;
  }
  static int find(void *ssl_object, const unsigned char *id, size_t id_len, void **session) {
    auto *self = static_cast<Session *>(ssl().get_ex_data(ssl_object, 0));
    *session = nullptr;
    if (self == nullptr) return 0;
    // Another identity: no PSK, and with no certificate the handshake fails.
    if (id_len != sizeof(kIdentity) - 1 || std::memcmp(id, kIdentity, id_len) != 0) return 1;
    *session = psk_session(ssl_object, self->key_);
    return *session != nullptr ? 1 : 0;
  }
};

std::string unavailable() { return ssl().error; }

std::shared_ptr<const CertContexts> CertContexts::load(const Certificates &files, std::string &why) {
  const Ssl &s = ssl();
  if (!s.error.empty()) {
    why = s.error;
    return nullptr;
  }
  std::shared_ptr<CertContexts> out(new CertContexts());
  for (bool server : {false, true}) {
    void *ctx = make_context(s, server, why);
    if (ctx == nullptr) return nullptr;
    (server ? out->server_ : out->client_) = ctx;
    s.err_clear();
    if (s.ctx_use_chain_file(ctx, files.cert_file.c_str()) != 1) {
      why = "the certificate " + files.cert_file + " cannot be loaded: " + error_text("not a PEM certificate chain");
      return nullptr;
    }
    if (s.ctx_use_key_file(ctx, files.key_file.c_str(), kFiletypePem) != 1) {
      why = "the private key " + files.key_file + " cannot be loaded, or is not the key of the certificate " +
            files.cert_file + ": " + error_text("not a PEM private key");
      return nullptr;
    }
    if (s.ctx_check_key(ctx) != 1) {
      why = "the private key " + files.key_file + " is not the key of the certificate " + files.cert_file + ": " +
            error_text("they differ");
      return nullptr;
    }
    if (s.ctx_load_verify(ctx, files.ca_file.c_str(), nullptr) != 1) {
      why = "the CA file " + files.ca_file + " cannot be loaded: " + error_text("not a PEM certificate bundle");
      return nullptr;
    }
    // Both ends present a certificate the CA signed, or the handshake fails.
    s.ctx_set_verify(ctx, kVerifyPeer | kVerifyFailIfNoPeerCert, nullptr);
  }
  return out;
}

CertContexts::~CertContexts() {
  if (client_ != nullptr) ssl().ctx_free(client_);
  if (server_ != nullptr) ssl().ctx_free(server_);
}

Key derive_key(const std::string &secret, const std::string &transcript) {
  const auth::Proof proof = auth::prove(secret, kKeyLabel, transcript);
  Key key;
  std::memcpy(key.data(), proof.data(), key.size());
  return key;
}

std::unique_ptr<Session> Session::create(int fd, bool server, const Key &key, std::string &why,
                                         const CertContexts *certs) {
  const Ssl &s = ssl();
  if (!s.error.empty()) {
    why = s.error;
    return nullptr;
  }
  std::unique_ptr<Session> session(new Session());
  session->fd_ = fd;
  session->server_ = server;
  session->key_ = key;
  session->gather_.reset(new uint8_t[kRecordBytes]);
  void *ctx = certs != nullptr ? (server ? certs->server() : certs->client()) : (server ? s.server_ctx : s.client_ctx);
  void *object = s.ssl_new(ctx);
  if (object == nullptr) {
    why = error_text("SSL_new failed");
    return nullptr;
  }
  session->ssl_ = object;
  if (s.set_fd(object, fd) != 1 || s.set_ex_data(object, 0, session.get()) != 1) {
    why = error_text("SSL_set_fd failed");
    return nullptr;
  }
  if (certs != nullptr) {
    session->key_.fill(0);  // the certificates authenticate: no PSK
    session->confirm_ = true;
  } else if (server) {
    s.set_psk_find(object, &Callbacks::find);
  } else {
    s.set_psk_use(object, &Callbacks::use);
  }
  return session;
}

Session::~Session() {
  if (ssl_ != nullptr) ssl().ssl_free(ssl_);
  key_.fill(0);
}

void Session::set_nonblocking() {
  if (nonblocking_) return;
  nonblocking_ = true;
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
}

Session::Step Session::settle_locked(int ret, const char *what) {
  const Ssl &s = ssl();
  const int saved = errno;
  switch (s.get_error(ssl_, ret)) {
    case kErrorWantRead:
      return Step::kWantRead;
    case kErrorWantWrite:
      return Step::kWantWrite;
    case kErrorZeroReturn:
      if (error_.empty()) error_ = std::string("the peer closed the connection during ") + what;
      return Step::kFailed;
    case kErrorSyscall:
      if (error_.empty()) {
        error_ = error_text(saved != 0 ? std::strerror(saved) : "the connection closed");
        error_ = std::string(what) + ": " + error_;
      }
      return Step::kFailed;
    default:
      if (error_.empty()) {
        error_ = std::string(what) + ": " + error_text("failed");
        // A peer certificate that did not verify: the reason, as X509 gives it.
        const long verified = s.get_verify_result(ssl_);
        if (verified != kVerifyOk) {
          const char *reason = s.verify_error_string(verified);
          error_ += std::string(" (the peer's certificate: ") + (reason != nullptr ? reason : "did not verify") + ")";
        }
      }
      return Step::kFailed;
  }
}

Session::Step Session::handshake() {
  set_nonblocking();
  const Ssl &s = ssl();
  std::lock_guard<std::mutex> lock(mu_);
  if (established_) return Step::kDone;
  if (!error_.empty()) return Step::kFailed;
  s.err_clear();
  errno = 0;
  if (!handshaken_) {
    const int ret = server_ ? s.accept(ssl_) : s.connect(ssl_);
    if (ret != 1) return settle_locked(ret, "the TLS handshake");
    handshaken_ = true;
    key_.fill(0);  // the PSK served its one handshake
  }
  if (confirm_) {
    uint8_t byte = kConfirmByte;
    size_t moved = 0;
    const int ret = server_ ? s.write_ex(ssl_, &byte, 1, &moved) : s.read_ex(ssl_, &byte, 1, &moved);
    if (ret != 1) return settle_locked(ret, "the TLS handshake (the acceptor's confirmation)");
    if (byte != kConfirmByte) {
      error_ = "the TLS handshake: the acceptor's confirmation is not the byte it should be";
      return Step::kFailed;
    }
  }
  established_ = true;
  return Step::kDone;
}

bool Session::handshake_until(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    const Step step = handshake();
    if (step == Step::kDone) return true;
    if (step == Step::kFailed) return false;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{fd_, static_cast<short>(step == Step::kWantRead ? POLLIN : POLLOUT), 0};
    const int n = left > 0 ? ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30))) : 0;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty()) error_ = n == 0 ? "the TLS handshake timed out" : std::strerror(errno);
      return false;
    }
  }
}

ssize_t Session::read_now(void *buf, size_t len) {
  const Ssl &s = ssl();
  std::lock_guard<std::mutex> lock(mu_);
  if (!error_.empty()) {
    errno = EBADMSG;
    return -1;
  }
  s.err_clear();
  errno = 0;
  size_t got = 0;
  const int ret = s.read_ex(ssl_, buf, len, &got);
  if (ret == 1) return static_cast<ssize_t>(got);
  const int saved = errno;
  switch (s.get_error(ssl_, ret)) {
    case kErrorWantRead:
    case kErrorWantWrite:
      errno = EAGAIN;
      return -1;
    case kErrorZeroReturn:
      return 0;  // the peer's close_notify, or its plain end of stream
    case kErrorSyscall:
      if (saved == 0) return 0;
      errno = saved;
      return -1;
    default:
      error_ = error_text("a TLS record could not be read");
      errno = EBADMSG;
      return -1;
  }
}

ssize_t Session::write_now(const iovec *iov, size_t count) {
  const Ssl &s = ssl();
  size_t taken = 0;
  size_t piece = 0, offset = 0;  // where the caller's bytes not taken yet begin
  auto skip = [&](size_t bytes) {
    offset += bytes;
    while (piece < count && offset >= iov[piece].iov_len) offset -= iov[piece++].iov_len;
  };
  skip(0);
  for (;;) {
    const void *buf;
    size_t len;
    if (held_ != nullptr) {
      buf = held_;
      len = held_len_;
    } else {
      if (piece == count) break;
      const size_t first = iov[piece].iov_len - offset;
      if (first >= kRecordBytes) {
        buf = static_cast<const uint8_t *>(iov[piece].iov_base) + offset;
        len = first;
      } else {
        size_t at = 0, p = piece, o = offset;
        while (p < count && at < kRecordBytes) {
          const size_t n = std::min(iov[p].iov_len - o, kRecordBytes - at);
          std::memcpy(gather_.get() + at, static_cast<const uint8_t *>(iov[p].iov_base) + o, n);
          at += n;
          o += n;
          if (o == iov[p].iov_len) ++p, o = 0;
        }
        buf = gather_.get();
        len = at;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return -1;
    s.err_clear();
    errno = 0;
    size_t written = 0;
    const int ret = s.write_ex(ssl_, buf, len, &written);
    if (ret == 1) {
      held_ = nullptr;
      taken += written;
      skip(written);
      continue;
    }
    const Step step = settle_locked(ret, "a TLS write");
    if (step == Step::kFailed) return -1;
    // OpenSSL keeps the record it made; the same bytes come first next time.
    held_ = buf;
    held_len_ = len;
    break;
  }
  return static_cast<ssize_t>(taken);
}

bool Session::write_all(const iovec *iov, size_t count) {
  std::vector<iovec> left(iov, iov + count);
  size_t total = 0;
  for (const iovec &v : left) total += v.iov_len;
  size_t done = 0;
  while (done < total) {
    const ssize_t n = write_now(left.data(), left.size());
    if (n < 0) return false;
    if (n > 0) {
      done += static_cast<size_t>(n);
      size_t drop = static_cast<size_t>(n);
      size_t i = 0;
      while (i < left.size() && drop >= left[i].iov_len) drop -= left[i++].iov_len;
      left.erase(left.begin(), left.begin() + static_cast<std::ptrdiff_t>(i));
      if (!left.empty()) {
        left[0].iov_base = static_cast<uint8_t *>(left[0].iov_base) + drop;
        left[0].iov_len -= drop;
      }
      continue;
    }
    pollfd p{fd_, POLLOUT, 0};
    const int r = ::poll(&p, 1, -1);
    if (r < 0 && errno != EINTR) return false;
    if (r > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0 && (p.revents & POLLOUT) == 0) return false;
  }
  return true;
}

bool Session::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ssl().has_pending(ssl_) == 1;
}

std::string Session::cipher() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (!established_) return {};
  const void *c = ssl().current_cipher(ssl_);
  const char *name = c != nullptr ? ssl().cipher_standard_name(c) : nullptr;
  return name != nullptr ? name : "";
}

bool Session::ktls_send() const {
  std::lock_guard<std::mutex> lock(mu_);
  void *bio = ssl().get_wbio(ssl_);
  return bio != nullptr && ssl().bio_ctrl(bio, kBioGetKtlsSend, 0, nullptr) > 0;
}

bool Session::ktls_recv() const {
  std::lock_guard<std::mutex> lock(mu_);
  void *bio = ssl().get_rbio(ssl_);
  return bio != nullptr && ssl().bio_ctrl(bio, kBioGetKtlsRecv, 0, nullptr) > 0;
}

std::string Session::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace datadist::tls
