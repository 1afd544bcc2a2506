// The `pmsnap` command line tool on real pools.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "pmsnap/pmem_layout/pool.h"
#include "testutil/pool_fixtures.h"
#include "testutil/temp_pool.h"

namespace pmsnap {
namespace {

using ::testing::HasSubstr;

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

CommandResult RunCli(const std::string& args) {
  const std::string command = std::string(PMSNAP_CLI_PATH) + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  CommandResult result;
  if (pipe == nullptr) return result;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) result.output += buffer;
  result.exit_code = WEXITSTATUS(::pclose(pipe));
  return result;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    layout::PoolOptions options;
    options.chunk_heap_bytes = 1 << 20;
    auto pool = layout::Pool::Create(path_.path(), manifest_, options);
    ASSERT_TRUE(pool.ok());
    ASSERT_TRUE(testing::WriteSeededEpoch(**pool, 1, 10).ok());
    ASSERT_TRUE(testing::WriteSeededEpoch(**pool, 2, 20, "rng").ok());
    data_offset_ = (*pool)->regions().slot_data[0].offset;
  }
  testing::TempPoolPath path_{"cli"};
  layout::Manifest manifest_ = testing::MakeManifest(2, 500);
  std::uint64_t data_offset_ = 0;
};

TEST_F(CliTest, InfoListsUnitsAndBothSlots) {
  CommandResult r = RunCli("info " + path_.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("layer1.weight"));
  EXPECT_THAT(r.output, HasSubstr("exp_avg  float32 [16, 31]"));
  EXPECT_THAT(r.output, HasSubstr("slot 0: COMPLETE  epoch 2  iteration 20"));
  EXPECT_THAT(r.output, HasSubstr("slot 1: COMPLETE  epoch 1  iteration 10"));
  EXPECT_THAT(r.output, HasSubstr("format version  1"));
}

TEST_F(CliTest, InfoJsonHasTheSameFacts) {
  CommandResult r = RunCli("info --json " + path_.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"format_version\": 1"));
  EXPECT_THAT(r.output, HasSubstr("\"name\": \"layer0.weight\""));
  EXPECT_THAT(r.output, HasSubstr("\"shape\": [16, 31]"));
  EXPECT_THAT(r.output, HasSubstr("\"latest\": {\"slot\": 0, \"epoch\": 2, \"iteration\": 20}"));
}

TEST_F(CliTest, VerifyExitsZeroOnAConsistentPool) {
  CommandResult r = RunCli("verify " + path_.path());
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("consistent"));
  CommandResult j = RunCli("verify --json " + path_.path());
  EXPECT_EQ(j.exit_code, 0);
  EXPECT_THAT(j.output, HasSubstr("\"consistent\": true"));
}

TEST_F(CliTest, VerifyExitsOneAndNamesTheDamagedUnit) {
  testing::FlipBit(path_.path(), data_offset_ + 10, 0);
  CommandResult r = RunCli("verify " + path_.path());
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("DAMAGED"));
  EXPECT_THAT(r.output, HasSubstr("layer0.weight"));
  EXPECT_THAT(r.output, HasSubstr("recovery uses slot 1"));
  CommandResult j = RunCli("verify --json " + path_.path());
  EXPECT_EQ(j.exit_code, 1);
  EXPECT_THAT(j.output, HasSubstr("\"consistent\": false"));
}

TEST(CliErrorsTest, MissingPoolAndBadUsage) {
  CommandResult missing = RunCli("info /nonexistent/pool");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.output, HasSubstr("does not exist"));
  EXPECT_EQ(RunCli("frobnicate x").exit_code, 2);
  EXPECT_EQ(RunCli("info").exit_code, 2);
  CommandResult json = RunCli("verify --json /nonexistent/pool");
  EXPECT_EQ(json.exit_code, 1);
  EXPECT_THAT(json.output, HasSubstr("\"consistent\": false"));
}

}  // namespace
}  // namespace pmsnap
