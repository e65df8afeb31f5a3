// The cleanup of a store a bench made itself (`terrace bench experts`, `terrace bench kv`): it
// knows the store is its own because the directory was absent or empty when it opened the NVMe
// tier there, so it removes the store marked or not (a failed creation, or a marker write that
// failed on a full disk, leaves it unmarked; owned_dirs.h).
// Thread-safety: free functions, no shared state.
#pragma once

#include <filesystem>
#include <string_view>

#include "terrace/status.h"

namespace terrace::cli {

// For a `dir` whose store the caller made (see above): removes its terrace.data, terrace.data.creating,
// index/ and `marker` (RemoveStoreFiles) when those are all `dir` holds (the files regular, index/ a
// real directory of index files only). Ok(false) when `dir` is absent or empty. InvalidArgument
// naming `flag`, `dir` and the first other entry, nothing removed; IoError when a removal fails.
Result<bool> RemoveOwnStore(const std::filesystem::path& dir, std::string_view marker, std::string_view flag);

// For a `dir` whose store the caller made and keeps (--keep): writes `marker` (WriteMarker, naming
// `who`) when `dir` holds a part of a store (terrace.data, terrace.data.creating or index/) and no
// marker, so a later run recognises it. Ok when nothing needed marking; WriteMarker's error otherwise.
Status MarkOwnStore(const std::filesystem::path& dir, std::string_view marker, std::string_view who);

}  // namespace terrace::cli
