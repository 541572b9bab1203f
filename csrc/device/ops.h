#pragma once
// What the device engine (device/engine.cpp) knows of an op: the request lowered into
// transfers with each peer (parts), the end work after them (folds, local copies), or one
// collective on the group's communicator; and the control protocol's records, by which the
// members of a pair agree on each op.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "device/events.h"
#include "device/runtime.h"
#include "device/work.h"
#include "engine/device.h"

namespace fastcomm {
namespace device {

using Clock = std::chrono::steady_clock;
using RedOp = c10d::ReduceOp::RedOpType;

// ---- the control protocol (frames over the host link, one ordered stream per pair)

// What both members of a pair must agree on for an op: a member issuing something else on the
// same group at the same position is a mismatch, raised on both.
struct Sig {
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t redop = 0;
  uint8_t flags = 0;  // SigFlags
  int32_t root = -1;
  uint64_t bytes = 0;  // what this pair moves each way (all_to_all: what this side sends)
  uint64_t back = 0;   // all_to_all: what this side receives (the pairs of one op differ in size)
  bool operator==(const Sig& o) const {
    return kind == o.kind && dtype == o.dtype && redop == o.redop && flags == o.flags && root == o.root &&
           bytes == o.bytes && back == o.back;
  }
};
enum SigFlags : uint8_t {
  kOnGroupComm = 1,   // the op runs on the group's communicator (members must agree on that)
  kGroupBroken = 2,   // this member's group communicator has failed: the op cannot run
  kLinkRS = 4,        // a large all_reduce of 3+ over the pair links: its reduce-scatter ...
  kLinkAG = 8,        // ... and its all-gather, the group's next op
};

// An op's place: its group's id (send/recv: the pair channel's) and its index there.
struct Key {
  uint64_t id = 0;
  uint64_t seq = 0;
  bool operator==(const Key& o) const { return id == o.id && seq == o.seq; }
};
struct KeyHash {
  size_t operator()(const Key& k) const { return std::hash<uint64_t>()(k.id * 0x9e3779b97f4a7c15ULL ^ k.seq); }
};

struct Entry {
  Key key;
  Sig sig;
};
static_assert(sizeof(Entry) == 40, "control entry layout");

// kGo and kRefuse: the group leader's word on a group-communicator op (see GroupComm), once
// every member answered its proposal; a kGo with an id carries the group communicator's.
// kCancel, kReset, kResetAck: the epochs of device/agreement.h.
enum FrameType : uint32_t {
  kPropose = 1,
  kCommit = 2,
  kMismatch = 3,
  kGo = 4,
  kRefuse = 5,
  kCancel = 6,
  kReset = 7,
  kResetAck = 8,
  kRelease = 9,
  kGroupRelease = 10,  // the group's rank 0 released the group's communicator (entries: Key{group, 0})
  kProbe = 11,         // leader: is your send with this key ready? (a recv from any source, unbound)
  kOffer = 12,         // follower: it is (or it was cancelled); the send stays where it was
};
struct FrameHead {
  uint32_t type = 0;
  uint32_t count = 0;
  uint32_t has_id = 0;  // the leader's first frame of an epoch carries the pair communicator's id
  uint32_t epoch = 0;
};
constexpr size_t kFrameBytes = 1024;
constexpr size_t kMaxEntries = (kFrameBytes - sizeof(FrameHead) - sizeof(UniqueId)) / sizeof(Entry);

std::string sig_str(const Sig& s);
// Whether the pair's two sides issued the same op (a send meets a recv).
bool compatible(const Sig& leader, const Sig& follower);

// ---- ops as the engine tracks them

struct Batch;

struct DevOp;

// One op's transfers with one peer: all sent and received in one group of the pair's channel.
struct Part {
  DevOp* op = nullptr;
  int peer = -1;
  Sig sig;
  std::vector<std::pair<const void*, size_t>> sends;
  std::vector<std::pair<void*, size_t>> recvs;
  enum State { kWaiting, kProposed, kCommitted, kLaunched, kDone } state = kWaiting;
  bool launched = false;  // on its channel's stream (or failed before): counted in parts_unlaunched
  EventPtr done_event;    // recorded after the channel group holding this part
  Clock::time_point launched_at{};  // when it went onto its channel's stream (a timeout says)
  Stream stream = nullptr;  // its channel's stream, once launched
  bool agree_only = false;  // a group-communicator op's agreement with one member: no data
  bool agreed = false;      // group leader: that member committed
  bool held_back = false;   // group leader, kernel bound: not proposed yet (members go highest first)
  bool mismatched = false;  // failed as a mismatch (the peer failed its side too)
  // A pair all_reduce: the fold of its one receive (`recvs[0]` is its scratch), which an IPC
  // link runs chunk by chunk straight from the peer's ring instead of copying the chunk out.
  bool fold_in_ring = false;
  FoldJob ring_fold{};
};

struct GroupComm;

// One collective on a group communicator.
struct Collective {
  OpKind kind = OpKind::kNone;
  void* in = nullptr;
  void* out = nullptr;
  int64_t count = 0;  // elements per member (all_gather and broadcast: bytes)
  c10::ScalarType dtype = c10::kByte;
  RedOp op = c10d::ReduceOp::SUM;
  int root = 0;
};

struct DevOp {
  Key key;
  OpKind kind = OpKind::kNone;
  std::string label;
  std::vector<at::Tensor> keep;  // every tensor the op touches, held until it is over
  at::Tensor scratch;
  std::vector<FoldJob> folds;
  std::vector<std::tuple<void*, const void*, size_t>> copies;  // local copies at the end
  std::vector<std::unique_ptr<Part>> parts;
  int parts_left = 0;        // parts whose transfers are not seen done (or failed) yet
  int parts_unlaunched = 0;  // parts not on their channel's stream yet (nor failed)
  bool ready = false;     // its group's previous op is enqueued: its parts may be agreed
  bool launched = false;  // every part and its end work are enqueued (or it failed before)
  bool finished = false;  // launched, and its transfers seen done (or failed)
  std::exception_ptr error;
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  Clock::time_point ready_at{};  // when its group's previous op was enqueued (a timeout says)
  EventPtr input;     // the caller's stream at issue
  EventPtr pred_end;  // the end of the group's previous op, if it put work on a device stream
  Stream pred_stream = nullptr;  // ... and the stream it is on
  EventPtr end;       // this op's end: after its transfers and end work, on end_stream
  Stream end_stream = nullptr;
  // Every stream this op's work went to, with an event after it: its memory is held until
  // each has run (after an abort too, when a stream may still run a part of it).
  std::vector<std::pair<Stream, EventPtr>> streams;
  bool group_op = false;    // the op runs as `coll` on its group's communicator
  GroupComm* gc = nullptr;  // that communicator (set by the engine thread)
  std::vector<int> ranks;   // group_op: the group, and this rank's place in it
  int me = 0;
  Collective coll;
  bool leads = false;  // this rank is the group's rank 0 (it decides go or refuse)
  bool decided = false;  // rank 0: its go or refuse went out
  int chain = 0;       // rank 0, kernel bound: parts[chain - 1] is the next part to propose
  bool awaits_go = false;  // member, kernel bound: committed holding its group's slot
  DevOp* next = nullptr;  // the group's next op
  // The all-gather of a large all_reduce over the links: its reduce-scatter, the group's op
  // before it (alive until this one is ready; parts in the same peer order).
  DevOp* scattered = nullptr;
  // A recv on its (group, tag)'s port (device/recv_ports.h). An unbound one (from any source,
  // or posted while one waits ahead of it) has no key until it is bound.
  bool recv_port = false;
  std::pair<uint64_t, int64_t> port;
  bool unbound = false;
  bool any_source = false;
  std::vector<DeviceOp::Sender> from;
  std::shared_ptr<Batch> batch;
};

// The ops of one post (one Work).
struct Batch {
  c10::intrusive_ptr<DeviceWork> work;
  int left = 0;          // ops not finished
  int unlaunched = 0;    // ops not launched
  bool returned = false;  // a native blocking call returned before it settled: a later error is the group's
  bool failed_early = false;  // an op failed before it was enqueued: waiters wait for the settle
  std::exception_ptr error;
  std::vector<at::Tensor> keep;  // every tensor the ops' device work touches, held until it has run
  // The last event of the ops' work on each stream it went to: the Work orders the caller after
  // these, and settles once they have run.
  std::vector<std::pair<Stream, EventPtr>> ends;
  std::vector<uint64_t> groups;  // the ops' group ids (deferred errors)
  bool one_op = false;           // a single op: a recv from any source sets the Work's source rank
  bool nested = false;           // issued inside a Future callback of ours (device/publisher.h)
};

// How ops are lowered on this engine.
struct Lowering {
  Runtime& rt;
  Stream join;              // where scratch is allocated: the end work's stream
  int rank;                 // this process's global rank (messages)
  bool group_comms;         // large ops of groups of 3+ may use the group's communicator
  size_t group_comm_bytes;  // ... from this many bytes per member
  // The group's members are linked over IPC (one host, FASTCOMM_DEVICE_IPC_GROUP_MAX): its large
  // ops stay on the pair channels, an all_reduce of 3+ as reduce-scatter + all-gather.
  bool links = false;
};
// The checked request in the engine's form. Throws (naming rank, group and argument) for what
// the device path does not run; nothing is issued before. An op lowered into two (a large
// all_reduce over the links) puts its second in `second` (which, if null, rules that out); the
// caller gives it the group's next key.
std::unique_ptr<DevOp> lower(DeviceOp& d, const std::shared_ptr<Batch>& batch, const Lowering& how,
                             std::unique_ptr<DevOp>* second = nullptr);

}  // namespace device
}  // namespace fastcomm
