#include "common/process.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace fastcomm {

bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill((pid_t)pid, 0) != 0) return errno == ESRCH;
  // A dead child that its parent has not reaped yet (a zombie) still answers kill().
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return false;  // no procfs: trust kill()
  const auto rp = line.rfind(')');
  if (rp == std::string::npos || rp + 2 >= line.size()) return false;
  const char state = line[rp + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace fastcomm
