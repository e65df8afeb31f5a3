// Test helper for store_cli_pytest: swaps the values of the first two block records (in key order)
// of an NVMe store's RocksDB index, or with "copy" writes the first one's value over the second's,
// as a damaged index might hold them. Each record keeps a valid record_check (it covers the record,
// not the key), so only the data file's descriptors (or, for a copy, the overlap) can tell.
// Usage: swap_index_records INDEX_DIR [copy]; exit 0 when done.
#include <rocksdb/db.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const bool copy = argc == 3 && std::string(argv[2]) == "copy";
  if (argc != 2 && !copy) {
    std::fprintf(stderr, "usage: swap_index_records INDEX_DIR [copy]\n");
    return 2;
  }
  rocksdb::DB* db = nullptr;
  if (!rocksdb::DB::Open(rocksdb::Options(), argv[1], &db).ok()) return 1;
  std::vector<std::pair<std::string, std::string>> recs;
  {
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions()));
    for (it->SeekToFirst(); it->Valid() && recs.size() < 2; it->Next()) {
      if (!it->key().starts_with("!")) recs.emplace_back(it->key().ToString(), it->value().ToString());  // '!': bookkeeping
    }
  }
  int rc = 1;
  if (recs.size() == 2 && (copy || db->Put(rocksdb::WriteOptions(), recs[0].first, recs[1].second).ok()) &&
      db->Put(rocksdb::WriteOptions(), recs[1].first, recs[0].second).ok()) {
    rc = 0;
  }
  delete db;
  return rc;
}
