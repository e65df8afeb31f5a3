// The data directory of `terrace demo` (default ./terrace-data) and what --fresh may remove.
//
// Layout: DIR/terrace-demo.marker (the demo created DIR's contents), DIR/model/ (the k3-small
// checkpoint: config.json + model.safetensors), DIR/kv, DIR/state, DIR/experts (Terrace stores,
// each with its own terrace-demo.marker), DIR/demo-run.json (the last run's figures; its first
// member is the generator mark, JsonTextWithMark), DIR/report.html (its `terrace report` page, with
// the HTML generator mark), and DIR/model.tmp while the model is built (a stopped run's is removed
// by the next one). A demo-run.json or report.html without its mark is not the demo's (a
// demo-run.json written before the mark was added is refused too: move or delete it). A DIR of an
// earlier demo version (terrace.data and index/ directly in DIR) is also recognised. A store folder
// may also hold the index folders Terrace's recovery set aside beside its index/ (index.damaged-*,
// index.reformatted-*, index.rebuilding; only index files in each): the demo's too, --fresh removes
// them. A run holds a flock on DIR itself (cmd_demo.cpp), so nothing here races another demo.
// Thread-safety: free functions, no shared state.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "terrace/status.h"

namespace terrace::cli {

inline constexpr const char* kDemoMarker = "terrace-demo.marker";
inline constexpr const char* kDemoRunJson = "demo-run.json";
inline constexpr const char* kDemoReportHtml = "report.html";
inline constexpr const char* kDemoModelDir = "model";
inline constexpr const char* kDemoModelTmpDir = "model.tmp";  // the model while it is built
inline constexpr const char* kDemoStores[] = {"kv", "state", "experts"};

// Why `dir` may not be used (or removed) as the demo's data directory; empty when it may: it is
// absent, empty, or holds only what the demo creates, with the top-level marker. `flag` names the
// CLI flag in messages.
std::string WhyNotDemoDir(const std::filesystem::path& dir, std::string_view flag);

// --fresh: removes what the demo created in `dir` (the entries of the layout above, and nothing
// else; `dir` itself stays). Ok(false) when there was nothing to remove. InvalidArgument (nothing
// removed) when `dir` is a symlink, not a directory, or holds anything the demo did not create;
// IoError when a removal fails.
Result<bool> RemoveDemoDir(const std::filesystem::path& dir, std::string_view flag);

// Writes `content` to `path` (DIR/demo-run.json or DIR/report.html) as WriteOutputFile does, with the
// ownership rule of its format (OutputFormat::kJson or kHtml): an existing file there without the
// demo's mark is left alone and InvalidArgument names it (nothing written).
Status WriteDemoFile(const std::filesystem::path& path, std::string_view content);

// Removes what a stopped run left of the demo's store in `store` (DIR/kv, DIR/state or DIR/experts)
// when nothing of it can be completed: neither terrace.data nor terrace.data.creating, and only a
// store's own files (its marker, index/ with index files only: a creation stopped before its data
// file, or a removal stopped after it). The NVMe tier refuses such a folder (not empty, no store).
// For a DIR that WhyNotDemoDir accepted. Ok(true) when it removed something (a note naming it goes
// to stderr), Ok(false) when there was nothing to remove; IoError naming `flag` when a removal fails.
Result<bool> RemoveUnfinishedDemoStore(const std::filesystem::path& store, std::string_view flag);

// Removes DIR/model.tmp (a stopped model build): its checkpoint files and temporary files, then the
// folder. Ok when absent; InvalidArgument (nothing removed) when it holds anything else.
Status RemoveStoppedModelBuild(const std::filesystem::path& dir);

}  // namespace terrace::cli
