# bench/stall (issue [bench]): training-thread stall, overhead, checkpoint
# frequency and restore time of pmsnap against torch::save, CheckFreq and
# weight-grained serialization on libtorch workloads. Needs libtorch. One file
# per concern under stall/ (stall/main.cc lists them).
if(TARGET pmsnap::workloads)
  set(_stall ${CMAKE_CURRENT_LIST_DIR}/stall)
  add_executable(pmsnap_bench_stall
    ${_stall}/main.cc ${_stall}/options.cc ${_stall}/workloads.cc ${_stall}/counters.cc
    ${_stall}/statistics.cc ${_stall}/checkpoint_files.cc ${_stall}/baselines.cc
    ${_stall}/pmsnap_method.cc ${_stall}/trials.cc ${_stall}/results.cc ${_stall}/report.cc
    ${_stall}/restore.cc)
  target_include_directories(pmsnap_bench_stall PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(pmsnap_bench_stall PRIVATE pmsnap::torch pmsnap::conflict pmsnap::workloads)
  target_compile_definitions(pmsnap_bench_stall PRIVATE
    PMSNAP_BENCH_RESULTS_DIR="${PMSNAP_BENCH_RESULTS_DIR}"
    PMSNAP_BENCH_SOURCE_DIR="${CMAKE_CURRENT_LIST_DIR}")
endif()

# End to end at a tiny size, restores in child processes included.
if(TARGET pmsnap_bench_stall AND PMSNAP_BUILD_TESTS)
  add_test(NAME bench_stall_smoke
           COMMAND ${PROJECT_SOURCE_DIR}/tests/bench_stall_smoke.sh $<TARGET_FILE:pmsnap_bench_stall>)
  set_tests_properties(bench_stall_smoke PROPERTIES ENVIRONMENT "PMEM_IS_PMEM_FORCE=1" TIMEOUT 300)
endif()
