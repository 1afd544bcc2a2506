// GoogleTest checks of a pool against a ToyModel's history, shared by the
// engine tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/toy_model.h"

namespace pmsnap::testing {

// The pool's newest epoch is of iteration `min_iteration` or later and
// holds exactly the model's values after that iteration's step.
inline void ExpectNewestEpochMatchesHistory(const layout::Pool& pool, const ToyModel& model,
                                            std::uint64_t min_iteration) {
  auto latest = pool.Latest();
  ASSERT_TRUE(latest.ok()) << latest.status().ToString();
  EXPECT_GE(latest->iteration(), min_iteration);
  EXPECT_EQ(model.CompareWithHistory(*latest), "");
}

// The same for the pool file at `path`, opened on its own (the engine that
// wrote it closed).
inline void ExpectPoolMatchesHistory(const std::string& path, const ToyModel& model,
                                     std::uint64_t min_iteration) {
  auto pool = layout::Pool::Open(path);
  ASSERT_TRUE(pool.ok()) << pool.status().ToString();
  ExpectNewestEpochMatchesHistory(**pool, model, min_iteration);
}

}  // namespace pmsnap::testing
