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
// A pair of one host whose device can read the other's memory goes over a fixed IPC link of
// the plan's own instead (device/ipc_link.h: flag waits and writes of fixed values, so the
// graph replays them as captured), where both engines use IPC links and the runtime can capture
// stream flag operations: the leader offers its ring, the follower accepts with its own (or
// declines), and the leader confirms (or sends a communicator id after all). Every link pair's
// work goes onto one stream of the plan's own, in the canonical order, which both sides of
// every pair follow, and so does every communicator pair's in a plan that has both kinds
// (docs/design.md, "CUDA graphs", has why this cannot deadlock).
//
// A replay launches the graph on the caller's stream and records an event behind it; each
// replay and wait() looks at the runs in flight: a plan communicator's asynchronous error, a
// peer the host knows is gone, or a run not done within the timeout aborts the plan's
// communicators (their kernels return, later runs drain without moving data) and raises
// DistBackendError naming the peer; the graph is dead from then on.
//
// A replay while the caller's stream is captured (torch.cuda.graph) records the same device work
// into that capture instead, forked from and joined back into the caller's stream, between two
// host calls that count the run's start and end at each replay of the user's graph; a watcher
// thread fails the graph as above while such a run is in flight, so the user's graph drains.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/ipc_link.h"
#include "device/ops.h"
#include "engine/device.h"

namespace fastcomm {
namespace device {

// What a plan needs to link pairs over IPC (from its engine).
struct GraphLinks {
  bool on = false;                   // offer links: IPC on, and the runtime captures flag operations
  std::function<bool(int)> same_host;  // whether a peer shares this host
  size_t ring_bytes = 0;
  uint32_t slots = 4;
  // Takes ended links whose streams here have drained, and frees their rings once the peer has
  // unmapped them (or is gone), and `rest` (memory their runs used) on the engine's thread. Any
  // thread but CUDA's callback thread may call it (after the engine stopped, it frees them there).
  std::function<void(std::vector<std::unique_ptr<IpcLink>>, std::shared_ptr<void> rest)> retire;
  std::atomic<int64_t>* made = nullptr;  // links that both sides took (debug "plan_ipc_links")
  std::atomic<int64_t>* serial = nullptr;  // plans of links and communicators both (debug "plan_serial")
  std::atomic<int64_t>* releasing = nullptr;  // graphs dropped, waiting for their runs (debug "plan_releasing")
};

class PlanGraph final : public DeviceGraph {
 public:
  // Blocks until every peer of the plan has captured the same plan (see above). `owner` keeps
  // the runtime alive.
  // `max_kernels`: FASTCOMM_DEVICE_MAX_KERNELS (0: unbounded); a plan with more peers than that
  // runs its launches in a window (docs/design.md, "Kernels in flight").
  PlanGraph(std::shared_ptr<void> owner, Runtime& rt, HostLink& host, int rank, Stream alloc,
            std::vector<DeviceOp> ops, bool naive, int64_t max_kernels = 0, GraphLinks links = {});
  ~PlanGraph() override;

  void replay() override;
  void wait(std::chrono::milliseconds timeout) override;
  int64_t replays() const override;
  int64_t recorded() const override;
  int64_t user_runs() const override;
  // fastcomm is shutting down: the plan's communicators are aborted, later replays raise.
  void abort(const std::string& why);

 private:
  struct Pair {
    int peer = -1;
    bool leader = false;  // the lower rank: makes the communicator's id
    Comm comm = nullptr;
    Stream stream = nullptr;  // a link pair's: the plan's one links stream (not its own)
    std::vector<Part*> parts;  // in the canonical order
    UniqueId id;
    std::unique_ptr<IpcLink> link;  // over IPC (then no comm)
    UniqueId peer_ring;             // ... the peer's ring
  };
  struct Run {
    Event end;
    Clock::time_point launched;
  };

