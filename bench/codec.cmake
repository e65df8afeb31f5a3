# KV / state codec throughput (CPU, one thread) against memcpy of the same bytes.
add_executable(bench_codec ${CMAKE_CURRENT_LIST_DIR}/codec/codec_bench.cpp)
target_link_libraries(bench_codec PRIVATE terrace_codec terrace_build_flags fmt::fmt)
