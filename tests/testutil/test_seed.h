// The one seed of every randomized C++ test: $PMSNAP_TEST_SEED, else a fixed
// default, so that CI runs the same draws on every machine and a failure
// reproduces with the seed the test printed (scripts/flake_hunt.sh runs the
// randomized tests with fresh seeds). tests/python/conftest.py reads the
// same variable for pytest.
//
// A test that needs several independent streams passes a salt of its own:
// TestSeed(salt) mixes it in, so two tests with the same base seed do not
// draw the same numbers.
//
// Thread-safety: any thread; the seed is read and printed once per process.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace pmsnap::testing {

inline constexpr std::uint64_t kDefaultTestSeed = 20261127;

// The base seed; prints "PMSNAP_TEST_SEED=<n>" to stderr the first time, which
// CTest shows with a failing test's output. A value that is not a number
// is a test setup error: it aborts naming the variable.
inline std::uint64_t BaseTestSeed() {
  static const std::uint64_t seed = [] {
    std::uint64_t value = kDefaultTestSeed;
    if (const char* text = std::getenv("PMSNAP_TEST_SEED"); text != nullptr && *text != '\0') {
      char* end = nullptr;
      value = std::strtoull(text, &end, 10);
      if (end == nullptr || *end != '\0') {
        std::fprintf(stderr, "PMSNAP_TEST_SEED='%s' is not a decimal number\n", text);
        std::abort();
      }
    }
    std::fprintf(stderr, "PMSNAP_TEST_SEED=%llu\n", static_cast<unsigned long long>(value));
    return value;
  }();
  return seed;
}

// The base seed mixed with `salt` (splitmix64), for one stream of draws.
inline std::uint64_t TestSeed(std::uint64_t salt = 0) {
  std::uint64_t z = BaseTestSeed() + 0x9e3779b97f4a7c15ull * (salt + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace pmsnap::testing
