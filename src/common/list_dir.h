// ListDir: a directory's entries without std::filesystem's exceptions. A range-for over
// std::filesystem::directory_iterator(dir, ec) checks only the opening: its ++ is the overload
// that throws filesystem_error when reading the next entry fails (EIO, a directory removed or
// remounted meanwhile), and no exception may leave Terrace's API or end the CLI as an "internal
// error". Pure function; thread-safe.
#pragma once

#include <filesystem>
#include <system_error>
#include <vector>

namespace terrace {

// The entries of `dir` (no "." or ".."), in the order the OS lists them. On a failure to open or
// read it, `*ec` holds the error and the entries read before it are returned; else `*ec` is cleared.
inline std::vector<std::filesystem::directory_entry> ListDir(const std::filesystem::path& dir, std::error_code* ec) {
  std::vector<std::filesystem::directory_entry> out;
  for (std::filesystem::directory_iterator it(dir, *ec), end; !*ec && it != end; it.increment(*ec)) out.push_back(*it);
  return out;
}

}  // namespace terrace
