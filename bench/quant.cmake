# bench/quant: throughput and mean l2 error of quant/ against a scalar
# reference and (when torch is enabled) PyTorch's prepack ops, on one core.
add_executable(pmsnap_bench_quant ${CMAKE_CURRENT_SOURCE_DIR}/quant.cc)
target_compile_definitions(pmsnap_bench_quant PRIVATE
  PMSNAP_BENCH_RESULTS_DIR="${PMSNAP_BENCH_RESULTS_DIR}")
target_link_libraries(pmsnap_bench_quant PRIVATE pmsnap::quant pmsnap::workloads_tables)
if(PMSNAP_WITH_TORCH)
  target_compile_definitions(pmsnap_bench_quant PRIVATE PMSNAP_BENCH_WITH_TORCH=1)
  target_link_libraries(pmsnap_bench_quant PRIVATE pmsnap::libtorch)
endif()
