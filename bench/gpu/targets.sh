# The GPU check's tests and benchmarks, shared by bench/gpu/prepare.sh (which builds them into the
# bundle) and bench/gpu/check.sh (which expects every one of them). Sourced, not run.
# GPU_TESTS: the test entries check.sh runs, each a built binary or, for test_codec_cuda_api, a
# binary with Catch2 test tags (gpu_test_command). Every entry must report Passed for RESULT: PASS.
GPU_TESTS=(test_hbm_cuda test_hbm_store_cuda test_hbm_emulated test_host_tier test_conformance test_codec_cuda
           test_codec_cuda_api)
# The binaries behind GPU_TESTS (build targets).
GPU_TEST_BINARIES=(test_hbm_cuda test_hbm_store_cuda test_hbm_emulated test_host_tier test_conformance test_codec_cuda)
GPU_BENCHES=(bench_hbm_bandwidth bench_hbm_tier bench_host_tier bench_codec_cuda)

# gpu_test_command NAME: the binary and arguments of test entry NAME, one per line.
gpu_test_command() {
  case $1 in
    test_codec_cuda_api) printf '%s\n' test_codec_cuda '[cuda-api]' ;;  # the checks that need no device
    *) printf '%s\n' "$1" ;;
  esac
}
