// AnswerHub: reads the answers that same-host links receive on their answer
// sockets, on a thread that is waiting for them anyway.
//
// A link to a peer on this host has, beside its connections, one Unix
// socket that carries nothing but answers to this end's operations. Those
// sockets sit in the hub's epoll set, which the completion queue's fd
// includes: an event loop awaiting a request wakes once, reads the answer
// itself and takes the completion it made, with no engine thread in between.
//
// Who reads:
// - drive(): whoever asks, above all CompletionQueue::drain on the loop's thread.
// - The hub's thread ("dd-answer"), while some thread blocks in a wait (the
//   synchronous API, the C++ API, finalize) and for kLinger after the last
//   such wait, so that a caller waiting again soon finds it awake.
// - sweep(): the transport's housekeeping round, for answers that no drive
//   has read since the previous round (a loop that stopped coming back).
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
enum class AnswerReaderKind { kDrain, kThread, kSweep, kLink };

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
  // Reads answers only if no drive has happened since the previous sweep.
  void sweep();
  // Counts answers read (by a reader, before it handles them).
  void count(Reader by, size_t n);
  // Answers read so far, by reader: "drain", "thread", "sweep", "link".
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
  uint64_t swept_ = 0;  // drives_ at the last sweep
  std::atomic<uint64_t> counts_[4] = {};
  std::thread thread_;
};

}  // namespace datadist

#endif  // DATADIST_ANSWER_HUB_H_
