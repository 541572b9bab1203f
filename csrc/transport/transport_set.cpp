#include "transport/transport_set.h"

#include "transport/gloo/transport.h"
#include "transport/shm/transport.h"

namespace fastcomm {

TransportSet::TransportSet(int rank, const std::string& token, const std::vector<int>& host_of,
                           const std::vector<int64_t>& pids, size_t ring_bytes, int stream_stores)
    : by_rank_(host_of.size(), nullptr), local_(host_of.size(), 0) {
  std::vector<int> local;
  for (int r = 0; r < (int)host_of.size(); ++r) {
    if (host_of[r] != host_of[rank]) continue;
    local.push_back(r);
    local_[r] = 1;
  }
  auto shm = std::make_unique<ShmTransport>(rank, (int)host_of.size(), token, local, pids, ring_bytes,
                                            stream_stores);
  shm_ = shm.get();
  bell_ = shm->doorbell();
  max_payload_ = shm->max_payload();
  add(std::move(shm), local_);
}

TransportSet::TransportSet(int world) : by_rank_(world, nullptr), local_(world, 0) {}

// Last made, first gone: a later transport may hold the doorbell in the shared-memory one's
// segment.
TransportSet::~TransportSet() {
  flush_.clear();
  while (!owned_.empty()) owned_.pop_back();
}

void TransportSet::add(std::unique_ptr<Transport> t, const std::vector<char>& serves) {
  for (size_t r = 0; r < serves.size() && r < by_rank_.size(); ++r)
    if (serves[r]) by_rank_[r] = t.get();
  if (max_payload_ == 0) max_payload_ = t->max_payload();
  flush_.push_back(t.get());
  owned_.push_back(std::move(t));
}

void TransportSet::attach_peers() {
  if (shm_) shm_->attach_peers();
}

void TransportSet::unlink_own() {
  if (shm_) shm_->unlink_own();
}

void TransportSet::unlink_local_segments() {
  if (shm_) shm_->unlink_local_segments();
}

void TransportSet::attach_gloo(int rank, std::chrono::milliseconds linger, size_t bulk_bytes) {
  std::vector<char> remote(by_rank_.size(), 0);
  for (size_t r = 0; r < remote.size(); ++r) remote[r] = !local_[r];
  auto gloo = std::make_unique<GlooTransport>(rank, (int)by_rank_.size(), remote, max_payload_, bell_, linger,
                                              bulk_bytes);
  gloo_ = gloo.get();
  add(std::move(gloo), remote);
}

GlooWants TransportSet::gloo_wanted(int64_t timeout_ms) {
  if (gloo_) return gloo_->wanted(timeout_ms);
  GlooWants none;
  none.stopping = true;
  return none;
}

void TransportSet::gloo_look_for_asks() {
  if (gloo_) gloo_->look_for_asks();
}

void TransportSet::gloo_connect(int peer) {
  if (gloo_) gloo_->connect(peer);
}

bool TransportSet::gloo_attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank) {
  return gloo_ && gloo_->attach(peer, std::move(pg), peer_rank);
}

void TransportSet::gloo_attach_failed(int peer, const std::string& why) {
  if (gloo_) gloo_->attach_failed(peer, why);
}

void TransportSet::set_close_gate(const std::function<int(int)>& busy_with) {
  for (auto& t : owned_) t->set_close_gate(busy_with);
}

void TransportSet::set_delivery_hook(const std::function<bool()>& hook) {
  for (auto& t : owned_) t->set_delivery_hook(hook);
}

void TransportSet::stop() {
  for (auto& t : owned_) t->stop();
}

std::map<std::string, uint64_t> TransportSet::counters() {
  std::map<std::string, uint64_t> out;
  for (auto& t : owned_)
    for (const auto& [name, v] : t->counters()) out[std::string(t->name()) + "." + name] = v;
  return out;
}

}  // namespace fastcomm
