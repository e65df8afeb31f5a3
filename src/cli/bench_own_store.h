// The cleanup of a store a bench made itself (`terrace bench experts`, `terrace bench kv`): it
// knows the store is its own because the directory was absent or empty right before it opened the
// NVMe tier there (CheckStillNew), so it removes the store marked or not (a failed creation, or a
// marker write that failed on a full disk, leaves it unmarked; owned_dirs.h).
// Thread-safety: free functions, no shared state.
#pragma once

#include <filesystem>
#include <string_view>

#include "terrace/status.h"

namespace terrace::cli {

// For a `dir` whose store the caller made (see above): removes its terrace.data, terrace.data.creating,
// index/ and `marker` (RemoveStoreFiles) when those are all `dir` holds (NonStoreEntry: the files
// regular, terrace.data a Terrace data file, index/ a real directory of index files only). Ok(false) when `dir` is absent or empty. InvalidArgument
// naming `flag`, `dir` and the first other entry, nothing removed; IoError when a removal fails.
Result<bool> RemoveOwnStore(const std::filesystem::path& dir, std::string_view marker, std::string_view flag);

// For a `dir` whose store the caller made and keeps (--keep): writes `marker` (WriteMarker, naming
// `who`) when `dir` holds a part of a store (terrace.data, terrace.data.creating or index/) and no
// marker, so a later run recognises it. Ok when nothing needed marking; WriteMarker's error otherwise.
Status MarkOwnStore(const std::filesystem::path& dir, std::string_view marker, std::string_view who);

// What a bench checks right before it opens a store it will take as its own (and later remove):
// Ok when `path` (--dir itself, or a pool's folder under it) is absent or an empty directory. Else
// Unavailable (a runtime failure, exit 1): `flag` `dir` gained entries while the bench ran, nothing
// in it was removed, give a `flag` no other process uses; the caller then removes and marks nothing.
// Between this check and the open another process can still write there: it narrows the window, a
// --dir that no other process uses closes it.
Status CheckStillNew(const std::filesystem::path& dir, const std::filesystem::path& path, std::string_view flag);

// Test hook, so a test can put another process's store into a bench's --dir exactly before the
// bench's store open instead of racing one: when TERRACE_TEST_STORE_OPEN_GATE names a file, creates
// "<file>.waiting" and waits (at most 60 s) until the file exists; callers run it right before
// CheckStillNew. Unset or empty: does nothing.
void WaitAtStoreOpenGate();

}  // namespace terrace::cli
