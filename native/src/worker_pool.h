// WorkerPool: the engine threads that run local data movement.
// Threads: submit() from any thread; shutdown() runs every job already
// submitted, then joins. Jobs never touch Python.
#ifndef DATADIST_WORKER_POOL_H_
#define DATADIST_WORKER_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace datadist {

class WorkerPool {
 public:
  explicit WorkerPool(size_t threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool &) = delete;
  WorkerPool &operator=(const WorkerPool &) = delete;

  size_t size() const { return threads_.size(); }
  // False (and the job is not run) once shutdown has begun.
  bool submit(std::function<void()> job);
  void shutdown();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace datadist

#endif  // DATADIST_WORKER_POOL_H_
