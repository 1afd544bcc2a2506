// frontend/parameter_units.h: the rules the C++ and Python CheckpointedOptimizers
// share, checked without libtorch (the hooks and pytest suites check them again
// through each front end).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pmsnap/frontend/parameter_units.h"

namespace pmsnap::frontend {
namespace {

using layout::DType;

runtime::TensorView View(std::string role, DType dtype, std::vector<std::int64_t> shape) {
  runtime::TensorView view;
  view.name = std::move(role);
  view.dtype = dtype;
  view.shape = std::move(shape);
  return view;
}

std::vector<std::string> Roles(const runtime::UnitRegistration& unit) {
  std::vector<std::string> roles;
  for (const runtime::TensorView& t : unit.tensors) roles.push_back(t.name);
  return roles;
}

TEST(FrontendParameterUnitsTest, DenseCompanionNameRoundTrips) {
  EXPECT_EQ(DenseUnitName("emb.weight"), "emb.weight#dense");
  EXPECT_EQ(TableOfDenseUnit("emb.weight#dense"), "emb.weight");
  EXPECT_EQ(TableOfDenseUnit("emb.weight"), std::nullopt);
  EXPECT_EQ(TableOfDenseUnit("#dense"), std::nullopt);  // no table name before it
}

runtime::TensorView HostView(std::string role, DType dtype, std::vector<std::int64_t> shape) {
  runtime::TensorView view = View(std::move(role), dtype, std::move(shape));
  view.on_host = true;
  return view;
}

TEST(FrontendParameterUnitsTest, HostCompanionNameRoundTrips) {
  EXPECT_EQ(HostUnitName("fc.weight"), "fc.weight#host");
  EXPECT_EQ(UnitOfHostCompanion("fc.weight#host"), "fc.weight");
  EXPECT_EQ(UnitOfHostCompanion("emb.weight#dense#host"), "emb.weight#dense");
  EXPECT_EQ(UnitOfHostCompanion("fc.weight"), std::nullopt);
  EXPECT_EQ(UnitOfHostCompanion("#host"), std::nullopt);
}

TEST(FrontendParameterUnitsTest, EveryCompanionNamesItsParameter) {
  for (const std::string& companion : CompanionUnitNames("emb.weight")) {
    EXPECT_EQ(ParameterOfCompanion(companion), "emb.weight") << companion;
  }
  EXPECT_EQ(CompanionUnitNames("fc.weight"),
            (std::vector<std::string>{"fc.weight#host", "fc.weight#dense",
                                      "fc.weight#dense#host"}));
  EXPECT_EQ(ParameterOfCompanion("fc.weight"), std::nullopt);
}

// The first GPU run: torch's default Adam keeps `step` on the CPU beside the
// GPU parameter and moments; pmsnap refused the optimizer. The host tensor
// now goes into a companion unit the engine copies with the CPU.
TEST(FrontendParameterUnitsTest, HostStateOfADeviceParameterGoesIntoAHostCompanion) {
  auto units = ParameterUnits(
      "fc.weight",
      {View("param", DType::kFloat32, {4, 3}), View("exp_avg", DType::kFloat32, {4, 3}),
       View("exp_avg_sq", DType::kFloat32, {4, 3}), HostView("step", DType::kFloat32, {})},
      /*embedding_table=*/false);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 2u);
  EXPECT_EQ((*units)[0].name, "fc.weight");
  EXPECT_FALSE((*units)[0].on_host);
  EXPECT_EQ(Roles((*units)[0]), (std::vector<std::string>{"param", "exp_avg", "exp_avg_sq"}));
  EXPECT_EQ((*units)[1].name, "fc.weight#host");
  EXPECT_TRUE((*units)[1].on_host);
  EXPECT_FALSE((*units)[1].encoded);
  EXPECT_EQ(Roles((*units)[1]), (std::vector<std::string>{"step"}));
  EXPECT_TRUE((*units)[1].tensors[0].on_host);
}

TEST(FrontendParameterUnitsTest, AUnitAllOnTheHostIsAHostUnitWithoutCompanion) {
  auto units = ParameterUnits(
      "bias", {HostView("param", DType::kFloat32, {4}), HostView("step", DType::kFloat32, {})},
      /*embedding_table=*/false);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 1u);
  EXPECT_EQ((*units)[0].name, "bias");
  EXPECT_TRUE((*units)[0].on_host);
}

TEST(FrontendParameterUnitsTest, ATableOnTheDeviceWithAHostStepHasAHostDenseCompanion) {
  // Adam on a GPU table: moments by row in the encoded unit, the CPU step
  // alone in "#dense", which is all host memory and so a host unit.
  auto units = ParameterUnits(
      "emb.weight",
      {View("param", DType::kFloat32, {10, 4}), View("exp_avg", DType::kFloat32, {10, 4}),
       HostView("step", DType::kFloat32, {})},
      /*embedding_table=*/true);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 2u);
  EXPECT_TRUE((*units)[0].encoded);
  EXPECT_FALSE((*units)[0].on_host);
  EXPECT_EQ((*units)[1].name, "emb.weight#dense");
  EXPECT_TRUE((*units)[1].on_host);
  auto on_host = ParameterUnits("emb.weight", {HostView("param", DType::kFloat32, {10, 4})},
                                /*embedding_table=*/true);
  EXPECT_EQ(on_host.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(on_host.status().message().find("emb.weight"), std::string::npos);
}

