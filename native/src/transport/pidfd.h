// A process watched through its pidfd, for memory held until a peer on this
// host that may still reach it has left: a pid reused since is only waited
// for longer.
#ifndef DATADIST_TRANSPORT_PIDFD_H_
#define DATADIST_TRANSPORT_PIDFD_H_

#include <poll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace datadist {

struct Pidfd {
  explicit Pidfd(pid_t pid) : fd(pid > 0 ? static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)) : -1) {}
  ~Pidfd() {
    if (fd >= 0) ::close(fd);
  }
  Pidfd(const Pidfd &) = delete;
  Pidfd &operator=(const Pidfd &) = delete;
  // False once the process has exited (its pidfd reads ready); true where
  // there is no pidfd (another PID namespace, or no such process to open).
  bool alive() const {
    if (fd < 0) return true;
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  const int fd;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PIDFD_H_
