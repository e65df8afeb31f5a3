#include <catch2/catch.hpp>

#include <cstring>
#include <unordered_set>

#include "terrace/block.h"
#include "terrace/hash.h"
#include "test_util.h"

using namespace terrace;

TEST_CASE("BlockKey text form round-trips and rejects malformed input") {
  for (std::uint64_t i = 0; i < 100; ++i) {
    BlockKey k = testing::TestKey(i, static_cast<BlockKind>(i % 4), static_cast<std::uint32_t>(i * 31));
    auto parsed = BlockKey::Parse(k.ToString());
    REQUIRE(parsed.ok());
    CHECK(*parsed == k);
  }
  for (const char* bad : {"", "1:kv:0", "1:kv:0:xyz", "1:bogus:0:000000000000000000000000000000ff",
                          "-1:kv:0:000000000000000000000000000000ff", "1:kv:0:00000000000000000000000000000ff",
                          "1:kv:0:000000000000000000000000000000fg"}) {
    auto r = BlockKey::Parse(bad);
    CHECK(r.status().IsInvalidArgument());
    CHECK(r.status().message().find("ns:kind:layer") != std::string::npos);
  }
}

TEST_CASE("BlockKey binary form round-trips and preserves order") {
  BlockKey prev;
  std::byte prev_buf[BlockKey::kEncodedSize];
  prev.EncodeTo(prev_buf);
  for (std::uint64_t i = 1; i < 200; ++i) {
    BlockKey k = testing::TestKey(i * 7919, static_cast<BlockKind>(i % 4), static_cast<std::uint32_t>(i % 5));
    std::byte buf[BlockKey::kEncodedSize];
    k.EncodeTo(buf);
    auto d = BlockKey::Decode(buf);
    REQUIRE(d.ok());
    CHECK(*d == k);
    int cmp = std::memcmp(prev_buf, buf, sizeof buf);
    CHECK((cmp < 0) == (prev < k));
    std::memcpy(prev_buf, buf, sizeof buf);
    prev = k;
  }
  std::byte bad[BlockKey::kEncodedSize] = {};
  bad[4] = std::byte{9};
  CHECK(BlockKey::Decode(bad).status().IsCorruption());
}

TEST_CASE("Chained content ids are deterministic and prefix-sensitive") {
  std::vector<std::int32_t> a = {1, 2, 3, 4}, b = {1, 2, 3, 5};
  ContentId root = RootContentId(7);
  CHECK(root == RootContentId(7));
  CHECK(root != RootContentId(8));
  ContentId ia = ChainContentId(root, a), ib = ChainContentId(root, b);
  CHECK(ia != ib);
  CHECK(ChainContentId(ia, b) != ChainContentId(ib, b));  // the parent matters
  CHECK(ChainContentId(root, a) == ia);
  // Pinned value: the hash must never change across versions or processes (cross-instance hits).
  CHECK(ChainContentId(ContentId{0, 0}, std::vector<std::int32_t>{}) == HashBytes(std::vector<std::byte>(16)));
  // Streaming over many tokens equals XXH3-128 of the documented byte string.
  std::vector<std::int32_t> many(1000);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<std::int32_t>(i * 2654435761u);
  ContentId parent{0x0123456789abcdefull, 0xfedcba9876543210ull};
  std::vector<std::byte> bytes;
  auto put_le = [&](std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  };
  put_le(parent.hi, 8);
  put_le(parent.lo, 8);
  for (std::int32_t t : many) put_le(static_cast<std::uint32_t>(t), 4);
  CHECK(ChainContentId(parent, many) == HashBytes(bytes));
}

TEST_CASE("Checksum detects a single bit flip") {
  auto data = testing::TestBytes(1, 4096);
  auto c = Checksum(data);
  data[100] ^= std::byte{0x10};
  CHECK(Checksum(data) != c);
  std::unordered_set<BlockKey> set;
  for (int i = 0; i < 1000; ++i) set.insert(testing::TestKey(i));
  CHECK(set.size() == 1000);
}
