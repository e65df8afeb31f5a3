// io_uring implementation of IoEngine: `rings` rings of `queue_depth` entries over one file.
//
// A caller of Execute() takes one ring for the whole call (first free ring, else it waits for
// one), so each ring is driven by one thread at a time and no completion crosses threads.
#pragma once

#include <memory>

#include "tiers/nvme/io_engine.h"

namespace terrace::nvme {

Result<std::unique_ptr<IoEngine>> OpenUringEngine(const IoEngineConfig& config);

}  // namespace terrace::nvme
