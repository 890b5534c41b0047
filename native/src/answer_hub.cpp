#include "answer_hub.h"

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <vector>

#include "thread_name.h"

namespace datadist {

namespace {

int checked(int fd, const char *what) {
  if (fd < 0) throw std::system_error(errno, std::generic_category(), what);
  return fd;
}

constexpr int kMaxEvents = 64;

}  // namespace

AnswerHub::AnswerHub()
    : epoll_fd_(checked(::epoll_create1(EPOLL_CLOEXEC), "epoll_create1")),
      stop_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (stop_fd_ < 0) {
    const int error = errno;
    ::close(epoll_fd_);
    throw std::system_error(error, std::generic_category(), "eventfd");
  }
}

AnswerHub::~AnswerHub() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(stop_fd_, &one, sizeof(one));
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  ::close(stop_fd_);
  ::close(epoll_fd_);
}

uint64_t AnswerHub::add(int fd, std::weak_ptr<AnswerReader> reader) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return 0;
  if (!thread_.joinable()) {
    try {
      thread_ = std::thread([this] {
        name_this_thread("dd-answer");
        run();
      });
    } catch (const std::system_error &) {
      return 0;
    }
  }
  const uint64_t id = next_id_++;
  epoll_event event{};
  event.events = EPOLLIN;
  event.data.u64 = id;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) return 0;
  readers_.emplace(id, Watched{fd, std::move(reader)});
  watched_.fetch_add(1, std::memory_order_relaxed);
  return id;
}

void AnswerHub::remove(uint64_t id, int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (readers_.erase(id) == 0) return;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  watched_.fetch_sub(1, std::memory_order_relaxed);
}

void AnswerHub::drive(Reader by) {
  if (watched_.load(std::memory_order_relaxed) == 0) return;
  epoll_event events[kMaxEvents];
  const int n = ::epoll_wait(epoll_fd_, events, kMaxEvents, 0);
  for (int i = 0; i < n; ++i) {
    std::shared_ptr<AnswerReader> reader;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = readers_.find(events[i].data.u64);
      if (it != readers_.end()) {
        reader = it->second.reader.lock();
        if (!reader) {
          // Gone without remove(): stop watching, or its socket keeps the set readable.
          ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
          readers_.erase(it);
          watched_.fetch_sub(1, std::memory_order_relaxed);
        }
      }
    }
    if (reader) reader->read_answers(by);
  }
  drives_.fetch_add(1, std::memory_order_release);
}

void AnswerHub::sweep(uint64_t seen) {
  if (sweep_after().count() == 0 || drives() != seen) return;
  drive(Reader::kSweep);
}

void AnswerHub::count(Reader by, size_t n) {
  if (n != 0) counts_[static_cast<int>(by)].fetch_add(n, std::memory_order_relaxed);
}

std::map<std::string, uint64_t> AnswerHub::answer_counts() const {
  static const char *const kNames[kAnswerReaderKinds] = {"drain", "look", "thread", "sweep", "link"};
  std::map<std::string, uint64_t> out;
  for (int i = 0; i < kAnswerReaderKinds; ++i) out[kNames[i]] = counts_[i].load(std::memory_order_relaxed);
  return out;
}

AnswerHub::Blocking::Blocking(AnswerHub &hub) : hub_(hub) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(hub_.mu_);
    wake = hub_.blocking_++ == 0;
  }
  if (wake) hub_.cv_.notify_all();
}

AnswerHub::Blocking::~Blocking() {
  std::lock_guard<std::mutex> lock(hub_.mu_);
  if (--hub_.blocking_ == 0) hub_.linger_until_ = std::chrono::steady_clock::now() + kLinger;
}

void AnswerHub::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return stopping_ || blocking_ > 0; });
    // Reads as answers come while a thread blocks, then lingers a while.
    while (!stopping_) {
      int timeout = -1;
      if (blocking_ == 0) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(linger_until_ - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        timeout = static_cast<int>(left.count()) + 1;
      }
      lock.unlock();
      pollfd fds[2] = {{epoll_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
      if (::poll(fds, 2, timeout) > 0 && (fds[0].revents & POLLIN) != 0) drive(Reader::kThread);
      lock.lock();
    }
    if (stopping_) return;
  }
}

}  // namespace datadist
