#pragma once
// Which transport reaches each peer: shared memory for ranks on this host, Gloo for ranks on
// other hosts once the job spans hosts. The engine reaches peers only through this set, so it
// names no concrete transport.
//
// Thread-safety: as the transports'; the engine calls everything under its lock, except
// stop() (after shutdown, when no pass runs) and the init steps.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/doorbell.h"
#include "transport/gloo/wants.h"
#include "transport/transport.h"

namespace fastcomm {

class ShmTransport;
class GlooTransport;

class TransportSet {
 public:
  // Creates this rank's shared-memory segment for the ranks on its host (host_of[r] equal to
  // its own); ranks elsewhere are unreachable until attach_gloo().
  TransportSet(int rank, const std::string& token, const std::vector<int>& host_of,
               const std::vector<int64_t>& pids, size_t ring_bytes, int stream_stores = -1);
  // An empty set over `world` ranks, for tests that add their own transports.
  explicit TransportSet(int world);
  ~TransportSet();

  // Makes `t` the transport of every rank r with serves[r] set.
  void add(std::unique_ptr<Transport> t, const std::vector<char>& serves);

  // Init steps of the shared-memory transport (transport/shm/transport.h).
  void attach_peers();
  void unlink_own();
  void unlink_local_segments();
  // Reaches the ranks on other hosts through Gloo, a connection per peer made when first
  // needed (transport/gloo/transport.h); gloo() is that transport, null before.
  void attach_gloo(int rank, std::chrono::milliseconds linger, size_t bulk_bytes);
  // The connector's calls into it (GlooTransport::wanted, attach, attach_failed); no-ops
  // before attach_gloo(). Any thread, no engine lock.
  GlooWants gloo_wanted(int64_t timeout_ms);
  void gloo_look_for_asks();
  void gloo_connect(int peer);
  bool gloo_attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank);
  void gloo_attach_failed(int peer, const std::string& why);

  // The transport to `peer`; null if none reaches it.
  Transport* of(int peer) const { return by_rank_[peer]; }
  bool reaches(int peer) const { return by_rank_[peer] != nullptr; }
  bool is_local(int peer) const { return local_[peer] != 0; }
  bool spans_hosts() const { return owned_.size() > 1; }
  // This process's doorbell: peers and transport threads ring it when there is news.
  Doorbell doorbell() const { return bell_; }
  // The piece size every transport cuts messages to; equal on every rank.
  size_t max_payload() const { return max_payload_; }

  // Publishes what every transport has appended since the last flush.
  void flush() {
    for (Transport* t : flush_) t->flush();
  }
  void set_delivery_hook(const std::function<bool()>& hook);
  void set_close_gate(const std::function<int(int)>& busy_with);
  void stop();
  // Every transport's counters, as "<transport>.<counter>".
  std::map<std::string, uint64_t> counters();

 private:
  std::vector<std::unique_ptr<Transport>> owned_;
  std::vector<Transport*> flush_;  // owned_, unowned pointers for the hot loop
  std::vector<Transport*> by_rank_;
  std::vector<char> local_;
  ShmTransport* shm_ = nullptr;
  GlooTransport* gloo_ = nullptr;
  Doorbell bell_;
  size_t max_payload_ = 0;
};

}  // namespace fastcomm
