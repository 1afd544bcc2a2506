// A toy "model" for runtime tests without libtorch: units of float params
// with an optimizer-like state tensor and an int64 step counter, updated by a
// deterministic rule, with a history of every step's values at rest.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "pmsnap/pmem_layout/pool.h"
#include "pmsnap/runtime/engine.h"

namespace pmsnap::testing {

class ToyModel {
 public:
  ToyModel(int units, std::int64_t floats_per_unit) {
    for (int u = 0; u < units; ++u) {
      params_.emplace_back(static_cast<std::size_t>(floats_per_unit + u * 17), 0.0f);
      state_.emplace_back(params_.back().size(), 0.0f);
      steps_.push_back(0);
    }
    for (std::size_t u = 0; u < params_.size(); ++u) {
      for (std::size_t i = 0; i < params_[u].size(); ++i) params_[u][i] = 0.001f * (i % 1000) + u;
    }
  }

  std::vector<runtime::UnitRegistration> Registrations() {
    std::vector<runtime::UnitRegistration> units;
    for (std::size_t u = 0; u < params_.size(); ++u) {
      const auto n = static_cast<std::int64_t>(params_[u].size());
      units.push_back({"block" + std::to_string(u) + ".weight",
                       {{"param", params_[u].data(), layout::DType::kFloat32, {n}},
                        {"momentum", state_[u].data(), layout::DType::kFloat32, {n}},
                        {"step", &steps_[u], layout::DType::kInt64, {}}}});
    }
    return units;
  }

  // As Registrations, with each unit's step counter in a companion unit of
  // host memory ("<unit>#host", UnitRegistration::on_host), the way PyTorch
  // keeps Adam's `step` on the CPU beside GPU tensors: unit 2u holds param
  // and momentum, unit 2u + 1 the step.
  std::vector<runtime::UnitRegistration> RegistrationsWithHostSteps() {
    std::vector<runtime::UnitRegistration> units;
    for (runtime::UnitRegistration& unit : Registrations()) {
      runtime::UnitRegistration host;
      host.name = unit.name + "#host";
      host.on_host = true;
      host.tensors.push_back(unit.tensors.back());
      host.tensors.back().on_host = true;
      unit.tensors.pop_back();
      units.push_back(std::move(unit));
      units.push_back(std::move(host));
    }
    return units;
  }

  std::size_t unit_count() const { return params_.size(); }

  // The optimizer update of unit u in step k (in place).
  void Update(std::size_t u, std::uint64_t k) {
    UpdateTensors(u, k);
    UpdateStep(u);
  }
  // Update's two halves: the device tensors, and the (host) step counter.
  void UpdateTensors(std::size_t u, std::uint64_t k) {
    auto& p = params_[u];
    auto& m = state_[u];
    const float g = 0.01f * static_cast<float>((k * 7 + u) % 13) - 0.05f;
    for (std::size_t i = 0; i < p.size(); ++i) {
      m[i] = 0.9f * m[i] + g * static_cast<float>(i % 7);
      p[i] -= 0.1f * m[i];
    }
  }
  void UpdateStep(std::size_t u) { steps_[u] += 1; }

  // As StepLaunched, for RegistrationsWithHostSteps: each unit's tensors
  // are updated by a launched kernel, its step counter on the host at once
  // (as torch.optim.Adam does), both between the hooks of both units.
  Status StepLaunchedWithHostSteps(
      runtime::Engine& engine, std::uint64_t k,
      const std::function<void(std::size_t, std::function<void()>)>& launch) {
    Status s = engine.BeginStep(k);
    for (std::size_t i = params_.size(); s.ok() && i-- > 0;) {
      const auto device_unit = static_cast<std::uint32_t>(2 * i);
      s = engine.BeforeUpdate(device_unit);
      if (s.ok()) s = engine.BeforeUpdate(device_unit + 1);
      if (!s.ok()) return s;
      launch(i, [this, i, k] { UpdateTensors(i, k); });
      UpdateStep(i);
      s = engine.AfterUpdate(device_unit);
      if (s.ok()) s = engine.AfterUpdate(device_unit + 1);
    }
    return s.ok() ? engine.EndStep() : s;
  }

  // "" if a pool laid out by RegistrationsWithHostSteps holds the model
  // after step view.iteration().
  std::string CompareWithHistoryOfHostSteps(const layout::SnapshotView& view) const {
    auto it = history_.find(view.iteration());
    if (it == history_.end()) return "no history for iteration " + std::to_string(view.iteration());
    for (std::uint32_t u = 0; u < params_.size(); ++u) {
      const std::pair<std::uint32_t, std::uint32_t> where[3] = {{2 * u, 0}, {2 * u, 1},
                                                                {2 * u + 1, 0}};
      for (std::uint32_t t = 0; t < 3; ++t) {
        const auto& expected = it->second[u * 3 + t];
        auto actual = view.tensor(where[t].first, where[t].second);
        if (actual.size() != expected.size() ||
            std::memcmp(actual.data(), expected.data(), expected.size()) != 0) {
          return "unit " + std::to_string(u) + " tensor " + std::to_string(t) +
                 " differs at iteration " + std::to_string(view.iteration());
        }
      }
    }
    return "";
  }

