// The fake runtime's same-host blocks (device/fake_ipc.h).
#include "device/fake_ipc.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/errors.h"

namespace fastcomm {
namespace device {
namespace fake {

namespace {

constexpr uint32_t kMagic = 0x46434950;  // "FCIP"
constexpr size_t kHead = 64;

// The handle: what a peer needs to map the segment.
struct Wire {
  uint32_t magic;
  uint32_t nflags;
  uint64_t bytes;
  int32_t device;  // the owner's fake device
  uint32_t host;   // the data is in host memory
  char name[88];
};
static_assert(sizeof(Wire) <= sizeof(Runtime::IpcHandle::bytes), "fake IPC handle layout");

struct Block {
  std::string name;
  void* base = nullptr;
  size_t size = 0;
  bool creator = false;
  uint32_t* flags = nullptr;
  bool host = false;  // the data is in host memory (which an owner's unmap leaves to the peer)
};

std::atomic<int64_t> g_blocks{0};
std::atomic<int64_t> g_early_waits{0};
std::atomic<int64_t> g_freed_while_mapped{0};
std::atomic<bool> g_open_hold{false};

// The segment's head: whether an opener has the data mapped (device blocks only matter).
uint32_t* mapped_word(void* base) { return static_cast<uint32_t*>(base); }

// The flags of every block this process maps, to find a flag's shadow: the highest value a
// stream write enqueued so far will store in it (kept beside the flags, so both processes see
// it). A wait enqueued for more than that waits on work nobody has enqueued yet.
std::mutex g_flags_mu;
std::vector<std::pair<uint32_t*, uint32_t>> g_flags;  // (flags, nflags)

uint32_t* shadow_of(const uint32_t* flag) {
  std::lock_guard<std::mutex> lk(g_flags_mu);
  for (auto& [f, n] : g_flags)
    if (flag >= f && flag < f + n) return const_cast<uint32_t*>(flag) + n;
  return nullptr;
}
std::atomic<int> g_device{0};
std::atomic<bool> g_peer_access{true};

// The flags, then as many shadow words (shadow_of).
size_t flags_bytes(int nflags) { return ((size_t)nflags * 8 + 63) & ~size_t(63); }

[[noreturn]] void fail(const char* call, const std::string& what) {
  throw_comm_error(std::string("fastcomm fake runtime: ") + call + ": " + what + " (" + std::strerror(errno) + ")");
}

void unfill(Block& k) {
  std::lock_guard<std::mutex> lk(g_flags_mu);
  for (auto it = g_flags.begin(); it != g_flags.end(); ++it)
    if (it->first == k.flags) {
      g_flags.erase(it);
      break;
    }
}

void fill(Block& k, int nflags, uint64_t bytes, Runtime::IpcBlock* b) {
  b->flags = reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(k.base) + kHead);
  b->data = static_cast<uint8_t*>(k.base) + kHead + flags_bytes(nflags);
  (void)bytes;
  k.flags = b->flags;
  std::lock_guard<std::mutex> lk(g_flags_mu);
  g_flags.emplace_back(b->flags, (uint32_t)nflags);
}

}  // namespace

void set_device(int device) { g_device = device; }
void set_peer_access(bool on) { g_peer_access = on; }

bool ipc_readable(const Runtime::IpcHandle& h) {
  Wire w;
  std::memcpy(&w, h.bytes.data(), sizeof(w));
  return w.magic == kMagic && (w.host != 0 || w.device == g_device.load() || g_peer_access.load());
}

void* ipc_create(size_t bytes, int nflags, Runtime::IpcHandle* h, Runtime::IpcBlock* b, bool host) {
  std::random_device rd;
  char name[64];
  std::snprintf(name, sizeof(name), "/fastcomm-dipc-%d-%08x%08x", (int)getpid(), rd(), rd());
  const size_t size = kHead + flags_bytes(nflags) + bytes;
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail("ipc_create", std::string("shm_open ") + name);
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    shm_unlink(name);
    fail("ipc_create", "ftruncate");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name);
    fail("ipc_create", "mmap");
  }
  auto* k = new Block{name, base, size, true};
  k->host = host;
  fill(*k, nflags, bytes, b);
  // Fresh device memory holds garbage: a read that no flag ordered after its write sees it.
  std::memset(b->data, 0xa5, bytes);
  Wire w{};
  w.magic = kMagic;
  w.nflags = (uint32_t)nflags;
  w.bytes = bytes;
  w.device = g_device.load();
  w.host = host ? 1 : 0;
  std::memcpy(w.name, name, std::min(std::strlen(name), sizeof(w.name) - 1));
  std::memcpy(h->bytes.data(), &w, sizeof(w));
  ++g_blocks;
  return k;
}

