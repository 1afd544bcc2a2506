#include "stall/checkpoint_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

namespace pmsnap::bench::stall {

void Fsync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

std::uint64_t FileBytes(const std::string& path) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(path, ec);
  return ec ? 0 : static_cast<std::uint64_t>(n);
}

void SaveFull(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
              const std::string& path) {
  torch::serialize::OutputArchive archive;
  module.save(archive);
  torch::serialize::OutputArchive state;
  optimizer.save(state);
  archive.write("optimizer", state);
  archive.save_to(path);
}

void LoadFull(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
              const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  module.load(archive);
  torch::serialize::InputArchive state;
  archive.read("optimizer", state);
  optimizer.load(state);
}

}  // namespace pmsnap::bench::stall
