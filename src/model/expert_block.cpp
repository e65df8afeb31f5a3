// The expert block format (docs/model-format.md, "Expert blocks"): SerializeExpertBlock,
// ParseExpertBlock, ExpertBlockBytes (declared in terrace/model_weights.h).
#include <array>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "src/common/aligned_buffer.h"
#include "src/model/mxfp4.h"
#include "terrace/model_weights.h"

namespace terrace::model {
namespace {

constexpr char kMagic[8] = {'T', 'X', 'P', 'R', 'T', '0', '0', '1'};
constexpr std::size_t kSections = 6;  // w1.packed, w1.scales, w3.packed, w3.scales, w2.packed, w2.scales
constexpr std::size_t kOffsetsAt = 16, kTotalAt = 40;


bool ValidDims(std::int64_t latent, std::int64_t intermediate) {
  constexpr std::int64_t kMax = std::int64_t{1} << 20;
  return latent > 0 && intermediate > 0 && latent % kMxfp4BlockSize == 0 && intermediate % kMxfp4BlockSize == 0 &&
         latent <= kMax && intermediate <= kMax && latent * intermediate <= (std::int64_t{1} << 31);
}

struct Layout {
  std::array<std::size_t, kSections> offset{}, size{};
  std::size_t total = 0;
};

Layout MakeLayout(std::int64_t L, std::int64_t I) {
  Layout l;
  const auto packed = static_cast<std::size_t>(L * I / 2), scales = static_cast<std::size_t>(L * I / kMxfp4BlockSize);
  std::size_t at = kExpertBlockHeaderBytes;
  for (std::size_t i = 0; i < kSections; ++i) {
    l.offset[i] = at;
    l.size[i] = i % 2 == 0 ? packed : scales;
    at = static_cast<std::size_t>(RoundUp(at + l.size[i], kExpertBlockAlign));
  }
  l.total = at;
  return l;
}

void PutU32(std::byte* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}
std::uint32_t GetU32(const std::byte* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(std::to_integer<std::uint8_t>(p[i])) << (8 * i);
  return v;
}

bool Consistent(const Mxfp4Matrix& m, std::int64_t rows, std::int64_t cols) {
  return m.packed != nullptr && m.scales != nullptr && m.rows == rows && m.cols == cols;
}

}  // namespace

std::size_t ExpertBlockBytes(std::int64_t latent, std::int64_t intermediate) {
  return ValidDims(latent, intermediate) ? MakeLayout(latent, intermediate).total : 0;
}

std::vector<std::byte> SerializeExpertBlock(const ExpertWeights& e) {
  if (e.format != ExpertFormat::kMxfp4) return {};
  const std::int64_t I = e.q1.rows, L = e.q1.cols;
  if (!ValidDims(L, I) || !Consistent(e.q1, I, L) || !Consistent(e.q3, I, L) || !Consistent(e.q2, L, I)) return {};
  const Layout l = MakeLayout(L, I);
  std::vector<std::byte> out(l.total, std::byte{0});
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  PutU32(out.data() + 8, static_cast<std::uint32_t>(L));
  PutU32(out.data() + 12, static_cast<std::uint32_t>(I));
  for (std::size_t i = 0; i < kSections; ++i)
    PutU32(out.data() + kOffsetsAt + 4 * i, static_cast<std::uint32_t>(l.offset[i]));
  PutU32(out.data() + kTotalAt, static_cast<std::uint32_t>(l.total));
  const Mxfp4Matrix* mats[3] = {&e.q1, &e.q3, &e.q2};
  for (std::size_t i = 0; i < kSections; ++i) {
    const Mxfp4Matrix& m = *mats[i / 2];
    std::memcpy(out.data() + l.offset[i], i % 2 == 0 ? m.packed : m.scales, l.size[i]);
  }
  return out;
}

Result<ExpertWeights> ParseExpertBlock(std::span<const std::byte> block, std::int64_t latent,
                                       std::int64_t intermediate) {
  if (!ValidDims(latent, intermediate))
    return Status::InvalidArgument(fmt::format(
        "ParseExpertBlock: latent {} x intermediate {} is not a valid MXFP4 expert (both must be positive "
        "multiples of {})",
        latent, intermediate, kMxfp4BlockSize));
  if (block.size() < kExpertBlockHeaderBytes)
    return Status::Corruption(fmt::format("expert block is {} bytes, shorter than its {}-byte header", block.size(),
                                          kExpertBlockHeaderBytes));
  if (std::memcmp(block.data(), kMagic, sizeof(kMagic)) != 0)
    return Status::Corruption("expert block has a bad magic (expected \"TXPRT001\"): not an expert block, or damaged");
  const std::uint32_t L = GetU32(block.data() + 8), I = GetU32(block.data() + 12);
  if (L != static_cast<std::uint64_t>(latent) || I != static_cast<std::uint64_t>(intermediate))
    return Status::Corruption(fmt::format(
        "expert block holds an expert of latent {} x intermediate {}, but the model expects {} x {}", L, I, latent,
        intermediate));
  const Layout l = MakeLayout(latent, intermediate);
  for (std::size_t i = 0; i < kSections; ++i) {
    const std::uint32_t off = GetU32(block.data() + kOffsetsAt + 4 * i);
    if (off != l.offset[i])
      return Status::Corruption(
          fmt::format("expert block section {} is at offset {}, expected {}; the header is damaged", i, off, l.offset[i]));
  }
  const std::uint32_t total = GetU32(block.data() + kTotalAt);
  if (total != l.total || block.size() != l.total)
    return Status::Corruption(fmt::format("expert block is {} bytes and its header says {}; expected {} for latent {} "
                                          "x intermediate {} (truncated or damaged)",
                                          block.size(), total, l.total, latent, intermediate));
  for (std::size_t i = kTotalAt + 4; i < kExpertBlockHeaderBytes; ++i)
    if (block[i] != std::byte{0})
      return Status::Corruption(fmt::format("expert block header byte {} is not zero; the header is damaged", i));
  const auto* base = reinterpret_cast<const std::uint8_t*>(block.data());
  ExpertWeights e;
  e.format = ExpertFormat::kMxfp4;
  Mxfp4Matrix* mats[3] = {&e.q1, &e.q3, &e.q2};
  const std::int64_t rows[3] = {intermediate, intermediate, latent}, cols[3] = {latent, latent, intermediate};
  const char* names[3] = {"expert block w1", "expert block w3", "expert block w2"};
  for (int j = 0; j < 3; ++j) {
    Mxfp4Matrix& m = *mats[j];
    m.packed = base + l.offset[static_cast<std::size_t>(2 * j)];
    m.scales = base + l.offset[static_cast<std::size_t>(2 * j + 1)];
    m.rows = rows[j];
    m.cols = cols[j];
    TERRACE_RETURN_IF_ERROR(ValidateMxfp4(m, names[j]));
  }
  return e;
}

}  // namespace terrace::model
