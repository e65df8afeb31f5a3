#include "terrace/tier.h"

#include <cstring>

#include <fmt/format.h>

namespace terrace {

std::string_view TierName(TierId id) {
  switch (id) {
    case TierId::kHbm: return "hbm";
    case TierId::kHost: return "host";
    case TierId::kNvme: return "nvme";
  }
  return "invalid";
}

std::vector<Status> Tier::PutBatch(std::span<const PutOp> ops) {
  std::vector<Status> out;
  out.reserve(ops.size());
  for (const auto& op : ops) out.push_back(Put(op.key, op.desc, op.data));
  return out;
}

std::vector<Status> Tier::GetBatch(std::span<GetOp> ops) {
  std::vector<Status> out;
  out.reserve(ops.size());
  for (auto& op : ops) out.push_back(Get(op.key, op.out, &op.desc));
  return out;
}

std::vector<Status> Tier::GetRangeBatch(std::span<RangeOp> ops) {
  std::vector<Status> out;
  out.reserve(ops.size());
  std::vector<std::byte> whole;
  for (auto& op : ops) {
    Result<BlockDesc> found = Lookup(op.key);
    if (!found.ok()) {
      out.push_back(found.status());
      continue;
    }
    Status s = CheckRange(op, found->size);
    if (s.ok()) {
      whole.resize(found->size);
      s = Get(op.key, whole, &op.desc);
      if (s.ok()) s = CheckRange(op, op.desc.size);
      if (s.ok()) std::memcpy(op.out.data(), whole.data() + op.offset, op.length);
    }
    out.push_back(std::move(s));
  }
  return out;
}

Status CheckRange(const RangeOp& op, std::uint64_t block_size) {
  if (op.offset > block_size || op.length > block_size - op.offset)
    return Status::InvalidArgument(fmt::format("range read of block {}: bytes [{}, +{}) pass the block's end ({} bytes)",
                                               op.key.ToString(), op.offset, op.length, block_size));
  if (op.out.size() < op.length)
    return Status::InvalidArgument(fmt::format("range read of block {}: output buffer has {} bytes, the range has {}",
                                               op.key.ToString(), op.out.size(), op.length));
  return Status::Ok();
}

}  // namespace terrace
