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
using ::testing::Not;

struct CommandResult {
  int exit_code = -1;
  std::string output;
};

// `env`: "NAME=value " assignments for the command, or "".
CommandResult RunCliWithEnv(const std::string& env, const std::string& args) {
  const std::string command = env + std::string(PMSNAP_CLI_PATH) + " " + args + " 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  CommandResult result;
  if (pipe == nullptr) return result;
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) result.output += buffer;
  result.exit_code = WEXITSTATUS(::pclose(pipe));
  return result;
}

CommandResult RunCli(const std::string& args) { return RunCliWithEnv("", args); }

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

TEST_F(CliTest, InfoLabelsSimulatedPmOnlyWhenTheModelIsOn) {
  // The test's own environment carries no model (ctest sets none).
  CommandResult plain = RunCliWithEnv("env -u PMSNAP_PM_WRITE_GBPS -u PMSNAP_PM_READ_GBPS ",
                                      "info " + path_.path());
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_THAT(plain.output, Not(HasSubstr("simulated PM")));
  CommandResult plain_json = RunCliWithEnv(
      "env -u PMSNAP_PM_WRITE_GBPS -u PMSNAP_PM_READ_GBPS ", "info --json " + path_.path());
  EXPECT_THAT(plain_json.output, Not(HasSubstr("\"pm\"")));
  // The environment reaches the CLI's open (PmBandwidth).
  const std::string env = "PMSNAP_PM_WRITE_GBPS=2.3 PMSNAP_PM_READ_GBPS=6.6 ";
  CommandResult labelled = RunCliWithEnv(env, "info " + path_.path());
  EXPECT_EQ(labelled.exit_code, 0) << labelled.output;
  EXPECT_THAT(labelled.output, HasSubstr("simulated PM (2.3 GB/s write, 6.6 GB/s read)"));
  CommandResult json = RunCliWithEnv(env, "info --json " + path_.path());
  EXPECT_THAT(json.output, HasSubstr("\"pm\": \"simulated PM (2.3 GB/s write, 6.6 GB/s read)\""));
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
