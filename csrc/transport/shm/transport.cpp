#include "transport/shm/transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/copy.h"
#include "common/errors.h"
#include "common/process.h"

namespace fastcomm {

namespace {
constexpr uint64_t kMagic = 0x6d6d6f6374736166ULL;  // "fastcomm"
constexpr uint32_t kVersion = 4;  // the segment format (3: skipped tails carry a marker; 4: `closed`)
constexpr size_t kCtlBytes = 4096;
constexpr size_t kRingCtlBytes = 256;
constexpr size_t kRecordHeader = 64;

size_t align64(size_t n) { return (n + 63) & ~size_t(63); }

// Payloads from this size on may be copied with non-temporal stores; smaller ones stay in the
// cache, where the receiver reads them.
constexpr size_t kStreamMin = 64 * 1024;
// A plain copy below this rate (bytes per ns, i.e. GB/s) counts as slow. Plain copies into a
// ring ran at 7-20 GB/s when both ranks' cores shared a cache, 2 GB/s when they did not.
constexpr double kSlowCopyRate = 4.0;
// Two slow plain copies in a row (one may just have been interrupted) switch a ring to
// non-temporal stores for this many large payloads, before plain copies are tried again (the
// host may have moved the cores meanwhile).
constexpr uint32_t kSlowInARow = 2;
constexpr uint32_t kStreamRun = 256;

// A ring's pages are mapped in ahead of use, up to this much at a time (the whole of a default
// ring at the first message): one call instead of a page fault per 4 KB on each side, which in
// this project's VM doubled a small op's cost until the ring had wrapped once. The price is
// paid at a peer's first message, about 0.6 ms per MB, and the memory of the whole ring.
constexpr uint64_t kPopulateChunk = 1 << 20;

// Maps in ring bytes from `done` to a chunk past `upto`, as a write (the sender, backing the
// pages) or a read (the receiver); advances `done`. Where the kernel cannot (before Linux
// 5.14), `done` jumps to the end and pages fault in one by one as before.
void populate(uint8_t* ring, uint64_t& done, uint64_t upto, uint64_t ring_bytes, bool write) {
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#define MADV_POPULATE_WRITE 23
#endif
  if (upto <= done) return;
  const uint64_t to = std::min(ring_bytes, (upto + kPopulateChunk - 1) / kPopulateChunk * kPopulateChunk + kPopulateChunk);
  static const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  const uintptr_t from = reinterpret_cast<uintptr_t>(ring + done) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(ring + to);
  done = madvise(reinterpret_cast<void*>(from), end - from, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0
             ? to
             : ring_bytes;
}
}  // namespace

struct ShmSegmentHeader {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int64_t pid;
  uint64_t ring_bytes;
  uint32_t num_local;
  // Set by the owner when its engine shuts down: its peers then fail their ops with it at once,
  // as they do when its process exits, instead of waiting out their timeouts.
  uint32_t closed;
  char token[68];
  alignas(64) DoorbellWords bell;
};
static_assert(sizeof(ShmSegmentHeader) <= kCtlBytes, "control block too large");

// One ring's control words; head is written only by the sender, tail only by the receiver,
// each on its own cache line so neither side's writes evict the other's.
struct ShmRingCtl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
  alignas(64) std::atomic<uint32_t> space_waiter;  // sender asks for a doorbell on pop
};
static_assert(sizeof(ShmRingCtl) <= kRingCtlBytes, "ring control too large");

// 64-byte record header in the ring; payload follows, padded to 64. `pos` is the record's
// absolute ring position, always the reader's own (anything else is corruption). A record that
// did not fit before the ring's end went to its start, leaving a marker (pad == kSkipMark, no
// header or payload) where it would have been.
struct Record {
  Header hdr;
  uint64_t pos;
  uint64_t pad;
};
constexpr uint64_t kSkipMark = 0x706b73;
static_assert(sizeof(Record) == kRecordHeader, "record layout");

ShmTransport::ShmTransport(int rank, int world_size, const std::string& token,
                           std::vector<int> local_ranks, std::vector<int64_t> pids,
                           size_t ring_bytes, int stream_stores)
    : rank_(rank),
      world_size_(world_size),
      token_(token),
      local_ranks_(std::move(local_ranks)),
      local_index_(world_size, -1),
      pids_(std::move(pids)),
      ring_bytes_(align64(ring_bytes)),
      stream_stores_(stream_stores),
      closed_seen_(world_size, 0),
      in_(world_size),
      out_(world_size),
      pidfd_(world_size, -1),
      imports_(world_size) {
  TORCH_CHECK_VALUE(ring_bytes_ >= 4 * 4096, "fastcomm: FASTCOMM_SHM_RING_BYTES must be >= 16384");
  TORCH_CHECK_VALUE(token_.size() < sizeof(ShmSegmentHeader::token), "fastcomm: job token too long");
  for (size_t i = 0; i < local_ranks_.size(); ++i) local_index_[local_ranks_[i]] = (int)i;
  TORCH_INTERNAL_ASSERT(local_index_[rank_] >= 0, "own rank missing from local ranks");
  // A record never takes more than a quarter of the ring, so several can be in flight.
  max_payload_ = (ring_bytes_ / 4 - kRecordHeader) & ~size_t(63);

  const std::string name = segment_name(rank_);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  FASTCOMM_SYSCHECK(fd >= 0, "shm_open(" + name + ")");
  own_.size = segment_size();
  if (ftruncate(fd, (off_t)own_.size) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name.c_str());
    errno = e;
    FASTCOMM_SYSCHECK(false, "ftruncate of shared-memory segment");
  }
  own_.base = mmap(nullptr, own_.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (own_.base == MAP_FAILED) {
    shm_unlink(name.c_str());
    FASTCOMM_SYSCHECK(false, "mmap of shared-memory segment");
  }
  auto* h = new (own_.base) ShmSegmentHeader();
  h->rank = rank_;
  h->pid = getpid();
  h->ring_bytes = ring_bytes_;
  h->num_local = (uint32_t)local_ranks_.size();
  std::memcpy(h->token, token_.data(), token_.size());
  h->version = kVersion;
  for (size_t i = 0; i < local_ranks_.size(); ++i) new (ring_ctl(own_.base, (int)i)) ShmRingCtl();
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  own_bell_ = Doorbell(&h->bell);
  peer_maps_.resize(local_ranks_.size());
  peer_maps_[local_index_[rank_]] = Mapping{nullptr, 0};
}

ShmTransport::~ShmTransport() {
  unlink_own();
  for (int r = 0; r < world_size_; ++r) drop_imports(r);
  for (auto& m : peer_maps_)
    if (m.base) munmap(m.base, m.size);
  if (own_.base) munmap(own_.base, own_.size);
}

std::string ShmTransport::segment_name(int rank) const {
  return "/fastcomm-" + token_ + "-" + std::to_string(rank);
}

size_t ShmTransport::segment_size() const {
  return kCtlBytes + local_ranks_.size() * (kRingCtlBytes + ring_bytes_);
}

ShmRingCtl* ShmTransport::ring_ctl(void* base, int local_idx) const {
  return reinterpret_cast<ShmRingCtl*>(static_cast<uint8_t*>(base) + kCtlBytes +
                                       local_idx * (kRingCtlBytes + ring_bytes_));
}

uint8_t* ShmTransport::ring_data(void* base, int local_idx) const {
  return reinterpret_cast<uint8_t*>(ring_ctl(base, local_idx)) + kRingCtlBytes;
}

void ShmTransport::attach_peers() {
  const int me = local_index_[rank_];
  for (size_t i = 0; i < local_ranks_.size(); ++i) {
    const int peer = local_ranks_[i];
    void* base = own_.base;
    if (peer != rank_) {
      const std::string name = segment_name(peer);
      int fd = shm_open(name.c_str(), O_RDWR, 0600);
      FASTCOMM_SYSCHECK(fd >= 0, "rank " + std::to_string(rank_) + ": attaching segment of rank " +
                                     std::to_string(peer) + " (shm_open " + name + ")");
      struct stat st;
      if (fstat(fd, &st) != 0 || (size_t)st.st_size != segment_size()) {
        close(fd);
        throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": segment of rank " +
                         std::to_string(peer) +
                         " has an unexpected size (FASTCOMM_SHM_RING_BYTES must be equal on all ranks)");
      }
      base = mmap(nullptr, segment_size(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      FASTCOMM_SYSCHECK(base != MAP_FAILED, "mmap of peer segment");
      peer_maps_[i] = Mapping{base, segment_size()};
      auto* h = static_cast<ShmSegmentHeader*>(base);
      // The name already carries the token; checking the block as well rejects a stale or
      // foreign segment that happens to sit under the same name.
      if (h->magic != kMagic || h->version != kVersion || h->rank != peer ||
          std::strncmp(h->token, token_.c_str(), sizeof(h->token)) != 0 || h->pid != pids_[peer]) {
        throw_comm_error("fastcomm: rank " + std::to_string(rank_) + ": segment of rank " +
                         std::to_string(peer) + " does not belong to this job");
      }
      // Where the kernel or a sandbox refuses, no op reads this peer's memory in place.
      pidfd_[peer] = (int)syscall(SYS_pidfd_open, (pid_t)pids_[peer], 0);
    }
    auto* peer_hdr = static_cast<ShmSegmentHeader*>(base);
    Doorbell peer_bell(&peer_hdr->bell);
    out_[peer].ctl = ring_ctl(own_.base, (int)i);
    out_[peer].ring = ring_data(own_.base, (int)i);
    out_[peer].peer_bell = peer_bell;
    in_[peer].ctl = ring_ctl(base, me);
    in_[peer].ring = ring_data(base, me);
    in_[peer].peer_bell = peer_bell;
  }
}

// Only for an init that failed: a local rank that died between creating its segment and the
// point where every rank had attached never unlinked its name, and nobody else would. The
// names are this job's (they carry its token) and the job's init is over, so any survivor may
// remove them all; a rank that is still alive and not yet attached then fails its init too.
void ShmTransport::unlink_local_segments() {
  for (int r : local_ranks_) shm_unlink(segment_name(r).c_str());
  unlinked_ = true;
}

void ShmTransport::unlink_own() {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(segment_name(rank_).c_str());
}

bool ShmTransport::try_send(int peer, const Header& hdr, const void* payload) {
  Outbound& o = out_[peer];
  if (o.ctl == nullptr) return false;  // released (the peer exited): nothing reaches it
  TORCH_INTERNAL_ASSERT(hdr.len <= max_payload_, "payload larger than max_payload");
  const uint64_t R = ring_bytes_;
  const uint64_t need = kRecordHeader + align64(hdr.len);
  uint64_t head = o.wpos;
  uint64_t pos = head % R;
  // The reader's position as last read: it only grows, so while it leaves room the shared word
  // (a line the reader writes at every pop) need not be read, nor taken from the reader's cache.
  uint64_t tail = o.tail;
  // A record that does not fit before the ring's end goes to its start. (Not also whenever the
  // ring is empty, to reuse warm lines: the skipped bytes count as used until the reader passes
  // them, so a reader that stalls would leave the sender too little room for an abort notice.)
  const bool restart = pos != 0 && need > R - pos;
  const uint64_t total = restart ? R - pos + need : need;
  if (head + total - tail > R) tail = o.tail = o.ctl->tail.load(std::memory_order_acquire);
  if (head + total - tail > R) {
    // Full: ask the receiver to ring us when it frees space, then look once more so a pop
    // that raced with the request is not missed.
    o.ctl->space_waiter.store(1, std::memory_order_seq_cst);
    tail = o.tail = o.ctl->tail.load(std::memory_order_seq_cst);
    if (head + total - tail > R) return false;
  }
  if (restart) {
    // The skipped bytes still hold an earlier pass's records and payloads: a marker, not a
    // stale word that a payload could forge, tells the reader to go to the start.
    populate(o.ring, o.populated, pos + kRecordHeader, R, true);
    auto* mark = reinterpret_cast<Record*>(o.ring + pos);
    mark->pos = head;
    mark->pad = kSkipMark;
    head += R - pos;
    pos = 0;
  }
  populate(o.ring, o.populated, pos + need, R, true);
  auto* rec = reinterpret_cast<Record*>(o.ring + pos);
  rec->hdr = hdr;
  rec->pos = head;
  rec->pad = 0;
  if (hdr.len) copy_payload(o, o.ring + pos + kRecordHeader, payload, hdr.len);
  o.wpos = head + need;
  if (!o.dirty) {
    o.dirty = true;
    dirty_.push_back(peer);
  }
  return true;
}

void ShmTransport::copy_payload(Outbound& o, uint8_t* dst, const void* src, size_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  if (n < kStreamMin || stream_stores_ == 0) {
    std::memcpy(dst, s, n);
  } else if (stream_stores_ == 1 || o.stream_left > 0) {
    if (o.stream_left > 0) --o.stream_left;
    stream_copy(dst, s, n);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst, s, n);
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    o.slow_copies = (double)n < kSlowCopyRate * (double)ns.count() ? o.slow_copies + 1 : 0;
    if (o.slow_copies >= kSlowInARow) {
      o.slow_copies = 0;
      o.stream_left = kStreamRun;
    }
  }
}

void ShmTransport::flush() {
  for (int peer : dirty_) {
    Outbound& o = out_[peer];
    o.ctl->head.store(o.wpos, std::memory_order_release);
    o.dirty = false;
    o.peer_bell.wake_if_sleeping();
  }
  dirty_.clear();
}

const Message* ShmTransport::peek(int peer) {
  Inbound& in = in_[peer];
  if (in.have) return &in.msg;
  if (in.ctl == nullptr) return nullptr;
  const uint64_t R = ring_bytes_;
  const uint64_t head = in.ctl->head.load(std::memory_order_acquire);
  uint64_t t = in.tail;
  if (t == head) return nullptr;
  uint64_t pos = t % R;
  populate(in.ring, in.populated, pos + kRecordHeader, R, false);
  auto* rec = reinterpret_cast<const Record*>(in.ring + pos);
  uint64_t skip = 0;
  TORCH_INTERNAL_ASSERT(rec->pos == t, "corrupt shared-memory ring from rank ", peer);
  if (rec->pad == kSkipMark) {
    TORCH_INTERNAL_ASSERT(pos != 0, "corrupt shared-memory ring from rank ", peer);
    skip = R - pos;
    t += skip;
    TORCH_INTERNAL_ASSERT(t != head, "ring skip without a following record from rank ", peer);
    rec = reinterpret_cast<const Record*>(in.ring);
    pos = 0;
    TORCH_INTERNAL_ASSERT(rec->pos == t && rec->pad == 0, "corrupt shared-memory ring from rank ", peer);
  }
  TORCH_INTERNAL_ASSERT(rec->hdr.len <= max_payload_, "corrupt shared-memory ring from rank ", peer);
  in.msg.hdr = rec->hdr;
  in.msg.data = in.ring + pos + kRecordHeader;
  in.cur_bytes = skip + kRecordHeader + align64(rec->hdr.len);
  in.have = true;
  return &in.msg;
}

void ShmTransport::pop(int peer) {
  Inbound& in = in_[peer];
  TORCH_INTERNAL_ASSERT(in.have, "pop without peek");
  in.have = false;
  in.tail += in.cur_bytes;
  in.ctl->tail.store(in.tail, std::memory_order_seq_cst);
  if (in.ctl->space_waiter.load(std::memory_order_seq_cst) != 0 &&
      in.ctl->space_waiter.exchange(0, std::memory_order_seq_cst) != 0) {
    in.peer_bell.ring();
  }
}

// A peer that exited is gone for good: drop our mapping of its segment, so that its memory
// (whose name was unlinked at init) returns to the system once no survivor maps it any more,
// instead of staying until this process shuts down. Afterwards peek() sees nothing from it
// and try_send() refuses, so no path touches the unmapped memory.
void ShmTransport::release_peer(int peer) {
  if (!is_local(peer) || peer == rank_) return;
  const int idx = local_index_[peer];
  in_[peer] = Inbound{};
  Outbound& o = out_[peer];
  o.ctl = nullptr;
  o.ring = nullptr;
  o.peer_bell = Doorbell();
  if (o.dirty) {
    o.dirty = false;
    dirty_.erase(std::remove(dirty_.begin(), dirty_.end(), peer), dirty_.end());
  }
  Mapping& m = peer_maps_[idx];
  if (m.base) munmap(m.base, m.size);
  m = Mapping{};
  drop_imports(peer);
}

void ShmTransport::drop_imports(int peer) {
  for (Imported& b : imports_[peer]) munmap(b.base, b.size);
  imports_[peer].clear();
  if (pidfd_[peer] >= 0) close(pidfd_[peer]);
  pidfd_[peer] = -1;
}

// A peer's buffers stay mapped here after the peer frees them (their memory with them) until
// they are evicted, the peer exits or this transport goes: at most this many per peer.
constexpr size_t kMaxImports = 8;

const uint8_t* ShmTransport::import_span(int peer, const SharedSpan& s) {
  if (!shares_memory(peer) || s.offset > s.size || s.bytes > s.size - s.offset) return nullptr;
  ++import_calls_;
  auto& list = imports_[peer];
  for (Imported& b : list) {
    if (b.buffer == s.buffer && b.size == s.size) {
      b.used = import_calls_;
      return static_cast<const uint8_t*>(b.base) + s.offset;
    }
  }
  // The owner keeps the buffer (and so its descriptor number) alive until every member has
  // finished the op that named it, which includes this call.
  const int fd = (int)syscall(SYS_pidfd_getfd, pidfd_[peer], s.fd, 0);
  if (fd < 0) return nullptr;
  struct stat st;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && (uint64_t)st.st_size == s.size)
    base = mmap(nullptr, s.size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  if (list.size() >= kMaxImports) {
    auto lru = std::min_element(list.begin(), list.end(),
                                [](const Imported& a, const Imported& b) { return a.used < b.used; });
    munmap(lru->base, lru->size);
    list.erase(lru);
  }
  list.push_back(Imported{s.buffer, base, s.size, import_calls_});
  ++buffers_mapped_;
  return static_cast<const uint8_t*>(base) + s.offset;
}

std::map<std::string, uint64_t> ShmTransport::counters() {
  return {{"spans_imported", import_calls_}, {"buffers_mapped", buffers_mapped_}};
}

bool ShmTransport::peer_closed(int peer) const {
  if (peer < 0 || peer >= (int)local_index_.size() || local_index_[peer] < 0) return false;
  const auto* h = static_cast<const ShmSegmentHeader*>(peer_maps_[local_index_[peer]].base);
  return h != nullptr && __atomic_load_n(&h->closed, __ATOMIC_ACQUIRE) != 0;
}

void ShmTransport::stop() {
  if (own_.base == nullptr) return;
  __atomic_store_n(&static_cast<ShmSegmentHeader*>(own_.base)->closed, 1u, __ATOMIC_RELEASE);
  for (int r : local_ranks_)  // a peer asleep in a wait looks now
    if (r != rank_ && out_[r].ctl != nullptr) out_[r].peer_bell.ring();
}

std::string ShmTransport::death_reason(int peer) {
  // (Seen by peer_alive, before release_peer unmapped its segment.)
  return closed_seen_[peer] ? kShutDown : "";
}

bool ShmTransport::peer_alive(int peer) {
  if (closed_seen_[peer]) return false;  // (its segment may be unmapped since: release_peer)
  if (peer_closed(peer)) {
    closed_seen_[peer] = 1;
    return false;
  }
  // An attached peer's pidfd names that very process (readable once it exited); its pid may be
  // another's by then.
  if (pidfd_[peer] >= 0) {
    pollfd p{pidfd_[peer], POLLIN, 0};
    const int n = poll(&p, 1, 0);
    if (n >= 0) return n == 0;
  }
  return !process_gone(pids_[peer]);
}

}  // namespace fastcomm