TEST(FrontendParameterUnitsTest, ModuleBuffersMakeOneUnitAndAHostCompanion) {
  auto units = BufferUnits({View("bn.running_mean", DType::kFloat32, {8}),
                            View("bn.running_var", DType::kFloat32, {8}),
                            HostView("counter", DType::kInt64, {}),
                            View("bn.num_batches_tracked", DType::kInt64, {})});
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 2u);
  EXPECT_EQ((*units)[0].name, kBuffersUnit);
  EXPECT_EQ(Roles((*units)[0]), (std::vector<std::string>{"bn.running_mean", "bn.running_var",
                                                          "bn.num_batches_tracked"}));
  EXPECT_EQ((*units)[1].name, HostUnitName(kBuffersUnit));
  EXPECT_TRUE((*units)[1].on_host);
  EXPECT_TRUE(IsBuffersUnit((*units)[0].name));
  EXPECT_TRUE(IsBuffersUnit((*units)[1].name));
  EXPECT_FALSE(IsBuffersUnit("bn.weight"));
  auto none = BufferUnits({});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
  auto twice = BufferUnits({View("a", DType::kFloat32, {1}), View("a", DType::kFloat32, {1})});
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
}

TEST(FrontendParameterUnitsTest, PlainParameterIsOneUnitInTheGivenOrder) {
  auto units =
      ParameterUnits("fc.weight",
                     {View("param", DType::kFloat32, {4, 3}),
                      View("exp_avg", DType::kFloat32, {4, 3}), View("step", DType::kInt64, {1})},
                     /*embedding_table=*/false);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 1u);
  EXPECT_EQ((*units)[0].name, "fc.weight");
  EXPECT_FALSE((*units)[0].encoded);
  EXPECT_EQ(Roles((*units)[0]), (std::vector<std::string>{"param", "exp_avg", "step"}));
}

TEST(FrontendParameterUnitsTest, TableSplitsRowTensorsFromTheRest) {
  // Adagrad in Python order: a float32 scalar step, then the [rows, dim] sum;
  // a [rows] accumulator also goes by row, a float64 one does not.
  auto units = ParameterUnits(
      "emb.weight",
      {View("param", DType::kFloat32, {10, 4}), View("step", DType::kFloat32, {}),
       View("sum", DType::kFloat32, {10, 4}), View("row_norm", DType::kFloat32, {10}),
       View("wide", DType::kFloat64, {10, 4})},
      /*embedding_table=*/true);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  ASSERT_EQ(units->size(), 2u);
  EXPECT_EQ((*units)[0].name, "emb.weight");
  EXPECT_TRUE((*units)[0].encoded);
  EXPECT_EQ(Roles((*units)[0]), (std::vector<std::string>{"param", "sum", "row_norm"}));
  EXPECT_EQ((*units)[1].name, "emb.weight#dense");
  EXPECT_FALSE((*units)[1].encoded);
  EXPECT_EQ(Roles((*units)[1]), (std::vector<std::string>{"step", "wide"}));
}

TEST(FrontendParameterUnitsTest, TableWithOnlyRowStateHasNoCompanion) {
  auto units = ParameterUnits(
      "emb.weight",
      {View("param", DType::kFloat32, {10, 4}), View("momentum_buffer", DType::kFloat32, {10, 4})},
      /*embedding_table=*/true);
  ASSERT_TRUE(units.ok()) << units.status().ToString();
  EXPECT_EQ(units->size(), 1u);
}

TEST(FrontendParameterUnitsTest, RefusesATableThatIsNotFloat32RowsByDim) {
  auto units = ParameterUnits("emb.weight", {View("param", DType::kFloat64, {10, 4})},
                              /*embedding_table=*/true);
  ASSERT_FALSE(units.ok());
  EXPECT_EQ(units.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(units.status().message().find("'emb.weight'"), std::string::npos);
  EXPECT_NE(units.status().message().find("float32 [rows, dim]"), std::string::npos);
  EXPECT_NE(units.status().message().find("float64 [10, 4]"), std::string::npos);

  const std::int64_t shape[] = {10, 4};
  Status sparse = CheckTableParameter("emb.weight", "float32", shape, /*dense_layout=*/false);
  EXPECT_NE(sparse.message().find("sparse float32 [10, 4]"), std::string::npos);
  const std::int64_t vector_shape[] = {10};
  EXPECT_FALSE(CheckTableParameter("emb.weight", "float32", vector_shape).ok());
}

TEST(FrontendParameterUnitsTest, RefusesAUnitThatDoesNotStartWithTheParameter) {
  auto units = ParameterUnits("fc.weight", {View("exp_avg", DType::kFloat32, {4})}, false);
  ASSERT_FALSE(units.ok());
  EXPECT_NE(units.status().message().find("'fc.weight'"), std::string::npos);
  EXPECT_FALSE(ParameterUnits("fc.weight", {}, false).ok());
}

TEST(FrontendParameterUnitsTest, OptimizersThatMoveRowsWithoutGradient) {
  EXPECT_FALSE(MovesRowsWithoutGradient("SGD", 0, 0));
  EXPECT_TRUE(MovesRowsWithoutGradient("SGD", 0.9, 0));
  EXPECT_TRUE(MovesRowsWithoutGradient("SGD", 0, 1e-4));
  EXPECT_FALSE(MovesRowsWithoutGradient("Adagrad", 0, 0));
  EXPECT_TRUE(MovesRowsWithoutGradient("Adagrad", 0, 1e-4));
  EXPECT_FALSE(MovesRowsWithoutGradient("SparseAdam", 0, 0));
  for (const char* moving : {"Adam", "AdamW", "RMSprop", "SomeUserOptimizer"}) {
    EXPECT_TRUE(MovesRowsWithoutGradient(moving, 0, 0)) << moving;
  }
}

}  // namespace
}  // namespace pmsnap::frontend
