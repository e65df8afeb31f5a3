# NVMe tier micro-benchmark: sequential 1 MiB write/read and 4 KiB random reads at a queue depth,
# plus reopen time of a large index. bench/nvme/fio_compare.sh runs it beside fio and prints the ratios.
add_executable(bench_nvme_tier ${CMAKE_CURRENT_LIST_DIR}/nvme/nvme_tier_bench.cpp)
target_link_libraries(bench_nvme_tier PRIVATE terrace_build_flags terrace_tier_nvme terrace_common fmt::fmt
  CLI11::CLI11 RocksDB::rocksdb)
