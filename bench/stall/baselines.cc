// The methods a user would pick instead of pmsnap, run on the same
// optimizer step so that only checkpointing differs (methods.h).
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "pmsnap/common/cpu_affinity.h"
#include "pmsnap/hooks/parameter_stepper.h"
#include "pmsnap/runtime/device.h"
#include "pmsnap/runtime/interval_policy.h"
#include "stall/checkpoint_files.h"
#include "stall/methods.h"
#include "stall/options.h"
#include "stall/workloads.h"

namespace pmsnap::bench::stall {

namespace {

// Called first on each checkpoint thread a method starts (`cpus` empty: not
// pinned; see Options::pin).
void PinCheckpointThread(const std::vector<int>& cpus) {
  if (!cpus.empty()) (void)PinCurrentThread(cpus, "checkpoint threads");
}

// Host copies of every state tensor, for snapshots through the device.
std::vector<torch::Tensor> Staging(const std::vector<torch::Tensor>& live) {
  std::vector<torch::Tensor> out;
  for (const auto& t : live) out.push_back(torch::empty_like(t).zero_());
  return out;
}

Status CopyOut(runtime::Device& device, const std::vector<torch::Tensor>& dst,
               const std::vector<torch::Tensor>& src) {
  for (std::size_t i = 0; i < src.size(); ++i) {
    Status s = device.CopyToHost(dst[i].data_ptr(), src[i].data_ptr(),
                                 static_cast<std::size_t>(src[i].numel() * src[i].element_size()));
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

// The optimizer step every method runs, so that the overhead column measures
// checkpointing alone: pmsnap's stepper (large Adam, AdamW and Adagrad
// parameters cache-blocked, bitwise libtorch's arithmetic) with
// `block_bytes`, or libtorch's own step() when 0 (the `none-libtorch`
// reference: what a libtorch user runs today).
class OptimizerStep {
 public:
  OptimizerStep(Workload& w, std::size_t block_bytes) : w_(w) {
    if (block_bytes == 0) return;
    auto stepper = hooks::ParameterStepper::Create(*w.optimizer, NamedParameters(w));
    if (!stepper.ok()) {
      init_ = stepper.status();
      return;
    }
    stepper_ = std::move(stepper).value();
    stepper_->set_block_bytes(block_bytes);
  }
  Status Run() {
    if (!init_.ok()) return init_;
    if (stepper_ == nullptr) {
      w_.optimizer->step();
      return Status::Ok();
    }
    return stepper_->Step(nullptr);
  }

 private:
  Workload& w_;
  std::unique_ptr<hooks::ParameterStepper> stepper_;
  Status init_;
};

class NoCheckpoint final : public Method {
 public:
  NoCheckpoint(Workload& w, std::size_t block_bytes) : step_(w, block_bytes) {}
  Status Step(std::uint64_t) override { return step_.Run(); }
  void Mark() override {}
  Counters Read() override { return {}; }
  Status Finish() override { return Status::Ok(); }

 private:
  OptimizerStep step_;
};

// Method 2: synchronous torch::save every k (through the device on the
// simulated one: the state is copied to host first).
class TorchSave final : public Method {
 public:
  TorchSave(Workload& w, runtime::Device& device, std::string path, std::uint64_t k,
            std::size_t block_bytes)
      : w_(w), step_(w, block_bytes), device_(device), path_(std::move(path)), k_(k) {}
  Status Step(std::uint64_t step) override {
    PMSNAP_RETURN_IF_ERROR(step_.Run());
    if (step % k_ != 0) return Status::Ok();
    if (!device_.cpu_addressable()) {
      const auto t = Clock::now();
      auto live = StateTensors(w_);
      if (staging_.empty()) staging_ = Staging(live);
      Status s = CopyOut(device_, staging_, live);
      if (!s.ok()) return s;
      c_.stall.copy += Since(t);
    }
    const auto t = Clock::now();
    SaveFull(*w_.module, *w_.optimizer, path_ + ".tmp");
    Fsync(path_ + ".tmp");
    std::filesystem::rename(path_ + ".tmp", path_);
    c_.stall.save += Since(t);
    c_.bytes += FileBytes(path_);
    ++c_.commits;
    return Status::Ok();
  }
  void Mark() override { c_ = {}; }
  Counters Read() override { return c_; }
  Status Finish() override { return Status::Ok(); }

 private:
  Workload& w_;
  OptimizerStep step_;
  runtime::Device& device_;
  std::string path_;
  std::uint64_t k_;
  std::vector<torch::Tensor> staging_;
  Counters c_;
};

// Method 3: CheckFreq. At a checkpoint boundary: wait for the previous
// persist, copy the whole state to DRAM (training stopped), resume; a
// background thread torch::saves the copy. Interval: fixed, or Algorithm 1.
class CheckFreq final : public Method {
 public:
  CheckFreq(Workload& w, runtime::Device& device, std::string path, std::uint64_t fixed_k,
            std::size_t block_bytes, std::vector<int> checkpoint_cpus)
      : w_(w),
        step_(w, block_bytes),
        device_(device),
        path_(std::move(path)),
        fixed_k_(fixed_k),
        checkpoint_cpus_(std::move(checkpoint_cpus)) {
    thread_ = std::thread([this] {
      PinCheckpointThread(checkpoint_cpus_);
      Persister();
    });
  }
  ~CheckFreq() override { (void)Finish(); }

  Status Step(std::uint64_t step) override {
    // T_i: boundary to boundary, minus this method's own stall in between.
    const auto now = Clock::now();
    if (step > 1) {
      const double ti =
          std::chrono::duration<double>(now - last_boundary_).count() - last_step_stall_;
      iteration_seconds_ = iteration_seconds_ == 0 ? ti : 0.7 * iteration_seconds_ + 0.3 * ti;
    }
    last_boundary_ = now;
    last_step_stall_ = 0;
    PMSNAP_RETURN_IF_ERROR(step_.Run());
    bool due = false;
    if (fixed_k_ > 0) {
      due = step % fixed_k_ == 0;
    } else if (last_checkpoint_ == 0) {
      due = true;  // the profiling checkpoint
    } else {
      bool profiled = false;
      {
        std::lock_guard lock(mutex_);
        profiled = have_profile_;
        persist_seen_ = persist_seconds_;
      }
      if (profiled) Recompute();
      due = profiled && step - last_checkpoint_ >= k_;
    }
    if (!due) return Status::Ok();
    {
      const auto t = Clock::now();
      std::unique_lock lock(mutex_);
      done_.wait(lock, [&] { return !busy_; });
      const double waited = Since(t);
      c_.stall.boundary += waited;
      last_step_stall_ += waited;
    }
    const auto t = Clock::now();
    auto live = StateTensors(w_);
    if (staging_.empty()) staging_ = Staging(live);
    Status s = CopyOut(device_, staging_, live);
    if (!s.ok()) return s;
    snapshot_seconds_ = Since(t);
    last_step_stall_ += snapshot_seconds_;
    model_bytes_ = Bytes(live);
    last_checkpoint_ = step;
    {
      std::lock_guard lock(mutex_);
      c_.stall.copy += snapshot_seconds_;
      busy_ = true;
    }
    work_.notify_one();
    return Status::Ok();
  }
  void Mark() override {
    std::lock_guard lock(mutex_);
    c_ = {};
  }
  Counters Read() override {
    std::lock_guard lock(mutex_);
    return c_;
  }
  Status Finish() override {
    if (!thread_.joinable()) return Status::Ok();
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_.notify_one();
    thread_.join();
    return Status::Ok();
  }
  std::string Note() const override {
    if (fixed_k_ > 0) return "";
    char b[160];
    std::snprintf(b, sizeof(b), "Algorithm 1: k=%llu (T_i %.0f ms, T_c %.0f ms, T_s %.0f ms)",
                  static_cast<unsigned long long>(k_), iteration_seconds_ * 1e3,
                  snapshot_seconds_ * 1e3, persist_seen_ * 1e3);
    return b;
  }
  std::uint64_t interval() const { return fixed_k_ > 0 ? fixed_k_ : k_; }

 private:
  // Algorithm 1 from this run's measurements. The snapshot stops training
  // (no overlap with forward/backward), so T_w = T_i makes T_oc = T_c; the
  // device-memory (GPU) mode is not offered (free bytes 0).
  void Recompute() {
    runtime::PolicyInputs in;
    in.iteration_seconds = std::max(iteration_seconds_, 1e-6);
    in.update_seconds = in.iteration_seconds;
    in.snapshot_seconds = snapshot_seconds_;
    in.in_device_seconds = device_.EstimateInDeviceCopySeconds(model_bytes_);
    in.persist_seconds = persist_seen_;
    in.model_bytes = model_bytes_;
    in.device_free_bytes = 0;
    in.have_profile = true;
    bool gpu = false;
    k_ = std::max<std::uint64_t>(
        1, runtime::CheckFreqPolicy::ComputeInterval(in, kOverheadBudget, &gpu));
  }
  void Persister() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || busy_; });
      if (!busy_ && stop_) return;
      lock.unlock();
      const auto t = Clock::now();
      torch::save(staging_, path_ + ".tmp");
      Fsync(path_ + ".tmp");
      std::filesystem::rename(path_ + ".tmp", path_);
      const std::uint64_t bytes = FileBytes(path_);
      lock.lock();
      persist_seconds_ = Since(t);
      have_profile_ = true;
      c_.bytes += bytes;
      ++c_.commits;
      busy_ = false;
      done_.notify_all();
    }
  }

