# Sourced by scripts/test.sh and scripts/demo.sh: the configuration of the main ./build folder, in
# one place, so that running one script after the other reuses every object the first one built.
#
# Unity builds (eight .cpp files of a target per compiler run) halve the suite's compile time: the
# headers and the inline code they instantiate are compiled once per batch instead of once per file
# (terrace_model under ASan: 81 s of CPU instead of 146). TERRACE_UNITY_BUILD=OFF builds file by
# file (scripts/thread_safety.sh and the package build in .ci/run always do, so a missing #include
# in the store and the tiers still fails CI).
unity=(-DCMAKE_UNITY_BUILD="${TERRACE_UNITY_BUILD:-ON}")
# -O2 -g1: the optimised code the benchmarks run, with line tables only (backtraces and
# sanitizer-style file:line still work; no variable info). Full -g costs a third more compile time
# here (cmd_demo.cpp: 30.9 s at -O2 -g, 20.8 s at -O2 -g1), which CI cannot afford.
main_build=("${unity[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG")
