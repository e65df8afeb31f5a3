// Directories the CLI creates and may later remove: a store directory made by `terrace demo` or
// `terrace bench tiers` is marked with a marker file, and only a directory that holds a Terrace
// store (terrace.data starting with the TRRCNVME magic, the index/ folder holding only index files)
// plus that marker and nothing else is ever removed, or what a removal (or creation) stopped part-way
// left of one: the marker with some of index/ and terrace.data.creating (the marker is removed last
// and written right after the store is made, so a marked folder is always the CLI's). Everything else
// is refused and left untouched.
// Thread-safety: free functions, no shared state.
#pragma once

#include <cstddef>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::cli {

// A store directory's parts (docs/nvme-format.md): its data file, the name that file has while its
// creation is under way ("Creation"), and its index folder.
inline constexpr std::string_view kDataFile = "terrace.data";
inline constexpr std::string_view kCreatingFile = "terrace.data.creating";
inline constexpr std::string_view kIndexDir = "index";

// Why `dir` holds something besides a store's parts (terrace.data with the TRRCNVME magic,
// terrace.data.creating, index/ of index files only) and the regular file `marker`: the first such
// entry, named with `flag`, or a listing failure; empty when it holds only those, or nothing.
std::string NonStoreEntry(const std::filesystem::path& dir, std::string_view marker, std::string_view flag);

// `flag`'s store directory: absent (it is created) or a directory (symlinks to one accepted).
// InvalidArgument naming the flag otherwise (a regular file, FIFO, device, ...), and for a model
// directory (config.json with model.safetensors or its index), where a store would mix with weights.
Status CheckStoreDirArg(const std::filesystem::path& dir, std::string_view flag);

// True when `data` is a Terrace data file: a regular file (not a symlink) whose superblock unit
// starts with the TRRCNVME magic, or holds a slot that decodes (the first slot is all zeros until
// the store has rewritten its superblock).
bool IsStoreDataFile(const std::filesystem::path& data);

// The first entry of the index directory `index` (a store's index/, or one moved aside as
// index.damaged-*) that an index never holds: anything but a regular file whose name
// nvme::IsIndexStoreFileName accepts, so a subdirectory, a symlink or a file of another name.
// `index` itself when it is not a real directory or cannot be listed; nullopt when every entry is
// an index file (an empty directory included). What decides whether a folder may be removed as
// an index. A regular file named `marker` (when not empty) is taken as the index's own too.
std::optional<std::filesystem::path> ForeignIndexEntry(const std::filesystem::path& index,
                                                       std::string_view marker = {});

// A path for a new scratch directory (not created) of a command whose directory flag `flag` was
// not given: <temporary directory>/<prefix>-<ProcessTag()>-<8 random hex digits>, the temporary directory being
// std::filesystem::temp_directory_path's ($TMPDIR, TMP, TEMP or TEMPDIR, else /tmp). Unavailable
// naming the variable, its value and `flag` when that is not an existing directory.
Result<std::filesystem::path> ScratchDirPath(std::string_view prefix, std::string_view flag);

// Removes, from `parent` (the temporary directory of ScratchDirPath), the scratch directories of
// killed runs: real directories of this user named <prefix>-<ProcessTag()>-<8 hex digits> whose <pid>
// no longer runs (DeadPidAfter) and that HoldsOnlyOwnedStores(dir, names, marker); a note naming each goes to stderr,
// prefixed with `who`. Anything else is left alone; failures are skipped.
void RemoveDeadScratchDirs(const std::filesystem::path& parent, std::string_view prefix,
                           std::initializer_list<std::string_view> names, std::string_view marker,
                           std::string_view who);

// True when dir/terrace.data exists (any kind of entry).
bool StoreDataExists(const std::filesystem::path& dir);

// Removes `index` when it is what a stopped store creation left after its data file went (someone
// deleted terrace.data.creating): `dir` holds neither terrace.data nor terrace.data.creating, and
// `index` is a real directory holding the creation marker (nvme::kIndexCreatingMarker, or the
// ".tmp" it is written through) and otherwise only index files (no ForeignIndexEntry). The tier
// refuses such an index as an incomplete store; without the data file nothing of it can be
// completed. True when it was removed; a note naming it goes to stderr, prefixed with `who`.
bool RemoveOrphanedIndexCreation(const std::filesystem::path& dir, const std::filesystem::path& index,
                                 std::string_view who);

// True when `dir` holds a Terrace store created by `who`: a real directory (not a symlink) whose
// entries are exactly terrace.data (IsStoreDataFile), optionally index/ (a directory holding only
// index files: no ForeignIndexEntry), and the regular file `marker`.
bool IsOwnedStore(const std::filesystem::path& dir, std::string_view marker);

// True when IsOwnedStore(dir, marker), or `dir` is what a stopped removal or creation of one left: a
// real directory holding the regular file `marker` and otherwise only a part of such a store
// (index/ with index files only, terrace.data, a regular terrace.data.creating).
bool IsOwnedStoreOrLeftover(const std::filesystem::path& dir, std::string_view marker);