  Workload& w_;
  OptimizerStep step_;
  runtime::Device& device_;
  std::string path_;
  std::uint64_t fixed_k_;
  std::vector<int> checkpoint_cpus_;
  std::uint64_t k_ = 1;
  std::uint64_t last_checkpoint_ = 0;
  double last_step_stall_ = 0;
  double persist_seen_ = 0;  // persist_seconds_ as last read under mutex_
  Clock::time_point last_boundary_{};
  double iteration_seconds_ = 0, snapshot_seconds_ = 0;
  std::uint64_t model_bytes_ = 0;
  std::vector<torch::Tensor> staging_;
  std::mutex mutex_;  // guards busy_, stop_, c_, persist_seconds_, have_profile_
  std::condition_variable work_, done_;
  bool busy_ = false, stop_ = false, have_profile_ = false;
  double persist_seconds_ = 0;
  Counters c_;
  std::thread thread_;
};

// Method 4: weight-grained serialization. Per-parameter stepping; right after
// a weight's update in a checkpointed step, a worker copies the weight and its
// optimizer state out (the weight's snapshot) and torch::saves the copy into
// the weight's own file. Each weight is its own pipeline: before a weight's
// next update the training thread waits for that weight's snapshot (not its
// file), and a weight's next snapshot waits until its previous file is
// written (one staging copy per weight). Epoch e writes directory e<e>, then
// a COMMIT file; the previous committed directory is removed after that.
class WeightFiles final : public Method, public hooks::StepObserver {
 public:
  static Result<std::unique_ptr<WeightFiles>> Create(Workload& w, runtime::Device& device,
                                                     std::string dir, std::uint64_t k, int workers,
                                                     std::size_t block_bytes,
                                                     std::vector<int> checkpoint_cpus) {
    auto stepper = hooks::ParameterStepper::Create(*w.optimizer, NamedParameters(w));
    if (!stepper.ok()) return stepper.status();
    (*stepper)->set_block_bytes(block_bytes);
    return std::unique_ptr<WeightFiles>(new WeightFiles(std::move(stepper).value(), device,
                                                        std::move(dir), k, workers,
                                                        std::move(checkpoint_cpus)));
  }
  ~WeightFiles() override { (void)Finish(); }

