# Tests of the quant/ library (issue 5). Each file is one behaviour.
foreach(quant_test
    quant_round_trip_test
    quant_adaptive_test
    quant_kmeans_test
    quant_edge_cases_test
    quant_nonfinite_test
    quant_param_selection_test
    quant_simd_equivalence_test
    quant_format_test)
  pmsnap_add_test(${quant_test} SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/${quant_test}.cc
                  LIBS pmsnap::quant pmsnap::workloads_tables)
endforeach()
# Checks the fast path's rounding against the library's internal fp16 helpers.
target_include_directories(quant_simd_equivalence_test PRIVATE ${PROJECT_SOURCE_DIR}/quant)

# Byte equality with PyTorch's fused rowwise prepack ops, through libtorch's
# dispatcher (slow to compile, so only when torch is enabled).
if(PMSNAP_WITH_TORCH)
  pmsnap_add_test(quant_torch_interop_test
                  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/quant_torch_interop_test.cc
                  LIBS pmsnap::quant pmsnap::workloads_tables pmsnap::libtorch)
endif()
