// IoLoop: the transport's I/O threads. A fixed number of threads wait on one
// epoll set and run the handler of each descriptor that became ready, so
// the thread count does not grow with the links and connections served.
//
// A descriptor is armed for the events it waits for and disarmed as they
// come (EPOLLONESHOT): one thread at a time runs its handler, which arms it
// again when it wants more. Handlers are held weakly; one whose owner is
// gone is skipped.
//
// Work that may block for long (a send staged through device copies) goes
// to the loop's blocking pool, a few threads of its own, started on first
// use, so it never holds up the I/O threads.
//
// Threads: every method may be called from any thread, including the
// loop's own; the destructor must not be.
#ifndef DATADIST_TRANSPORT_IO_LOOP_H_
#define DATADIST_TRANSPORT_IO_LOOP_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "worker_pool.h"

namespace datadist {

class IoHandler {
 public:
  virtual ~IoHandler() = default;
  // `tag` is what add() was given; `events` what epoll reported. The
  // descriptor stays disarmed until armed again.
  virtual void on_ready(uint64_t tag, uint32_t events) = 0;
};

class IoLoop {
 public:
  // One thread per core, within [1, kMaxThreads].
  static size_t default_threads();
  static constexpr size_t kMaxThreads = 64;
  static constexpr size_t kBlockingThreads = 2;

  // `threads` 0: default_threads(). Throws std::system_error when the
  // kernel refuses the epoll set.
  explicit IoLoop(size_t threads = 0);
  ~IoLoop();
  IoLoop(const IoLoop &) = delete;
  IoLoop &operator=(const IoLoop &) = delete;

  size_t threads() const { return count_; }
  // Threads running now (they start with the first descriptor added).
  size_t running_threads() const;

  // Watches `fd`, disarmed, for `handler`; 0 when the kernel refuses it or
  // the threads cannot start.
  uint64_t add(int fd, std::weak_ptr<IoHandler> handler, uint64_t tag);
  // Arms the descriptor of `id` for `events` (EPOLLIN, EPOLLOUT) once;
  // false when it is not watched or the kernel refuses.
  bool arm(uint64_t id, uint32_t events);
  // Stops watching; a handler already running goes on to its end.
  void remove(uint64_t id);
  // Runs `job` on the blocking pool; false once the loop is stopping or
  // its threads cannot start.
  bool run_blocking(std::function<void()> job);

 private:
  void run();

  struct Watched {
    int fd;
    std::weak_ptr<IoHandler> handler;
    uint64_t tag;
  };

  const size_t count_;
  const int epoll_fd_;
  const int stop_fd_;  // an eventfd, written once at destruction
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Watched> watched_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  std::unique_ptr<WorkerPool> blocking_;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_IO_LOOP_H_