  Status Step(std::uint64_t step) override {
    if (step % k_ == 0) {
      std::lock_guard lock(mutex_);
      ++epoch_;
      pending_[epoch_] = units_.size();
      capturing_ = true;
      std::filesystem::create_directories(EpochDir(epoch_));
    }
    Status s = stepper_->Step(this);
    if (capturing_) {
      std::lock_guard lock(mutex_);
      for (std::size_t i = 0; i < units_.size(); ++i)
        if (units_[i].captured < epoch_) Enqueue(i);  // not updated this step
      capturing_ = false;
    }
    changed_.notify_all();
    return s;
  }
  Status BeforeUpdate(std::size_t i) override {
    std::unique_lock lock(mutex_);
    Unit& u = units_[i];
    if (u.snapshotted >= u.captured) return Status::Ok();
    const auto t = Clock::now();
    ++c_.conflicts;
    changed_.wait(lock, [&] { return u.snapshotted >= u.captured; });
    c_.stall.conflict += Since(t);
    return Status::Ok();
  }
  Status AfterUpdate(std::size_t i) override {
    if (!capturing_) return Status::Ok();
    {
      std::lock_guard lock(mutex_);
      Enqueue(i);
    }
    changed_.notify_all();
    return Status::Ok();
  }
  void Mark() override {
    std::lock_guard lock(mutex_);
    c_ = {};
  }
  Counters Read() override {
    std::lock_guard lock(mutex_);
    return c_;
  }
  Status Finish() override {
    {
      std::lock_guard lock(mutex_);
      if (stop_) return Status::Ok();
      stop_ = true;
    }
    changed_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
    return Status::Ok();
  }