// Whether HoldsOnlyOwnedStores accepts an empty sub-folder: only inside a folder proven the bench's
// own (a scratch directory of a dead process, by its name), never in a folder the user named.
enum class EmptySubDirs { kRefuse, kAccept };

// True when `dir` holds at least one entry and each is one of `names` and either an
// IsOwnedStoreOrLeftover(entry, marker) or, with EmptySubDirs::kAccept, an empty real directory:
// what a killed run of a bench that keeps its stores in sub-folders of its --dir left.
bool HoldsOnlyOwnedStores(const std::filesystem::path& dir, std::initializer_list<std::string_view> names,
                          std::string_view marker, EmptySubDirs empty);

// Why HoldsOnlyOwnedStores(dir, names, marker, EmptySubDirs::kRefuse) is false for a `dir` holding
// entries: a sentence naming (with `flag`) the first entry it refuses - one not in `names`, a
// sub-folder's entry that is not part of a store, an empty sub-folder, a store without `marker` -
// or the listing failure; empty when it is true, or `dir` is empty or absent.
std::string WhyNotOnlyOwnedStores(const std::filesystem::path& dir, std::initializer_list<std::string_view> names,
                                  std::string_view marker, std::string_view flag);

// Who uses the store in `dir` right now: "another process (pid N) (it holds the lock on
// DIR/terrace.data)" when a process holds the flock the NVMe tier takes on its data file (or on
// terrace.data.creating while it creates one), readers included, for 2 s (a killed process's lock
// lingers a moment); nullopt when none does.
std::optional<std::string> StoreInUse(const std::filesystem::path& dir);

// The pid of a process that has the RocksDB index in `index` open (it holds an fcntl write lock on
// index/LOCK while open); nullopt when none has, or there is no LOCK file. One look.
std::optional<long> IndexLockHolder(const std::filesystem::path& index);

// Removes the store in `dir` if IsOwnedStoreOrLeftover(dir, marker): its terrace.data, index/ and marker;
// the directory itself stays. Ok(false) when `dir` is absent or empty (nothing to do). A `dir`
// holding anything else is refused with InvalidArgument (naming `flag` and the first foreign
// entry, or saying the store has no marker of `who`) and nothing is removed; so is a store a process
// uses right now (StoreInUse: a run still going is no leftover). IoError when a removal fails.
Result<bool> RemoveOwnedStore(const std::filesystem::path& dir, std::string_view marker, std::string_view flag,
                              std::string_view who);

// RemoveOwnedStore for each sub-folder `names` of `dir`, then removes each sub-folder once empty:
// for a `dir` that HoldsOnlyOwnedStores accepted, and a bench's own cleanup. Each sub-folder is
// removed under a StopSignalHold, so a second Ctrl-C never leaves an unmarked empty sub-folder
// (which a user-named --dir would then refuse). Every sub-folder is checked first: a refusal of one
// removes none; `note` (when not empty) goes to stderr once all pass. The first error, naming `flag`.
Status RemoveOwnedSubStores(const std::filesystem::path& dir, std::initializer_list<std::string_view> names,
                            std::string_view marker, std::string_view flag, std::string_view who,
                            std::string_view note = {});

// Removes a store's own files in `dir` (terrace.data, terrace.data.creating, index/, then `marker`,
// last, so a stop part-way leaves a marked leftover), and nothing else: for a caller that checked
// `dir` holds only those (RemoveOwnedStore does). The directory itself stays. IoError naming `flag`
// when a removal fails.
Status RemoveStoreFiles(const std::filesystem::path& dir, std::string_view marker, std::string_view flag);

// The capacity (bytes) recorded in the superblock of dir/terrace.data, for a command that reopens
// an existing store without being told its capacity. NotFound when there is no terrace.data;
// InvalidArgument/Corruption when it is not a Terrace data file.
Result<std::uint64_t> ExistingStoreCapacity(const std::filesystem::path& dir);
// The same for dir/terrace.data.creating, a creation a kill interrupted (its superblock is written
// first, docs/nvme-format.md "Creation"): NotFound when it is absent; an error when it holds no
// Terrace superblock (empty, zeros, or not Terrace's).
Result<std::uint64_t> InterruptedCreationCapacity(const std::filesystem::path& dir);

// The first nvme::kSuperblockBytes of the data file or device `data` (fewer when it is shorter): the
// superblock unit that nvme::Superblock::DecodeUnit reads. NotFound when `data` does not exist;
// IoError otherwise. With follow_symlinks false a symlink is refused (O_NOFOLLOW). Opens
// non-blocking, so a FIFO in its place fails instead of hanging.
Result<std::vector<std::byte>> ReadSuperblockUnit(const std::filesystem::path& data, bool follow_symlinks);

// Writes dir/marker (a one-line text naming `who`) with the safe writer.
Status WriteMarker(const std::filesystem::path& dir, std::string_view marker, std::string_view who);

}  // namespace terrace::cli
