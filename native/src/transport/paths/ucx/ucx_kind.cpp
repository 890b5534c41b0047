#include "transport/paths/ucx/ucx_kind.h"

#include <dirent.h>

#include <cstdlib>
#include <utility>
#include <vector>

#include "log.h"
#include "transport/paths/ucx/ucx_data_path.h"

namespace datadist::ucx {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;

namespace {

// An RDMA device on this host (a verbs device: InfiniBand, RoCE, EFA), by
// its entry in sysfs; nothing is loaded to tell.
bool rdma_device_here() {
  DIR *dir = opendir("/sys/class/infiniband");
  if (dir == nullptr) return false;
  bool found = false;
  while (dirent *e = readdir(dir)) found = found || e->d_name[0] != '.';
  closedir(dir);
  return found;
}

class Handshake : public PathHandshake {
 public:
  Handshake(std::shared_ptr<Worker> worker, bool required, uint64_t peer_id)
      : worker_(std::move(worker)), required_(required), peer_id_(peer_id) {}

  std::string hello_part(uint32_t index) override { return index == 0 ? worker_->address() : std::string(); }

  Status settle(const std::string &address, bool, std::string &why) override {
    if (address.empty()) return required_ ? missing(why) : LLM_SUCCESS;
    peer_ = Peer::connect(worker_, address, why);
    if (peer_) return LLM_SUCCESS;
    if (!required_) why = "the peer chose UCX, which refused its address here: " + why;
    return LLM_LINK_FAILED;
  }

  Status accept(const std::vector<std::string> &parts, bool served, std::string &why) override {
    const std::string address = parts.empty() ? std::string() : parts[0];
    if (address.empty()) return required_ ? missing(why) : LLM_SUCCESS;
    if (!required_ && served) return LLM_SUCCESS;
    peer_ = Peer::connect(worker_, address, why);
    if (peer_ || required_) return peer_ ? LLM_SUCCESS : LLM_LINK_FAILED;
    log_warning("link from cluster " + std::to_string(peer_id_) + " goes without UCX: " + why);
    why.clear();
    return LLM_SUCCESS;
  }

  std::string ack_part() override { return peer_ ? worker_->address() : std::string(); }

  void paths(std::vector<std::shared_ptr<DataPath>> &out) override {
    if (peer_) out.push_back(std::make_shared<UcxDataPath>(peer_));
  }

 private:
  static Status missing(std::string &why) {
    why = "it does not move bytes with UCX (its transport is not \"ucx\")";
    return LLM_LINK_FAILED;
  }

  const std::shared_ptr<Worker> worker_;
  const bool required_;
  const uint64_t peer_id_;
  std::shared_ptr<Peer> peer_;
};

}  // namespace

Status UcxKind::start(std::string &why) {
  if (worker_) return LLM_SUCCESS;
  if (required_) {
    worker_ = Worker::create(io_loop_, why);
    if (worker_) return LLM_SUCCESS;
    why = "transport \"ucx\": " + why;
    return llm_datadist::LLM_FEATURE_NOT_ENABLED;
  }
  const char *env = std::getenv("DATADIST_AIO_UCX_AUTO");
  const std::string asked = env != nullptr ? env : "";
  if (asked == "0" || (asked != "1" && !rdma_device_here())) return LLM_SUCCESS;
  std::shared_ptr<Worker> worker = Worker::create(io_loop_, why);
  if (worker && asked != "1" && !worker->one_sided_network()) {
    why = "UCX " + worker->version() + " has no one-sided network transport here";
    worker->stop();
    worker.reset();
  }
  if (!worker) {
    log_message(LogLevel::kInfo, "transport \"auto\" goes on without UCX: " + why);
    why.clear();
    return LLM_SUCCESS;
  }
  worker_ = std::move(worker);
  return LLM_SUCCESS;
}

void UcxKind::stop() {
  if (worker_) worker_->stop();
}

std::unique_ptr<PathHandshake> UcxKind::handshake(uint64_t peer_id, bool) {
  if (!worker_) return nullptr;
  return std::make_unique<Handshake>(worker_, required_, peer_id);
}

}  // namespace datadist::ucx
