// terrace ref kda|mla|attnres|moe|mxfp4: runs one mechanism of the reference model on tensors read
// from a safetensors file and writes the results to another, so engine developers can check their
// kernels against Terrace. Tensor names, shapes and dtypes: docs/ref-cli.md.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/model/attnres.h"
#include "src/model/config.h"
#include "src/model/kda.h"
#include "src/model/mla.h"
#include "src/model/moe.h"
#include "src/model/mxfp4.h"
#include "src/model/mxfp4_matmul.h"
#include "src/model/ops.h"
#include "src/model/safetensors.h"

namespace terrace::cli {
namespace {

using namespace terrace::model;
using Shape = std::vector<std::int64_t>;

// A WeightSource over one safetensors file (tensor names as stored) that remembers the names read
// through Get, so a mechanism can refuse the tensors it did not use.
class FileSource : public WeightSource {
 public:
  explicit FileSource(std::unique_ptr<SafetensorsFile> f) : f_(std::move(f)) {}
  Result<TensorView> Get(std::string_view name) const override {
    read_.emplace(name);
    return f_->Get(name);
  }
  bool Has(std::string_view name) const override { return f_->Has(name); }
  std::vector<std::string> Names() const override { return f_->Names(); }
  const std::string path() const { return f_->path().string(); }

  // InvalidArgument naming the first tensor of the file not read so far; `reads` lists what `op` reads.
  Status CheckAllRead(std::string_view op, std::string_view reads) const {
    for (const std::string& name : Names()) {
      if (!read_.contains(name))
        return Status::InvalidArgument(fmt::format(
            "tensor '{}' is not an input of ref {} here; it reads {} (see docs/ref-cli.md)", name, op, reads));
    }
    return Status::Ok();
  }