 private:
  struct Unit {
    std::vector<torch::Tensor> live, staging;
    std::uint64_t captured = 0;     // last epoch that enqueued this weight
    std::uint64_t snapshotted = 0;  // last epoch whose snapshot of it is done
    bool writing = false;           // staging copy in use by a worker
  };
  WeightFiles(std::unique_ptr<hooks::ParameterStepper> stepper, runtime::Device& device,
              std::string dir, std::uint64_t k, int workers, std::vector<int> checkpoint_cpus)
      : stepper_(std::move(stepper)),
        device_(device),
        dir_(std::move(dir)),
        k_(k),
        checkpoint_cpus_(std::move(checkpoint_cpus)) {
    for (const auto& slot : stepper_->slots()) {
      Unit u;
      u.live.push_back(slot.param);
      for (const auto& [role, t] : slot.state) u.live.push_back(t);
      u.staging = Staging(u.live);
      units_.push_back(std::move(u));
    }
    for (int i = 0; i < std::max(1, workers); ++i) {
      threads_.emplace_back([this] {
        PinCheckpointThread(checkpoint_cpus_);
        Worker();
      });
    }
  }
  std::string EpochDir(std::uint64_t e) const { return dir_ + "/e" + std::to_string(e); }
  void Enqueue(std::size_t i) {  // mutex_ held
    units_[i].captured = epoch_;
    queue_.emplace_back(i, epoch_);
  }
  void Worker() {
    std::unique_lock lock(mutex_);
    for (;;) {
      changed_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      const auto [i, epoch] = queue_.front();
      queue_.pop_front();
      Unit& u = units_[i];
      changed_.wait(lock, [&] { return !u.writing; });
      u.writing = true;
      lock.unlock();
      (void)CopyOut(device_, u.staging, u.live);
      lock.lock();
      u.snapshotted = epoch;
      changed_.notify_all();
      lock.unlock();
      const std::string path = EpochDir(epoch) + "/w" + std::to_string(i) + ".pt";
      torch::save(u.staging, path);
      Fsync(path);
      const std::uint64_t bytes = FileBytes(path);
      lock.lock();
      u.writing = false;
      c_.bytes += bytes;
      if (--pending_[epoch] == 0) {
        pending_.erase(epoch);
        lock.unlock();
        const std::string commit = EpochDir(epoch) + "/COMMIT";
        std::ofstream(commit) << epoch << "\n";
        Fsync(commit);
        lock.lock();
        ++c_.commits;
        if (epoch > committed_) {
          if (committed_ > 0) {
            const std::string old = EpochDir(committed_);
            lock.unlock();
            std::filesystem::remove_all(old);
            lock.lock();
          }
          committed_ = epoch;
        }
      }
      changed_.notify_all();
    }
  }

  std::unique_ptr<hooks::ParameterStepper> stepper_;
  runtime::Device& device_;
  std::string dir_;
  std::uint64_t k_;
  std::vector<int> checkpoint_cpus_;
  std::mutex mutex_;  // guards everything below (tensor data: the `writing` protocol)
  std::condition_variable changed_;
  std::vector<Unit> units_;
  std::deque<std::pair<std::size_t, std::uint64_t>> queue_;  // (weight, epoch)
  std::map<std::uint64_t, std::size_t> pending_;             // epoch -> files left
  std::uint64_t epoch_ = 0, committed_ = 0;
  bool capturing_ = false, stop_ = false;
  Counters c_;
  std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Method> MakeNoCheckpoint(Workload& w, std::size_t block_bytes) {
  return std::make_unique<NoCheckpoint>(w, block_bytes);
}

std::unique_ptr<Method> MakeTorchSave(Workload& w, runtime::Device& device, std::string path,
                                      std::uint64_t k, std::size_t block_bytes) {
  return std::make_unique<TorchSave>(w, device, std::move(path), k, block_bytes);
}

std::unique_ptr<Method> MakeCheckFreq(Workload& w, runtime::Device& device, std::string path,
                                      std::uint64_t fixed_k, std::size_t block_bytes,
                                      std::vector<int> checkpoint_cpus) {
  return std::make_unique<CheckFreq>(w, device, std::move(path), fixed_k, block_bytes,
                                     std::move(checkpoint_cpus));
}

Result<std::unique_ptr<Method>> MakeWeightFiles(Workload& w, runtime::Device& device,
                                                std::string dir, std::uint64_t k, int workers,
                                                std::size_t block_bytes,
                                                std::vector<int> checkpoint_cpus) {
  PMSNAP_ASSIGN_OR_RETURN(auto method,
                          WeightFiles::Create(w, device, std::move(dir), k, workers, block_bytes,
                                              std::move(checkpoint_cpus)));
  return std::unique_ptr<Method>(std::move(method));
}

}  // namespace pmsnap::bench::stall
