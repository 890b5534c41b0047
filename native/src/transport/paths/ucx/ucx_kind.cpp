#include "transport/paths/ucx/ucx_kind.h"

#include <dirent.h>

#include <cstdio>
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

// Whether UCX `version` names an endpoint's transports (1.14 on), which
// says whether it reaches the peer's memory by itself (ucx_plugin.h).
bool names_transports(const std::string &version) {
  unsigned major = 0, minor = 0;
  return std::sscanf(version.c_str(), "%u.%u", &major, &minor) == 2 && (major > 1 || minor >= 14);
}

class Handshake : public PathHandshake {
 public:
  Handshake(std::shared_ptr<Worker> worker, bool required, bool one_sided, uint64_t peer_id, bool acceptor)
      : worker_(std::move(worker)), required_(required), one_sided_(one_sided), acceptor_(acceptor), peer_id_(peer_id) {}

  std::string hello_part(uint32_t index) override { return index == 0 ? worker_->address() : std::string(); }

  Status settle(const std::string &address, bool, std::string &why) override {
    if (address.empty()) return required_ ? missing(why) : LLM_SUCCESS;
    peer_ = Peer::connect(worker_, address, why);
    if (peer_) {
      reach(address);
      return LLM_SUCCESS;
    }
    if (!required_) why = "the peer chose UCX, which refused its address here: " + why;
    return LLM_LINK_FAILED;
  }

  Status accept(const std::vector<std::string> &parts, bool served, std::string &why) override {
    const std::string address = parts.empty() ? std::string() : parts[0];
    if (address.empty()) return required_ ? missing(why) : LLM_SUCCESS;
    if (!required_ && served) return LLM_SUCCESS;
    peer_ = Peer::connect(worker_, address, why);
    if (peer_) reach(address);
    if (peer_ || required_) return peer_ ? LLM_SUCCESS : LLM_LINK_FAILED;
    log_warning("link from cluster " + std::to_string(peer_id_) + " goes without UCX: " + why);
    why.clear();
    return LLM_SUCCESS;
  }

  std::string ack_part() override { return peer_ ? worker_->address() : std::string(); }

  void paths(std::vector<std::shared_ptr<DataPath>> &out) override {
    if (peer_) out.push_back(std::make_shared<UcxDataPath>(peer_, direct_, direct_rma_, one_sided_, !acceptor_));
  }

 private:
  // Access "one_sided": the endpoint on which this end would move bytes
  // under the peer's grants, where one reaches the peer's memory by itself:
  // the link's own (RDMA), else one made for it (a shared-memory transport
  // of this host, which the link's endpoint never takes: it handles peer
  // failure, which those do not offer).
  void reach(const std::string &address) {
    if (!one_sided_ || !names_transports(worker_->version())) return;
    direct_rma_ = peer_->rma();
    if (direct_rma_ == DATADIST_UCX_RMA_FENCED) {
      direct_ = peer_;
      return;
    }
    std::string why;
    std::shared_ptr<Peer> direct = Peer::connect_direct(worker_, address, why);
    direct_rma_ = direct ? direct->rma() : DATADIST_UCX_RMA_NONE;
    if (direct_rma_ == DATADIST_UCX_RMA_DIRECT) {
      direct_ = std::move(direct);
    } else if (direct) {
      direct->close();
    }
  }

  static Status missing(std::string &why) {
    why = "it does not move bytes with UCX (its transport is not \"ucx\")";
    return LLM_LINK_FAILED;
  }

  const std::shared_ptr<Worker> worker_;
  const bool required_;
  const bool one_sided_;
  const bool acceptor_;
  const uint64_t peer_id_;
  std::shared_ptr<Peer> peer_;
  std::shared_ptr<Peer> direct_;
  int direct_rma_ = DATADIST_UCX_RMA_NONE;
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

std::unique_ptr<PathHandshake> UcxKind::handshake(uint64_t peer_id, bool acceptor) {
  if (!worker_) return nullptr;
  return std::make_unique<Handshake>(worker_, required_, one_sided_, peer_id, acceptor);
}

}  // namespace datadist::ucx
