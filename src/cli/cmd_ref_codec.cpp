// terrace ref codec --codec C --in X.safetensors --out Y.safetensors: encodes tensor `x` (F32) with
// a KV / state codec and decodes it again, writing `decoded` (F32, x's shape) and `encoded` (U8, the
// block's bytes) so the rounding can be checked against an independent implementation. Shapes and
// the scale rules: docs/ref-cli.md ("ref codec") and docs/kv-codecs.md.
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "src/cli/cli_util.h"
#include "src/cli/command.h"
#include "src/cli/safe_files.h"
#include "src/model/safetensors.h"
#include "terrace/codec.h"

namespace terrace::cli {
namespace {

struct RefCodecArgs {
  std::string in, out, codec;
  bool force = false;
};

// --out replaces a file Terrace wrote (its safetensors carry the mark), any file with --force, never --in.
OutputRules CodecOutRules(const RefCodecArgs& a) {
  return {.format = OutputFormat::kSafetensors, .force = a.force, .inputs = {{"--in", a.in}}};
}

Status RefCodec(const RefCodecArgs& a, const codec::CodecSpec& spec) {
  TERRACE_ASSIGN_OR_RETURN(auto file, model::SafetensorsFile::Open(a.in));
  // The one tensor it reads: another one there (a misspelt name, a second input) is refused, not skipped.
  for (const std::string& name : file->Names()) {
    if (name != "x")
      return Status::InvalidArgument(fmt::format("{}: tensor '{}' is not read by ref codec, which takes only 'x' "
                                                 "(F32, rank >= 1); remove it or rename it to x",
                                                 a.in, name));
  }
  auto view = file->Get("x");
  if (!view.ok())
    return Status::NotFound(fmt::format("{}: required tensor 'x' is missing (expected F32 of rank >= 1); see "
                                        "docs/ref-cli.md",
                                        a.in));
  if (view->dtype != model::DType::kF32)
    return Status::InvalidArgument(
        fmt::format("tensor 'x': expected dtype F32, got {}", model::DTypeName(view->dtype)));
  if (view->shape.empty())
    return Status::InvalidArgument("tensor 'x': expected rank >= 1 (a scalar has no columns), got a scalar");
  // Channels are the last dimension; the leading dimensions are rows.
  const std::int64_t cols = view->shape.back();
  std::int64_t rows = 1;
  for (std::size_t i = 0; i + 1 < view->shape.size(); ++i) rows *= view->shape[i];
  TERRACE_ASSIGN_OR_RETURN(model::Tensor x, model::ToFloat(*view, "x"));
  std::vector<std::byte> encoded;
  TERRACE_RETURN_IF_ERROR(codec::Encode(spec, x.data, rows, cols, &encoded).WithContext("tensor 'x'"));
  model::Tensor decoded(view->shape);
  TERRACE_RETURN_IF_ERROR(codec::Decode(encoded, rows, cols, decoded.data));
  model::SafetensorsWriter w;
  w.SetMetadata("terrace_ref", "codec " + spec.Name());
  TERRACE_RETURN_IF_ERROR(w.AddF32("decoded", decoded));
  TERRACE_RETURN_IF_ERROR(w.Add("encoded", model::DType::kU8, {static_cast<std::int64_t>(encoded.size())}, encoded));
  TERRACE_RETURN_IF_ERROR(WriteOutputFileNamingTarget(a.out, "--out", CodecOutRules(a), "the output",
                                                      [&](const std::filesystem::path& tmp) { return w.Write(tmp); }));
  fmt::print("wrote {} (decoded F32 {}, encoded U8 [{}]; codec {})\n", a.out, model::ShapeString(view->shape),
             encoded.size(), spec.Name());
  return Status::Ok();
}

}  // namespace

void RegisterRefCodec(CLI::App* ref_cmd, Runner* run) {
  auto args = std::make_shared<RefCodecArgs>();
  auto* c = ref_cmd->add_subcommand(
      "codec", "Encode and decode x F32 [..., C] with a KV codec -> decoded F32, encoded U8 (docs/kv-codecs.md)");
  c->add_option("--codec", args->codec,
                "f32, bf16, f16, fp8, fp8-block, int8, int4-g32, int4-g64, optionally +zstd or +lz4")
      ->required();
  c->add_option("--in", args->in, "Input safetensors file holding tensor x")->required();
  c->add_option("--out", args->out, "Output safetensors file")->required();
  c->add_flag("--force", args->force, "Replace an existing --out file Terrace did not write (never the --in file)");
  c->callback([args, run] {
    *run = [args] {
      auto spec = codec::CodecSpec::Parse(args->codec);
      if (!spec.ok()) return FailUsage(fmt::format("ref codec: --codec: {}", spec.status().message()));
      if (Status s = CheckInputFile(args->in, "--in"); !s.ok()) return FailUsage("ref codec: " + s.message());
      if (Status s = CheckOutputFile(args->out, "--out", CodecOutRules(*args)); !s.ok())
        return FailUsage("ref codec: " + s.message());
      const Status s = RefCodec(*args, *spec);
      return s.ok() ? 0 : Fail(fmt::format("ref codec: {}", s.ToString()));
    };
  });
}

}  // namespace terrace::cli
