// IoLoop: the transport's I/O threads. A fixed number of threads wait on one
// epoll set and run the handler of each descriptor that became ready, so
// the thread count does not grow with the links and connections served.
//
// A descriptor is armed for the events it waits for and disarmed as they
// come (EPOLLONESHOT): one thread at a time runs its handler, which arms it
// again when it wants more. Handlers are held weakly; one whose owner is
// gone is skipped.
//
// Work that may wait for long (a frame staged through device copies, whose
// sends and reads wait on the socket) goes to the loop's blocking pool, so
// it never holds up the I/O threads. Every job gets a thread at once: an
// idle one, or one started for it (a job may wait for one on the peer, so
// none may wait for a thread); a thread idle for kBlockingIdle ends. The
// pool is as large as the staged frames in flight, and empty when none are.
//
// Threads: every method may be called from any thread, including the
// loop's own; the destructor must not be.
#ifndef DATADIST_TRANSPORT_IO_LOOP_H_
#define DATADIST_TRANSPORT_IO_LOOP_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>


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
  static constexpr std::chrono::milliseconds kBlockingIdle{5000};

  // `threads` 0: default_threads(); `blocking_idle`: how long a blocking
  // thread waits for a job before it ends. Throws std::system_error when
  // the kernel refuses the epoll set.
  explicit IoLoop(size_t threads = 0, std::chrono::milliseconds blocking_idle = kBlockingIdle);
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
  // Stops watching. Returns once no thread runs the descriptor's handler or
  // holds it (called from that handler itself, at once), so the handler's
  // owner may close the descriptor and go.
  void remove(uint64_t id);
  // Runs `job` on the blocking pool; false once the loop is stopping or
  // no thread can start for it.
  bool run_blocking(std::function<void()> job);
  // Threads of the blocking pool now, and those of them waiting for a job.
  size_t blocking_threads() const;
  size_t idle_blocking_threads() const;

 private:
  void run();
  void run_blocking_thread(std::list<std::thread>::iterator self);
  // Joins the blocking threads that ended (mu_ held; they hold no lock).
  void join_ended_locked();

  struct Watched {
    int fd;
    std::weak_ptr<IoHandler> handler;
    uint64_t tag;
    int dispatching = 0;  // threads holding the handler (a re-armed one may fire before the last let go)
  };

  const size_t count_;
  const std::chrono::milliseconds blocking_idle_;
  const int epoll_fd_;
  const int stop_fd_;  // an eventfd, written once at destruction
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, Watched> watched_;
  std::condition_variable dispatched_cv_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
  // The blocking pool.
  std::condition_variable blocking_cv_;
  std::deque<std::function<void()>> jobs_;
  std::list<std::thread> blocking_;
  std::vector<std::thread> ended_;  // ended blocking threads, to be joined
  size_t idle_ = 0;  // blocking threads waiting for a job
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_IO_LOOP_H_
