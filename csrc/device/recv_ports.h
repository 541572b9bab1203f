#pragma once
// Receives that wait for their channel, as a pure state machine (docs/design.md, "recv from any
// source"): the recvs of one (group, tag) posted while one from any source waits ahead of them,
// in posting order. Binding a recv gives it its channel's next receive number, so the receives
// of a (group, tag) take their numbers in posting order (MPI's matching rule), front first:
// - a recv from a named sender binds as soon as it is at the front;
// - one from any source binds, at the front, to the first candidate (round robin from the last
//   match) whose next message is offered (device/agreement.h: its send is ready there, or was
//   cancelled), and it watches every candidate's next message meanwhile;
// - it fails, naming the member, once a candidate's channel failed for good while none offered:
//   that member may have been the sender, and a later message of another member, taken
//   instead, would belong to a later receive.
// No runtime, no clock: tests/cpp/test_any_source.cpp drives it with pair agreements.
#include <cstdint>
#include <deque>
#include <map>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/ops.h"

namespace fastcomm {
namespace device {

using PortKey = std::pair<uint64_t, int64_t>;  // (group id, tag)

// The posting side (under the engine's lock): the receive number each channel gives next, and
// the ports with unbound recvs. A recv from any source, and a recv of its (group, tag) posted
// while one waits unbound there (whatever posts it: a single op, a batch, a plan's start), take
// no number at post: they go to RecvPorts and take theirs when bound, in posting order.
class RecvNumbers {
 public:
  // An op of channel `id` posted; `port`: it is a recv on that port (`any`: from any source).
  // True with its key, or false: post it unbound (RecvPorts::post).
  bool take(uint64_t id, const PortKey* port, bool any, Key& key);
  // An unbound recv of `port` was bound, failed or taken out.
  void settled(const PortKey& port);
  std::unordered_map<uint64_t, uint64_t>& next_seq() { return next_seq_; }

 private:
  std::unordered_map<uint64_t, uint64_t> next_seq_;
  std::map<PortKey, int> unbound_;  // per port: recvs posted unbound, not yet settled
};

class RecvPorts {
 public:
  using PortKey = device::PortKey;
  struct Recv {
    void* token = nullptr;
    bool any = false;
    std::vector<DeviceOp::Sender> from;  // the candidates; one for a named sender
  };
  struct Bound {
    void* token;
    DeviceOp::Sender from;
    Key key;
  };
  struct Failed {
    void* token;
    int rank;  // the candidate whose channel failed
  };
  // What binding asks of the pair channels (the agreements of device/agreement.h).
  class Channels {
   public:
    virtual ~Channels() = default;
    virtual void watch(int rank, const Key& k) = 0;
    virtual void unwatch(int rank, const Key& k) = 0;
    virtual bool offered(int rank, const Key& k) = 0;
    virtual bool failed(int rank) = 0;
  };

  void post(const PortKey& port, Recv r) { ports_[port].queue.push_back(std::move(r)); }
  // Binds what can be, front first in each port; `next_seq` is the receive number each channel
  // gives next (the engine's, shared with recvs posted straight to their channel).
  void step(Channels& ch, std::unordered_map<uint64_t, uint64_t>& next_seq, std::vector<Bound>& bound,
            std::vector<Failed>& failed);
  // Takes an unbound recv out (it timed out); false if it is not here.
  bool remove(Channels& ch, const std::unordered_map<uint64_t, uint64_t>& next_seq, void* token);
  bool empty() const { return ports_.empty(); }

 private:
  struct Port {
    std::deque<Recv> queue;
    size_t next = 0;  // round robin: the candidate tried first
  };
  std::map<PortKey, Port> ports_;
};

}  // namespace device
}  // namespace fastcomm
