// Checks inside fuzz targets: a failed check prints what was expected and
// aborts, which libFuzzer records as a crash with the input that caused it.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "pmsnap/common/status.h"

#define FUZZ_CHECK(condition)                                                                 \
  do {                                                                                        \
    if (!(condition)) {                                                                       \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

#define FUZZ_CHECK_OK(expression)                                                                 \
  do {                                                                                            \
    const ::pmsnap::Status fuzz_check_status = (expression);                                      \
    if (!fuzz_check_status.ok()) {                                                                \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s: %s\n", __FILE__, __LINE__, #expression, \
                   fuzz_check_status.ToString().c_str());                                         \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)