void* ipc_open(const Runtime::IpcHandle& h, Runtime::IpcBlock* b, const Runtime::IpcClaim& claim) {
  Wire w;
  std::memcpy(&w, h.bytes.data(), sizeof(w));
  if (w.magic != kMagic) throw_comm_error("fastcomm fake runtime: ipc_open: not a fake IPC handle");
  if (!ipc_readable(h))
    throw_comm_error("fastcomm fake runtime: ipc_open: fake device " + std::to_string(g_device.load()) +
                     " has no peer access to fake device " + std::to_string(w.device) + "'s memory");
  w.name[sizeof(w.name) - 1] = 0;
  const size_t size = kHead + flags_bytes((int)w.nflags) + w.bytes;
  int fd = shm_open(w.name, O_RDWR, 0600);
  if (fd < 0) fail("ipc_open", std::string("shm_open ") + w.name);
  struct stat st;
  if (fstat(fd, &st) != 0 || (size_t)st.st_size != size) {
    close(fd);
    throw_comm_error(std::string("fastcomm fake runtime: ipc_open: ") + w.name + " has an unexpected size");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) fail("ipc_open", "mmap");
  // Both sides have it mapped now: the name can go, so a crash of either leaves nothing.
  shm_unlink(w.name);
  auto* k = new Block{w.name, base, size, false};
  fill(*k, (int)w.nflags, w.bytes, b);
  if (claim.take && !claim.take(b->flags)) {
    unfill(*k);
    munmap(base, size);
    delete k;
    throw_comm_error(std::string("fastcomm fake runtime: ipc_open: the peer's ring ") + w.name +
                     " was ended before it was mapped here");
  }
  __atomic_store_n(mapped_word(base), 1, __ATOMIC_SEQ_CST);  // the data mapped (cudaIpcOpenMemHandle)
  while (g_open_hold.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ++g_blocks;
  return k;
}

void ipc_close(void* token) {
  auto* k = static_cast<Block*>(token);
  if (k == nullptr) return;
  unfill(*k);
  if (!k->creator) {
    __atomic_store_n(mapped_word(k->base), 0, __ATOMIC_SEQ_CST);
  } else if (!k->host && __atomic_load_n(mapped_word(k->base), __ATOMIC_SEQ_CST) != 0) {
    ++g_freed_while_mapped;  // cudaFree under a peer's cudaIpcOpenMemHandle: undefined on CUDA
  }
  munmap(k->base, k->size);
  if (k->creator) shm_unlink(k->name.c_str());  // never opened: the name is still there
  delete k;
  --g_blocks;
}

void flag_store(uint32_t* flag, uint32_t value) {
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
  syscall(SYS_futex, flag, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void flag_block(const uint32_t* flag, uint32_t value) {
  for (;;) {
    const uint32_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
    if ((int32_t)(v - value) >= 0) return;
    // Shared (not FUTEX_PRIVATE): the writer is another process. The timeout only bounds a
    // wake-up lost to a store between the load and the wait.
    struct timespec ts{0, 2000000};
    syscall(SYS_futex, const_cast<uint32_t*>(flag), FUTEX_WAIT, v, &ts, nullptr, 0);
  }
}

void note_write(const uint32_t* flag, uint32_t value) {
  uint32_t* sh = shadow_of(flag);
  if (sh == nullptr) return;
  uint32_t cur = __atomic_load_n(sh, __ATOMIC_ACQUIRE);
  while ((int32_t)(value - cur) > 0 &&
         !__atomic_compare_exchange_n(sh, &cur, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
}

void note_wait(const uint32_t* flag, uint32_t value) {
  const uint32_t* sh = shadow_of(flag);
  if (sh == nullptr) return;
  if ((int32_t)(__atomic_load_n(sh, __ATOMIC_ACQUIRE) - value) < 0) {
    ++g_early_waits;
    std::fprintf(stderr, "fastcomm fake runtime: a stream waits for flag value %u, which no write enqueued yet stores\n",
                 value);
  }
}

int64_t ipc_blocks() { return g_blocks.load(); }
void set_open_hold(bool on) { g_open_hold = on; }
void ipc_close_data(void* token) {
  auto* k = static_cast<Block*>(token);
  if (k != nullptr && !k->creator) __atomic_store_n(mapped_word(k->base), 0, __ATOMIC_SEQ_CST);
}
int64_t freed_while_mapped() { return g_freed_while_mapped.load(); }
int64_t early_waits() { return g_early_waits.load(); }

}  // namespace fake
}  // namespace device
}  // namespace fastcomm
