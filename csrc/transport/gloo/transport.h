#pragma once
// Gloo transport for peers on other hosts, over a two-rank ProcessGroupGloo per peer, made
// when this rank first needs the peer (docs/design.md, "Connections across hosts"): connect()
// asks the session's connector (a thread of the Python layer, which makes the process group
// with the peer's through the store) and returns at once; frames and bulk sends to the peer
// are held until attach() brings its process group, then go out in order.
// Everything appended for a peer between two flushes travels as one frame; the receiver keeps a
// window of frame-sized receives posted, since Gloo sends only into a posted receive. Large
// spans go as bulk transfers on tags of their own, straight from and into the op's memory.
// Gloo cannot poll, so a thread per remote peer receives, a pool of threads waits on bulk
// transfers, and one reaps finished sends; they ring the doorbell or run the engine's pass.
// stop() first makes sure every peer has read this rank's last frames (a closing handshake).
//
// Thread-safety: the Transport calls are serialised by the engine's lock; the inbox, free
// buffers and dead flags are shared with the helper threads under their own locks.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/doorbell.h"
#include "transport/gloo/wants.h"
#include "transport/transport.h"

namespace fastcomm {

struct GlooOutBuf;
struct GlooOutPool;

class GlooTransport final : public Transport {
 public:
  // `remote[r]` is true for ranks reached through this transport. `max_payload` is the
  // engine-wide piece size (Gloo itself has no limit; keeping the shm one makes pieces agree).
  // `linger`: how long stop() lets sends in flight finish (a peer may still be reading this
  // rank's last messages; unlike a shared-memory ring, they die with the process).
  // `bulk_bytes`: spans from this size go as bulk transfers (0: adaptive, SIZE_MAX: never).
  GlooTransport(int rank, int world_size, std::vector<char> remote, size_t max_payload, Doorbell bell,
                std::chrono::milliseconds linger, size_t bulk_bytes);
  ~GlooTransport() override;

  const char* name() const override { return "gloo"; }
  size_t max_payload() const override { return max_payload_; }
  bool try_send(int peer, const Header& hdr, const void* payload) override;
  void flush() override;
  const Message* peek(int peer) override;
  void pop(int peer) override;
  bool peer_alive(int peer) override;
  size_t bulk_min(int peer, bool more_ops) override;
  std::shared_ptr<Bulk> send_bulk(int peer, at::Tensor bytes) override;
  std::shared_ptr<Bulk> recv_bulk(int peer, uint64_t slot, at::Tensor bytes, Bulk* with) override;
  void drain_bulk(int peer, const Message& offer) override;
  // Run by a bulk waiter thread once a chain of transfers is over, and by a receiver thread
  // once a data frame is in, instead of ringing the doorbell (a thread already running does
  // the pass: no wake-up of a sleeping driver).
  void set_delivery_hook(std::function<bool()> hook) override { bulk_hook_ = std::move(hook); }
  void set_close_gate(std::function<int(int)> busy_with) override { close_gate_ = std::move(busy_with); }

  // Asks for a connection to `peer` if none is asked for yet (at first use, or when the peer
  // asked for one through the store: any thread); never blocks.
  void connect(int peer) override;
  bool linked(int peer) override { return peers_[peer]->link.load(std::memory_order_acquire) == 2; }
  // The connector's side (any thread, no engine lock). wanted(): blocks until some peers are
  // asked for, the engine asks the connector to read its list of requests (look_for_asks),
  // the transport stops, or `timeout_ms` passes (< 0: no bound).
  GlooWants wanted(int64_t timeout_ms);
  // An op has waited long enough that a peer may be asking for a connection this rank does
  // not want itself (a mismatched op's message, an any-source receive): see the requests.
  void look_for_asks();
  // The process group with `peer` is up (`peer_rank`: the peer's rank in it): sends what was
  // held, starts its receiver. False if the transport stopped meanwhile (pg is not used).
  bool attach(int peer, c10::intrusive_ptr<c10d::Backend> pg, int peer_rank);
  // The connection could not be made: the peer is declared dead with `why`.
  void attach_failed(int peer, const std::string& why);
  // Peers with a connection asked for and not made yet (what a timeout names).
  std::string pending_reason(int peer) override;
  // Peers this rank holds a connection to.
  size_t connected() const { return connected_.load(); }
  // Waits (bounded) for every peer this rank sent data to to confirm it has read it, and for
  // sends in flight; then aborts posted receives and joins the helper threads.
  void stop() override;
  // Why the peer was declared dead (empty if it was not).
  std::string death_reason(int peer) override;
  // frames_sent, closes_sent, bulk_started, bulk_live, frames_unreaped (below).
  std::map<std::string, uint64_t> counters() override;
  // Bulk transfers started so far (sends and receives): what tests check the bulk path by.
  uint64_t bulk_started() const { return bulk_started_; }
  // Bulk transfers not over yet: what tests check that none is left waiting by.
  size_t bulk_live() {
    std::lock_guard<std::mutex> lk(bulk_mu_);
    return bulk_live_.size();
  }
  // Frames handed to Gloo so far (one per peer and flush, more when a flush exceeds
  // frame_max()): what tests check batching by.
  uint64_t frames_sent() const { return frames_sent_; }
  // Frames sent whose completion the reaper has not seen yet (tests check that one slow peer
  // does not hold back the others' by this).
  size_t frames_unreaped() {
    std::lock_guard<std::mutex> lk(send_mu_);
    return sends_.size() + (reaping_.work ? 1 : 0);
  }
  // "closing" frames stop() sent, one per peer it waited for: what tests check the
  // handshake by.
  uint64_t closes_sent() const { return closes_sent_; }
  // Largest frame, length word included; equal on every rank since max_payload is.
  size_t frame_max() const { return frame_max_; }