 private:
  std::unique_ptr<SafetensorsFile> f_;
  mutable std::set<std::string, std::less<>> read_;
};

struct RefArgs {
  std::string in, out, config;
  std::optional<double> scale;
  bool chunked = false, absorbed = false, force = false;
  int chunk = 64;
  std::optional<int> heads, top_k;
  std::optional<double> scaling, situ_beta, situ_linear_beta, eps;
};

Status Missing(const FileSource& src, const std::string& name, std::string_view dtype, std::string_view shape) {
  return Status::NotFound(fmt::format("{}: required tensor '{}' is missing (expected {} {}); see docs/ref-cli.md",
                                      src.path(), name, dtype, shape));
}

// InvalidArgument naming `name` and its first value for which `ok` is false, at row (the flattened
// leading dimensions) and column (the last dimension) as ref codec counts them; `rule` says why.
template <class Ok>
Status CheckValues(const Tensor& t, const std::string& name, Ok ok, std::string_view rule) {
  const std::int64_t cols = t.shape.empty() ? 1 : std::max<std::int64_t>(t.shape.back(), 1);
  for (std::size_t i = 0; i < t.data.size(); ++i) {
    if (!ok(t.data[i]))
      return Status::InvalidArgument(fmt::format("tensor '{}': the input value at row {}, column {} is {:.9g}; {}",
                                                 name, static_cast<std::int64_t>(i) / cols,
                                                 static_cast<std::int64_t>(i) % cols, t.data[i], rule));
  }
  return Status::Ok();
}

// Each row's fp32 sum of squares (ops::SumSquares, what the model's RMS norms compute) must be finite:
// the fp32 reference (transformers' too) would divide by an infinite norm there.
Status CheckRowSquares(const Tensor& t, const std::string& name) {
  const std::int64_t cols = t.shape.empty() ? 1 : t.shape.back();
  for (std::int64_t r = 0; cols > 0 && r < t.numel() / cols; ++r) {
    const float* row = t.ptr() + r * cols;
    if (std::isfinite(ops::SumSquares(row, cols))) continue;
    float amax = 0.0f;
    for (std::int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(row[c]));
    return Status::InvalidArgument(
        fmt::format("tensor '{}': the sum of squares of row {} overflows fp32 (largest |x| {:.9g}), so its fp32 RMS "
                    "norm would be infinite; scale the input down",
                    name, r, amax));
  }
  return Status::Ok();
}

// An expected shape for messages, its wildcards (-1) as '*': "[*, 64]".
std::string WantString(const Shape& want) {
  std::vector<std::string> dims;
  for (const std::int64_t d : want) dims.push_back(d < 0 ? "*" : std::to_string(d));
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

// `name` as fp32, every value finite; `f32_only` rejects BF16/F16. want: expected shape with -1 as a
// wildcard (any size; '*' in messages).
Result<Tensor> Input(const FileSource& src, const std::string& name, const Shape& want, bool f32_only = true) {
  auto view = src.Get(name);
  if (!view.ok()) return Missing(src, name, f32_only ? "F32" : "F32, BF16 or F16", WantString(want));
  bool match = view->shape.size() == want.size();
  for (std::size_t i = 0; match && i < want.size(); ++i) match = want[i] < 0 || want[i] == view->shape[i];
  if (!match)
    return Status::InvalidArgument(
        fmt::format("tensor '{}': expected shape {}{}, got {}", name, WantString(want),
                    std::ranges::any_of(want, [](std::int64_t d) { return d < 0; }) ? " (* = any size)" : "",
                    ShapeString(view->shape)));
  if (f32_only ? view->dtype != DType::kF32
               : (view->dtype != DType::kF32 && view->dtype != DType::kBF16 && view->dtype != DType::kF16))
    return Status::InvalidArgument(fmt::format("tensor '{}': expected dtype {}, got {}", name,
                                               f32_only ? "F32" : "F32, BF16 or F16", DTypeName(view->dtype)));
  TERRACE_ASSIGN_OR_RETURN(Tensor t, ToFloat(*view, name));
  TERRACE_RETURN_IF_ERROR(
      CheckValues(t, name, [](float x) { return std::isfinite(x); }, "ref takes finite values only"));
  return t;
}

Result<FileSource> OpenInput(const std::string& path) {
  TERRACE_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(path));
  return FileSource(std::move(f));
}

// --out replaces a file Terrace wrote (its safetensors carry the mark), any file with --force, never --in
// or --config.
OutputRules RefOutRules(const RefArgs& a) {
  OutputRules r{.format = OutputFormat::kSafetensors, .force = a.force, .inputs = {{"--in", a.in}}};
  if (!a.config.empty()) r.inputs.push_back({"--config", a.config});
  return r;
}

// InvalidArgument naming `name` and the first non-finite value's index in `t`: every input was
// checked finite, so the computation overflowed fp32 (docs/ref-cli.md: such input is refused, never
// written as NaN or inf).
Status CheckFiniteOutput(std::string_view name, const Tensor& t) {
  const auto bad = std::find_if(t.data.begin(), t.data.end(), [](float x) { return !std::isfinite(x); });
  if (bad == t.data.end()) return Status::Ok();
  auto flat = static_cast<std::int64_t>(bad - t.data.begin());
  std::vector<std::int64_t> index(t.shape.size());
  for (std::size_t i = t.shape.size(); i-- > 0;) {
    index[i] = t.shape[i] > 0 ? flat % t.shape[i] : 0;
    flat = t.shape[i] > 0 ? flat / t.shape[i] : flat;
  }
  return Status::InvalidArgument(fmt::format(
      "the output '{}' would hold {} at [{}]: the inputs are finite, but the computation left fp32's range on "
      "them (an overflow, or 0/0 after an underflow); nothing was written to --out; bring the inputs to a "
      "smaller magnitude (see docs/ref-cli.md, \"Bad input\")",
      name, std::isnan(*bad) ? "NaN" : (*bad > 0 ? "inf" : "-inf"), fmt::join(index, ", ")));
}

// Adds `tensors` (F32) to `w`, writes it to --out and says so on one line: "wrote OUT (o F32 [1, 4,
// 2, 8], ...)". `also`: what `w` already holds, described the same way ("topk_ids I32 [3, 2]").
// Every tensor must be finite (CheckFiniteOutput), except those named in `may_be_infinite`.
Status WriteOutputs(const RefArgs& a, const std::vector<std::pair<std::string, const Tensor*>>& tensors,
                    SafetensorsWriter* w, const std::vector<std::string>& also = {},
                    const std::vector<std::string>& may_be_infinite = {}) {
  for (const auto& [name, t] : tensors) {
    if (std::find(may_be_infinite.begin(), may_be_infinite.end(), name) == may_be_infinite.end())
      TERRACE_RETURN_IF_ERROR(CheckFiniteOutput(name, *t));
  }
  std::vector<std::string> wrote;
  for (const auto& [name, t] : tensors) {
    TERRACE_RETURN_IF_ERROR(w->AddF32(name, *t));
    wrote.push_back(fmt::format("{} F32 {}", name, ShapeString(t->shape)));
  }
  wrote.insert(wrote.end(), also.begin(), also.end());
  TERRACE_RETURN_IF_ERROR(WriteOutputFileNamingTarget(a.out, "--out", RefOutRules(a), "the output",
                                                      [&](const std::filesystem::path& tmp) { return w->Write(tmp); }));
  fmt::print("wrote {} ({})\n", a.out, fmt::join(wrote, ", "));
  return Status::Ok();
}

// The largest KDA state `ref kda` allocates: 2^28 fp32 values (1 GiB).
constexpr std::int64_t kMaxKdaStateValues = std::int64_t{1} << 28;

Status RefKda(const RefArgs& a) {
  TERRACE_ASSIGN_OR_RETURN(FileSource src, OpenInput(a.in));
  TERRACE_ASSIGN_OR_RETURN(Tensor q, Input(src, "q", {-1, -1, -1, -1}));
  const std::int64_t B = q.dim(0), T = q.dim(1), H = q.dim(2), K = q.dim(3);
  TERRACE_ASSIGN_OR_RETURN(Tensor k, Input(src, "k", {B, T, H, K}));
  TERRACE_ASSIGN_OR_RETURN(Tensor g, Input(src, "g", {B, T, H, K}));
  TERRACE_RETURN_IF_ERROR(CheckValues(g, "g", [](float x) { return x <= 0.0f; }, "g is a log-decay and must be <= 0"));
  TERRACE_ASSIGN_OR_RETURN(Tensor v, Input(src, "v", {B, T, H, -1}));
  const std::int64_t V = v.dim(3);
  TERRACE_ASSIGN_OR_RETURN(Tensor beta, Input(src, "beta", {B, T, H}));
  // The state is [B, H, K, V] whatever T is: a file of no tokens (T = 0) holds no values, yet its K
  // and V alone can ask for more memory than exists (or a count that wraps past 2^64).
  const std::int64_t state_values = NumElements(Shape{B, H, K, V});
  if (state_values < 0 || state_values > kMaxKdaStateValues)
    return Status::InvalidArgument(fmt::format(
        "--in {}: the KDA state [B, H, K, V] = {} (B, H, K from q {}, V from v {}) holds {} values; ref kda holds "
        "at most {} (1 GiB of fp32) in memory; use a smaller K (q's last dimension) or V (v's last dimension)",
        a.in, ShapeString(Shape{B, H, K, V}), ShapeString(q.shape), ShapeString(v.shape),
        state_values < 0 ? std::string("more than 2^63") : std::to_string(state_values), kMaxKdaStateValues));
  Tensor state({B, H, K, V});
  if (src.Has("initial_state")) {
    TERRACE_ASSIGN_OR_RETURN(state, Input(src, "initial_state", {B, H, K, V}));
  }
  TERRACE_RETURN_IF_ERROR(src.CheckAllRead("kda", "q, k, g, v, beta and optionally initial_state"));
  // --chunk-size is range-checked by its option. A chunk longer than the sequence is one chunk of
  // T tokens: the same result, without chunk^2 scratch for a huge --chunk-size.
  const std::int64_t chunk = std::max<std::int64_t>(1, std::min<std::int64_t>(a.chunk, T));
  const float scale = static_cast<float>(a.scale.value_or(1.0 / std::sqrt(static_cast<double>(K))));
  for (float& x : q.data) x *= scale;
  Tensor o({B, T, H, V});
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int64_t qk = b * T * H * K, vv = b * T * H * V;
    KdaCoreArgs args{q.ptr() + qk, k.ptr() + qk, v.ptr() + vv, g.ptr() + qk, beta.ptr() + b * T * H, T, H, K, V};
    float* s = state.ptr() + b * H * K * V;
    if (a.chunked) {
      KdaChunked(args, s, o.ptr() + vv, chunk);
    } else {
      KdaRecurrent(args, s, o.ptr() + vv);
    }
  }
  SafetensorsWriter w;
  w.SetMetadata("terrace_ref", a.chunked ? "kda chunked" : "kda recurrent");
  return WriteOutputs(a, {{"o", &o}, {"final_state", &state}}, &w);
}

Status RefMxfp4(const RefArgs& a) {
  TERRACE_ASSIGN_OR_RETURN(FileSource src, OpenInput(a.in));
  if (!src.Has("weight_packed")) return Missing(src, "weight_packed", "U8", "[R, C/2]");
  TERRACE_ASSIGN_OR_RETURN(TensorView packed, src.Get("weight_packed"));
  if (packed.dtype != DType::kU8 || packed.shape.size() != 2)
    return Status::InvalidArgument(fmt::format("tensor 'weight_packed': expected U8 [R, C/2], got {} {}",
                                               DTypeName(packed.dtype), ShapeString(packed.shape)));
  const std::int64_t R = packed.shape[0], C = packed.shape[1] * 2;
  const Shape want_scale{R, C / kMxfp4BlockSize};
  if (C % kMxfp4BlockSize != 0)
    return Status::InvalidArgument(fmt::format("tensor 'weight_packed': C = {} columns is not a multiple of {}", C,
                                               kMxfp4BlockSize));
  if (!src.Has("weight_scale")) return Missing(src, "weight_scale", "U8", ShapeString(want_scale));
  TERRACE_ASSIGN_OR_RETURN(TensorView scale, src.Get("weight_scale"));
  if (scale.dtype != DType::kU8 || scale.shape != want_scale)
    return Status::InvalidArgument(fmt::format("tensor 'weight_scale': expected U8 {}, got {} {}",
                                               ShapeString(want_scale), DTypeName(scale.dtype),
                                               ShapeString(scale.shape)));
  const auto u8 = [](std::span<const std::byte> b) {
    return std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(b.data()), b.size());
  };
  Tensor out({R, C});
  TERRACE_RETURN_IF_ERROR(DequantizeMxfp4(u8(packed.data), u8(scale.data), R, C, out.data));
  SafetensorsWriter w;
  // The dequantised weight is what the codes say: scale 254 gives inf (docs/ref-cli.md), kept as is.
  const std::vector<std::string> weight_may_be_infinite = {"weight"};
  if (!src.Has("input")) {
    TERRACE_RETURN_IF_ERROR(src.CheckAllRead("mxfp4", "weight_packed, weight_scale and optionally input"));
    return WriteOutputs(a, {{"weight", &out}}, &w, {}, weight_may_be_infinite);
  }
  // With an input x [T, C]: also output = x W^T by the fused MXFP4 kernel (what the MoE runs).
  TERRACE_ASSIGN_OR_RETURN(Tensor x, Input(src, "input", {-1, C}));
  TERRACE_RETURN_IF_ERROR(src.CheckAllRead("mxfp4", "weight_packed, weight_scale and optionally input"));
  const Mxfp4Matrix q{u8(packed.data).data(), u8(scale.data).data(), R, C};
  TERRACE_RETURN_IF_ERROR(ValidateMxfp4(q, "weight_packed"));
  Tensor y({x.dim(0), R});
  Mxfp4Linear(q, x.ptr(), x.dim(0), y.ptr());
  return WriteOutputs(a, {{"weight", &out}, {"output", &y}}, &w, {}, weight_may_be_infinite);
}

