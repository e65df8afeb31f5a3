// Safe file access for the CLI: every path a user passes to a flag goes through these.
//
// Output files. Terrace writes an output file only where the path is absent or names a regular file.
// The last component is not followed: a symbolic link, a directory, a FIFO, a socket or a device node
// is refused and left exactly as it was (renaming over it would replace the link or the node; writing
// into it would block on a FIFO or go to a place the user did not name). The content goes to a
// temporary file in the same directory (".terrace-tmp-<pid>-<n>"), is fsynced, and is renamed over
// the target only after the target has been checked again; on any failure, and on a SIGINT/SIGTERM
// that ends the process while it is written, the temporary file is removed and the target is
// untouched. What a killed process (SIGKILL) left, regular files of that name pattern (also with the
// ".tmp.<pid>" suffix of the safetensors writer) of this user whose <pid> no longer runs, is removed
// from the folder by the next write there. (Between the last check and rename(2) another process could
// still swap the target; the window is one syscall.)
//
// Ownership (OutputRules). An existing regular file is replaced only when the command was given
// --force, or when Terrace itself wrote it: its first bytes carry the mark Terrace writes in that
// format (src/common/generator_mark.h). Formats with no room for a mark (PNG, trace .jsonl) need
// --force. A model checkpoint Terrace wrote (IsTerraceCheckpoint) carries the safetensors mark, yet is
// no command's output: replaced only with --force, as `model init --out` asks. A path that is the
// same file as one of the command's inputs is refused even with --force.
// A refusal is InvalidArgument naming the flag and the path and saying how to proceed. The overloads
// without OutputRules skip the ownership rule: only for paths inside a directory the CLI owns through
// its marker (owned_dirs.h), whose regular files are Terrace's.
//
// Input files. Symbolic links are followed; what they lead to must be a regular file. A FIFO, device,
// socket or directory is refused with a message naming the flag instead of being opened (opening a
// FIFO blocks until a writer appears; /dev/zero never ends). Reads are bounded by a byte limit.
//
// Errors: a path of the wrong kind (or a missing input) is InvalidArgument/NotFound with a message
// that starts with the flag, meant for FailUsage (exit 2); I/O failures are IoError (exit 1), a full
// file system (ENOSPC, EDQUOT) OutOfCapacity (exit 1) (FileErrno).
// Thread-safety: all functions may be called concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "terrace/status.h"

namespace terrace::cli {

// The Status of a failed file call on `path` for `flag`: "<flag> <path>: <what>: <strerror(err)>",
// OutOfCapacity for a full file system or quota (ENOSPC, EDQUOT), IoError for any other errno.
Status FileErrno(int err, std::string_view what, const std::filesystem::path& path, std::string_view flag);

// "a directory", "a symbolic link", "a FIFO", "a socket", "a block device", "a character device",
// "a regular file", or "missing" for the entry `path` itself (lstat: not followed).
std::string DescribePathKind(const std::filesystem::path& path);
// True when the entry `path` itself (lstat: not followed) exists and its S_IFMT type is `kind`
// (S_IFREG, S_IFDIR, ...).
bool IsKind(const std::filesystem::path& path, unsigned kind);
// True when `path` itself (not followed) is a directory owned by this process's effective user:
// what a sweep of a killed run's leftovers may remove.
bool IsOwnRealDir(const std::filesystem::path& path);

// What a process puts in the names of its temporary files: "<pid>.<8 hex digits>", the hex digits
// HostTag(). A pid names a process only on one host and in one pid namespace, so a sweep trusts
// kill(2) only for names that carry its own HostTag (a volume shared by containers or over NFS).
std::string ProcessTag();
// The low 32 bits of XXH3-64 (terrace::Checksum) of "<host name>/<inode of /proc/self/ns/pid>"
// (0 for the inode when it cannot be read), as 8 lower-case hex digits.
std::string HostTag();

// For a name `prefix` + ProcessTag() + rest that a process gives its temporary files: the decimal
// <pid> when the name carries this process's HostTag and no process with that pid runs any more
// (kill(2) says ESRCH), so the entry is a killed run's leftover; *rest is set to what follows the
// tag. nullopt when `name` is not of that form, carries another host's or pid namespace's tag (or
// none: names of older versions), the pid is this process's, or that process may still run.
std::optional<long> DeadPidAfter(std::string_view name, std::string_view prefix, std::string_view* rest);

// What an output file holds, which decides the mark that shows Terrace wrote it.
enum class OutputFormat : unsigned char {
  kHtml,         // kHtmlGeneratorMeta in the first KiB of a file starting "<!DOCTYPE html>"
  kSvg,          // kSvgGeneratorComment straight after the opening <svg ...> tag
  kSafetensors,  // "generator":"terrace" in the header's __metadata__ (as SafetensorsWriter writes it)
  kPrometheus,   // first line kPrometheusGeneratorLine
  kPng,          // a tEXt chunk "Software" = kPngGeneratorText straight after IHDR (WithPngMark)
  kJson,         // a JSON object whose first member is kJsonGeneratorKey: kJsonGeneratorValue (DIR/demo-run.json)
  kTrace,        // Mooncake JSONL, no mark: likewise
};

// One command's rule for its output files (see "Ownership" above).
struct OutputRules {
  struct Input {
    std::string flag;  // as the user wrote it: "--in", "RUN.json"
    std::filesystem::path path;
  };
  OutputFormat format = OutputFormat::kTrace;
  bool force = false;         // the command's --force: replace any regular file
  std::vector<Input> inputs;  // never replaced, even with --force

