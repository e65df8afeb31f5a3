# Host tier benchmark (and, in CUDA builds, the GPU benchmarks under bench/gpu/).
add_executable(bench_host_tier ${CMAKE_CURRENT_LIST_DIR}/host/host_tier_bench.cpp)
target_link_libraries(bench_host_tier PRIVATE terrace::terrace terrace_tier_host terrace_build_flags PkgConfig::XXHASH fmt::fmt)
include(${CMAKE_CURRENT_LIST_DIR}/gpu/gpu.cmake)
