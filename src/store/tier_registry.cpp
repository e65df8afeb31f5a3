// The tier registry: the one place that knows the concrete tiers. It maps a tier kind's name to the
// factory that builds it, turns StoreOptions into the store's ordered tier list, and implements
// Store::Open on top of that. Built as its own library (terrace_store), so the store core
// (terrace_store_core) links no concrete tier.
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "src/common/reworded.h"
#include "src/store/store_impl.h"
#include "tiers/hbm/hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace terrace {
namespace store_internal {
namespace {

using Factory = Result<std::unique_ptr<Tier>> (*)(const TierSlotOptions& slot);

Result<std::unique_ptr<Tier>> MakeHbm(const TierSlotOptions& slot) {
  return CreateHbmTier(slot.hbm);
}

Result<std::unique_ptr<Tier>> MakeHost(const TierSlotOptions& slot) {
  TERRACE_ASSIGN_OR_RETURN(auto t, HostTier::Create(slot.host));
  return std::unique_ptr<Tier>(std::move(t));
}

Result<std::unique_ptr<Tier>> MakeNvme(const TierSlotOptions& slot) {
  TERRACE_ASSIGN_OR_RETURN(auto t, NvmeTier::Open(slot.nvme));
  return std::unique_ptr<Tier>(std::move(t));
}

struct Registered {
  std::string_view kind;
  Factory make;
};
constexpr Registered kFactories[] = {
    {"hbm", MakeHbm},
    {"host", MakeHost},
    {"nvme", MakeNvme},
};

// The standard configuration as an explicit list.
std::vector<TierSlotOptions> StandardList(const StoreOptions& o) {
  std::vector<TierSlotOptions> list;
  if (o.hbm.mode != HbmMode::kOff) list.push_back(TierSlotOptions{"hbm", "", o.hbm, {}, {}});
  if (o.host.capacity_bytes > 0) list.push_back(TierSlotOptions{"host", "", {}, o.host, {}});
  if (!o.nvme.path.empty()) list.push_back(TierSlotOptions{"nvme", "", {}, {}, o.nvme});
  return list;
}

Result<std::vector<NamedTier>> BuildTiers(const StoreOptions& options) {
  std::vector<TierSlotOptions> list = options.tier_list.empty() ? StandardList(options) : options.tier_list;
  if (list.size() > static_cast<std::size_t>(kMaxTierSlots)) {
    return Status::InvalidArgument(fmt::format("open store: tier_list names {} tiers; a store composes at most {}",
                                               list.size(), kMaxTierSlots));
  }
  // Given names are the slots' names in stats and metrics: two alike would be told apart only by
  // a renumbering the caller did not ask for. Checked before any tier creates a file.
  for (std::size_t i = 0; i < list.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (!list[i].name.empty() && list[i].name == list[j].name) {
        return Status::InvalidArgument(fmt::format("open store: tier_list[{}] and tier_list[{}] are both named '{}'; "
                                                   "give each slot its own name (or none: its kind's name, numbered)",
                                                   j, i, list[i].name));
      }
    }
  }
  std::vector<NamedTier> tiers;
  for (std::size_t i = 0; i < list.size(); ++i) {
    TierSlotOptions& slot = list[i];
    // A tier without its own logger logs where the store does.
    for (std::shared_ptr<Logger>* l : {&slot.hbm.logger, &slot.host.logger, &slot.nvme.logger}) {
      if (!*l) *l = options.logger;
    }
    Factory make = nullptr;
    std::string known;
    for (const Registered& r : kFactories) {
      if (r.kind == slot.kind) make = r.make;
      known += known.empty() ? std::string(r.kind) : fmt::format(", {}", r.kind);
    }
    if (!make) {
      return Status::InvalidArgument(fmt::format("open store: tier_list[{}] has kind '{}'; known kinds: {}", i,
                                                 slot.kind, known));
    }
    auto t = make(slot);
    if (!t.ok()) {
      std::string where = fmt::format("open store: {} tier", slot.kind);
      if (!slot.name.empty()) where += fmt::format(" '{}'", slot.name);
      if (slot.kind == "nvme") where += fmt::format(" at {}", slot.nvme.path.string());
      if (slot.kind == "hbm") where += " (set hbm.mode = kOff to run without it)";
      // A tier's own messages start with "<kind> tier: " (HostTier::Create's do): said once.
      const std::string own = fmt::format("{} tier: ", slot.kind);
      const Status refused = t.status();  // a copy: Result::status() returns by value
      const std::string& message = refused.message();
      if (message.starts_with(own))
        return Reworded(refused, fmt::format("{}: {}", where, std::string_view(message).substr(own.size())));
      return refused.WithContext(where);
    }
    tiers.push_back(NamedTier{std::move(t).value(), slot.name});
  }
  return tiers;
}

}  // namespace
}  // namespace store_internal

Result<std::unique_ptr<Store>> Store::Open(const StoreOptions& options) {
  TERRACE_RETURN_IF_ERROR(store_internal::ValidateStoreEnums(options));  // before any tier creates files
  TERRACE_ASSIGN_OR_RETURN(auto tiers, store_internal::BuildTiers(options));
  if (tiers.empty()) {
    return Status::InvalidArgument("store options configure no tier; enable host (host.capacity_bytes > 0), hbm "
                                   "(hbm.mode other than kOff) or nvme (nvme.path), or list tiers in tier_list");
  }
  TERRACE_ASSIGN_OR_RETURN(auto impl, store_internal::OpenImpl(options, std::move(tiers)));
  return std::unique_ptr<Store>(new Store(std::move(impl)));
}

}  // namespace terrace
