// Public model API (docs/model.md, "Public API"): where the reference model's weights come from.
// The forward pass reads every dense tensor through a WeightSource (a checkpoint directory, or any
// other source such as the Terrace store) and asks an ExpertProvider for each routed expert it uses,
// so a store-backed provider can serve cold experts from HBM / host / NVMe and prove the results
// identical.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/model_config.h"
#include "terrace/model_tensor.h"
#include "terrace/status.h"

namespace terrace::model {

// Thread-safety: const methods may be called concurrently. Returned views stay valid for the
// lifetime of the source.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // NotFound naming the tensor if absent. Names are Terrace's (docs/model-format.md section 4).
  virtual Result<TensorView> Get(std::string_view name) const = 0;
  virtual bool Has(std::string_view name) const = 0;
  virtual std::vector<std::string> Names() const = 0;
};

// A row-major MXFP4 matrix [rows, cols] in the compressed-tensors layout (docs/model-format.md,
// section 5): `packed` holds rows * cols/2 bytes (byte j of a row: column 2j in the low nibble, 2j+1
// in the high nibble, E2M1 codes), `scales` rows * cols/32 E8M0 exponents (one per 32 consecutive
// columns of a row). cols is a positive multiple of 32. A view: whoever hands it out keeps the
// bytes alive (and unchanged) for as long as the view is used; no alignment is required.
struct Mxfp4Matrix {
  const std::uint8_t* packed = nullptr;
  const std::uint8_t* scales = nullptr;
  std::int64_t rows = 0, cols = 0;
  std::int64_t packed_bytes() const { return rows * cols / 2; }
  std::int64_t scale_bytes() const { return rows * cols / 32; }
};

// How an expert's weights are held in memory: kF32, owning fp32 tensors (checkpoints whose experts
// are F32 / BF16 / F16), or kMxfp4, views of the quantised bytes (checkpoints in MXFP4; the MoE
// multiplies them with a fused dequantise-and-multiply kernel, never an fp32 copy).
enum class ExpertFormat : std::uint8_t { kF32, kMxfp4 };

// One routed expert. w1 (gate) and w3 (up) are [intermediate, latent]; w2 (down) is
// [latent, intermediate]. kF32 uses w1/w2/w3 (q1..q3 empty); kMxfp4 uses q1/q2/q3 (w1..w3 empty),
// whose bytes belong to whoever returned the ExpertWeights (valid until its Release, or for a
// ParseExpertBlock result as long as the block).
struct ExpertWeights {
  ExpertFormat format = ExpertFormat::kF32;
  Tensor w1, w2, w3;
  Mxfp4Matrix q1, q2, q3;
  std::int64_t intermediate() const { return format == ExpertFormat::kF32 ? w1.dim(0) : q1.rows; }
  std::int64_t latent() const { return format == ExpertFormat::kF32 ? w1.dim(1) : q1.cols; }
};

// The expert block format (docs/model-format.md, "Expert blocks"): one MXFP4 expert serialised as
// a store block. A 64-byte little-endian header (magic "TXPRT001", latent, intermediate, then the
// offset of each of the six sections) followed by w1.packed, w1.scales, w3.packed, w3.scales,
// w2.packed, w2.scales, each at a 64-byte aligned offset, zero padding between them.
inline constexpr std::size_t kExpertBlockHeaderBytes = 64;
inline constexpr std::size_t kExpertBlockAlign = 64;
// The block's size for these dimensions (latent and intermediate positive multiples of 32).
std::size_t ExpertBlockBytes(std::int64_t latent, std::int64_t intermediate);
// `mxfp4_expert` must be kMxfp4 with consistent shapes (w1/w3 [I, L], w2 [L, I]); anything else
// returns an empty vector. Pure; thread-safe.
std::vector<std::byte> SerializeExpertBlock(const ExpertWeights& mxfp4_expert);
// Views into `block` (which must outlive the result and stay unchanged). Corruption naming what is
// wrong: size, magic, dimensions other than `latent` x `intermediate`, offsets, a NaN scale (E8M0
// 255) or a scale that makes a weight overflow fp32 (naming the matrix, row and block). O(scales):
// the packed nibbles are read only in blocks whose scale is >= 2^126.
Result<ExpertWeights> ParseExpertBlock(std::span<const std::byte> block, std::int64_t latent,
                                       std::int64_t intermediate);

// Thread-safety: implementations must allow concurrent calls from different threads.
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  // The expert's weights (kF32 or kMxfp4), valid until the matching Release(layer, expert). Every successful Acquire
  // is paired with exactly one Release. Errors name the layer and expert.
  virtual Result<const ExpertWeights*> Acquire(int layer, int expert) = 0;
  virtual void Release(int layer, int expert) = 0;
  // A hint: these experts of `layer` will be acquired soon. Must not block on I/O. Default: no-op.
  virtual void Prefetch(int layer, std::span<const int> experts) {
    (void)layer;
    (void)experts;
  }
};

// A checkpoint directory (config.json + model.safetensors, or an index and shards), opened and
// validated: the config, the keys it read and ignored, and the weights. Every tensor the config
// implies is checked for presence, shape and dtype; values are checked when the model loads.
struct Checkpoint {
  ModelConfig config;
  ConfigKeys config_keys;
  std::unique_ptr<WeightSource> weights;  // valid as long as it lives; thread-safe reads
};
// InvalidArgument / NotFound / Corruption naming the file, key or tensor (docs/errors.md).
Result<Checkpoint> OpenCheckpoint(const std::filesystem::path& dir);

}  // namespace terrace::model