Status RefAttnRes(const RefArgs& a) {
  TERRACE_ASSIGN_OR_RETURN(FileSource src, OpenInput(a.in));
  TERRACE_ASSIGN_OR_RETURN(Tensor sources, Input(src, "sources", {-1, -1, -1}));
  const std::int64_t S = sources.dim(0), T = sources.dim(1), d = sources.dim(2);
  if (S < 1) return Status::InvalidArgument("tensor 'sources': needs at least one source (shape [S >= 1, T, d])");
  TERRACE_RETURN_IF_ERROR(CheckRowSquares(sources, "sources"));
  TERRACE_ASSIGN_OR_RETURN(Tensor proj, Input(src, "proj", {1, d}, false));
  TERRACE_ASSIGN_OR_RETURN(Tensor norm, Input(src, "norm", {d}, false));
  TERRACE_RETURN_IF_ERROR(src.CheckAllRead("attnres", "sources, proj and norm"));
  std::vector<const float*> ptrs;
  for (std::int64_t s = 0; s < S; ++s) ptrs.push_back(sources.ptr() + s * T * d);
  Tensor out({T, d});
  AttnResMix(ptrs, T, d, proj.ptr(), norm.ptr(), out.ptr());
  SafetensorsWriter w;
  return WriteOutputs(a, {{"output", &out}}, &w);
}

