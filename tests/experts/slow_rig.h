// An ExpertOffload over ToyDir() whose expert home copies sit behind a deliberately slow,
// fault-injectable home tier: the host tier, or the real NVMe tier (a temp dir, O_DIRECT data
// file, batched io_uring reads) with its I/O engine wrapped for read faults. The fast (HBM) tier
// can be wrapped for faults too. Test support for prefetch_control_test.cpp and nvme_home_test.cpp.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "experts_test_util.h"
#include "tiers/fault/fault_tier.h"
#include "tiers/hbm/emulated_hbm_tier.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/fault_engine.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/uring_engine.h"

namespace terrace::experts::testing {

enum class Home { kHost, kNvme };
inline std::string_view HomeName(Home h) { return h == Home::kHost ? "host" : "nvme"; }

struct SlowRig {
  // Declared first: destroyed last, after the store has closed the NVMe tier inside it.
  std::unique_ptr<terrace::testing::TempDir> dir;  // NVMe home only
  TierId home_tier = TierId::kHost;
  SlowHomeTier* slow = nullptr;                    // the home tier, owned by the store (delay 0 at first)
  FaultInjectingTier* home_faults = nullptr;       // host home only: under `slow`
  SlowNvmeTier* nvme = nullptr;                    // NVMe home only: `slow` itself
  nvme::FaultInjectingIoEngine* nvme_engine = nullptr;  // NVMe home only: under the NVMe tier
  FaultInjectingTier* hbm_faults = nullptr;        // the fast tier's wrapper, when asked for
  std::unique_ptr<Store> store;
  std::shared_ptr<ExpertOffload> offload;

