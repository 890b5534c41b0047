// Raw loopback TCP throughput: the baseline for bench_transfer.py.
//
//   raw_tcp STREAMS TOTAL_BYTES ITERATIONS   -> prints the median GB/s
//
// A forked receiver process accepts STREAMS connections; each thread reads
// its share into memory of the share's size (as a transfer lands in its
// destination) and acknowledges every iteration with one byte. The sender's
// threads send their share from memory of the same size with large send()s.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

bool io_all(int fd, char *p, size_t n, bool sending) {
  while (n > 0) {
    ssize_t k = sending ? ::send(fd, p, std::min<size_t>(n, 8u << 20), MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

void receive(int listener, int streams, size_t share, int iterations) {
  std::vector<std::thread> threads;
  for (int s = 0; s < streams; ++s) {
    int fd = ::accept(listener, nullptr, nullptr);
    threads.emplace_back([fd, share, iterations] {
      std::vector<char> dest(share, 1);
      char ack = 'k';
      for (int i = 0; i < iterations; ++i) {
        if (!io_all(fd, dest.data(), share, false) || !io_all(fd, &ack, 1, true)) break;
      }
      ::close(fd);
    });
  }
  for (auto &t : threads) t.join();
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s STREAMS TOTAL_BYTES ITERATIONS\n", argv[0]);
    return 2;
  }
  const int streams = std::atoi(argv[1]);
  const size_t share = std::strtoull(argv[2], nullptr, 10) / streams;
  const int iterations = std::atoi(argv[3]);
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(listener, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0 || ::listen(listener, 64) != 0) return 1;
  ::getsockname(listener, reinterpret_cast<sockaddr *>(&addr), &len);
  pid_t child = ::fork();
  if (child == 0) {
    receive(listener, streams, share, iterations);
    _exit(0);
  }
  ::close(listener);
  std::vector<int> fds;
  for (int s = 0; s < streams; ++s) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) != 0) return 1;
    fds.push_back(fd);
  }
  std::vector<std::vector<char>> sources(streams, std::vector<char>(share, 2));
  std::vector<double> seconds;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> threads;
    for (int s = 0; s < streams; ++s) {
      threads.emplace_back([&, s] {
        char ack;
        io_all(fds[s], sources[s].data(), share, true);
        io_all(fds[s], &ack, 1, false);
      });
    }
    for (auto &t : threads) t.join();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  for (int fd : fds) ::close(fd);
  ::waitpid(child, nullptr, 0);
  std::sort(seconds.begin(), seconds.end());
  std::printf("%.3f\n", share * streams / seconds[seconds.size() / 2] / 1e9);
  return 0;
}