Status RefMla(const RefArgs& a) {
  TERRACE_ASSIGN_OR_RETURN(FileSource src, OpenInput(a.in));
  TERRACE_ASSIGN_OR_RETURN(Tensor x, Input(src, "hidden_states", {-1, -1}));
  const std::int64_t T = x.dim(0), d = x.dim(1);
  if (!a.heads) return Status::InvalidArgument("mla needs --heads (num_attention_heads)");
  MlaWeights w;
  MlaDims m;
  m.hidden = d;
  m.heads = *a.heads;
  m.rms_eps = static_cast<float>(a.eps.value_or(1e-5));
  TERRACE_ASSIGN_OR_RETURN(w.kv_a_norm, Input(src, "kv_a_layernorm.weight", {-1}, false));
  m.kv_lora = w.kv_a_norm.dim(0);
  if (m.kv_lora < 1)
    return Status::InvalidArgument("tensor 'kv_a_layernorm.weight': expected [kv_lora] with kv_lora >= 1, got [0]");
  TERRACE_ASSIGN_OR_RETURN(w.kv_a, Input(src, "kv_a_proj_with_mqa.weight", {-1, d}, false));
  m.rope = w.kv_a.dim(0) - m.kv_lora;
  if (m.rope < 0)
    return Status::InvalidArgument(fmt::format(
        "tensor 'kv_a_proj_with_mqa.weight': {} rows, fewer than kv_lora = {} (the length of kv_a_layernorm.weight); "
        "expected [kv_lora + rope, d] = [{} + rope, {}]",
        w.kv_a.dim(0), m.kv_lora, m.kv_lora, d));
  TERRACE_ASSIGN_OR_RETURN(w.kv_b, Input(src, "kv_b_proj.weight", {-1, m.kv_lora}, false));
  if (src.Has("q_a_proj.weight")) {
    if (src.Has("q_proj.weight"))
      return Status::InvalidArgument(
          "tensors 'q_proj.weight' and 'q_a_proj.weight' are two forms of the query projection (full or low-rank); "
          "give one");
    TERRACE_ASSIGN_OR_RETURN(w.q_a, Input(src, "q_a_proj.weight", {-1, d}, false));
    m.q_lora = w.q_a.dim(0);
    TERRACE_ASSIGN_OR_RETURN(w.q_a_norm, Input(src, "q_a_layernorm.weight", {m.q_lora}, false));
    TERRACE_ASSIGN_OR_RETURN(w.q_b, Input(src, "q_b_proj.weight", {-1, m.q_lora}, false));
  } else {
    TERRACE_ASSIGN_OR_RETURN(w.q_proj, Input(src, "q_proj.weight", {-1, d}, false));
  }
  // Per head: the query rows are nope + rope (rope from kv_a_proj_with_mqa), the kv_b_proj rows nope + v.
  const std::string qname = m.q_lora > 0 ? "q_b_proj.weight" : "q_proj.weight";
  const std::int64_t qrows = m.q_lora > 0 ? w.q_b.dim(0) : w.q_proj.dim(0), kvrows = w.kv_b.dim(0);
  for (const auto& [name, rows, want] : {std::tuple{qname, qrows, "H*(nope+rope)"},
                                         std::tuple{std::string("kv_b_proj.weight"), kvrows, "H*(nope+v)"}}) {
    if (rows % m.heads != 0)
      return Status::InvalidArgument(fmt::format(
          "--heads {} does not divide the {} rows of tensor '{}' (expected {} rows)", m.heads, rows, name, want));
  }
  m.nope = qrows / m.heads - m.rope;
  if (m.nope < 0 || m.nope + m.rope < 1)  // as a config may set it: qk_nope_head_dim >= 0, nope + rope >= 1
    return Status::InvalidArgument(fmt::format(
        "tensor '{}': {} rows are {} a head for --heads {}, which leaves nope = {} after rope = {} "
        "(kv_a_proj_with_mqa.weight's rows - kv_lora); expected H*(nope+rope) rows with nope >= 0 and nope + rope "
        ">= 1",
        qname, qrows, qrows / m.heads, m.heads, m.nope, m.rope));
  m.v = kvrows / m.heads - m.nope;
  if (m.v < 1)
    return Status::InvalidArgument(fmt::format(
        "tensor 'kv_b_proj.weight': {} rows are {} a head for --heads {}, which leaves v = {} after nope = {} (from "
        "{}); expected H*(nope+v) rows with v >= 1",
        kvrows, kvrows / m.heads, m.heads, m.v, m.nope, qname));
  // o_proj and g_proj are sized by H*v, which q_b / q_proj and kv_b_proj fix: a mismatch says so.
  const auto per_head_v = [&](const std::string& name, const Tensor& t, const Shape& want) {
    if (t.shape == want) return Status::Ok();
    return Status::InvalidArgument(
        fmt::format("tensor '{}': expected shape {} with H*v = {} (v = {}: kv_b_proj.weight's {} rows a head minus "
                    "nope = {} from {}), got {}",
                    name, ShapeString(want), m.heads * m.v, m.v, kvrows / m.heads, m.nope, qname,
                    ShapeString(t.shape)));
  };
  TERRACE_ASSIGN_OR_RETURN(w.o_proj, Input(src, "o_proj.weight", {d, -1}, false));
  TERRACE_RETURN_IF_ERROR(per_head_v("o_proj.weight", w.o_proj, {d, m.heads * m.v}));
  m.output_gate = src.Has("g_proj.weight");
  if (m.output_gate) {
    TERRACE_ASSIGN_OR_RETURN(w.g_proj, Input(src, "g_proj.weight", {-1, d}, false));
    TERRACE_RETURN_IF_ERROR(per_head_v("g_proj.weight", w.g_proj, {m.heads * m.v, d}));
  }
  TERRACE_RETURN_IF_ERROR(CheckMlaWeights(w, m, ""));
  std::vector<float> cache;
  if (src.Has("past_latents")) {
    TERRACE_ASSIGN_OR_RETURN(Tensor past, Input(src, "past_latents", {-1, m.CacheWidth()}));
    cache = std::move(past.data);
  }
  TERRACE_RETURN_IF_ERROR(src.CheckAllRead(
      "mla", "hidden_states, q_proj.weight or q_a_proj.weight + q_a_layernorm.weight + q_b_proj.weight, "
             "kv_a_proj_with_mqa.weight, kv_a_layernorm.weight, kv_b_proj.weight, o_proj.weight, and optionally "
             "g_proj.weight and past_latents"));
  Tensor out({T, d});
  MlaForward(w, m, x.ptr(), T, &cache, a.absorbed, out.ptr());
  Tensor latents({static_cast<std::int64_t>(cache.size()) / m.CacheWidth(), m.CacheWidth()});
  latents.data = std::move(cache);
  SafetensorsWriter wr;
  return WriteOutputs(a, {{"output", &out}, {"latents", &latents}}, &wr);
}

