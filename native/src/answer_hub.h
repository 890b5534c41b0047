// AnswerHub: reads the answers that same-host links receive on their answer
// sockets, on a thread that is waiting for them anyway.
//
// A link to a peer on this host has, beside its connections, one Unix
// socket that carries nothing but answers to this end's operations. Those
// sockets sit in the hub's epoll set, which the completion queue's fd
// includes, so no engine thread sits between an answer and its waiter.
//
// Who reads an answer (the one rule; docs/design.md, "Who reads an answer"):
// whoever waits for a request reads, at the moment it waits.
// - A thread that looks at a request (Request::done, outcome, wait(0): a
//   poll of done() or get_results(0), or the first look of an await) reads
//   what is waiting before it looks: drive(kLook).
// - An event loop awaiting a request watches the completion fd; the answer
//   makes it readable and the loop's drain reads it: drive(kDrain).
// - A thread blocking in a wait (the synchronous API, the C++ API,
//   finalize) cannot read while it sleeps, so the hub's thread ("dd-answer")
//   reads for it, and for kLinger after the last such wait so that a caller
//   waiting again soon finds it awake: drive(kThread). A callback registered
//   from no event loop is waited for by the library's callback thread,
//   which drains the completion fd like a loop.
// - Only an answer nobody came for (a task never awaited nor polled) is left
//   to the transport: the hub's fd, readable while an answer waits, is
//   watched by its I/O loop, and sweep_after later its timer reads what
//   waits (kSweep), unless someone read answers in between (0: never).
//   No style of waiting depends on it; operations it would not settle are
//   settled by their deadline, which reads a link's answers before failing.
// - A link that goes down reads its own answers before it settles its
//   operations (kLink).
//
// Threads: every method may be called from any thread.
#ifndef DATADIST_ANSWER_HUB_H_
#define DATADIST_ANSWER_HUB_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace datadist {

// What a hub calls when a socket it watches is readable.
// Who read an answer; counted for AnswerHub::answer_counts().
enum class AnswerReaderKind { kDrain, kLook, kThread, kSweep, kLink };
inline constexpr int kAnswerReaderKinds = 5;

class AnswerReader {
 public:
  virtual ~AnswerReader() = default;
  // Reads and handles every answer waiting on the reader's socket, without
  // blocking, counting each with AnswerHub::count(by) before handling it.
  virtual void read_answers(AnswerReaderKind by) = 0;
};

class AnswerHub {
 public:
  using Reader = AnswerReaderKind;
  // How long the hub's thread goes on reading after the last blocking wait.
  static constexpr std::chrono::milliseconds kLinger{50};
  // How long answers may wait unread before the sweep takes them.
  static constexpr std::chrono::milliseconds kSweepAfter{100};

  AnswerHub();
  ~AnswerHub();
  AnswerHub(const AnswerHub &) = delete;
  AnswerHub &operator=(const AnswerHub &) = delete;

  // An epoll set: readable while a watched socket may hold answers.
  int fd() const { return epoll_fd_; }

  // Watches `fd` for `reader` until remove(); 0 when the kernel refuses it
  // or the hub's thread cannot start.
  uint64_t add(int fd, std::weak_ptr<AnswerReader> reader);
  void remove(uint64_t id, int fd);

  // Reads every answer waiting now; `by` says who for the counts.
  void drive(Reader by = Reader::kDrain);
  // Reads every answer waiting now (kSweep), unless answers were read
  // since drives() was `seen`: the transport's timer calls it sweep_after
  // after it found answers waiting.
  void sweep(uint64_t seen);
  // Reads so far (drive() calls that found sockets to read).
  uint64_t drives() const { return drives_.load(std::memory_order_acquire); }
  // 0 turns the sweep off. Default kSweepAfter.
  void set_sweep_after(std::chrono::milliseconds after) { sweep_after_ = after; }
  std::chrono::milliseconds sweep_after() const { return sweep_after_.load(std::memory_order_relaxed); }
  // Counts answers read (by a reader, before it handles them).
  void count(Reader by, size_t n);
  // Answers read so far, by reader: "drain", "look", "thread", "sweep", "link".
  std::map<std::string, uint64_t> answer_counts() const;

  // While one lives, a thread blocks waiting for a request: the hub's
  // thread reads answers meanwhile.
  class Blocking {
   public:
    explicit Blocking(AnswerHub &hub);
    ~Blocking();
    Blocking(const Blocking &) = delete;
    Blocking &operator=(const Blocking &) = delete;

   private:
    AnswerHub &hub_;
  };

 private:
  void run();

  const int epoll_fd_;
  const int stop_fd_;  // an eventfd: written once, at destruction
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Watched {
    int fd;
    std::weak_ptr<AnswerReader> reader;
  };
  std::unordered_map<uint64_t, Watched> readers_;
  std::atomic<size_t> watched_{0};
  uint64_t next_id_ = 1;
  size_t blocking_ = 0;
  std::chrono::steady_clock::time_point linger_until_{};
  bool stopping_ = false;
  std::atomic<uint64_t> drives_{0};
  std::atomic<std::chrono::milliseconds> sweep_after_{kSweepAfter};
  std::atomic<uint64_t> counts_[kAnswerReaderKinds] = {};
  std::thread thread_;
};

}  // namespace datadist

#endif  // DATADIST_ANSWER_HUB_H_