  // Stores `data` as `key`'s home copy, rotted at rest: its checksum fails at every read. Host:
  // the copy is put with one bit flipped under the good checksum. NVMe (whose puts check the
  // checksum): the good copy is put, then one bit of it is flipped in the data file.
  void PutRottenHomeCopy(const BlockKey& key, std::span<const std::byte> data);
};

// Flips one bit in the middle of every copy of the block whose bytes are `data` in the NVMe data
// file `file`, each found by its first 4 KiB at a 4 KiB-aligned extent start (the live extent and
// any freed one that still holds the same bytes). A buffered write: the tier's O_DIRECT reads of
// that range see it (the kernel writes dirty pages back before a direct read). Returns how many.
inline int RotOnDisk(const std::filesystem::path& file, std::span<const std::byte> data) {
  const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const std::size_t probe = std::min<std::size_t>(data.size(), 4096);
  std::vector<std::byte> buf(probe);
  int rotted = 0;
  for (off_t off = 0; ::pread(fd, buf.data(), probe, off) == static_cast<ssize_t>(probe); off += 4096) {
    if (std::memcmp(buf.data(), data.data(), probe) != 0) continue;
    const off_t at = off + static_cast<off_t>(data.size() / 2);
    std::byte b{};
    REQUIRE(::pread(fd, &b, 1, at) == 1);
    b ^= std::byte{0x10};
    REQUIRE(::pwrite(fd, &b, 1, at) == 1);
    ++rotted;
  }
  ::close(fd);
  return rotted;
}

inline void SlowRig::PutRottenHomeCopy(const BlockKey& key, std::span<const std::byte> data) {
  PutOptions po;
  po.tier = home_tier;
  if (nvme == nullptr) {
    home_faults->CorruptNextPuts(1);
    REQUIRE(store->Put(key, data, po).ok());
    return;
  }
  REQUIRE(store->Put(key, data, po).ok());
  REQUIRE(store->Flush().ok());
  REQUIRE(RotOnDisk(dir->path() / "store" / "terrace.data", data) >= 1);
}

// `store_threads`: the store's background threads. `wrap_hbm`: put the fast tier behind a
// FaultInjectingTier (which turns off its direct-read reservations: every copy into it is a Put).
inline SlowRig MakeSlowRig(ExpertOffloadOptions opt, unsigned store_threads, Home home = Home::kHost,
                           bool wrap_hbm = true) {
  const auto& config = ToyDir().config();
  const std::uint64_t total = ExpertOffload::TotalExpertBytes(config);
  SlowRig rig;
  std::string nvme_dir;
  if (home == Home::kNvme) {
    rig.dir = std::make_unique<terrace::testing::TempDir>("experts-slow-nvme");
    nvme_dir = (rig.dir->path() / "store").string();
  }
  StoreOptions so = ExpertOffload::OpenStoreOptions(total, opt.budget.Resolve(total), nvme_dir);
  so.background_threads = store_threads;
  auto host = HostTier::Create(so.host);
  REQUIRE(host.ok());
  auto hbm = EmulatedHbmTier::Create(so.hbm);
  REQUIRE(hbm.ok());
  std::array<std::unique_ptr<Tier>, kNumTiers> tiers;
  if (home == Home::kHost) {
    auto home_faults = std::make_unique<FaultInjectingTier>(std::move(host).value());
    rig.home_faults = home_faults.get();
    auto slow = std::make_unique<SlowTier>(std::move(home_faults), std::chrono::milliseconds(0));
    rig.slow = slow.get();
    tiers[static_cast<int>(TierId::kHost)] = std::move(slow);
  } else {
    so.nvme.logger = so.logger;
    // The factory runs inside Open only (the data file's engine), so `engine` outlives its use.
    nvme::FaultInjectingIoEngine* engine = nullptr;
    auto nvme = NvmeTier::OpenWithEngine(so.nvme, [&engine](const nvme::IoEngineConfig& cfg)
                                                      -> Result<std::unique_ptr<nvme::IoEngine>> {
      TERRACE_ASSIGN_OR_RETURN(auto base, nvme::OpenUringEngine(cfg));
      auto f = std::make_unique<nvme::FaultInjectingIoEngine>(std::move(base), /*seed=*/7);
      engine = f.get();
      return std::unique_ptr<nvme::IoEngine>(std::move(f));
    });
    if (!nvme.ok()) FAIL(nvme.status().ToString());
    REQUIRE(engine != nullptr);
    rig.nvme_engine = engine;
    auto slow = std::make_unique<SlowNvmeTier>(std::move(nvme).value(), std::chrono::milliseconds(0));
    rig.slow = rig.nvme = slow.get();
    tiers[static_cast<int>(TierId::kHost)] = std::move(host).value();
    tiers[static_cast<int>(TierId::kNvme)] = std::move(slow);
    rig.home_tier = opt.home = TierId::kNvme;
  }
  if (wrap_hbm) {
    auto faulty = std::make_unique<FaultInjectingTier>(std::move(hbm).value());
    rig.hbm_faults = faulty.get();
    tiers[static_cast<int>(TierId::kHbm)] = std::move(faulty);
  } else {
    tiers[static_cast<int>(TierId::kHbm)] = std::move(hbm).value();
  }
  auto store = Store::OpenWithTiers(so, std::move(tiers));
  if (!store.ok()) FAIL(store.status().ToString());
  rig.store = std::move(store).value();
  auto off = ExpertOffload::Create(config, ToyDir(), rig.store.get(), std::move(opt));
  if (!off.ok()) FAIL(off.status().ToString());
  rig.offload = *off;
  return rig;
}

inline int LayerOf(const BlockKey& k) { return static_cast<int>(k.layer); }
// The expert whose key (ExpertOffload::key) `k` is, or -1 (an expert's key id is a hash).
inline int ExpertOf(const ExpertOffload& offload, const BlockKey& k) {
  for (int e = 0; e < 4096; ++e) {
    auto key = offload.key(static_cast<int>(k.layer), e);
    if (!key.ok()) return -1;
    if (*key == k) return e;
  }
  return -1;
}

}  // namespace terrace::experts::testing
