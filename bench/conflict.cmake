add_executable(pmsnap_bench_conflict conflict.cc)
target_link_libraries(pmsnap_bench_conflict PRIVATE pmsnap::conflict)
target_compile_definitions(pmsnap_bench_conflict PRIVATE
  PMSNAP_BENCH_RESULTS_DIR="${PMSNAP_BENCH_RESULTS_DIR}"
  PMSNAP_BENCH_SOURCE_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
