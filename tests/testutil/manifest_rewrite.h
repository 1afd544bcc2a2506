// Replaces the manifest of a closed pool file with another of the same
// encoded length and recomputes the manifest checksum, the model signature
// and the header checksum: damage that the checksums cannot catch, for tests
// of the checks behind them. The including test needs pmem_layout/ on its
// include path (detail/format.h).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "detail/format.h"
#include "pmsnap/pmem_layout/checksum.h"
#include "pmsnap/pmem_layout/pool.h"

namespace pmsnap::testing {

// `header_offset`: Pool::regions().header.offset of the pool at `path`.
// gtest failures if the file cannot be read or written or the lengths differ.
inline void RewriteManifest(const std::string& path, std::uint64_t header_offset,
                            const layout::Manifest& manifest) {
  const std::vector<std::byte> bytes = manifest.Serialize();
  layout::detail::PoolHeader header{};
  const int fd = ::open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pread(fd, &header, sizeof(header), header_offset),
            static_cast<ssize_t>(sizeof(header)));
  ASSERT_EQ(bytes.size(), header.manifest_bytes) << "the new manifest must keep the length";
  ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), header.manifest_offset),
            static_cast<ssize_t>(bytes.size()));
  header.manifest_checksum = layout::Checksum64(bytes.data(), bytes.size());
  header.model_signature = manifest.Signature();
  header.header_checksum = 0;
  header.header_checksum = layout::Checksum64(&header, sizeof(header));
  ASSERT_EQ(::pwrite(fd, &header, sizeof(header), header_offset),
            static_cast<ssize_t>(sizeof(header)));
  ::close(fd);
}

}  // namespace pmsnap::testing
