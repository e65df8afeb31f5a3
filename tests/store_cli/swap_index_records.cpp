// Test helper for store_cli_pytest: swaps the values of the first two block records (in key order)
// of an NVMe store's RocksDB index, as a damaged index might hold them. Each record keeps a valid
// record_check (it covers the record, not the key), so only a comparison with the data file's
// descriptors can tell. Usage: swap_index_records INDEX_DIR. Prints the two keys (hex); exit 0.
#include <rocksdb/db.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: swap_index_records INDEX_DIR\n");
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
  if (recs.size() == 2 && db->Put(rocksdb::WriteOptions(), recs[0].first, recs[1].second).ok() &&
      db->Put(rocksdb::WriteOptions(), recs[1].first, recs[0].second).ok()) {
    rc = 0;
  }
  delete db;
  return rc;
}
