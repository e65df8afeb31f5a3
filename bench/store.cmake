# Store-level benchmarks: directory lookups and batched NVMe reads.
add_executable(bench_store_lookup ${CMAKE_CURRENT_LIST_DIR}/store/lookup_bench.cpp)
target_link_libraries(bench_store_lookup PRIVATE terrace::terrace terrace_build_flags fmt::fmt)
# Store reads from NVMe: single Gets vs GetBatch.
add_executable(bench_store_nvme_batch ${CMAKE_CURRENT_LIST_DIR}/store/nvme_batch_bench.cpp)
target_link_libraries(bench_store_nvme_batch PRIVATE terrace::terrace terrace_build_flags fmt::fmt CLI11::CLI11)
