// Encode / Decode: header, scales and the lossless stage; the element loops (the int4 groups with
// their scales included) are in the kernels (kernels.h). Format: docs/kv-codecs.md.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include "src/codec/format.h"
#include "src/codec/kernels.h"
#include "src/codec/lossless.h"
#include "src/codec/spec_check.h"
#include "terrace/codec.h"

namespace terrace::codec {
namespace {

using detail::kHeaderBytes;

std::uint32_t Bits(float f) { return std::bit_cast<std::uint32_t>(f); }

template <typename T>
T LoadLe(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
void StoreLe(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

std::string FloatText(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}

// The first element of x (row-major [rows, cols]) that is NaN or +-Inf, as an InvalidArgument.
Status NonFinite(const CodecSpec& spec, std::span<const float> x, std::int64_t cols) {
  for (std::size_t i = 0; i < x.size(); ++i) {
    if ((Bits(x[i]) & 0x7FFFFFFFu) >= 0x7F800000u) {
      const auto r = static_cast<std::int64_t>(i) / std::max<std::int64_t>(cols, 1);
      const auto c = static_cast<std::int64_t>(i) % std::max<std::int64_t>(cols, 1);
      return Status::InvalidArgument("codec " + spec.Name() + ": the input value at row " + std::to_string(r) +
                                     ", column " + std::to_string(c) + " is " + FloatText(x[i]) +
                                     "; the codecs take finite values only (see docs/kv-codecs.md)");
    }
  }
  return Status::Internal("codec " + spec.Name() + ": non-finite input reported but not found");
}

// The first element whose 16-bit rounding is not finite (bf16 / f16 overflow or NaN / Inf input).
Status Overflow16(const CodecSpec& spec, std::span<const float> x, std::int64_t cols) {
  const bool bf16 = spec.kind == CodecKind::kBf16;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::uint16_t h = bf16 ? detail::Bf16FromF32(x[i]) : detail::F16FromF32(x[i]);
    if ((h & 0x7FFF) >= (bf16 ? 0x7F80 : 0x7C00)) {
      if ((Bits(x[i]) & 0x7FFFFFFFu) >= 0x7F800000u) return NonFinite(spec, x.subspan(0, i + 1), cols);
      const auto r = static_cast<std::int64_t>(i) / cols, c = static_cast<std::int64_t>(i) % cols;
      return Status::InvalidArgument("codec " + spec.Name() + ": the input value at row " + std::to_string(r) +
                                     ", column " + std::to_string(c) + " (" + FloatText(x[i]) + ") rounds past " +
                                     (bf16 ? "bf16" : "f16") + "'s largest finite value (" +
                                     (bf16 ? "3.38953139e+38" : "65504") +
                                     "); scale the tensor or use a codec with scales (fp8, int8)");
    }
  }
  return Status::Internal("codec " + spec.Name() + ": overflow reported but not found");
}

// Appends only: GCC 12 at -O3 reports a false -Wrestrict in `"[" + std::to_string(r)` (operator+ on a
// temporary inserts at its front).
std::string ShapeText(std::uint64_t r, std::uint64_t c) {
  std::string s = "[";
  s += std::to_string(r);
  s += ", ";
  s += std::to_string(c);
  s += ']';
  return s;
}

}  // namespace

std::uint64_t MaxEncodedBytes(const CodecSpec& spec, std::int64_t rows, std::int64_t cols) {
  if (rows < 0 || cols < 0 || !detail::SpecProblem(spec.kind, spec.scales, spec.group, spec.lossless).empty()) return 0;
  const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  if (c != 0 && r > (std::numeric_limits<std::uint64_t>::max() / 8) / c) return 0;
  const std::uint64_t nscales = detail::ScaleCount(spec, r, c);
  if (nscales > std::numeric_limits<std::uint32_t>::max()) return 0;  // Encode refuses it
  const std::uint64_t raw = detail::RawPayloadBytes(spec.kind, r * c);
  const std::uint64_t stored = spec.lossless == Lossless::kNone ? raw : detail::CompressBound(spec.lossless, raw);
  if (stored == 0 && raw != 0) return 0;  // over the lossless stage's input limit: Encode refuses it
  return kHeaderBytes + 4 * nscales + stored;
}

namespace {

Status EncodeBlock(const CodecSpec& spec, std::span<const float> x, std::int64_t rows, std::int64_t cols,
                   std::vector<std::byte>* out) {
  if (out == nullptr) return Status::InvalidArgument("codec encode: the output pointer is null; pass a std::vector");
  if (const std::string p = detail::SpecProblem(spec.kind, spec.scales, spec.group, spec.lossless); !p.empty())
    return Status::InvalidArgument("codec spec is not valid: " + p + "; build specs with CodecSpec::Parse");
  if (rows < 0 || cols < 0) return Status::InvalidArgument("codec shape " + std::to_string(rows) + " x " +
                                                           std::to_string(cols) + " has a negative dimension");
  const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  if (c != 0 && r > (std::numeric_limits<std::uint64_t>::max() / 8) / c)
    return Status::InvalidArgument("codec shape " + ShapeText(r, c) + " is too large");
  const std::uint64_t n = r * c;
  if (x.size() != n)
    return Status::InvalidArgument("codec input has " + std::to_string(x.size()) + " values; shape " +
                                   ShapeText(r, c) + " needs " + std::to_string(n));
  const detail::KernelTable& k = detail::Kernels();
  const std::uint64_t nscales = detail::ScaleCount(spec, r, c);
  const std::uint64_t raw_bytes = detail::RawPayloadBytes(spec.kind, n);
  if (nscales > std::numeric_limits<std::uint32_t>::max())
    return Status::InvalidArgument("codec " + spec.Name() + ": shape " + ShapeText(r, c) + " needs " +
                                   std::to_string(nscales) + " scales, more than a block holds (2^32 - 1)");

  std::vector<float> scales(nscales), inv;
  // The raw payload goes straight into *out without a lossless stage, else into a scratch buffer.
  std::vector<unsigned char> scratch;
  // resize, not assign: a reused buffer of the right size is not cleared first (every byte of the
  // header, scales and payload is written below).
  out->resize(kHeaderBytes + 4 * nscales + (spec.lossless == Lossless::kNone ? raw_bytes : 0));
  unsigned char* payload = reinterpret_cast<unsigned char*>(out->data()) + kHeaderBytes + 4 * nscales;
  if (spec.lossless != Lossless::kNone) {
    scratch.resize(raw_bytes);
    payload = scratch.data();
  }
  // rn is 0 for an empty tensor: a shape such as [2^40, 0] holds no value, and the row loops below
  // must not run once per empty row.
  const std::size_t cn = static_cast<std::size_t>(c), rn = n == 0 ? 0 : static_cast<std::size_t>(r);

  switch (spec.kind) {
    case CodecKind::kF32:
      if (k.max_abs_bits(x.data(), n) >= 0x7F800000u) return NonFinite(spec, x, cols);
      if (n != 0) std::memcpy(payload, x.data(), 4 * n);
      break;
    case CodecKind::kBf16:
      if (k.bf16_encode(x.data(), n, payload) >= 0x7F80) return Overflow16(spec, x, cols);
      break;
    case CodecKind::kF16:
      if (k.f16_encode(x.data(), n, payload) >= 0x7C00) return Overflow16(spec, x, cols);
      break;
    case CodecKind::kFp8E4M3:
    case CodecKind::kInt8: {
      const float qmax = spec.kind == CodecKind::kInt8 ? detail::kInt8Max : detail::kFp8Max;
      if (spec.scales == ScaleMode::kPerBlock) {
        const std::uint32_t amax = k.max_abs_bits(x.data(), n);
        if (amax >= 0x7F800000u) return NonFinite(spec, x, cols);
        inv.resize(1);
        detail::ScaleFromAmax(amax, qmax, detail::MaxScale(spec.kind), &scales[0], &inv[0]);
        k.fp8_encode(x.data(), inv.data(), 0, n, payload);
      } else {
        if (n == 0) break;  // no value: no channel to scale (ScaleCount is 0 for [0, cols])
        std::vector<std::uint32_t> colmax(cn, 0);
        k.col_max_abs_bits(x.data(), rn, cn, colmax.data());
        inv.resize(cn);
        for (std::size_t j = 0; j < cn; ++j) {
          if (colmax[j] >= 0x7F800000u) return NonFinite(spec, x, cols);
          detail::ScaleFromAmax(colmax[j], qmax, detail::MaxScale(spec.kind), &scales[j], &inv[j]);
        }
        for (std::size_t i = 0; i < rn; ++i) {
          if (spec.kind == CodecKind::kInt8) {
            k.int8_encode(x.data() + i * cn, inv.data(), cn, payload + i * cn);
          } else {
            k.fp8_encode(x.data() + i * cn, inv.data(), 1, cn, payload + i * cn);
          }
        }
      }
      break;
    }
    case CodecKind::kInt4:
      if (n == 0) break;  // no value, no group; the payload may be an empty scratch (no memory at all)
      if (!k.int4_encode(x.data(), rn, cn, static_cast<std::size_t>(spec.group), detail::MaxScale(spec.kind),
                         scales.data(), payload))
        return NonFinite(spec, x, cols);
      break;
  }

  if (spec.lossless != Lossless::kNone) TERRACE_RETURN_IF_ERROR(detail::Compress(spec.lossless, scratch, out));
  const std::uint64_t stored = out->size() - kHeaderBytes - 4 * nscales;
  auto* h = reinterpret_cast<unsigned char*>(out->data());
  std::memset(h, 0, kHeaderBytes);
  std::memcpy(h, detail::kMagic, 4);
  h[detail::kOffVersion] = detail::kFormatVersion;
  h[detail::kOffKind] = static_cast<unsigned char>(spec.kind);
  h[detail::kOffScales] = static_cast<unsigned char>(spec.scales);
  h[detail::kOffLossless] = static_cast<unsigned char>(spec.lossless);
  StoreLe<std::uint16_t>(h + detail::kOffGroup, static_cast<std::uint16_t>(spec.group));
  StoreLe<std::uint16_t>(h + detail::kOffReserved, 0);
  StoreLe<std::uint32_t>(h + detail::kOffScaleCount, static_cast<std::uint32_t>(nscales));
  StoreLe<std::uint64_t>(h + detail::kOffRows, r);
  StoreLe<std::uint64_t>(h + detail::kOffCols, c);
  StoreLe<std::uint64_t>(h + detail::kOffRawBytes, raw_bytes);
  StoreLe<std::uint64_t>(h + detail::kOffStoredBytes, stored);
  StoreLe<std::uint32_t>(h + detail::kOffHeaderCheck, detail::HeaderCheck(h));
  if (nscales) std::memcpy(h + kHeaderBytes, scales.data(), 4 * nscales);
  return Status::Ok();
}

Status DecodeBlock(std::span<const std::byte> encoded, std::int64_t rows, std::int64_t cols, std::span<float> out) {
  if (rows < 0 || cols < 0)
    return Status::InvalidArgument("codec shape " + std::to_string(rows) + " x " + std::to_string(cols) +
                                   " has a negative dimension");
  const auto r = static_cast<std::uint64_t>(rows), c = static_cast<std::uint64_t>(cols);
  if (c != 0 && r > std::numeric_limits<std::uint64_t>::max() / 8 / c)
    return Status::InvalidArgument("codec shape " + ShapeText(r, c) + " is too large");
  const std::uint64_t n = r * c;
  if (out.size() != n)
    return Status::InvalidArgument("codec output has room for " + std::to_string(out.size()) + " values; shape " +
                                   ShapeText(r, c) + " needs " + std::to_string(n));
  const auto* b = reinterpret_cast<const unsigned char*>(encoded.data());
  const std::size_t size = encoded.size();
  if (size < kHeaderBytes)
    return Status::Corruption("codec block is " + std::to_string(size) + " bytes, shorter than its " +
                              std::to_string(kHeaderBytes) + "-byte header");
  if (std::memcmp(b, detail::kMagic, 4) != 0) return Status::Corruption("codec block has a bad magic (not 'TKVC')");
  if (b[detail::kOffVersion] != detail::kFormatVersion)
    return Status::Corruption("codec block has format version " + std::to_string(b[detail::kOffVersion]) +
                              "; this build reads version " + std::to_string(detail::kFormatVersion));
  if (LoadLe<std::uint32_t>(b + detail::kOffHeaderCheck) != detail::HeaderCheck(b))
    return Status::Corruption("codec block header fails its check (bytes 48..51: FNV-1a of bytes 0..47); "
                              "the header was damaged");
  for (std::size_t i = detail::kOffPad; i < kHeaderBytes; ++i) {
    if (b[i] != 0) return Status::Corruption("codec block header's reserved bytes 52..63 are not zero");
  }
  CodecSpec spec;
  spec.kind = static_cast<CodecKind>(b[detail::kOffKind]);
  spec.scales = static_cast<ScaleMode>(b[detail::kOffScales]);
  spec.lossless = static_cast<Lossless>(b[detail::kOffLossless]);
  spec.group = LoadLe<std::uint16_t>(b + detail::kOffGroup);
  if (const std::string p = detail::SpecProblem(spec.kind, spec.scales, spec.group, spec.lossless); !p.empty())
    return Status::Corruption("codec block header names an invalid codec: " + p);
  if (LoadLe<std::uint16_t>(b + detail::kOffReserved) != 0)
    return Status::Corruption("codec block header's reserved bytes 10..11 are not zero");
  const auto hr = LoadLe<std::uint64_t>(b + detail::kOffRows), hc = LoadLe<std::uint64_t>(b + detail::kOffCols);
  if (hr != r || hc != c)
    return Status::Corruption("codec block (" + spec.Name() + ") holds shape " + ShapeText(hr, hc) +
                              "; the caller expected " + ShapeText(r, c));
  std::uint64_t nscales = detail::ScaleCount(spec, r, c);
  const auto hscales = LoadLe<std::uint32_t>(b + detail::kOffScaleCount);
  // Builds before the [0, cols] rule wrote `cols` per-channel scales for a block with no rows; they
  // are read (and checked) as before, but no value uses them.
  if (r == 0 && spec.scales == ScaleMode::kPerChannel && hscales == c) nscales = hscales;
  if (hscales != nscales)
    return Status::Corruption("codec block (" + spec.Name() + ") header says " + std::to_string(hscales) +
                              " scales; shape " + ShapeText(r, c) + " needs " + std::to_string(nscales));
  const std::uint64_t raw_bytes = detail::RawPayloadBytes(spec.kind, n);
  const auto hraw = LoadLe<std::uint64_t>(b + detail::kOffRawBytes);
  const auto stored = LoadLe<std::uint64_t>(b + detail::kOffStoredBytes);
  if (hraw != raw_bytes)
    return Status::Corruption("codec block (" + spec.Name() + ") header says " + std::to_string(hraw) +
                              " payload bytes; shape " + ShapeText(r, c) + " needs " + std::to_string(raw_bytes));
  if (spec.lossless == Lossless::kNone && stored != raw_bytes)
    return Status::Corruption("codec block (" + spec.Name() + ") header says " + std::to_string(stored) +
                              " stored payload bytes; without a lossless stage it must be " + std::to_string(raw_bytes));
  const std::uint64_t body = size - kHeaderBytes;
  if (nscales > body / 4 || stored != body - 4 * nscales)
    return Status::Corruption("codec block (" + spec.Name() + ") is " + std::to_string(size) + " bytes; its header " +
                              "says " + std::to_string(kHeaderBytes) + " + " + std::to_string(4 * nscales) +
                              " (scales) + " + std::to_string(stored) + " (payload)");
  if (nscales) {
    const std::uint32_t max_scale_bits = Bits(detail::MaxScale(spec.kind));
    const std::uint32_t min_scale_bits = Bits(detail::kMinScale);
    for (std::uint64_t i = 0; i < nscales; ++i) {
      const auto bits = LoadLe<std::uint32_t>(b + kHeaderBytes + 4 * i);
      // Negative, NaN, Inf, or so large that code * scale overflows; or a subnormal, which Encode
      // never writes (a scale below kMinScale is stored as 0).
      if (bits > max_scale_bits || (bits != 0 && bits < min_scale_bits))
        return Status::Corruption("codec block (" + spec.Name() + ") scale " + std::to_string(i) + " is " +
                                  FloatText(std::bit_cast<float>(bits)) + "; scales are 0 or lie in [" +
                                  FloatText(detail::kMinScale) + ", " + FloatText(detail::MaxScale(spec.kind)) + "]");
    }
  }
  // Copied (aligned) only where a value uses them: a block with no value needs none.
  std::vector<float> scales(n == 0 ? 0 : nscales);
  if (!scales.empty()) std::memcpy(scales.data(), b + kHeaderBytes, 4 * scales.size());
  const unsigned char* payload = b + kHeaderBytes + 4 * nscales;
  std::vector<unsigned char> scratch;
  if (spec.lossless != Lossless::kNone) {
    scratch.resize(raw_bytes);
    TERRACE_RETURN_IF_ERROR(detail::Decompress(spec.lossless, {payload, stored}, scratch)
                                .WithContext("codec block (" + spec.Name() + ")"));
    payload = scratch.data();
  }

  const detail::KernelTable& k = detail::Kernels();
  // rn is 0 for an empty tensor: a shape such as [2^40, 0] holds no value, and the row loops below
  // must not run once per empty row.
  const std::size_t cn = static_cast<std::size_t>(c), rn = n == 0 ? 0 : static_cast<std::size_t>(r);
  switch (spec.kind) {
    case CodecKind::kF32:
      if (n != 0) std::memcpy(out.data(), payload, 4 * n);
      if (k.max_abs_bits(out.data(), n) >= 0x7F800000u)
        return Status::Corruption("codec block (f32) holds a NaN or Inf value, which Encode never writes");
      break;
    case CodecKind::kBf16:
      if (k.bf16_decode(payload, n, out.data()) >= 0x7F80)
        return Status::Corruption("codec block (" + spec.Name() + ") holds a bf16 NaN or Inf, which Encode never writes");
      break;
    case CodecKind::kF16:
      if (k.f16_decode(payload, n, out.data()) >= 0x7C00)
        return Status::Corruption("codec block (" + spec.Name() + ") holds an f16 NaN or Inf, which Encode never writes");
      break;
    case CodecKind::kFp8E4M3: {
      bool nan = false;
      if (spec.scales == ScaleMode::kPerBlock) {
        nan = k.fp8_decode(payload, scales.data(), 0, n, out.data());
      } else {
        for (std::size_t i = 0; i < rn; ++i) nan |= k.fp8_decode(payload + i * cn, scales.data(), 1, cn, out.data() + i * cn);
      }
      if (nan) return Status::Corruption("codec block (" + spec.Name() + ") holds an fp8 NaN code (0x7F or 0xFF), "
                                         "which Encode never writes");
      break;
    }
    case CodecKind::kInt8:
      for (std::size_t i = 0; i < rn; ++i) k.int8_decode(payload + i * cn, scales.data(), cn, out.data() + i * cn);
      break;
    case CodecKind::kInt4:
      if ((n & 1) && (payload[raw_bytes - 1] >> 4) != 0)
        return Status::Corruption("codec block (" + spec.Name() + ") has a non-zero padding nibble after its last value");
      k.int4_decode(payload, rn, cn, static_cast<std::size_t>(spec.group), scales.data(), out.data());
      break;
  }
  return Status::Ok();
}

// The message for a buffer the allocator refused (std::bad_alloc, or std::length_error past its limit).
Status NoMemory(const char* what, const std::string& codec, std::int64_t rows, std::int64_t cols) {
  return Status::OutOfCapacity(std::string("codec ") + what + (codec.empty() ? "" : " (" + codec + ")") +
                               ": could not allocate the buffers for shape " + std::to_string(rows) + " x " +
                               std::to_string(cols) + " (out of memory); encode smaller blocks or free memory");
}

}  // namespace

// No exception leaves the public API: an allocation the system refuses is an OutOfCapacity Status.
Status Encode(const CodecSpec& spec, std::span<const float> x, std::int64_t rows, std::int64_t cols,
              std::vector<std::byte>* out) {
  try {
    return EncodeBlock(spec, x, rows, cols, out);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  return NoMemory("encode", spec.Name(), rows, cols);
}

Status Decode(std::span<const std::byte> encoded, std::int64_t rows, std::int64_t cols, std::span<float> out) {
  try {
    return DecodeBlock(encoded, rows, cols, out);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  return NoMemory("decode", "", rows, cols);
}

}  // namespace terrace::codec