// Whether expert e is stored as MXFP4: as its first projection present is, else as the file's other
// experts are (any MXFP4 expert tensor).
bool ExpertIsMxfp4(const FileSource& src, int e) {
  const std::string p = fmt::format("experts.{}.", e);
  for (const char* proj : {"w1", "w2", "w3"}) {
    const bool mxfp4 = src.Has(p + proj + ".weight_packed") || src.Has(p + proj + ".weight_scale");
    if (mxfp4 || src.Has(p + proj + ".weight")) return mxfp4;
  }
  for (const std::string& name : src.Names()) {
    if (name.starts_with("experts.") && (name.ends_with(".weight_packed") || name.ends_with(".weight_scale")))
      return true;
  }
  return false;
}

// experts.E.w{1,2,3}: each projection either MXFP4 (weight_packed + weight_scale) or float (weight). A
// missing tensor is named in the form ExpertIsMxfp4 gives.
Status CheckExpertTensors(const FileSource& src, int e, std::int64_t latent, std::int64_t inter) {
  const std::string p = fmt::format("experts.{}.", e);
  const bool mxfp4 = ExpertIsMxfp4(src, e);
  for (const std::string proj : {"w1", "w2", "w3"}) {
    const std::string base = p + proj;
    const std::int64_t rows = proj == "w2" ? latent : inter, cols = proj == "w2" ? inter : latent;
    const bool packed = src.Has(base + ".weight_packed"), scale = src.Has(base + ".weight_scale");
    if (src.Has(base + ".weight")) {
      if (packed || scale)
        return Status::InvalidArgument(fmt::format(
            "tensor '{0}.weight' and the MXFP4 tensors '{0}.weight_packed' / '{0}.weight_scale' are two forms of one "
            "projection; give one",
            base));
      continue;
    }
    if (!packed && !scale && !mxfp4)
      return Missing(src, base + ".weight", "F32, BF16 or F16", ShapeString(Shape{rows, cols}));
    if (!packed) return Missing(src, base + ".weight_packed", "U8", ShapeString(Shape{rows, cols / 2}));
    if (!scale) return Missing(src, base + ".weight_scale", "U8", ShapeString(Shape{rows, cols / kMxfp4BlockSize}));
  }
  return Status::Ok();
}

