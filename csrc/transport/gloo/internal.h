// What the Gloo transport's files share (transport.cpp: frames, connections, receivers,
// closing; bulk.cpp: bulk transfers): the wire constants, the frame buffers, a transfer in
// flight. Private to transport/gloo/.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/gloo/transport.h"

namespace fastcomm {
namespace gloo_wire {

// A frame starts with two words: bytes of the frame used, and control flags (0 on a data frame;
// a control frame carries no records).
constexpr size_t kLenWords = 16;
constexpr uint64_t kCtlClose = 1;     // the sender is closing: answer once you have read this
constexpr uint64_t kCtlCloseAck = 2;  // the answer
constexpr uint64_t kCtlAll = kCtlClose | kCtlCloseAck;
// How long stop() waits for those answers. A peer answers once it has read every frame before
// "closing" and no op of a group with us runs there any more (a rank that leaves after its
// last op may be ahead of its peers, whose ops of that group may still be running: our
// connection closing would fail them). Only a peer that is stopped, hung, or waits for an op
// we never issued does not, and for that one the op timeout (minutes, by default) would be
// far too long a shutdown.
constexpr std::chrono::seconds kCloseWait{10};
// Frames are cut at about this size. Smaller frames overlap the receiver's fold with the
// transfer of the next frame sooner; larger ones pay Gloo's per-message cost (a ready notice,
// a wake-up of the receiving thread and of the reaper) less often. Every posted receive is
// this large, but only the bytes a frame fills are ever touched.
constexpr size_t kFrameTarget = 1024 * 1024;
// Receives kept posted per peer: up to this many frames may be in flight to one peer before
// the sender has to wait for the receiver's thread to post again.
constexpr int kRecvWindow = 4;
// Sent frames kept for reuse (per transport, all peers together).
constexpr size_t kPoolMax = 8;
constexpr int kFrameTag = 0x6663;
// How long a wait on Gloo may last: a receive for a peer's next frame stays posted while the
// peer is idle, for as long as the job runs. (The process groups' own timeout, which bounds
// making the connection, would otherwise apply; ops are timed by the engine.)
constexpr std::chrono::milliseconds kIdleWait{std::chrono::hours(24 * 7)};
// Bulk transfers use tags from here on, one per slot number (modulo the span: far more than
// can ever be in flight between two ranks). Gloo tags are non-negative ints.
constexpr int kBulkTagBase = 0x10000;
constexpr uint64_t kBulkTagSpan = uint64_t(1) << 30;
// Which spans go as bulk transfers, by default. A bulk transfer saves the copies through
// frames (CPU), but its data leaves only after the offer has reached the receiver's op and
// the receive is posted: a few thread hand-offs that frames, whose receives are always
// posted, do not wait for. So the choice depends on the link: while other traffic to the peer
// is in flight (a batch, async ops), that wait hides behind it and the saved CPU is what
// counts, from kBulkBusyMin up; on an idle link (one op at a time) the wait is the op's
// latency, and only spans from kBulkIdleMin up, whose copies cost as much, go bulk.
// The bulk_bytes setting (FASTCOMM_GLOO_BULK_BYTES) replaces both.
constexpr size_t kBulkBusyMin = 256 * 1024;
constexpr size_t kBulkIdleMin = 1024 * 1024;

inline int bulk_tag(uint64_t slot) { return kBulkTagBase + (int)(slot % kBulkTagSpan); }

inline size_t align8(size_t n) { return (n + 7) & ~size_t(7); }

inline std::string what_of(const std::exception& e) {
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) return ce->what_without_backtrace();
  return e.what();
}

inline void abort_quietly(const c10::intrusive_ptr<c10d::Work>& w) {
  try {
    w->abort();
  } catch (...) {
    // Already finished, or nothing to abort: either way nothing is left waiting on it.
  }
}
}  // namespace gloo_wire

// Outgoing frame: malloc'd once at frame_max() bytes (never zero-filled, never grown, so
// appending never re-copies), and shared with the tensor Gloo sends from until the send is
// reaped, then returned to the pool.
struct GlooOutBuf {
  uint8_t* data = nullptr;
  size_t size = 0;
  explicit GlooOutBuf(size_t cap) : data(static_cast<uint8_t*>(std::malloc(cap))) {
    TORCH_CHECK(data != nullptr, "fastcomm: out of memory for a Gloo frame of ", cap, " bytes");
  }
  GlooOutBuf(const GlooOutBuf&) = delete;
  ~GlooOutBuf() { std::free(data); }
};

struct GlooOutPool {
  std::mutex mu;
  std::vector<std::unique_ptr<GlooOutBuf>> free;
};

// A bulk transfer in flight: the handle the op polls, and what Gloo needs kept alive (its work,
// and the tensor over the memory it reads or writes).
struct GlooTransport::BulkXfer : Bulk {
  int peer = -1;
  bool send = false;
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor bytes;
  // Under bulk_mu_: transfers to wait on right after this one, by the same thread, and
  // whether that thread has already moved on (then a transfer cannot join it any more).
  std::deque<std::shared_ptr<BulkXfer>> then;
  bool waiter_left = false;
};

}  // namespace fastcomm
