// A process watched through its pidfd, for memory held until a peer on this
// host that may still reach it has left: a pid reused since is only waited
// for longer. The pid must name the peer in this process's PID namespace
// (the same-host path's probe reads the peer's memory by it; cma, xpmem and
// knem work only within one namespace): a pid that cannot be opened for
// want of a process (ESRCH) is a peer that has exited.
#ifndef DATADIST_TRANSPORT_PIDFD_H_
#define DATADIST_TRANSPORT_PIDFD_H_

#include <poll.h>

#include <cerrno>
#include <memory>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

namespace datadist {

struct Pidfd {
  explicit Pidfd(pid_t pid) : fd(open(pid)), gone(fd < 0 && errno == ESRCH) {}
  ~Pidfd() {
    if (fd >= 0) ::close(fd);
  }
  Pidfd(const Pidfd &) = delete;
  Pidfd &operator=(const Pidfd &) = delete;
  // False once the process has exited (its pidfd reads ready, or there was
  // no process to open); true where no pidfd could be had otherwise.
  bool alive() const {
    if (gone) return false;
    if (fd < 0) return true;
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }
  const int fd;
  const bool gone;

 private:
  static int open(pid_t pid) {
    if (pid <= 0) {
      errno = EINVAL;
      return -1;
    }
    return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  }
};

// Whether process `pid` has exited, watched through `watch`, its pidfd
// opened on the first call (a grantor opens it only once a wait begins;
// what is then held for the process keeps watching it).
inline bool exited(std::shared_ptr<Pidfd> &watch, pid_t pid) {
  if (!watch) watch = std::make_shared<Pidfd>(pid);
  return !watch->alive();
}

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PIDFD_H_