// --config's MoE structure against the file's tensors (InvalidArgument naming the key, both sizes
// and the fix): a config of another layer must not be taken for this one's.
Status CheckMoeConfigMatchesFile(const ModelConfig& c, const MoeDims& m, const MoeWeights& w, const std::string& path) {
  const bool file_shared = w.shared_gate.shape.size() == 2;
  const std::int64_t file_shared_inter = file_shared ? w.shared_gate.dim(0) : 0;
  const std::int64_t config_shared_inter =
      c.num_shared_experts > 0 ? (c.shared_expert_intermediate_size > 0
                                      ? c.shared_expert_intermediate_size
                                      : std::int64_t{c.num_shared_experts} * c.moe_intermediate_size)
                               : 0;
  const std::int64_t config_latent = c.HasLatentProjection() ? c.routed_expert_hidden_size : c.hidden_size;
  const struct {
    const char* key;
    std::int64_t config, file;
    const char* where;
  } checks[] = {
      {"hidden_size", c.hidden_size, m.hidden, "hidden_states' columns"},
      {"num_experts", c.num_experts, m.experts, "gate.weight's rows"},
      {"routed_expert_hidden_size (the latent width; == hidden_size: no projection)", config_latent, m.latent,
       "routed_expert_down_proj.weight's rows, or hidden_size without it"},
      {"moe_intermediate_size", c.moe_intermediate_size, m.intermediate, "experts.0.w1's rows"},
      {"num_shared_experts x moe_intermediate_size (or shared_expert_intermediate_size)", config_shared_inter,
       file_shared_inter, "shared_experts.gate_proj.weight's rows, 0 without it"},
  };
  for (const auto& k : checks) {
    if (k.config != k.file)
      return Status::InvalidArgument(fmt::format(
          "--config {}: {} is {}, but the file's layer has {} ({}); give the config of this layer's model, or "
          "leave --config out and pass --top-k",
          path, k.key, k.config, k.file, k.where));
  }
  return Status::Ok();
}

// Every routed expert, read and validated before the forward pass (those no token routes to as well).
class FileExperts : public ExpertProvider {
 public:
  Status Load(const FileSource& src, std::int64_t latent, std::int64_t inter, int n) {
    for (int e = 0; e < n; ++e) {
      TERRACE_RETURN_IF_ERROR(CheckExpertTensors(src, e, latent, inter));
      TERRACE_ASSIGN_OR_RETURN(ExpertWeights w, LoadExpert(src, fmt::format("experts.{}.", e), latent, inter));
      experts_.push_back(std::move(w));
    }
    return Status::Ok();
  }
  Result<const ExpertWeights*> Acquire(int, int e) override { return &experts_[static_cast<std::size_t>(e)]; }
  void Release(int, int) override {}

 private:
  std::vector<ExpertWeights> experts_;
};

