#include "terrace/tier.h"

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

}  // namespace terrace
