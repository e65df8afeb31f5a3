#include "src/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/common/generator_mark.h"

namespace terrace::model {
namespace {

Status ErrnoStatus(int err, std::string_view what, const std::filesystem::path& path) {
  std::string msg = fmt::format("{} '{}': {}", what, path.string(), std::strerror(err));
  if (err == ENOENT) return Status::NotFound(std::move(msg));
  return Status::IoError(std::move(msg), err == EINTR || err == EAGAIN);
}

Status WriteAll(int fd, const void* data, std::size_t size, const std::filesystem::path& path) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "cannot write", path);
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

// Writes the pieces to a temporary file next to `path`, fsyncs it and renames it over `path`.
Status WritePiecesAtomically(const std::filesystem::path& path, std::span<const std::span<const std::byte>> pieces) {
  const std::filesystem::path tmp = path.string() + fmt::format(".tmp.{}", ::getpid());
  // O_EXCL: a file that happens to have this name is not ours to truncate (or to rename over `path`).
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "cannot create the temporary file", tmp);
  Status s;
  for (const auto& piece : pieces) {
    s = WriteAll(fd, piece.data(), piece.size(), tmp);
    if (!s.ok()) break;
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoStatus(errno, "cannot fsync", tmp);
  if (::close(fd) != 0 && s.ok()) s = ErrnoStatus(errno, "cannot close", tmp);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoStatus(errno, "cannot rename into", path);
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

}  // namespace

// ---- SafetensorsFile ------------------------------------------------------------------------------

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "cannot open safetensors file", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoStatus(err, "cannot stat", path);
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  file->size_ = static_cast<std::uint64_t>(st.st_size);
  if (file->size_ > 0) {
    void* p = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, "cannot mmap", path);
    }
    file->base_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  TERRACE_RETURN_IF_ERROR(ParseSafetensorsHeader(std::span<const std::byte>(file->base_, file->size_),
                                                 path.string(), &file->header_));
  for (std::size_t i = 0; i < file->header_.entries.size(); ++i) file->index_.emplace(file->header_.entries[i].name, i);
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (base_ != nullptr) ::munmap(const_cast<std::byte*>(base_), size_);
}

Result<TensorView> SafetensorsFile::Get(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    return Status::NotFound(fmt::format("tensor '{}' is not in safetensors file '{}'", name, path_.string()));
  }
  const SafetensorsEntry& e = header_.entries[it->second];
  TensorView view;
  view.dtype = e.dtype;
  view.shape = e.shape;
  view.data = std::span<const std::byte>(base_ + header_.data_start + e.begin, e.end - e.begin);
  return view;
}

bool SafetensorsFile::Has(std::string_view name) const { return index_.find(name) != index_.end(); }

std::vector<std::string> SafetensorsFile::Names() const {
  std::vector<std::string> names;
  names.reserve(index_.size());
  for (const auto& [name, i] : index_) names.push_back(name);
  return names;
}

// ---- SafetensorsWriter ----------------------------------------------------------------------------

Status SafetensorsWriter::Add(std::string name, DType dtype, std::vector<std::int64_t> shape,
                              std::span<const std::byte> bytes) {
  if (name.empty() || name == "__metadata__") {
    return Status::InvalidArgument(fmt::format("tensor name '{}' is reserved or empty; choose another", name));
  }
  for (std::int64_t d : shape) {
    if (d < 0) return Status::InvalidArgument(fmt::format("tensor '{}': negative dim in {}", name, ShapeString(shape)));
  }
  const std::int64_t numel = NumElements(shape);
  if (numel < 0 || static_cast<std::uint64_t>(numel) > std::numeric_limits<std::size_t>::max() / DTypeSize(dtype)) {
    return Status::InvalidArgument(fmt::format("tensor '{}': shape {} of {} is too large to address; check the shape",
                                               name, ShapeString(shape), DTypeName(dtype)));
  }
  const auto expected = static_cast<std::size_t>(numel) * DTypeSize(dtype);
  if (bytes.size() != expected) {
    return Status::InvalidArgument(fmt::format("tensor '{}': {} bytes given for {} {} (expected {})", name,
                                               bytes.size(), DTypeName(dtype), ShapeString(shape), expected));
  }
  for (const auto& t : tensors_) {
    if (t.name == name) return Status::InvalidArgument(fmt::format("tensor '{}' was added twice", name));
  }
  data_bytes_ += bytes.size();
  tensors_.push_back(Pending{std::move(name), dtype, std::move(shape), {bytes.begin(), bytes.end()}});
  return Status::Ok();
}

Status SafetensorsWriter::AddF32(std::string name, const Tensor& tensor) {
  return Add(std::move(name), DType::kF32, tensor.shape, std::as_bytes(std::span<const float>(tensor.data)));
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

Status SafetensorsWriter::Write(const std::filesystem::path& path) const {
  std::vector<const Pending*> order;
  for (const auto& t : tensors_) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const Pending* a, const Pending* b) {
    const std::size_t sa = DTypeSize(a->dtype);
    const std::size_t sb = DTypeSize(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  nlohmann::json header = nlohmann::json::object();
  std::map<std::string, std::string> metadata = metadata_;
  metadata[std::string(kSafetensorsGeneratorKey)] = std::string(kSafetensorsGeneratorValue);
  header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const Pending* t : order) {
    header[t->name] = {{"dtype", DTypeName(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + t->bytes.size()}}};
    offset += t->bytes.size();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const std::exception& e) {  // invalid UTF-8 in a name or metadata value
    return Status::InvalidArgument(fmt::format("cannot write '{}': {}; use UTF-8 names", path.string(), e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::byte len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::byte>((static_cast<std::uint64_t>(text.size()) >> (8 * i)) & 0xFFu);

  std::vector<std::span<const std::byte>> pieces;
  pieces.emplace_back(len, 8);
  pieces.push_back(std::as_bytes(std::span<const char>(text)));
  for (const Pending* t : order) pieces.emplace_back(t->bytes);
  return WritePiecesAtomically(path, pieces);
}

Status WriteFileAtomically(const std::filesystem::path& path, std::string_view text) {
  const std::span<const std::byte> piece = std::as_bytes(std::span<const char>(text.data(), text.size()));
  return WritePiecesAtomically(path, std::span<const std::span<const std::byte>>(&piece, 1));
}

}  // namespace terrace::model