Status RefMoe(const RefArgs& a) {
  TERRACE_ASSIGN_OR_RETURN(FileSource src, OpenInput(a.in));
  std::optional<ModelConfig> cfg;
  if (!a.config.empty()) {  // checked by the command (CheckPaths)
    TERRACE_ASSIGN_OR_RETURN(cfg, LoadConfig(a.config));
  }
  TERRACE_ASSIGN_OR_RETURN(Tensor x, Input(src, "hidden_states", {-1, -1}));
  const std::int64_t T = x.dim(0), d = x.dim(1);
  MoeWeights w;
  MoeDims m;
  m.hidden = d;
  TERRACE_ASSIGN_OR_RETURN(w.router, Input(src, "gate.weight", {-1, d}, false));
  m.experts = w.router.dim(0);
  if (src.Has("gate.e_score_correction_bias")) {
    TERRACE_ASSIGN_OR_RETURN(w.bias, Input(src, "gate.e_score_correction_bias", {m.experts}, false));
  }
  m.latent = d;
  // The latent projection is there when either of its tensors is. The MoE takes latent == hidden for
  // "no projection", so a square one cannot be applied: refused.
  if (src.Has("routed_expert_down_proj.weight") || src.Has("routed_expert_up_proj.weight")) {
    TERRACE_ASSIGN_OR_RETURN(w.down, Input(src, "routed_expert_down_proj.weight", {-1, d}, false));
    m.latent = w.down.dim(0);
    if (m.latent == d)
      return Status::InvalidArgument(fmt::format(
          "tensor 'routed_expert_down_proj.weight': a square latent projection {} is not supported (the MoE takes a "
          "latent width equal to hidden_size {} as no projection); use another latent width, or leave out both "
          "routed_expert_down_proj.weight and routed_expert_up_proj.weight",
          ShapeString(w.down.shape), d));
    TERRACE_ASSIGN_OR_RETURN(w.up, Input(src, "routed_expert_up_proj.weight", {d, m.latent}, false));
  }
  const bool has_norm = src.Has("routed_expert_norm.weight");
  m.latent_norm = cfg ? cfg->latent_moe_use_norm : has_norm;
  if (has_norm && !m.latent_norm)
    return Status::InvalidArgument(
        "tensor 'routed_expert_norm.weight' is present but --config sets latent_moe_use_norm false, so the layer "
        "would not use it; leave it out or set latent_moe_use_norm true");
  if (m.latent_norm) {
    TERRACE_ASSIGN_OR_RETURN(w.latent_norm, Input(src, "routed_expert_norm.weight", {m.latent}, false));
  }
  // The shared experts are there when any of their three tensors is.
  if (src.Has("shared_experts.gate_proj.weight") || src.Has("shared_experts.up_proj.weight") ||
      src.Has("shared_experts.down_proj.weight")) {
    TERRACE_ASSIGN_OR_RETURN(w.shared_gate, Input(src, "shared_experts.gate_proj.weight", {-1, d}, false));
    const std::int64_t is = w.shared_gate.dim(0);
    TERRACE_ASSIGN_OR_RETURN(w.shared_up, Input(src, "shared_experts.up_proj.weight", {is, d}, false));
    TERRACE_ASSIGN_OR_RETURN(w.shared_down, Input(src, "shared_experts.down_proj.weight", {d, is}, false));
  }
  // Expert intermediate size from expert 0's w1 (packed: [I, latent/2]; plain: [I, latent]).
  const bool mxfp4 = ExpertIsMxfp4(src, 0);
  if (!src.Has(mxfp4 ? "experts.0.w1.weight_packed" : "experts.0.w1.weight"))
    return mxfp4 ? Missing(src, "experts.0.w1.weight_packed", "U8", fmt::format("[I, {}]", m.latent / 2))
                 : Missing(src, "experts.0.w1.weight", "F32, BF16 or F16", fmt::format("[I, {}]", m.latent));
  TERRACE_ASSIGN_OR_RETURN(TensorView w1, src.Get(mxfp4 ? "experts.0.w1.weight_packed" : "experts.0.w1.weight"));
  if (w1.shape.size() != 2) return Status::InvalidArgument("tensor 'experts.0.w1': expected a 2-D weight");
  m.intermediate = w1.shape[0];
  m.top_k = a.top_k.value_or(cfg ? cfg->num_experts_per_token : 0);
  if (m.top_k <= 0) return Status::InvalidArgument("moe needs --top-k (num_experts_per_token) or --config config.json");
  m.scaling = static_cast<float>(a.scaling.value_or(cfg ? cfg->routed_scaling_factor : 1.0));
  m.act = cfg ? cfg->hidden_act : Activation::kSitu;  // hidden_act: never SiTU for a SiLU model
  m.renormalize = cfg ? cfg->moe_renormalize : true;
  m.situ_beta = static_cast<float>(a.situ_beta.value_or(cfg ? cfg->activation_situ_beta : 4.0));
  m.situ_linear_beta = static_cast<float>(a.situ_linear_beta.value_or(cfg ? cfg->activation_situ_linear_beta : 25.0));
  m.rms_eps = static_cast<float>(a.eps.value_or(cfg ? cfg->rms_norm_eps : 1e-5));
  TERRACE_RETURN_IF_ERROR(CheckMoeWeights(w, m, ""));
  if (cfg) TERRACE_RETURN_IF_ERROR(CheckMoeConfigMatchesFile(*cfg, m, w, a.config));
  // Flags that change nothing for this layer are refused, never ignored.
  if (m.act != Activation::kSitu && (a.situ_beta || a.situ_linear_beta))
    return Status::InvalidArgument(fmt::format(
        "{} applies to the SiTU activation, but --config {} sets hidden_act silu; drop it",
        a.situ_beta ? "--situ-beta" : "--situ-linear-beta", a.config));
  if (!m.latent_norm && a.eps)
    return Status::InvalidArgument("--eps is the latent norm's epsilon, and this layer has no latent norm (no "
                                   "routed_expert_norm.weight); drop --eps");
  FileExperts experts;
  TERRACE_RETURN_IF_ERROR(experts.Load(src, m.latent, m.intermediate, static_cast<int>(m.experts)));
  TERRACE_RETURN_IF_ERROR(src.CheckAllRead(
      "moe", fmt::format("hidden_states, gate.weight, and optionally gate.e_score_correction_bias, "
                         "routed_expert_{{down,up}}_proj.weight, routed_expert_norm.weight and "
                         "shared_experts.{{gate,up,down}}_proj.weight, and for E = 0..{} "
                         "experts.E.w{{1,2,3}}.weight_packed + weight_scale or experts.E.w{{1,2,3}}.weight",
                         m.experts - 1)));
  Tensor out({T, d});
  model::Routing r;
  TERRACE_RETURN_IF_ERROR(MoeForward(w, m, 0, &experts, x.ptr(), T, out.ptr(), &r));
  Tensor weights({T, m.top_k});
  weights.data = r.weights;
  std::vector<std::int32_t> ids(r.ids.begin(), r.ids.end());
  SafetensorsWriter wr;
  TERRACE_RETURN_IF_ERROR(wr.Add("topk_ids", DType::kI32, {T, m.top_k}, std::as_bytes(std::span(ids))));
  return WriteOutputs(a, {{"output", &out}, {"topk_weights", &weights}}, &wr,
                      {fmt::format("topk_ids I32 {}", ShapeString(Shape{T, m.top_k}))});
}

