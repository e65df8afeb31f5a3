#include "src/codec/lossless.h"

#include <climits>
#include <string>

#include <lz4.h>
#include <zstd.h>

namespace terrace::codec::detail {
namespace {
constexpr int kZstdLevel = 1;
}

std::uint64_t CompressBound(Lossless l, std::uint64_t raw_bytes) {
  if (l == Lossless::kZstd) return ZSTD_compressBound(raw_bytes);
  if (l == Lossless::kLz4) {
    if (raw_bytes > static_cast<std::uint64_t>(LZ4_MAX_INPUT_SIZE)) return 0;  // Compress refuses it
    return static_cast<std::uint64_t>(LZ4_compressBound(static_cast<int>(raw_bytes)));
  }
  return raw_bytes;
}

Status Compress(Lossless l, std::span<const unsigned char> raw, std::vector<std::byte>* out) {
  const std::size_t at = out->size();
  if (l == Lossless::kZstd) {
    out->resize(at + ZSTD_compressBound(raw.size()));
    // With a content checksum (XXH64 of the raw payload): a damaged frame is refused on decode.
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    if (cctx == nullptr) return Status::Internal("zstd: ZSTD_createCCtx failed (out of memory?)");
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, kZstdLevel);
    ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
    const std::size_t n = ZSTD_compress2(cctx, out->data() + at, out->size() - at, raw.data(), raw.size());
    ZSTD_freeCCtx(cctx);
    if (ZSTD_isError(n)) return Status::Internal(std::string("zstd compression failed: ") + ZSTD_getErrorName(n));
    out->resize(at + n);
    return Status::Ok();
  }
  if (l == Lossless::kLz4) {
    if (raw.size() > static_cast<std::size_t>(LZ4_MAX_INPUT_SIZE))
      return Status::InvalidArgument("the +lz4 stage takes at most " + std::to_string(LZ4_MAX_INPUT_SIZE) +
                                     " payload bytes (got " + std::to_string(raw.size()) +
                                     "); use +zstd or encode smaller blocks");
    const int bound = LZ4_compressBound(static_cast<int>(raw.size()));
    out->resize(at + static_cast<std::size_t>(bound));
    const int n = LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                                       reinterpret_cast<char*>(out->data() + at), static_cast<int>(raw.size()), bound);
    if (n <= 0) return Status::Internal("lz4 compression failed");
    out->resize(at + static_cast<std::size_t>(n));
    return Status::Ok();
  }
  out->insert(out->end(), reinterpret_cast<const std::byte*>(raw.data()),
              reinterpret_cast<const std::byte*>(raw.data() + raw.size()));
  return Status::Ok();
}

Status Decompress(Lossless l, std::span<const unsigned char> stored, std::span<unsigned char> raw) {
  if (l == Lossless::kZstd) {
    const unsigned long long content = ZSTD_getFrameContentSize(stored.data(), stored.size());
    if (content == ZSTD_CONTENTSIZE_ERROR)
      return Status::Corruption("the zstd payload is not a zstd frame (bad frame header)");
    if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != raw.size())
      return Status::Corruption("the zstd frame holds " + std::to_string(content) + " bytes; the header says " +
                                std::to_string(raw.size()));
    const std::size_t n = ZSTD_decompress(raw.data(), raw.size(), stored.data(), stored.size());
    if (ZSTD_isError(n)) return Status::Corruption(std::string("the zstd payload does not decompress: ") + ZSTD_getErrorName(n));
    if (n != raw.size())
      return Status::Corruption("the zstd payload decompresses to " + std::to_string(n) + " bytes; the header says " +
                                std::to_string(raw.size()));
    return Status::Ok();
  }
  if (l == Lossless::kLz4) {
    if (stored.size() > static_cast<std::size_t>(INT_MAX) || raw.size() > static_cast<std::size_t>(INT_MAX))
      return Status::Corruption("the lz4 payload sizes exceed lz4's 2 GiB limit");
    const int n = LZ4_decompress_safe(reinterpret_cast<const char*>(stored.data()), reinterpret_cast<char*>(raw.data()),
                                      static_cast<int>(stored.size()), static_cast<int>(raw.size()));
    if (n < 0) return Status::Corruption("the lz4 payload is malformed (LZ4_decompress_safe failed)");
    if (static_cast<std::size_t>(n) != raw.size())
      return Status::Corruption("the lz4 payload decompresses to " + std::to_string(n) + " bytes; the header says " +
                                std::to_string(raw.size()));
    return Status::Ok();
  }
  return Status::Internal("Decompress called without a lossless stage");
}

}  // namespace terrace::codec::detail
