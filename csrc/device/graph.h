#pragma once
// A plan's device ops captured into a CUDA graph (`p.capture()`, docs/design.md "CUDA graphs").
//
// Everything that needs the host or the peers happens once, before the capture: the members of
// each pair the plan uses agree on its parts in one canonical order (by group id, then the op's
// place in its group) and check that they match, exchange the id of a communicator of the
// plan's own per pair, wait for it to be up, and allocate the folds' scratch. The capture then
// holds device work only: per pair, the transfers on a stream of the plan's own, in that order
// (a FIFO both sides fill alike, so the engine's no-deadlock argument holds inside the graph);
// folds and copies right behind them (ops of 3+ on a join stream); forked from and joined back
// into one origin stream by events.
//
// A replay launches the graph on the caller's stream and records an event behind it; each
// replay and wait() looks at the runs in flight: a plan communicator's asynchronous error, a
// peer the host knows is gone, or a run not done within the timeout aborts the plan's
// communicators (their kernels return, later runs drain without moving data) and raises
// DistBackendError naming the peer; the graph is dead from then on.
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device/ops.h"
#include "engine/device.h"

namespace fastcomm {
namespace device {

class PlanGraph final : public DeviceGraph {
 public:
  // Blocks until every peer of the plan has captured the same plan (see above). `owner` keeps
  // the runtime alive.
  PlanGraph(std::shared_ptr<void> owner, Runtime& rt, HostLink& host, int rank, Stream alloc,
            std::vector<DeviceOp> ops, bool naive);
  ~PlanGraph() override;

  void replay() override;
  void wait(std::chrono::milliseconds timeout) override;
  int64_t replays() const override;
  // fastcomm is shutting down: the plan's communicators are aborted, later replays raise.
  void abort(const std::string& why);

 private:
  struct Pair {
    int peer = -1;
    bool leader = false;  // the lower rank: makes the communicator's id
    Comm comm = nullptr;
    Stream stream = nullptr;
    std::vector<Part*> parts;  // in the canonical order
    UniqueId id;
  };
  struct Run {
    Event end;
    Clock::time_point launched;
  };

  void agree();         // the host exchange with every peer: order, matching, ids
  void connect();       // the plan's communicators, up
  void record_graph();  // the capture itself
  Pair& pair(int peer);
  // Runs seen done are dropped; a fault fails the graph (broken_) and raises.
  void check_locked(bool block_until_done, std::chrono::milliseconds timeout);
  [[noreturn]] void fail_locked(const std::string& why);
  void release();  // comms, streams, events, the graph

  std::shared_ptr<void> owner_;
  Runtime& rt_;
  HostLink& host_;
  const int rank_;
  const bool naive_;
  std::chrono::milliseconds timeout_{0};
  std::string label_;  // the plan's groups, for messages
  std::vector<std::unique_ptr<DevOp>> ops_;  // in the canonical order
  std::vector<Pair> pairs_;
  Stream origin_ = nullptr;
  Stream join_ = nullptr;  // end work of ops of 3+ (or of none)
  void* graph_ = nullptr;
  bool open_capture_ = false;  // begun on origin_, not ended yet

  mutable std::mutex mu_;
  std::deque<Run> runs_;       // launched, not seen done
  std::vector<Event> spare_;   // events of runs seen done
  int64_t replays_ = 0;
  std::exception_ptr broken_;
};

}  // namespace device
}  // namespace fastcomm
