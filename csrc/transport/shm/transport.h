#pragma once
// Shared-memory transport for peers on the same host.
//
// Each process owns one segment. It holds a control block (identity, doorbell) and one
// outbound byte ring per same-host peer: the sender writes records into its own segment and
// the receiver reads them from there, advancing the ring's tail. Every process maps the
// segments of all its same-host peers once at init; a ring's pages are backed (and mapped in on
// both sides, ahead of use) only from its first message, so an unused peer costs address space,
// not memory.
//
// Lifetime: the segment is created with mode 0600 under a name that carries the job's random
// token, and unlinked as soon as every same-host rank has attached it (see unlink_own), so a
// crash of any rank afterwards leaves nothing behind in /dev/shm; the kernel frees the memory
// when the last mapping goes away.
//
// Large payloads are copied into a ring with plain stores while such copies run fast. The ring's
// lines were last read by the receiver, so each store first takes the line from the receiver's
// cache; where that cache is far (a VM whose two vCPUs the host puts on different core
// complexes) a copy ran 5x slower. A copy that runs slow switches that peer's ring to
// non-temporal stores, which write to memory without taking the lines, for a while
// (FASTCOMM_SHM_STREAM_STORES forces either way).
//
// Thread-safety: none. The engine serialises every call under its progress lock.
#include <map>
#include <string>
#include <vector>

#include "common/doorbell.h"
#include "transport/transport.h"

namespace fastcomm {

struct ShmSegmentHeader;
struct ShmRingCtl;

class ShmTransport final : public Transport {
 public:
  // Creates this rank's segment. `local_ranks` lists the global ranks on this host (sorted,
  // including this rank); `pids` are the peers' process ids, indexed by global rank.
  // `stream_stores`: 1 non-temporal copies of large payloads always, 0 never, -1 when plain
  // ones run slow.
  ShmTransport(int rank, int world_size, const std::string& token, std::vector<int> local_ranks,
               std::vector<int64_t> pids, size_t ring_bytes, int stream_stores = -1);
  ~ShmTransport() override;

  // Maps every same-host peer's segment and checks it belongs to this job.
  void attach_peers();
  // Removes this rank's segment name; safe to call more than once.
  void unlink_own();
  void unlink_local_segments();

  const char* name() const override { return "shm"; }
  size_t max_payload() const override { return max_payload_; }
  bool try_send(int peer, const Header& hdr, const void* payload) override;
  void flush() override;
  const Message* peek(int peer) override;
  void pop(int peer) override;
  bool peer_alive(int peer) override;
  std::string death_reason(int peer) override;
  // Marks this rank's segment closed (its engine shuts down) and wakes its peers.
  void stop() override;
  void release_peer(int peer) override;
  std::map<std::string, uint64_t> counters() override;
  bool shares_memory(int peer) override { return is_local(peer) && peer != rank_ && pidfd_[peer] >= 0; }
  const uint8_t* import_span(int peer, const SharedSpan& span) override;

  bool is_local(int peer) const { return local_index_[peer] >= 0; }
  bool peer_closed(int peer) const;  // its engine shut down (ShmSegmentHeader::closed)
  Doorbell doorbell() const { return own_bell_; }

 private:
  struct Mapping {
    void* base = nullptr;
    size_t size = 0;
  };
  struct Inbound {  // reading side of peer->me ring (lives in the peer's segment)
    ShmRingCtl* ctl = nullptr;
    uint8_t* ring = nullptr;
    uint64_t tail = 0;       // private copy of ctl->tail, published on pop
    uint64_t cur_bytes = 0;  // bytes the peeked record occupies (incl. any wrap skip)
    bool have = false;
    uint64_t populated = 0;  // ring bytes mapped in here so far (transport.cpp, populate)
    Message msg;
    Doorbell peer_bell;
  };
  struct Outbound {  // writing side of me->peer ring (lives in this segment)
    ShmRingCtl* ctl = nullptr;
    uint8_t* ring = nullptr;
    uint64_t wpos = 0;   // end of what we wrote; ctl->head trails it until flush()
    uint64_t tail = 0;   // ctl->tail as last read (the reader may be further on)
    bool dirty = false;  // wpos is ahead of ctl->head
    uint64_t populated = 0;  // ring bytes backed and mapped in so far
    uint32_t stream_left = 0;  // large payloads still to copy with non-temporal stores
    uint32_t slow_copies = 0;  // plain copies of large payloads in a row that ran slow
    Doorbell peer_bell;
  };

  struct Imported {  // a peer's shared buffer mapped here (read-only)
    uint64_t buffer = 0;
    void* base = nullptr;
    size_t size = 0;
    uint64_t used = 0;  // import_calls_ when last used, for eviction
  };

  void copy_payload(Outbound& o, uint8_t* dst, const void* src, size_t n);
  void drop_imports(int peer);
  std::string segment_name(int rank) const;
  size_t segment_size() const;
  ShmRingCtl* ring_ctl(void* base, int local_idx) const;
  uint8_t* ring_data(void* base, int local_idx) const;

  int rank_;
  int world_size_;
  std::string token_;
  std::vector<int> local_ranks_;
  std::vector<int> local_index_;  // global rank -> index in local_ranks_, or -1
  std::vector<int64_t> pids_;
  size_t ring_bytes_;
  int stream_stores_;
  size_t max_payload_;
  bool unlinked_ = false;
  Mapping own_;
  std::vector<Mapping> peer_maps_;  // by local index
  std::vector<char> closed_seen_;   // by global rank: peer_alive found it shut down (engine lock)
  std::vector<Inbound> in_;         // by global rank
  std::vector<Outbound> out_;       // by global rank
  std::vector<int> dirty_;          // peers with unpublished messages
  // Same-host peers' process descriptors (-1: none, so no imports from that peer), opened when
  // the peer's segment was checked, so they name that process even if its pid is reused.
  std::vector<int> pidfd_;          // by global rank
  std::vector<std::vector<Imported>> imports_;  // by global rank
  uint64_t import_calls_ = 0, buffers_mapped_ = 0;
  Doorbell own_bell_;
};

}  // namespace fastcomm
