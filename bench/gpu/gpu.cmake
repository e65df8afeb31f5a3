# GPU benchmarks: built only in CUDA builds; run by bench/gpu/check.sh on a GPU machine.
if(TERRACE_HAVE_CUDA)
  # Dependency-free (CUDA runtime + C++ standard library only), so check.sh can also build it alone.
  add_executable(bench_hbm_bandwidth ${CMAKE_CURRENT_LIST_DIR}/hbm_bandwidth.cpp)
  target_link_libraries(bench_hbm_bandwidth PRIVATE CUDA::cudart_static terrace_build_flags)
  add_executable(bench_hbm_tier ${CMAKE_CURRENT_LIST_DIR}/hbm_tier_bench.cpp)
  target_link_libraries(bench_hbm_tier PRIVATE terrace_tier_hbm CUDA::cudart_static terrace_build_flags fmt::fmt)
endif()
