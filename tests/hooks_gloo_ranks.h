// Ranks as threads of one test process: each a real gloo process group over
// one in-memory store (the torch wheel has no gloo headers; tests/hooks.cmake
// adds Debian's).
#pragma once

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <functional>
#include <thread>
#include <vector>

namespace pmsnap::testing {

// Runs body(rank, backend) on `world` threads and joins them.
inline void OnGlooRanks(int world,
                        const std::function<void(int, c10::intrusive_ptr<c10d::Backend>)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto options = c10d::ProcessGroupGloo::Options::create();
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      body(r, c10::make_intrusive<c10d::ProcessGroupGloo>(store, r, world, options));
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace pmsnap::testing
