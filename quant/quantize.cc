// Quantizer driver: option checks, per-row parameter recipes (pmsnap and
// PyTorch-fused rounding), the adaptive greedy range search, dequantization,
// the mean l2 error, and the oneTBB row split.
// Thread-safety: reentrant; rows are independent, each task owns its scratch.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/parallel_reduce.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "detail/half.h"
#include "detail/pack.h"
#include "detail/rowwise.h"
#include "pmsnap/quant/quant.h"

namespace pmsnap::quant {

const char* MethodName(Method method) {
  switch (method) {
    case Method::kSymmetric:
      return "symmetric";
    case Method::kAsymmetric:
      return "asymmetric";
    case Method::kAdaptive:
      return "adaptive";
    case Method::kKMeans:
      return "kmeans";
  }
  return "unknown";
}

const char* ScaleTypeName(ScaleType type) {
  switch (type) {
    case ScaleType::kFp16:
      return "fp16";
    case ScaleType::kFp32:
      return "fp32";
  }
  return "unknown";
}

const char* LayoutName(Layout layout) {
  switch (layout) {
    case Layout::kPmsnap:
      return "pmsnap";
    case Layout::kTorchFused:
      return "torch_fused";
  }
  return "unknown";
}

std::uint64_t QuantSpec::code_bytes() const { return detail::CodeBytesFor(dim, bits); }

std::uint64_t QuantSpec::param_bytes() const {
  const std::uint64_t one = scale_type == ScaleType::kFp16 ? 2 : 4;
  switch (method) {
    case Method::kSymmetric:
      return one;
    case Method::kAsymmetric:
    case Method::kAdaptive:
      return 2 * one;
    case Method::kKMeans:
      return one << bits;
  }
  return 0;
}

namespace {

bool KnownMethod(Method m) {
  return m == Method::kSymmetric || m == Method::kAsymmetric || m == Method::kAdaptive ||
         m == Method::kKMeans;
}

Status Invalid(std::string message) {
  return Status(StatusCode::kInvalidArgument, std::move(message));
}

}  // namespace

Status ValidateOptions(const QuantOptions& o, std::uint32_t dim) {
  if (!KnownMethod(o.method)) {
    return Invalid("unknown quantization method " + std::to_string(static_cast<int>(o.method)));
  }
  if (o.bits != 2 && o.bits != 3 && o.bits != 4 && o.bits != 8) {
    return Invalid("bits must be 2, 3, 4 or 8, got " + std::to_string(o.bits));
  }
  if (o.scale_type != ScaleType::kFp16 && o.scale_type != ScaleType::kFp32) {
    return Invalid("unknown scale type " + std::to_string(static_cast<int>(o.scale_type)));
  }
  if (o.layout != Layout::kPmsnap && o.layout != Layout::kTorchFused) {
    return Invalid("unknown layout " + std::to_string(static_cast<int>(o.layout)));
  }
  if (dim == 0) return Invalid("rows must have at least one element (dim == 0)");
  if (o.method == Method::kAdaptive) {
    if (o.adaptive.num_bins == 0 || o.adaptive.num_bins > 100000) {
      return Invalid("adaptive num_bins must be in [1, 100000], got " +
                     std::to_string(o.adaptive.num_bins));
    }
    if (!(o.adaptive.ratio > 0.0f && o.adaptive.ratio <= 1.0f)) {
      return Invalid("adaptive ratio must be in (0, 1], got " + std::to_string(o.adaptive.ratio));
    }
  }
  if (o.method == Method::kKMeans && (o.kmeans_iterations == 0 || o.kmeans_iterations > 1000)) {
    return Invalid("kmeans_iterations must be in [1, 1000]");
  }
  if (o.layout == Layout::kTorchFused) {
    if (o.method != Method::kAsymmetric && o.method != Method::kAdaptive) {
      return Invalid(std::string("torch_fused layout needs asymmetric or adaptive, got ") +
                     MethodName(o.method));
    }
    if (o.bits == 8 && o.scale_type != ScaleType::kFp32) {
      return Invalid("torch_fused 8-bit rows carry fp32 scale/bias; set scale_type = kFp32");
    }
    if ((o.bits == 4 || o.bits == 2) && o.scale_type != ScaleType::kFp16) {
      return Invalid("torch_fused 2/4-bit rows carry fp16 scale/bias; set scale_type = kFp16");
    }
    if (o.bits == 3) return Invalid("PyTorch has no 3-bit fused layout");
    const std::uint32_t per_byte = 8 / static_cast<std::uint32_t>(o.bits);
    if (dim % per_byte != 0) {
      return Invalid("torch_fused " + std::to_string(o.bits) + "-bit needs dim a multiple of " +
                     std::to_string(per_byte) + " (PyTorch rejects others), got " +
                     std::to_string(dim));
    }
  }
  if (o.isa != Isa::kAuto && !IsaSupported(o.isa)) {
    return Invalid(std::string("instruction set ") + IsaName(o.isa) +
                   " is not supported by this CPU or build");
  }
  return Status::Ok();
}

QuantSpec SpecFor(const QuantOptions& options, std::uint32_t dim, std::uint64_t rows) {
  QuantSpec spec;
  spec.method = options.method;
  spec.bits = options.bits;
  spec.scale_type = options.scale_type;
  spec.layout = options.layout;
  spec.dim = dim;
  spec.rows = rows;
  spec.adaptive = options.method == Method::kAdaptive ? options.adaptive : AdaptiveParams{0, 0};
  return spec;
}

namespace detail {

RowContext MakeRowContext(const QuantOptions& options, std::uint32_t dim) {
  RowContext ctx;
  ctx.options = options;
  ctx.kernels = &KernelsFor(options.isa);
  ctx.dim = dim;
  ctx.qmax = static_cast<float>((1 << options.bits) - 1);
  const QuantSpec spec = SpecFor(options, dim, 0);
  ctx.code_bytes = spec.code_bytes();
  ctx.param_bytes = spec.param_bytes();
  ctx.fused_asym8 = ctx.kernels->asym8_fp32_rows != nullptr &&
                    options.method == Method::kAsymmetric && options.bits == 8 &&
                    options.scale_type == ScaleType::kFp32 && options.layout == Layout::kPmsnap;
  if (options.method == Method::kAdaptive) {
    const AdaptiveSchedule sched = ScheduleFor(options.adaptive);
    ctx.plan = SearchPlan{ctx.qmax, sched.num_bins, sched.min_bins, sched.refine_iterations};
    ctx.fast_adaptive = ctx.kernels->adaptive_fp16 != nullptr &&
                        options.scale_type == ScaleType::kFp16 && options.layout == Layout::kPmsnap;
  }
  return ctx;
}

namespace {

constexpr float kMaxHalf = 65504.0f;

// Scale 0 with inverse 0 encodes every element as code 0 = bias: exact for a
// constant row, and the fallback when the step underflows.
void SetDegenerate(EncodeParams* e) {
  e->scale = 0.0f;
  e->inv_scale = 0.0f;
}

RowError TorchParams(const RowContext& ctx, float lo, float hi, UniformParams* out) {
  EncodeParams& e = out->enc;
  if (ctx.options.bits == 8) {
    // quantized::embedding_bag_byte_prepack without FBGEMM: fp32 scale
    // range / 255, bias = min, codes from (x - min) * 255 / (range + 1e-8).
    const float range = hi - lo;
    if (!std::isfinite(range)) return RowError::kRangeOverflow;
    e.bias = lo;
    e.scale = range / 255.0f;
    e.inv_scale = 255.0f / (range + 1e-8f);
    out->stored_scale = std::bit_cast<std::uint32_t>(e.scale);
    out->stored_bias = std::bit_cast<std::uint32_t>(e.bias);
    return RowError::kOk;
  }
  // embedding_bag_{4,2}bit_prepack: bias = half(min); scale =
  // half((max - bias) / qmax), 1.0 when that is 0; inverse from the half scale.
  const std::uint16_t bias_h = FloatToHalfRne(lo);
  if (!HalfIsFinite(bias_h)) return RowError::kHalfOverflow;
  e.bias = HalfToFloat(bias_h);
  const float range = hi - e.bias;
  std::uint16_t scale_h = range == 0.0f ? std::uint16_t{0x3c00} : FloatToHalfRne(range / ctx.qmax);
  if (!HalfIsFinite(scale_h)) return RowError::kHalfOverflow;
  e.scale = HalfToFloat(scale_h);
  e.inv_scale = e.scale == 0.0f ? 1.0f : 1.0f / e.scale;
  if (e.scale == 0.0f || std::isinf(e.inv_scale)) {
    scale_h = 0x3c00;
    e.scale = 1.0f;
    e.inv_scale = 1.0f;
  }
  out->stored_scale = scale_h;
  out->stored_bias = bias_h;
  return RowError::kOk;
}

}  // namespace

RowError MakeUniformParams(const RowContext& ctx, float lo, float hi, UniformParams* out) {
  hi = hi < lo ? lo : hi;  // a search candidate may cross by rounding
  if (ctx.options.layout == Layout::kTorchFused) return TorchParams(ctx, lo, hi, out);
  EncodeParams& e = out->enc;
  const bool fp16 = ctx.options.scale_type == ScaleType::kFp16;
  if (ctx.options.method == Method::kSymmetric) {
    const float a = std::max(-lo, hi);
    if (fp16 && a > kMaxHalf) return RowError::kHalfOverflow;
    // 2a / qmax computed as (a / qmax) * 2 so it cannot overflow.
    const float step = (a / ctx.qmax) * 2.0f;
    if (fp16) {
      const std::uint16_t scale_h = FloatToHalfRoundUp(step);
      if (!HalfIsFinite(scale_h)) return RowError::kHalfOverflow;
      e.scale = HalfToFloat(scale_h);
      out->stored_scale = scale_h;
    } else {
      e.scale = step;
      out->stored_scale = std::bit_cast<std::uint32_t>(step);
    }
    e.inv_scale = e.scale == 0.0f ? 0.0f : 1.0f / e.scale;
    if (!std::isfinite(e.inv_scale)) e.inv_scale = 0.0f;
    e.bias = -(e.scale * 0.5f) * ctx.qmax;
    out->stored_bias = 0;
    return RowError::kOk;
  }
  if (fp16) {
    if (hi > kMaxHalf || lo < -kMaxHalf) return RowError::kHalfOverflow;
    const std::uint16_t bias_h = FloatToHalfRoundDown(lo);
    e.bias = HalfToFloat(bias_h);
    out->stored_bias = bias_h;
    const float range = hi - e.bias;
    if (range <= 0.0f) {
      SetDegenerate(&e);
      out->stored_scale = 0;
      return RowError::kOk;
    }
    const std::uint16_t scale_h = FloatToHalfRoundUp(range / ctx.qmax);
    if (!HalfIsFinite(scale_h)) return RowError::kHalfOverflow;
    e.scale = HalfToFloat(scale_h);
    e.inv_scale = 1.0f / e.scale;
    out->stored_scale = scale_h;
    return RowError::kOk;
  }
  const float range = hi - lo;
  if (!std::isfinite(range)) return RowError::kRangeOverflow;
  e.bias = lo;
  out->stored_bias = std::bit_cast<std::uint32_t>(lo);
  e.scale = range / ctx.qmax;
  e.inv_scale = e.scale == 0.0f ? 0.0f : 1.0f / e.scale;
  if (range <= 0.0f || e.scale == 0.0f || !std::isfinite(e.inv_scale)) SetDegenerate(&e);
  out->stored_scale = std::bit_cast<std::uint32_t>(e.scale);
  return RowError::kOk;
}

namespace {

void StoreParams(const RowContext& ctx, const UniformParams& p, std::uint8_t* dst) {
  if (ctx.options.scale_type == ScaleType::kFp16) {
    const std::uint16_t s = static_cast<std::uint16_t>(p.stored_scale);
    const std::uint16_t b = static_cast<std::uint16_t>(p.stored_bias);
    std::memcpy(dst, &s, 2);
    if (ctx.options.method != Method::kSymmetric) std::memcpy(dst + 2, &b, 2);
  } else {
    std::memcpy(dst, &p.stored_scale, 4);
    if (ctx.options.method != Method::kSymmetric) std::memcpy(dst + 4, &p.stored_bias, 4);
  }
}

// Paper 5.2 / PyTorch choose_qparams_optimized: shrink [lo, hi] one step at a
// time from the side whose removal lowers the l2 error more; keep the best
// iteration. Iteration 0 is the plain asymmetric range, so the result is never
// worse than asymmetric on the same row. Then a local refinement: the same
// greedy walk with a quarter of the step, from the best range widened by one
// step on each side (clipped to [min, max]), for RefineIterations() steps,
// still keeping the best range seen. The step grid of num_bins is coarse near
// the optimum; this recovers what a finer grid would find (PyTorch's 200
// bins) for about a quarter of a 45-bin search's cost. The AVX-512 fast path (kernels_x86.cc)
// follows this definition operation for operation.
RowError AdaptiveSearch(const RowContext& ctx, const float* x, float lo0, float hi0,
                        UniformParams* best) {
  RowError err = MakeUniformParams(ctx, lo0, hi0, best);
  if (err != RowError::kOk) return err;
  const float range = hi0 - lo0;
  if (!(range > 0.0f)) return RowError::kOk;
  const Kernels& k = *ctx.kernels;
  float best_loss, unused;
  k.loss2(x, ctx.dim, best->enc, best->enc, ctx.qmax, &best_loss, &unused);
  const AdaptiveSchedule sched = ScheduleFor(ctx.options.adaptive);
  const float step = range / static_cast<float>(sched.num_bins);
  float best_lo = lo0, best_hi = hi0;
  UniformParams raise_lo, lower_hi;
  // One greedy walk from [lo, hi]: each iteration removes one `step`; the
  // bound guards against rounding drift.
  auto walk = [&](float cur_lo, float cur_hi, float walk_step, float threshold, std::uint32_t iter,
                  std::uint32_t end) -> RowError {
    for (; iter < end && cur_lo + threshold < cur_hi; ++iter) {
      RowError e;
      if ((e = MakeUniformParams(ctx, cur_lo + walk_step, cur_hi, &raise_lo)) != RowError::kOk)
        return e;
      if ((e = MakeUniformParams(ctx, cur_lo, cur_hi - walk_step, &lower_hi)) != RowError::kOk)
        return e;
      float loss_raise, loss_lower;
      k.loss2(x, ctx.dim, raise_lo.enc, lower_hi.enc, ctx.qmax, &loss_raise, &loss_lower);
      float cur_loss;
      const UniformParams* cur;
      if (loss_raise < loss_lower) {
        cur_lo += walk_step;
        cur_loss = loss_raise;
        cur = &raise_lo;
      } else {
        cur_hi -= walk_step;
        cur_loss = loss_lower;
        cur = &lower_hi;
      }
      if (cur_loss < best_loss) {
        best_loss = cur_loss;
        *best = *cur;
        best_lo = cur_lo;
        best_hi = cur_hi;
      }
    }
    return RowError::kOk;
  };
  const float threshold = static_cast<float>(sched.min_bins) * step;
  if ((err = walk(lo0, hi0, step, threshold, sched.min_bins, sched.num_bins)) != RowError::kOk) {
    return err;
  }
  float refine_lo = best_lo - step;
  refine_lo = refine_lo < lo0 ? lo0 : refine_lo;
  float refine_hi = best_hi + step;
  refine_hi = refine_hi > hi0 ? hi0 : refine_hi;
  return walk(refine_lo, refine_hi, step * 0.25f, 0.0f, 0, sched.refine_iterations);
}

}  // namespace

RowError QuantizeRow(const RowContext& ctx, const float* x, std::uint8_t* out_row,
                     std::uint8_t* scratch) {
  float lo, hi;
  if (!ctx.kernels->min_max(x, ctx.dim, &lo, &hi)) return RowError::kNonFinite;
  UniformParams params;
  RowError err = ctx.options.method == Method::kAdaptive ? AdaptiveSearch(ctx, x, lo, hi, &params)
                                                         : MakeUniformParams(ctx, lo, hi, &params);
  if (err != RowError::kOk) return err;
  const int bits = ctx.options.bits;
  if (bits == 8) {
    ctx.kernels->encode(x, ctx.dim, params.enc, ctx.qmax, out_row);
  } else {
    ctx.kernels->encode(x, ctx.dim, params.enc, ctx.qmax, scratch);
    PackCodes(scratch, ctx.dim, bits, out_row);
  }
  StoreParams(ctx, params, out_row + ctx.code_bytes);
  return RowError::kOk;
}

bool QuantizeAdaptiveGroup(const RowContext& ctx, const float* const* x, int count,
                           std::uint8_t* const* out_rows, std::uint8_t* scratch) {
  if (!ctx.fast_adaptive) return false;
  float lo[kSearchRows] = {}, hi[kSearchRows] = {};
  for (int r = 0; r < count; ++r) {
    if (!ctx.kernels->min_max(x[r], ctx.dim, &lo[r], &hi[r])) return false;
  }
  SearchResult result[kSearchRows];
  if (!ctx.kernels->adaptive_fp16(x, count, ctx.dim, ctx.plan, lo, hi, result)) return false;
  const int bits = ctx.options.bits;
  for (int r = 0; r < count; ++r) {
    std::uint8_t* dst = out_rows[r];
    if (bits == 8) {
      ctx.kernels->encode(x[r], ctx.dim, result[r].enc, ctx.qmax, dst);
    } else {
      ctx.kernels->encode(x[r], ctx.dim, result[r].enc, ctx.qmax, scratch);
      PackCodes(scratch, ctx.dim, bits, dst);
    }
    std::memcpy(dst + ctx.code_bytes, &result[r].scale_h, 2);
    std::memcpy(dst + ctx.code_bytes + 2, &result[r].bias_h, 2);
  }
  return true;
}

bool DequantizeRowInto(const QuantSpec& spec, const std::uint8_t* row, float* out,
                       std::uint8_t* scratch) {
  UnpackCodes(row, spec.dim, spec.bits, scratch);
  const std::uint8_t* params = row + spec.code_bytes();
  const bool fp16 = spec.scale_type == ScaleType::kFp16;
  auto load = [&](std::uint64_t index) {
    if (fp16) {
      std::uint16_t h;
      std::memcpy(&h, params + 2 * index, 2);
      return HalfToFloat(h);
    }
    float f;
    std::memcpy(&f, params + 4 * index, 4);
    return f;
  };
  if (spec.method == Method::kKMeans) {
    float codebook[256];
    const std::uint32_t k = 1u << spec.bits;
    for (std::uint32_t i = 0; i < k; ++i) {
      codebook[i] = load(i);
      if (!std::isfinite(codebook[i])) return false;
    }
    for (std::uint32_t i = 0; i < spec.dim; ++i) out[i] = codebook[scratch[i]];
    return true;
  }
  const float scale = load(0);
  const float qmax = static_cast<float>((1 << spec.bits) - 1);
  const float bias = spec.method == Method::kSymmetric ? -(scale * 0.5f) * qmax : load(1);
  if (!std::isfinite(scale) || !std::isfinite(bias)) return false;
  for (std::uint32_t i = 0; i < spec.dim; ++i) {
    out[i] = static_cast<float>(scratch[i]) * scale + bias;
  }
  return true;
}

}  // namespace detail

namespace {

// Runs body(begin, end) over [0, rows) on at most max_threads threads.
template <typename Body>
void ForRowRanges(std::uint64_t rows, int max_threads, std::uint64_t grain, const Body& body) {
  if (rows == 0) return;
  if (max_threads == 1 || rows <= grain) {
    body(std::uint64_t{0}, rows);
    return;
  }
  auto run = [&] {
    tbb::parallel_for(
        tbb::blocked_range<std::uint64_t>(0, rows, grain),
        [&](const tbb::blocked_range<std::uint64_t>& r) { body(r.begin(), r.end()); });
  };
  if (max_threads > 1) {
    tbb::task_arena arena(max_threads);
    arena.execute(run);
  } else {
    run();
  }
}

// Keeps the smallest failing row index, so the report does not depend on
// thread scheduling.
void RecordFailure(std::atomic<std::uint64_t>& first, std::uint64_t row) {
  std::uint64_t seen = first.load(std::memory_order_relaxed);
  while (row < seen && !first.compare_exchange_weak(seen, row, std::memory_order_relaxed)) {
  }
}

std::string TableName(const TableView& t) {
  return t.name.empty() ? std::string("<unnamed>") : std::string(t.name);
}

Status DescribeRowError(const TableView& table, const QuantOptions& o, std::uint64_t row,
                        detail::RowError err) {
  const float* x = table.row(row);
  const std::string where = "table '" + TableName(table) + "' row " + std::to_string(row);
  if (err == detail::RowError::kNonFinite) {
    for (std::uint32_t c = 0; c < table.dim; ++c) {
      if (!std::isfinite(x[c])) {
        return Invalid(where + " column " + std::to_string(c) + " holds " +
                       (std::isnan(x[c]) ? "NaN" : (x[c] > 0 ? "+Inf" : "-Inf")) +
                       "; cannot quantize non-finite values");
      }
    }
  }
  const auto [lo, hi] = std::minmax_element(x, x + table.dim);
  const std::string range = " (min " + std::to_string(*lo) + ", max " + std::to_string(*hi) + ")";
  if (err == detail::RowError::kHalfOverflow) {
    return Invalid(where + range + " exceeds the fp16 range of " + ScaleTypeName(o.scale_type) +
                   " scale/bias (|x| <= 65504); use ScaleType::kFp32");
  }
  return Invalid(where + range + ": max - min overflows fp32");
}

Status ValidateTable(const TableView& table) {
  if (table.rows > 0 && table.data == nullptr) {
    return Invalid("table '" + TableName(table) + "' has rows but no data");
  }
  if (table.row_stride != 0 && table.row_stride < table.dim) {
    return Invalid("table '" + TableName(table) + "' row_stride " +
                   std::to_string(table.row_stride) + " < dim " + std::to_string(table.dim));
  }
  return Status::Ok();
}

std::uint64_t GrainFor(const QuantOptions& o, std::uint32_t dim) {
  std::uint64_t work_per_row = dim;
  if (o.method == Method::kAdaptive) work_per_row *= 2ull * o.adaptive.num_bins;
  if (o.method == Method::kKMeans) work_per_row *= 8ull * o.kmeans_iterations;
  return std::max<std::uint64_t>(1, (1u << 16) / std::max<std::uint64_t>(1, work_per_row));
}

}  // namespace

Status QuantizeInto(const TableView& table, const QuantOptions& options,
                    std::span<std::uint8_t> out) {
  PMSNAP_RETURN_IF_ERROR(ValidateOptions(options, table.dim));
  PMSNAP_RETURN_IF_ERROR(ValidateTable(table));
  const detail::RowContext ctx = detail::MakeRowContext(options, table.dim);
  const std::uint64_t row_bytes = ctx.code_bytes + ctx.param_bytes;
  if (out.size() != row_bytes * table.rows) {
    return Invalid("output holds " + std::to_string(out.size()) + " bytes, table '" +
                   TableName(table) + "' needs " + std::to_string(row_bytes * table.rows));
  }
  std::atomic<std::uint64_t> first_bad{std::numeric_limits<std::uint64_t>::max()};
  std::atomic<std::uint8_t> first_kind{0};
  ForRowRanges(table.rows, options.max_threads, GrainFor(options, table.dim),
               [&](std::uint64_t begin, std::uint64_t end) {
                 std::vector<std::uint8_t> scratch(table.dim + 8);
                 std::vector<float> sorted;
                 std::vector<double> prefix;
                 if (ctx.fused_asym8) {
                   const std::uint64_t done =
                       ctx.kernels->asym8_fp32_rows(table.row(begin), table.stride(), end - begin,
                                                    table.dim, out.data() + begin * row_bytes);
                   begin += done;  // a row it stopped at goes through QuantizeRow
                 }
                 for (std::uint64_t r = begin; r < end; ++r) {
                   // Rows past a known failure cannot change the report.
                   if (r > first_bad.load(std::memory_order_relaxed)) break;
                   if (ctx.fast_adaptive && r % detail::kSearchRows == 0) {
                     const int count =
                         static_cast<int>(std::min<std::uint64_t>(detail::kSearchRows, end - r));
                     const float* x[detail::kSearchRows];
                     std::uint8_t* dsts[detail::kSearchRows];
                     for (int i = 0; i < count; ++i) {
                       x[i] = table.row(r + i);
                       dsts[i] = out.data() + (r + i) * row_bytes;
                     }
                     if (detail::QuantizeAdaptiveGroup(ctx, x, count, dsts, scratch.data())) {
                       r += static_cast<std::uint64_t>(count) - 1;
                       continue;
                     }
                   }
                   std::uint8_t* dst = out.data() + r * row_bytes;
                   const detail::RowError err =
                       options.method == Method::kKMeans
                           ? detail::KMeansRow(ctx, table.row(r), dst, sorted, prefix)
                           : detail::QuantizeRow(ctx, table.row(r), dst, scratch.data());
                   if (err != detail::RowError::kOk) {
                     RecordFailure(first_bad, r);
                     first_kind.store(static_cast<std::uint8_t>(err), std::memory_order_relaxed);
                     break;
                   }
                 }
               });
  const std::uint64_t bad = first_bad.load();
  if (bad != std::numeric_limits<std::uint64_t>::max()) {
    // Recompute the kind for the reported row: first_kind may come from another.
    std::vector<std::uint8_t> row(row_bytes), scratch(table.dim + 8);
    std::vector<float> sorted;
    std::vector<double> prefix;
    const detail::RowError err =
        options.method == Method::kKMeans
            ? detail::KMeansRow(ctx, table.row(bad), row.data(), sorted, prefix)
            : detail::QuantizeRow(ctx, table.row(bad), row.data(), scratch.data());
    return DescribeRowError(table, options, bad, err);
  }
  return Status::Ok();
}

Result<QuantizedTable> Quantize(const TableView& table, const QuantOptions& options) {
  PMSNAP_RETURN_IF_ERROR(ValidateOptions(options, table.dim));
  QuantizedTable result;
  result.spec = SpecFor(options, table.dim, table.rows);
  result.payload.resize(result.spec.payload_bytes());
  PMSNAP_RETURN_IF_ERROR(QuantizeInto(table, options, result.payload));
  return result;
}

namespace {

Status CheckView(const QuantizedView& q) {
  QuantOptions o;
  o.method = q.spec.method;
  o.bits = q.spec.bits;
  o.scale_type = q.spec.scale_type;
  if (!KnownMethod(o.method) || (o.bits != 2 && o.bits != 3 && o.bits != 4 && o.bits != 8) ||
      (o.scale_type != ScaleType::kFp16 && o.scale_type != ScaleType::kFp32) || q.spec.dim == 0) {
    return Invalid("quantized view has an invalid spec");
  }
  if (q.payload.size() != q.spec.payload_bytes()) {
    return Invalid("quantized payload holds " + std::to_string(q.payload.size()) +
                   " bytes, spec needs " + std::to_string(q.spec.payload_bytes()));
  }
  return Status::Ok();
}

Status CorruptRow(std::uint64_t row) {
  return Status(StatusCode::kCorruption, "quantized row " + std::to_string(row) +
                                             " has a non-finite scale, bias or centroid");
}

}  // namespace

Status DequantizeRow(const QuantizedView& quantized, std::uint64_t row, float* out) {
  PMSNAP_RETURN_IF_ERROR(CheckView(quantized));
  if (row >= quantized.spec.rows) {
    return Invalid("row " + std::to_string(row) + " out of range (" +
                   std::to_string(quantized.spec.rows) + " rows)");
  }
  std::vector<std::uint8_t> scratch(quantized.spec.dim + 8);
  if (!detail::DequantizeRowInto(quantized.spec, quantized.row(row), out, scratch.data())) {
    return CorruptRow(row);
  }
  return Status::Ok();
}

Status Dequantize(const QuantizedView& quantized, float* out, std::uint64_t out_row_stride) {
  PMSNAP_RETURN_IF_ERROR(CheckView(quantized));
  const QuantSpec& spec = quantized.spec;
  const std::uint64_t stride = out_row_stride == 0 ? spec.dim : out_row_stride;
  if (stride < spec.dim) return Invalid("out_row_stride < dim");
  std::atomic<std::uint64_t> first_bad{std::numeric_limits<std::uint64_t>::max()};
  ForRowRanges(spec.rows, 0, std::max<std::uint64_t>(1, 65536 / spec.dim),
               [&](std::uint64_t begin, std::uint64_t end) {
                 std::vector<std::uint8_t> scratch(spec.dim + 8);
                 for (std::uint64_t r = begin; r < end; ++r) {
                   if (!detail::DequantizeRowInto(spec, quantized.row(r), out + r * stride,
                                                  scratch.data())) {
                     RecordFailure(first_bad, r);
                   }
                 }
               });
  if (first_bad.load() != std::numeric_limits<std::uint64_t>::max()) {
    return CorruptRow(first_bad.load());
  }
  return Status::Ok();
}

Result<double> MeanL2Error(const TableView& original, const QuantizedView& quantized,
                           int max_threads) {
  PMSNAP_RETURN_IF_ERROR(CheckView(quantized));
  PMSNAP_RETURN_IF_ERROR(ValidateTable(original));
  if (original.rows != quantized.spec.rows || original.dim != quantized.spec.dim) {
    return Invalid("table '" + TableName(original) + "' is " + std::to_string(original.rows) + "x" +
                   std::to_string(original.dim) + " but the quantized table is " +
                   std::to_string(quantized.spec.rows) + "x" + std::to_string(quantized.spec.dim));
  }
  if (original.rows == 0) return 0.0;
  const QuantSpec& spec = quantized.spec;
  std::atomic<std::uint64_t> first_bad{std::numeric_limits<std::uint64_t>::max()};
  // Fixed grain + deterministic reduce: the same float sum for any thread count.
  const std::uint64_t grain = std::max<std::uint64_t>(1, 16384 / spec.dim);
  auto sum_range = [&](const tbb::blocked_range<std::uint64_t>& r, double acc) {
    std::vector<std::uint8_t> scratch(spec.dim + 8);
    std::vector<float> decoded(spec.dim);
    for (std::uint64_t i = r.begin(); i < r.end(); ++i) {
      if (!detail::DequantizeRowInto(spec, quantized.row(i), decoded.data(), scratch.data())) {
        RecordFailure(first_bad, i);
        continue;
      }
      const float* x = original.row(i);
      double sq = 0;
      for (std::uint32_t c = 0; c < spec.dim; ++c) {
        const double d = static_cast<double>(x[c]) - static_cast<double>(decoded[c]);
        sq += d * d;
      }
      acc += std::sqrt(sq);
    }
    return acc;
  };
  double total = 0;
  auto run = [&] {
    total = tbb::parallel_deterministic_reduce(
        tbb::blocked_range<std::uint64_t>(0, original.rows, grain), 0.0, sum_range,
        [](double a, double b) { return a + b; });
  };
  if (max_threads > 0) {
    tbb::task_arena arena(max_threads);
    arena.execute(run);
  } else {
    run();
  }
  if (first_bad.load() != std::numeric_limits<std::uint64_t>::max()) {
    return CorruptRow(first_bad.load());
  }
  return total / static_cast<double>(original.rows);
}

}  // namespace pmsnap::quant
