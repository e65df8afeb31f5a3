#include "src/common/aligned_buffer.h"

#include <catch2/catch.hpp>

#include "test_util.h"

#include <cstdint>
#include <cstring>

using terrace::AlignedBuffer;

TEST_CASE("aligned buffer: address and room are multiples of the alignment", "[common][aligned]") {
  for (std::size_t align : {std::size_t{64}, std::size_t{512}, std::size_t{4096}}) {
    for (std::size_t n : {std::size_t{1}, align - 1, align, align + 1, 3 * align + 7}) {
      AlignedBuffer b(n, align);
      REQUIRE(b.ok());
      CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % align == 0);
      CHECK(b.size() == n);
      CHECK(b.capacity() % align == 0);
      CHECK(b.capacity() >= n);
      CHECK(b.capacity() < n + align);
      std::memset(b.data(), 0xab, b.capacity());  // the whole room is writable (ASan checks it)
    }
  }
}

TEST_CASE("aligned buffer: move hands over ownership, Ensure keeps a big enough buffer", "[common][aligned]") {
  AlignedBuffer a(10000);
  std::byte* p = a.data();
  AlignedBuffer b(std::move(a));
  CHECK(b.data() == p);
  CHECK(a.data() == nullptr);
  CHECK(a.size() == 0);
  CHECK(b.Ensure(12288));  // within 12288 bytes of room: kept
  CHECK(b.data() == p);
  CHECK(b.size() == 12288);
  CHECK(b.Ensure(12289));  // more than the room: replaced
  CHECK(b.size() == 12289);
  CHECK(b.capacity() == 16384);
  AlignedBuffer empty;
  CHECK(empty.ok());
  CHECK(empty.span().empty());
}

TEST_CASE("aligned buffer: a failed allocation is reported, not thrown", "[common][aligned]") {
  // Sanitizer allocators abort on an impossible size instead of returning null.
  if (terrace::testing::kSanitizedBuild) {
    WARN("skipped in a sanitized build: its allocator aborts on an impossible size");
    return;
  }
  AlignedBuffer huge(std::size_t{1} << 62);
  CHECK_FALSE(huge.ok());
  CHECK(huge.data() == nullptr);
  CHECK(huge.span().empty());
}