  // One training step through the engine's hooks; units updated in reverse.
  // `skip_unit` (if >= 0) has no gradient this step. `before_end_step` runs
  // after the last update, before EndStep.
  Status Step(runtime::Engine& engine, std::uint64_t k, int skip_unit = -1,
              const std::string& extra = "",
              const std::function<void()>& before_end_step = nullptr) {
    Status s = engine.BeginStep(k);
    if (!s.ok()) return s;
    for (std::size_t i = params_.size(); i-- > 0;) {
      if (static_cast<int>(i) == skip_unit) continue;
      s = engine.BeforeUpdate(static_cast<std::uint32_t>(i));
      if (!s.ok()) return s;
      Update(i, k);
      s = engine.AfterUpdate(static_cast<std::uint32_t>(i));
      if (!s.ok()) return s;
    }
    if (before_end_step) before_end_step();
    s = engine.EndStep({reinterpret_cast<const std::byte*>(extra.data()), extra.size()});
    if (s.ok()) Remember(k);
    return s;
  }

  // As Step, for updates queued on a device (a simulated GPU queue):
  // `launch(u, update)` queues `update`, which performs unit u's update of
  // step k, instead of running it here. Remembers no history (the values are
  // not there yet): compare against a reference model stepped with
  // StepPlain.
  Status StepLaunched(runtime::Engine& engine, std::uint64_t k,
                      const std::function<void(std::size_t, std::function<void()>)>& launch) {
    Status s = engine.BeginStep(k);
    if (!s.ok()) return s;
    for (std::size_t i = params_.size(); i-- > 0;) {
      s = engine.BeforeUpdate(static_cast<std::uint32_t>(i));
      if (!s.ok()) return s;
      launch(i, [this, i, k] { Update(i, k); });
      s = engine.AfterUpdate(static_cast<std::uint32_t>(i));
      if (!s.ok()) return s;
    }
    return engine.EndStep();
  }

  // Same updates without any engine.
  void StepPlain(std::uint64_t k, int skip_unit = -1) {
    for (std::size_t i = params_.size(); i-- > 0;) {
      if (static_cast<int>(i) != skip_unit) Update(i, k);
    }
    Remember(k);
  }

  // Bytes of every tensor as they were after step k.
  const std::vector<std::vector<std::byte>>& At(std::uint64_t k) const { return history_.at(k); }
  bool HasHistory(std::uint64_t k) const { return history_.count(k) != 0; }

  // "" if the view equals the model after step view.iteration().
  std::string CompareWithHistory(const layout::SnapshotView& view) const {
    auto it = history_.find(view.iteration());
    if (it == history_.end()) return "no history for iteration " + std::to_string(view.iteration());
    std::size_t flat = 0;
    for (std::uint32_t u = 0; u < params_.size(); ++u) {
      for (std::uint32_t t = 0; t < 3; ++t, ++flat) {
        const auto& expected = it->second[flat];
        auto actual = view.tensor(u, t);
        if (actual.size() != expected.size() ||
            std::memcmp(actual.data(), expected.data(), expected.size()) != 0) {
          return "unit " + std::to_string(u) + " tensor " + std::to_string(t) +
                 " differs at iteration " + std::to_string(view.iteration());
        }
      }
    }
    return "";
  }

  // "" if the live tensors equal the history at step k.
  std::string CompareLive(std::uint64_t k) const { return CompareLive(*this, k); }
  // "" if the live tensors equal `reference`'s history at step k.
  std::string CompareLive(const ToyModel& reference, std::uint64_t k) const {
    const auto& expected = reference.history_.at(k);
    std::size_t flat = 0;
    for (std::size_t u = 0; u < params_.size(); ++u) {
      const std::vector<std::byte> live[3] = {Bytes(params_[u]), Bytes(state_[u]),
                                              Bytes(steps_[u])};
      for (int t = 0; t < 3; ++t, ++flat) {
        if (live[t] != expected[flat])
          return "unit " + std::to_string(u) + " tensor " + std::to_string(t);
      }
    }
    return "";
  }

  void Zero() {
    for (auto& p : params_) std::fill(p.begin(), p.end(), 0.0f);
    for (auto& m : state_) std::fill(m.begin(), m.end(), 0.0f);
    std::fill(steps_.begin(), steps_.end(), 0);
  }

 private:
  template <typename T>
  static std::vector<std::byte> Bytes(const std::vector<T>& v) {
    std::vector<std::byte> out(v.size() * sizeof(T));
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  static std::vector<std::byte> Bytes(const std::int64_t& v) {
    std::vector<std::byte> out(sizeof(v));
    std::memcpy(out.data(), &v, sizeof(v));
    return out;
  }
  void Remember(std::uint64_t k) {
    std::vector<std::vector<std::byte>> all;
    for (std::size_t u = 0; u < params_.size(); ++u) {
      all.push_back(Bytes(params_[u]));
      all.push_back(Bytes(state_[u]));
      all.push_back(Bytes(steps_[u]));
    }
    history_[k] = std::move(all);
  }

  std::vector<std::vector<float>> params_;
  std::vector<std::vector<float>> state_;
  std::vector<std::int64_t> steps_;
  std::map<std::uint64_t, std::vector<std::vector<std::byte>>> history_;
};

}  // namespace pmsnap::testing
