#include "comm_links.h"

#include <algorithm>
#include <set>

#include "error_detail.h"
#include "log.h"
#include "thread_name.h"

namespace datadist {

using llm_datadist::LLM_ALREADY_LINK;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {

constexpr auto kRound = std::chrono::milliseconds(20);
constexpr uint32_t kMinAttemptMs = 200;
constexpr uint32_t kMaxAttemptMs = 2000;

}  // namespace

CommLinks::CommLinks(uint64_t cluster_id, LinkManager &transport) : cluster_id_(cluster_id), transport_(transport) {
  transport_.set_loss_observer([this](uint64_t peer) { lost(peer); });
}

CommLinks::~CommLinks() { shutdown(); }

Status CommLinks::link(const CommSpec &given, uint64_t &comm_id) {
  CommSpec spec = given;
  if (spec.name.empty()) return refuse(LLM_PARAM_INVALID, "comm_name is empty");
  if (spec.members.size() < 2 || spec.members.size() > kMaxCommMembers) {
    return refuse(LLM_PARAM_INVALID, words("a comm has 2 to ", kMaxCommMembers, " members; cluster_rank_info names ",
                                           spec.members.size()));
  }
  std::set<uint64_t> ids;
  std::set<uint32_t> ranks;
  const CommMember *self = nullptr;
  for (const CommMember &m : spec.members) {
    if (!ids.insert(m.cluster_id).second) return refuse(LLM_PARAM_INVALID, words("cluster ", m.cluster_id, " repeats"));
    if (!ranks.insert(m.rank).second) return refuse(LLM_PARAM_INVALID, words("rank ", m.rank, " repeats"));
    if (m.ip.empty()) return refuse(LLM_PARAM_INVALID, words("rank ", m.rank, " has no device_ip"));
    if (m.cluster_id == cluster_id_) self = &m;
  }
  if (self == nullptr) {
    return refuse(LLM_PARAM_INVALID, words("this instance (cluster ", cluster_id_, ") is not in cluster_rank_info"));
  }
  // A member that accepts from higher ranks must listen: where it already
  // does, or at its own entry of the table.
  const bool accepts = std::any_of(spec.members.begin(), spec.members.end(),
                                   [&](const CommMember &m) { return m.rank > self->rank; });
  uint16_t listen_port = transport_.listen_port();
  if (accepts && listen_port == 0) {
    if (self->port == 0) {
      return refuse(LLM_PARAM_INVALID, words("rank ", self->rank, " accepts links but has no listen_ip_info and no ",
                                             "device_port in the rank table"));
    }
    Status st = transport_.listen(self->ip, self->port);
    if (st != LLM_SUCCESS) return st;
    listen_port = transport_.listen_port();
  }
  for (CommMember &m : spec.members) {
    if (m.port != 0 || m.cluster_id == cluster_id_) continue;
    if (listen_port == 0) {  // where the peer is cannot be known
      return refuse(LLM_PARAM_INVALID, words("rank ", m.rank, " has no device_port and this instance does not listen"));
    }
    m.port = listen_port;
  }
  if (spec.retry_count == 0) spec.retry_count = 1;
  auto comm = std::make_shared<Comm>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return LLM_FAILED;
    for (const auto &entry : comms_) {
      const CommSpec &other = entry.second->spec;
      if (other.name == spec.name) {
        return refuse(LLM_ALREADY_LINK, words("comm ", spec.name, " is linked already (comm id ", entry.first, ")"));
      }
      for (const CommMember &m : other.members) {
        if (m.cluster_id != cluster_id_ && ids.count(m.cluster_id) != 0) {
          return refuse(LLM_ALREADY_LINK, words("cluster ", m.cluster_id, " is linked already by comm ", other.name));
        }
      }
    }
    comm->spec = std::move(spec);
    comm_id = next_id_++;
    comms_[comm_id] = comm;
    comm->thread = std::thread([this, comm_id, comm] {
      name_this_thread("dd-comm");
      run(comm_id, comm);
    });
  }
  return LLM_SUCCESS;
}

void CommLinks::run(uint64_t comm_id, std::shared_ptr<Comm> comm) {
  const CommSpec &spec = comm->spec;
  std::vector<uint64_t> peers;
  for (const CommMember &m : spec.members) {
    if (m.cluster_id != cluster_id_) peers.push_back(m.cluster_id);
  }
  const std::string name = "comm " + spec.name + " (id " + std::to_string(comm_id) + ")";
  std::unique_lock<std::mutex> lock(mu_);
  CommState result = establish(*comm, peers, lock);
  for (;;) {
    if (comm->stop) return;
    comm->state = result;
    comm->relinking.clear();
    if (result == CommState::kFailed) {
      log_warning(name + ": not every member linked within " + std::to_string(spec.total_time_ms) + " ms");
      return;
    }
    // Linked: sleep until a link is lost or the comm is unlinked.
    cv_.wait(lock, [&] { return comm->stop || !comm->lost.empty(); });
    if (comm->stop) return;
    std::vector<uint64_t> again(comm->lost.begin(), comm->lost.end());
    comm->relinking = std::move(comm->lost);
    comm->lost.clear();
    comm->state = CommState::kPreparing;
    std::string who;
    for (uint64_t peer : again) who += (who.empty() ? "" : ", ") + std::to_string(peer);
    log_warning(name + ": the link to cluster " + who + " was lost; linking again");
    result = establish(*comm, again, lock);
  }
}

