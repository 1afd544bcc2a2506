add_executable(pmsnap_bench_embedding embedding.cc)
target_link_libraries(pmsnap_bench_embedding PRIVATE pmsnap::diff)
target_compile_definitions(pmsnap_bench_embedding PRIVATE
  PMSNAP_BENCH_RESULTS_DIR="${PMSNAP_BENCH_RESULTS_DIR}"
  PMSNAP_BENCH_SOURCE_DIR="${CMAKE_CURRENT_SOURCE_DIR}")
