// Runner of the C++ unit tests.
//   fastcomm_unit_tests              all tests
//   fastcomm_unit_tests SUBSTRING    tests whose name contains SUBSTRING
//   fastcomm_unit_tests --exact NAME the one test named NAME
//   fastcomm_unit_tests --list       the test names, one a line
// Prints one line per test and then "N passed, M failed"; exits 1 if any failed, 2 on bad
// usage or when no test matches (a typo must not look like success).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <set>
#include <string>

#include "algorithms/reduce.h"
#include "unit.h"

int main(int argc, char** argv) {
  // Names must be unique: --exact and the pytest driver address tests by name.
  std::set<std::string> names;
  for (const auto& t : unit::registry()) {
    if (!names.insert(t.name).second) {
      std::fprintf(stderr, "two tests are named %s\n", t.name.c_str());
      return 2;
    }
  }
  std::string filter;
  bool exact = false;
  if (argc >= 2 && std::strcmp(argv[1], "--list") == 0) {
    for (const auto& t : unit::registry()) std::printf("%s\n", t.name.c_str());
    return 0;
  }
  if (argc >= 2 && std::strcmp(argv[1], "--exact") == 0) {
    if (argc != 3) {
      std::fprintf(stderr, "usage: %s [--list | --exact NAME | SUBSTRING]\n", argv[0]);
      return 2;
    }
    exact = true;
    filter = argv[2];
  } else if (argc == 2) {
    filter = argv[1];
  } else if (argc > 2) {
    std::fprintf(stderr, "usage: %s [--list | --exact NAME | SUBSTRING]\n", argv[0]);
    return 2;
  }

  // The engine does this as it starts; the folds under test use the same kernels.
  fastcomm::select_reduce_kernels();

  int passed = 0, failed = 0;
  for (const auto& t : unit::registry()) {
    if (exact ? t.name != filter : t.name.find(filter) == std::string::npos) continue;
    unit::failures().clear();
    const auto t0 = std::chrono::steady_clock::now();
    try {
      t.fn();
    } catch (const unit::Abort&) {
      // already recorded by REQUIRE*
    } catch (const std::exception& e) {
      unit::failures().push_back(std::string("uncaught exception: ") + e.what());
    } catch (...) {
      unit::failures().push_back("uncaught exception of unknown type");
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const auto& f = unit::failures();
    if (f.empty()) {
      ++passed;
      std::printf("PASS %s (%.1f ms)\n", t.name.c_str(), ms);
    } else {
      ++failed;
      std::printf("FAIL %s (%.1f ms)\n", t.name.c_str(), ms);
      // A broken loop can fail thousands of checks; the first ones say what went wrong.
      const size_t shown = std::min<size_t>(f.size(), 20);
      for (size_t i = 0; i < shown; ++i) std::printf("    %s\n", f[i].c_str());
      if (f.size() > shown) std::printf("    ... and %zu more failures\n", f.size() - shown);
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  if (passed + failed == 0) {
    std::fprintf(stderr, "no test matches '%s'\n", filter.c_str());
    return 2;
  }
  return failed ? 1 : 0;
}
