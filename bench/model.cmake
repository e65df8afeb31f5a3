# Reference forward pass: prefill / decode tokens/s and time share per component (KDA, MLA, MoE,
# AttnRes) for k3-toy and k3-small at 1 and 2 OpenBLAS threads.
if(TARGET terrace_model)
  add_executable(bench_model ${CMAKE_CURRENT_LIST_DIR}/model/model_bench.cpp)
  target_link_libraries(bench_model PRIVATE terrace_model terrace_common terrace_build_flags fmt::fmt CLI11::CLI11)
endif()

# The fused MXFP4 kernel against an fp32 GEMV/GEMM over the dequantised weights (one thread).
if(TARGET terrace_model)
  add_executable(bench_mxfp4 ${CMAKE_CURRENT_LIST_DIR}/model/mxfp4_bench.cpp)
  target_link_libraries(bench_mxfp4 PRIVATE terrace_model terrace_common terrace_build_flags fmt::fmt CLI11::CLI11)
endif()
