#include "transport/shm/buffers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <ATen/Functions.h>

#include <atomic>
#include <map>
#include <mutex>

#include "common/errors.h"

namespace fastcomm {
namespace {

struct Buffer {
  uint64_t id;
  int fd;
  size_t size;
};

// Live buffers by base address. Ids are never reused, so a peer's mapping cached under an id
// can never stand for a later buffer that got the same descriptor number.
std::mutex g_mu;
std::map<uintptr_t, Buffer> g_buffers;
std::atomic<uint64_t> g_next_id{1};

void release(void* base) {
  Buffer b{};
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_buffers.find(reinterpret_cast<uintptr_t>(base));
    TORCH_INTERNAL_ASSERT(it != g_buffers.end(), "freeing an unknown shared buffer");
    b = it->second;
    g_buffers.erase(it);
  }
  munmap(base, b.size);
  close(b.fd);
}

}  // namespace

at::Tensor shared_empty(c10::IntArrayRef sizes, c10::ScalarType dtype) {
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "fastcomm.empty: negative dimension ", s, " in size ", sizes);
    numel *= s;
  }
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t bytes = (size_t)numel * c10::elementSize(dtype);
  // Even an empty tensor gets a page: every buffer has a distinct base address.
  const size_t size = std::max(page, (bytes + page - 1) / page * page);
  const int fd = memfd_create("fastcomm-buffer", MFD_CLOEXEC);
  FASTCOMM_SYSCHECK(fd >= 0, "memfd_create for fastcomm.empty");
  if (ftruncate(fd, (off_t)size) != 0) {
    const int e = errno;
    close(fd);
    errno = e;
    FASTCOMM_SYSCHECK(false, "ftruncate of a fastcomm.empty buffer of " + std::to_string(size) + " bytes");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int e = errno;
    close(fd);
    errno = e;
    FASTCOMM_SYSCHECK(false, "mmap of a fastcomm.empty buffer of " + std::to_string(size) + " bytes");
  }
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_buffers[reinterpret_cast<uintptr_t>(base)] = Buffer{g_next_id++, fd, size};
  }
  return at::from_blob(base, sizes, [base](void*) { release(base); }, at::TensorOptions().dtype(dtype));
}

bool find_shared_span(const void* p, size_t n, SharedSpan* out) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_buffers.upper_bound(a);
  if (it == g_buffers.begin()) return false;
  --it;
  const Buffer& b = it->second;
  if (a + n > it->first + b.size) return false;
  out->buffer = b.id;
  out->fd = b.fd;
  out->offset = a - it->first;
  out->bytes = n;
  out->size = b.size;
  return true;
}

}  // namespace fastcomm
