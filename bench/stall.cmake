# bench/stall (issue [bench]): training-thread stall, overhead, checkpoint
# frequency and restore time of pmsnap against torch::save, CheckFreq and
# weight-grained serialization on libtorch workloads. Needs libtorch.
if(TARGET pmsnap::torch)
  add_executable(pmsnap_bench_stall ${CMAKE_CURRENT_LIST_DIR}/stall.cc)
  target_link_libraries(pmsnap_bench_stall PRIVATE pmsnap::torch pmsnap::conflict)
  target_compile_definitions(pmsnap_bench_stall PRIVATE
    PMSNAP_BENCH_RESULTS_DIR="${PMSNAP_BENCH_RESULTS_DIR}"
    PMSNAP_BENCH_SOURCE_DIR="${CMAKE_CURRENT_LIST_DIR}")
endif()
