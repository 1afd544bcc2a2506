#include <cstdlib>
#include <string>
#include <vector>

#include "pmsnap/runtime/cuda_device.h"

namespace pmsnap::runtime {

Result<std::unique_ptr<Device>> MakeDevice(const std::string& spec, std::string* note,
                                           const CudaDeviceOptions& cuda_options) {
  auto fields = [&spec]() {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (true) {
      const std::size_t colon = spec.find(':', start);
      out.push_back(spec.substr(start, colon - start));
      if (colon == std::string::npos) return out;
      start = colon + 1;
    }
  }();
  const std::string& kind = fields[0];
  auto number = [&](std::size_t i, double fallback) -> Result<double> {
    if (fields.size() <= i || fields[i].empty()) return fallback;
    char* end = nullptr;
    const double value = std::strtod(fields[i].c_str(), &end);
    if (end == nullptr || *end != '\0' || value < 0) {
      return Status(StatusCode::kInvalidArgument,
                    "device spec '" + spec + "': '" + fields[i] + "' is not a non-negative number");
    }
    return value;
  };
  if (kind == "host" && fields.size() == 1) {
    return std::unique_ptr<Device>(std::make_unique<HostDevice>());
  }
  if (kind == "simulated" && fields.size() <= 3) {
    SimulatedDeviceOptions options;
    PMSNAP_ASSIGN_OR_RETURN(options.copy_bandwidth_gbps, number(1, options.copy_bandwidth_gbps));
    PMSNAP_ASSIGN_OR_RETURN(const double mib, number(2, options.memory_bytes / 1048576.0));
    if (options.copy_bandwidth_gbps <= 0) {
      return Status(StatusCode::kInvalidArgument,
                    "device spec '" + spec + "': bandwidth must be > 0");
    }
    options.memory_bytes = static_cast<std::uint64_t>(mib * 1048576.0);
    return std::unique_ptr<Device>(std::make_unique<SimulatedDevice>(options));
  }
  if (kind == "cuda" && fields.size() <= 2) {
    PMSNAP_ASSIGN_OR_RETURN(const double ordinal, number(1, 0));
    auto cuda = CreateCudaDevice(static_cast<int>(ordinal), cuda_options);
    if (cuda.ok()) return cuda;
    if (note != nullptr) {
      *note = "no usable CUDA device (" + cuda.status().message() + "); using the host device";
    }
    return std::unique_ptr<Device>(std::make_unique<HostDevice>());
  }
  return Status(
      StatusCode::kInvalidArgument,
      "unknown device spec '" + spec + "' (expected host, simulated[:GBPS[:MEM_MIB]] or cuda[:N])");
}

}  // namespace pmsnap::runtime