CommState CommLinks::establish(Comm &comm, const std::vector<uint64_t> &peers, std::unique_lock<std::mutex> &lock) {
  const CommSpec &spec = comm.spec;
  const auto deadline = Clock::now() + std::chrono::milliseconds(spec.total_time_ms);
  const uint32_t attempt_ms = std::clamp(spec.total_time_ms / spec.retry_count, kMinAttemptMs, kMaxAttemptMs);
  uint32_t self_rank = 0;
  for (const CommMember &m : spec.members) {
    if (m.cluster_id == cluster_id_) self_rank = m.rank;
  }
  std::vector<const CommMember *> pending;
  std::map<uint64_t, uint64_t> made_before;  // a link made since linking started counts, even if gone
  for (const CommMember &m : spec.members) {
    if (std::find(peers.begin(), peers.end(), m.cluster_id) == peers.end()) continue;
    pending.push_back(&m);
    made_before[m.cluster_id] = transport_.links_made(m.cluster_id);
  }
  for (;;) {
    if (comm.stop) return CommState::kPreparing;
    lock.unlock();
    for (auto it = pending.begin(); it != pending.end();) {
      const CommMember &peer = **it;
      // A link going down is found until its loss was told (the observer
      // hears of it first): it is not up, or the comm would settle on it.
      const std::shared_ptr<Link> link = transport_.find(peer.cluster_id);
      bool up = (link != nullptr && !link->is_down()) ||
                transport_.links_made(peer.cluster_id) > made_before[peer.cluster_id];
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (!up && peer.rank < self_rank && left > 0) {
        // This member connects; the peer, lower in rank, accepts.
        const int timeout = static_cast<int>(std::min<int64_t>(attempt_ms, left));
        up = transport_.link(peer.cluster_id, peer.ip, peer.port, "", timeout) == LLM_SUCCESS;
      }
      it = up ? pending.erase(it) : it + 1;
    }
    lock.lock();
    if (pending.empty()) return CommState::kOk;
    if (Clock::now() >= deadline) return CommState::kFailed;
    cv_.wait_for(lock, kRound, [&] { return comm.stop; });
  }
}

void CommLinks::lost(uint64_t peer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    for (auto &entry : comms_) {
      Comm &comm = *entry.second;
      if (comm.state != CommState::kOk && comm.relinking.empty()) continue;  // still linking the first time, or failed
      for (const CommMember &m : comm.spec.members) {
        if (m.cluster_id == peer && peer != cluster_id_) comm.lost.insert(peer);
      }
    }
  }
  cv_.notify_all();
}

bool CommLinks::relinking(uint64_t peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &entry : comms_) {
    if (entry.second->relinking.count(peer) != 0 || entry.second->lost.count(peer) != 0) return true;
  }
  return false;
}

Status CommLinks::state(uint64_t comm_id, CommState &out) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = comms_.find(comm_id);
  if (it == comms_.end()) return refuse(LLM_PARAM_INVALID, words("no comm with id ", comm_id));
  out = it->second->state;
  return LLM_SUCCESS;
}

void CommLinks::stop(const std::shared_ptr<Comm> &comm) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    comm->stop = true;
  }
  cv_.notify_all();
  if (comm->thread.joinable()) comm->thread.join();
}

Status CommLinks::unlink(uint64_t comm_id, int timeout_ms) {
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find(comm_id);
    if (it == comms_.end()) return refuse(LLM_PARAM_INVALID, words("no comm with id ", comm_id));
    comm = it->second;
    comms_.erase(it);
  }
  stop(comm);
  for (const CommMember &m : comm->spec.members) {
    if (m.cluster_id == cluster_id_ || transport_.find(m.cluster_id) == nullptr) continue;
    // A peer that does not answer still sees the connections close.
    transport_.unlink(m.cluster_id, false, timeout_ms);
  }
  return LLM_SUCCESS;
}

void CommLinks::shutdown() {
  std::map<uint64_t, std::shared_ptr<Comm>> comms;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    comms.swap(comms_);
  }
  for (auto &entry : comms) stop(entry.second);
}

}  // namespace datadist