 private:
  struct BulkXfer;
  struct Frame {
    at::Tensor buf;  // a frame_max()-sized receive buffer
    size_t len = 0;  // bytes Gloo wrote into it (from the length word)
  };
  struct Peer {
    // The connection: 0 none asked for, 1 asked for, 2 up (pg set: read without link_mu only
    // by threads that saw 2). Frames and bulk sends wait in `held` until it is up.
    std::atomic<int> link{0};
    std::mutex link_mu;
    c10::intrusive_ptr<c10d::Backend> pg;
    int prank = 0;  // the peer's rank in pg
    std::atomic<int64_t> asked_ns{0};  // when it was asked for (steady clock)
    struct Held {
      std::shared_ptr<GlooOutBuf> frame;  // a frame (flags), or ...
      uint64_t flags = 0;
      std::shared_ptr<BulkXfer> bulk;  // ... a bulk send not posted yet
    };
    std::vector<Held> held;
    // Sending side (engine lock).
    std::shared_ptr<GlooOutBuf> out;  // records appended since the last flush
    bool dirty = false;
    bool sent_data = false;  // a data frame went to this peer (stop() waits for its ack)
    // Traffic in flight to it (frames not yet reaped, bulk transfers not yet over): whether
    // a bulk transfer's wait would hide behind other traffic (bulk_min()).
    std::atomic<int> frames_in_flight{0};
    std::atomic<int> bulk_in_flight{0};
    // Receiving side: current frame and cursor (engine lock) ...
    Frame cur;
    size_t pos = 0;
    bool have = false;
    size_t cur_bytes = 0;
    Message msg;
    // ... and what is shared with the receiver thread (mu).
    std::mutex mu;
    std::deque<Frame> inbox;
    std::vector<at::Tensor> free;  // consumed receive buffers, to be posted again
    std::atomic<size_t> ready{0};
    std::vector<c10::intrusive_ptr<c10d::Work>> posted;  // receives in flight (for abort)
    std::thread thread;
    std::atomic<bool> dead{false};
    std::atomic<bool> close_acked{false};   // the peer confirmed our "closing" frame
    std::atomic<bool> peer_closing{false};  // the peer sent "closing" itself
    std::string why;  // guarded by mu
  };

