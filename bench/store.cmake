# Store-level benchmarks: directory lookups.
add_executable(bench_store_lookup ${CMAKE_CURRENT_LIST_DIR}/store/lookup_bench.cpp)
target_link_libraries(bench_store_lookup PRIVATE terrace::terrace terrace_build_flags fmt::fmt)