  // A copy for another file of the same command.
  OutputRules As(OutputFormat f) const {
    OutputRules r = *this;
    r.format = f;
    return r;
  }
};

// True when `head` (the first bytes of an existing file, up to kMarkProbeBytes) carries the mark
// Terrace writes in `format`; always false for formats without a mark.
inline constexpr std::size_t kMarkProbeBytes = std::size_t{1} << 20;
bool HasTerraceMark(OutputFormat format, std::string_view head);
// The head of `path` (its first kMarkProbeBytes at most) when it is a regular file (not a symlink)
// carrying the mark Terrace writes in `format`: a file Terrace wrote, which it may replace or remove
// as its own; nullopt otherwise. IsMarkedTerraceFile: whether there is one.
std::optional<std::string> MarkedTerraceFileHead(const std::filesystem::path& path, OutputFormat format);
bool IsMarkedTerraceFile(const std::filesystem::path& path, OutputFormat format);
// True when `head` is the start of a safetensors file of a model checkpoint Terrace wrote: marked as
// Terrace's and holding kSafetensorsCheckpointKey in its __metadata__ (`model init` writes it into
// every checkpoint file). Such a file is a model, not an output: an output flag replaces it only with
// --force, though it carries the mark.
bool IsTerraceCheckpoint(std::string_view head);

// `png` with Terrace's mark (kPng above) inserted after its IHDR chunk; `png` unchanged when it does
// not start with the PNG signature and an IHDR chunk.
std::string WithPngMark(std::string_view png);

// Ok when `path` may be written as an output file: absent or a regular file (not a symlink) that
// `rules` allow replacing, and its parent is an existing directory. InvalidArgument naming `flag`
// otherwise ("<flag> <path> is a FIFO; ...", "... Terrace did not write it; ... --force ...").
Status CheckOutputFile(const std::filesystem::path& path, std::string_view flag, const OutputRules& rules);
// Without the ownership rule: any regular file may be replaced (paths inside an owned directory).
Status CheckOutputFile(const std::filesystem::path& path, std::string_view flag);

// Writes an output file as described above, checking `path` against `rules` before and again just
// before the rename. produce(tmp) must create `tmp` (a regular file; it does not exist when produce
// is called) and write the whole content to it; it may itself write to a temporary name and rename
// onto `tmp`. The result is fsynced and renamed over `path`.
Status WriteOutputFile(const std::filesystem::path& path, std::string_view flag, const OutputRules& rules,
                       const std::function<Status(const std::filesystem::path& tmp)>& produce);
// The same for content already in memory.
Status WriteOutputFile(const std::filesystem::path& path, std::string_view flag, const OutputRules& rules,
                       std::string_view content);
// The same for a `produce` whose own errors name only `tmp` (a SafetensorsWriter's Write): its
// failure is told in the user's words, "<flag> <path>: cannot write <what>: <its message>".
Status WriteOutputFileNamingTarget(const std::filesystem::path& path, std::string_view flag, const OutputRules& rules,
                                   std::string_view what,
                                   const std::function<Status(const std::filesystem::path& tmp)>& produce);
// Without the ownership rule (paths inside an owned directory only).
Status WriteOutputFile(const std::filesystem::path& path, std::string_view flag,
                       const std::function<Status(const std::filesystem::path& tmp)>& produce);
Status WriteOutputFile(const std::filesystem::path& path, std::string_view flag, std::string_view content);

// InvalidArgument when the output `path` lies inside the directory `dir` (both resolved through their
// symlinks; neither need exist): the command keeps its own files there (a --store), which no output
// replaces, even with --force. Ok when `dir` is empty.
Status CheckOutsideDir(const std::filesystem::path& path, std::string_view flag, const std::filesystem::path& dir,
                       std::string_view dir_flag);

// Ok when `path` (following symlinks) is a regular file of at most max_bytes. NotFound when it does
// not exist, InvalidArgument when it is not a regular file or is too large; both name `flag`.
Status CheckInputFile(const std::filesystem::path& path, std::string_view flag,
                      std::uint64_t max_bytes = UINT64_MAX);

// Reads a whole input file, refusing what CheckInputFile refuses. Never blocks on a FIFO: the file
// is opened O_NONBLOCK and checked with fstat before anything is read.
Result<std::string> ReadInputFile(const std::filesystem::path& path, std::string_view flag, std::uint64_t max_bytes);

// Ok when `path` (following symlinks) is a directory. NotFound / InvalidArgument naming `flag`.
Status CheckInputDir(const std::filesystem::path& path, std::string_view flag);

// A model directory given to `flag`: a directory with a config.json, whose *.safetensors and *.json
// entries (the files a model load opens) are all regular files (symlinks to regular files
// accepted). InvalidArgument naming `flag` otherwise (and DIR/model when that is the model: a
// demo's data directory).
Status CheckModelDirInput(const std::filesystem::path& path, std::string_view flag);
// Those files of a model directory (config.json, *.safetensors, *.json), as inputs of `flag` for
// OutputRules::inputs. Unreadable entries are left out.
std::vector<OutputRules::Input> ModelDirInputs(const std::filesystem::path& path, std::string_view flag);

}  // namespace terrace::cli
