// Who holds the lock on an NVMe data area, for the refusal of an open that could not take it.
// Defined in nvme_open.cpp.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::nvme {

// The pids that /proc/locks lists as holding a flock (LockDataArea's lock) on the file `fd` is open
// on, ascending, each once; empty when none is listed or /proc/locks cannot be read. One look: a
// holder may exit right after it.
std::vector<long> FlockHolderPids(int fd);

// Who FlockHolderPids(fd) says holds the lock, for a message: "another process (pid N)", "other
// processes (pids N, M)", or "another process" when it lists none; this process among the holders
// is named apart ("... and this process (pid P: another Store or tier_list entry)").
std::string FlockHolderText(int fd);

// The Unavailable of an open that LockDataArea refused with EWOULDBLOCK on `fd` (the open data area
// `data`): "NVMe store '<data>' is in use by <holder> (its data file is locked<detail>); <advice>",
// where <holder> is as FlockHolderText says; when the one holder is this process, the
// message says the store is already open in it (and drops `advice`, which is for another process).
Status DataAreaInUse(const std::filesystem::path& data, int fd, std::string_view detail, std::string_view advice);

}  // namespace terrace::nvme