  // Runs inside user graphs: counted by host calls at their start and end (any thread).
  struct Watch {
    std::mutex mu;
    std::condition_variable cv;
    int64_t started = 0, ended = 0;
    std::deque<Clock::time_point> begun;  // the start of each run in flight
    bool stop = false;  // the graph goes
    bool idle = false;  // the graph is dead: nothing left to watch
    static void on_start(void* w);
    static void on_end(void* w);
    int64_t in_flight();
  };
  // kLaunch: before a replay (a fault fails it); kWait: until settled; kWatch: the watcher's poll.
  enum class Check { kLaunch, kWait, kWatch };

  void agree();         // the host exchange with every peer: order, matching, ids
  bool can_link(int peer) const;  // IPC links offered or taken with this peer
  // Whether this side takes the leader's offer of a link (its ring's id).
  bool accepts(int peer, const UniqueId& ring) const;
  std::unique_ptr<IpcLink> new_link(int peer);
  void connect();       // the plan's communicators, up
  void record_graph();  // the capture itself
  // The plan's device work, forked from `origin` and joined back into it (captured).
  void emit(Stream origin);
  void record_into(Stream caller);  // replay() under the caller's capture
  void watch_loop();
  Pair& pair(int peer);
  // Runs seen done are dropped; a fault fails the graph (broken_) and raises. kWait returns once
  // every run so far has run (and `until`, where given).
  void check_locked(Check how, std::chrono::milliseconds timeout, Event until = nullptr);
  std::string fault_locked();  // a plan channel failed or a peer gone: why ("" if none)
  // A peer failed its side of a link while its runs were in flight: what they wrote may be
  // garbage, so even runs seen done fail ("" if none).
  std::string garbage_locked();
  void start_drain();  // a failed plan's links: their waits released until release() ends it
  void end_links();    // release(): every link ended, unmapped and retired
  // What user graphs that recorded a plan hold (Runtime::capture_keep): the plan's watch, and
  // its links and memory from the plan's release until the last of those graphs is destroyed
  // (its memory only where no communicator's aborter holds it: abort_comms).
  struct LinkKeep;
  std::shared_ptr<LinkKeep> keep_;  // made at the first record_into
  void keep_with(Stream caller);    // record_into: the user's capture holds keep_
  [[noreturn]] void fail_locked(const std::string& why);
  // The plan's communicators aborted and destroyed on a detached thread, which then frees ops_.
  void abort_comms();
  void release();  // comms, streams, events, the graph

  std::shared_ptr<void> owner_;
  Runtime& rt_;
  HostLink& host_;
  const int rank_;
  const bool naive_;
  const int64_t max_kernels_;
  GraphLinks links_;
  Stream links_stream_ = nullptr;  // every link pair's work, in the canonical order
  // Link pairs and communicator pairs both: every pair's work goes on links_stream_, in the
  // canonical order (a flag wait blocks the hardware queue it sits in, and CUDA may put a
  // communicator's kernel behind it; docs/design.md, "CUDA graphs", "Mixed plans").
  bool serial_ = false;
  std::thread drain_;
  std::atomic<bool> drain_stop_{false};
  // More peers than max_kernels_: launches go in canonical order, at most max_kernels_ kernels
  // of them in flight, each admitted once every launch too far back has retired (on retire_).
  bool windowed_ = false;
  Stream retire_ = nullptr;
  std::chrono::milliseconds timeout_{0};
  std::string label_;  // the plan's groups, for messages
  std::vector<std::unique_ptr<DevOp>> ops_;  // in the canonical order
  std::vector<Pair> pairs_;
  Stream origin_ = nullptr;
  Stream join_ = nullptr;  // end work of ops of 3+ (or of none)
  void* graph_ = nullptr;
  bool open_capture_ = false;  // begun on origin_, not ended yet
  std::vector<Event> emit_events_;  // made at the first emit, reused by the next (none made under a user's capture)
  std::shared_ptr<Watch> watch_;    // made at the first record_into
  std::thread watcher_;

  mutable std::mutex mu_;
  std::deque<Run> runs_;       // launched, not seen done
  std::vector<Event> spare_;   // events of runs seen done
  int64_t replays_ = 0;
  int64_t recorded_ = 0;  // times recorded into a user's capture
  std::exception_ptr broken_;
};

}  // namespace device
}  // namespace fastcomm