  std::shared_ptr<GlooOutBuf> new_frame();
  void flush_peer(int peer);
  // Fills in the frame's two words and hands it to Gloo, queued for the reaper; false (the
  // peer marked dead) if Gloo refused it. From any thread.
  bool send_frame(int peer, const std::shared_ptr<GlooOutBuf>& b, uint64_t flags);
  // Sends a frame with no records, only control flags (from any thread).
  void send_control(int peer, uint64_t flags);
  // Answers a peer's "closing" once no op of a group with it runs here (close_gate_), or at
  // kCloseWait, when the closer stops waiting; runs on that peer's receiver thread.
  void answer_close(int peer);
  // Hands a frame to Gloo (link up, link_mu held).
  bool post_frame(int peer, const std::shared_ptr<GlooOutBuf>& b);
  // Posts a bulk send held while the link was down (link_mu held).
  void post_held_bulk(int peer, const std::shared_ptr<BulkXfer>& x);
  // The closing handshake of stop(); returns when every peer it waits for has answered or
  // died, or at the deadline.
  void close_handshake();
  void recv_main(int peer);
  void reap_main();
  void mark_dead(int peer, const std::string& why);
  c10::intrusive_ptr<c10d::Work> post_recv(int peer, at::Tensor& t, int tag);
  // Posts the Gloo send or receive of a transfer (marking the peer dead if Gloo refuses it)
  // and hands it to watch_bulk.
  std::shared_ptr<Bulk> start_bulk(int peer, bool send, uint64_t slot, at::Tensor bytes, Bulk* with);
  // Hands a started transfer to a waiter thread (starting one if none is idle).
  std::shared_ptr<Bulk> watch_bulk(int peer, bool send, c10::intrusive_ptr<c10d::Work> w,
                                   at::Tensor bytes, uint64_t slot, Bulk* with);
  void watch(const std::shared_ptr<BulkXfer>& x, Bulk* with);
  struct Released {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> tensors;
  };
  // Keeps, or lets go of, what a finished transfer held, under bulk_mu_ (the caller then sets
  // its state). What it lets go of (maybe the last references to a Gloo work and a tensor,
  // whose release may need the GIL) goes into `release`, to be dropped outside bulk_mu_.
  void settle_bulk(BulkXfer& x, bool ok, Released& release);
  void bulk_main();
  void stop_bulk();

  int rank_;
  int world_size_;
  std::vector<char> remote_;
  size_t max_payload_;
  size_t frame_max_;
  std::shared_ptr<GlooOutPool> pool_;  // shared with the frames in flight, which may outlive us
  std::chrono::milliseconds linger_;
  Doorbell bell_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<int> dirty_;
  std::atomic<bool> stop_{false};
  std::chrono::steady_clock::time_point stop_deadline_;  // for the handshake and sends in flight
  bool closing_ = false;  // stop() has begun (send_mu_)
  std::atomic<bool> closing_flag_{false};  // the same, for the receiver threads
  std::mutex close_mu_;  // with close_cv_: stop() waiting for acks (and deaths)
  std::condition_variable close_cv_;
  uint64_t frames_sent_ = 0;
  size_t bulk_min_;
  std::atomic<uint64_t> bulk_started_{0};
  // Peers asked for and not yet handed to the connector, and whether it may stop (want_mu_).
  std::mutex want_mu_;
  std::condition_variable want_cv_;
  std::vector<int> want_;
  bool look_ = false;
  std::atomic<size_t> connected_{0};
  std::mutex link_start_mu_;  // attach() against stop(): no receiver starts once stop() joins
  std::vector<uint64_t> bulk_next_;  // next slot number per peer (engine lock)

  // Bulk transfers in flight and their waiter threads (bulk_mu_).
  std::mutex bulk_mu_;
  std::condition_variable bulk_cv_;
  std::deque<std::shared_ptr<BulkXfer>> bulk_queue_;              // not yet taken by a waiter
  std::vector<std::shared_ptr<BulkXfer>> bulk_live_;              // all not yet finished
  std::vector<c10::intrusive_ptr<c10d::Work>> bulk_unfinished_;   // aborted: kept, as unfinished_
  std::vector<at::Tensor> bulk_unfinished_bytes_;                 // ... with their memory
  std::vector<std::thread> bulk_threads_;
  int bulk_idle_ = 0;
  bool bulk_stop_ = false;
  std::function<bool()> bulk_hook_;
  std::function<int(int)> close_gate_;  // set once before any message moves
  std::atomic<uint64_t> closes_sent_{0};  // written by stop(), read by any thread

  // Sends in flight, reaped in order by reaper_.
  std::mutex send_mu_;
  std::condition_variable send_cv_;
  struct InFlight {
    int peer;
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::deque<InFlight> sends_;
  // The send the reaper is waiting on, so that it can be aborted when its peer dies or when
  // stop() runs out of time: a Gloo send to a dead peer can stay pending for good.
  InFlight reaping_{-1, {}};
  bool reaper_done_ = false;
  // Sends that were aborted or timed out rather than completed: Gloo may still hold a pointer
  // into their frames, so the frames live until the transport (after the process group) goes.
  std::vector<c10::intrusive_ptr<c10d::Work>> unfinished_;
  std::condition_variable reaper_done_cv_;
  std::thread reaper_;
};

}  // namespace fastcomm
