# KV / state codec throughput (CPU, one thread) against memcpy of the same bytes.
add_executable(bench_codec ${CMAKE_CURRENT_LIST_DIR}/codec/codec_bench.cpp)
target_link_libraries(bench_codec PRIVATE terrace_codec terrace_build_flags fmt::fmt)
# The CUDA kernels (CUDA builds; run by bench/gpu/check.sh on a GPU machine).
if(TERRACE_HAVE_CUDA)
  add_executable(bench_codec_cuda ${CMAKE_CURRENT_LIST_DIR}/codec/codec_cuda_bench.cpp)
  target_link_libraries(bench_codec_cuda PRIVATE terrace_codec_cuda CUDA::cudart_static terrace_build_flags)
endif()