// Inputs must be regular files (a FIFO would block), the output a new path or a regular file that
// RefOutRules allow replacing.
Status CheckPaths(const RefArgs& a, std::string_view name) {
  if (name == "moe" && !a.top_k && a.config.empty()) {
    return Status::InvalidArgument("moe needs --top-k (num_experts_per_token) or --config config.json");
  }
  TERRACE_RETURN_IF_ERROR(CheckInputFile(a.in, "--in"));
  if (!a.config.empty()) TERRACE_RETURN_IF_ERROR(CheckInputFile(a.config, "--config", 16ull << 20));
  return CheckOutputFile(a.out, "--out", RefOutRules(a));
}

}  // namespace

void RegisterRef(CLI::App& app, Runner* run) {
  auto* ref = app.add_subcommand("ref", "Run one reference mechanism on tensors from a safetensors file "
                                        "(see docs/ref-cli.md)");
  ref->require_subcommand(1);
  auto args = std::make_shared<RefArgs>();
  const auto add = [&](const char* name, const char* help, Status (*fn)(const RefArgs&)) {
    auto* c = ref->add_subcommand(name, help);
    c->add_option("--in", args->in, "Input safetensors file")->required();
    c->add_option("--out", args->out, "Output safetensors file")->required();
    c->add_flag("--force", args->force,
                "Replace an existing --out file Terrace did not write (never the --in or --config file)");
    c->callback([args, run, fn, name] {
      *run = [args, fn, name] {
        if (Status s = CheckPaths(*args, name); !s.ok()) return FailUsage(fmt::format("ref {}: {}", name, s.message()));
        const Status s = fn(*args);
        return s.ok() ? 0 : Fail(fmt::format("ref {}: {}", name, s.ToString()));
      };
    });
    return c;
  };
  auto* kda = add("kda", "KDA recurrence: q,k,g [B,T,H,K], v [B,T,H,V], beta [B,T,H] -> o, final_state", RefKda);
  AddDoubleOption(kda, "--scale", &args->scale, -1e6, 1e6, "Multiplier for q (default K^-0.5)");
  auto* chunked = kda->add_flag("--chunked", args->chunked, "Use the chunkwise form (default: recurrent)");
  AddIntOption(kda, "--chunk-size", &args->chunk, 1, 1 << 16, "Chunk length for --chunked")->needs(chunked);
  auto* mla = add("mla", "Gated MLA layer on hidden_states [T, d] -> output, latents", RefMla);
  AddOptionalIntOption(mla, "--heads", &args->heads, 1, 4096, "num_attention_heads")->required();
  mla->add_flag("--absorbed", args->absorbed, "Use the absorbed form (default: naive)");
  AddPositiveDoubleOption(mla, "--eps", &args->eps, model::kMaxRmsEps, "RMSNorm epsilon (default 1e-5)");
  add("attnres", "Block AttnRes mix of sources [S, T, d] -> output [T, d]", RefAttnRes);
  auto* moe = add("moe", "Stable LatentMoE layer on hidden_states [T, d] -> output, topk_ids, topk_weights", RefMoe);
  moe->add_option("--config", args->config, "config.json to take the MoE settings from");
  AddOptionalIntOption(moe, "--top-k", &args->top_k, 1, 4096, "num_experts_per_token");
  AddPositiveDoubleOption(moe, "--scaling", &args->scaling, model::kMaxScaling, "routed_scaling_factor (default 1)");
  AddPositiveDoubleOption(moe, "--situ-beta", &args->situ_beta, model::kMaxSituBeta, "activation_situ_beta (default 4)");
  AddPositiveDoubleOption(moe, "--situ-linear-beta", &args->situ_linear_beta, model::kMaxSituBeta,
                  "activation_situ_linear_beta (default 25)");
  AddPositiveDoubleOption(moe, "--eps", &args->eps, model::kMaxRmsEps, "RMSNorm epsilon for the latent norm (default 1e-5)");
  add("mxfp4", "Dequantise weight_packed U8 [R, C/2] + weight_scale U8 [R, C/32] -> weight F32 [R, C]; with input F32 [T, C] also output = input weight^T (the fused MXFP4 kernel)", RefMxfp4);
  RegisterRefCodec(ref, run);
}

}  // namespace terrace::cli
