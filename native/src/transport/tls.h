// TLS 1.3 on a link's TCP connections, with OpenSSL's libssl loaded when
// encryption is first used (as auth.h loads libcrypto), so the engine builds
// and runs without OpenSSL until a link is to be encrypted.
//
// Keys: no certificates. Each connection's key is an external PSK derived
// from the link secret and that connection's handshake (derive_key: an
// HMAC-SHA256 under the secret, with its own label, over the hello, the
// challenge and the ack), so no two connections share one and the raw
// secret never keys TLS. The PSK is used with (EC)DHE (psk_dhe_ke), so a
// recorded session stays unreadable even to a later holder of the secret.
// One cipher suite, TLS_AES_128_GCM_SHA256 (AES-GCM on the CPU's AES
// instructions). The kernel's TLS offload (kTLS) is asked for; where the
// kernel takes it, it carries the records and OpenSSL only hands them over.
//
// A Session wraps one connected, non-blocking socket (it makes it so at its
// first handshake step) and owns nothing but its SSL object: the socket
// stays the caller's. Its reads and writes never wait; the *_until and
// write_all forms wait in poll. Threads: one thread reads and another
// writes at once (each call takes the session's lock for the length of one
// OpenSSL call, never while waiting); handshake steps come before both.
#ifndef DATADIST_TRANSPORT_TLS_H_
#define DATADIST_TRANSPORT_TLS_H_

#include <sys/types.h>
#include <sys/uio.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

namespace datadist::tls {

struct Callbacks;

constexpr size_t kKeyBytes = 32;
using Key = std::array<uint8_t, kKeyBytes>;

inline constexpr const char *kKeyLabel = "datadist_aio link v1 tls psk";
// The cipher suite both ends use.
inline constexpr const char *kCipherSuite = "TLS_AES_128_GCM_SHA256";

// Empty when libssl with TLS 1.3 and external PSKs can be had; otherwise why not.
std::string unavailable();

// Certificates instead of keys from the secret (sites with a PKI): this
// end's certificate chain and private key (PEM files), and the CA bundle
// every peer's chain must verify against. Both ends present theirs
// (mutual); any certificate the CA signed is taken, whatever its names.
struct Certificates {
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
};

// OpenSSL's client and server contexts of one set of certificates, loaded
// (and checked: the key matches the certificate) once, at init.
class CertContexts {
 public:
  // nullptr with `why` (naming the file and OpenSSL's reason) when a file
  // cannot be loaded.
  static std::shared_ptr<const CertContexts> load(const Certificates &files, std::string &why);
  ~CertContexts();
  CertContexts(const CertContexts &) = delete;
  CertContexts &operator=(const CertContexts &) = delete;
  void *client() const { return client_; }
  void *server() const { return server_; }

 private:
  CertContexts() = default;
  void *client_ = nullptr;  // SSL_CTX *
  void *server_ = nullptr;
};

// The connection's PSK: HMAC-SHA256(secret, kKeyLabel || transcript).
// Call only when auth::unavailable() is empty.
Key derive_key(const std::string &secret, const std::string &transcript);

class Session {
 public:
  enum class Step { kDone, kWantRead, kWantWrite, kFailed };

  // The client (initiator) or server (acceptor) end on `fd`, keyed by
  // `key` (an external PSK), or, with `certs`, authenticated by both ends'
  // certificates (`key` unused); nullptr with `why` when OpenSSL refuses.
  // Call only when unavailable() is empty.
  static std::unique_ptr<Session> create(int fd, bool server, const Key &key, std::string &why,
                                         const CertContexts *certs = nullptr);
  ~Session();
  Session(const Session &) = delete;
  Session &operator=(const Session &) = delete;

  // One step of the handshake, never waiting.
  Step handshake();
  // The handshake to its end, waiting in poll until `deadline`; false with
  // error() set (a timeout included).
  bool handshake_until(std::chrono::steady_clock::time_point deadline);
  bool established() const { return established_; }

  // As recv(MSG_DONTWAIT): bytes read (at most one record's), 0 at the end
  // of the stream, -1 with errno EAGAIN when more must come first, or -1
  // with another errno (EBADMSG: a record failed its check; error() says).
  ssize_t read_now(void *buf, size_t len);
  // As sendmsg(MSG_DONTWAIT): the bytes taken (0 when the socket is full),
  // or -1 (error() says). Small pieces are gathered into one record. The
  // caller's next bytes after a return are always those it had not had
  // taken, as on a socket.
  ssize_t write_now(const iovec *iov, size_t count);
  // Writes every byte, waiting in poll while the socket is full; false on an error.
  bool write_all(const iovec *iov, size_t count);
  // Whether bytes read from the socket wait inside the session (decrypted
  // or not): they must be read before the socket says more came.
  bool pending() const;

  // The cipher suite, empty before the handshake ends.
  std::string cipher() const;
  // Whether the kernel carries the records sent (and received).
  bool ktls_send() const;
  bool ktls_recv() const;
  // Why the session failed; empty while it has not.
  std::string error() const;

 private:
  friend struct Callbacks;  // the PSK callbacks read key_
  Session() = default;
  // The error of an OpenSSL call that returned `ret`, as a step (mu_ held).
  Step settle_locked(int ret, const char *what);
  void set_nonblocking();

  mutable std::mutex mu_;
  void *ssl_ = nullptr;  // SSL *
  int fd_ = -1;
  bool server_ = false;
  bool established_ = false;
  bool nonblocking_ = false;
  // With certificates: TLS 1.3 ends the client's handshake before the
  // server has checked the client's certificate, so the server confirms
  // with a record of one byte, which the client's handshake waits for (a
  // refusal then comes as the server's alert, with its reason).
  bool confirm_ = false;
  bool handshaken_ = false;
  Key key_{};
  std::string error_;
  // A write OpenSSL took in part and holds (it must be called again with
  // the same bytes): where they were and how many.
  const void *held_ = nullptr;
  size_t held_len_ = 0;
  // Small pieces gathered into one record.
  std::unique_ptr<uint8_t[]> gather_;
};

}  // namespace datadist::tls

#endif  // DATADIST_TRANSPORT_TLS_H_
