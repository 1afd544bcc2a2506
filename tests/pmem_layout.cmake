# pmem_layout: pool format, recovery, bad input, crash consistency.
pmsnap_add_test(manifest_test SOURCES manifest_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_roundtrip_test SOURCES pool_roundtrip_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_bad_input_test SOURCES pool_bad_input_test.cc
                     LIBS pmsnap::layout PkgConfig::PMEMOBJ)
target_include_directories(pool_bad_input_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(pool_crash_test SOURCES pool_crash_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_readonly_test SOURCES pool_readonly_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_slot_extents_test SOURCES pool_slot_extents_test.cc LIBS pmsnap::layout)
target_include_directories(pool_slot_extents_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_test(cli_test SOURCES cli_test.cc LIBS pmsnap::layout ENV "PMEM_IS_PMEM_FORCE=1")
target_compile_definitions(cli_test PRIVATE PMSNAP_CLI_PATH="$<TARGET_FILE:pmsnap>")
add_dependencies(cli_test pmsnap)
pmsnap_add_test(checksum_test SOURCES checksum_test.cc LIBS pmsnap::layout PkgConfig::XXHASH)
target_include_directories(checksum_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(pool_prefault_test SOURCES pool_prefault_test.cc LIBS pmsnap::layout)
target_include_directories(pool_prefault_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(pool_bad_env_test SOURCES pool_bad_env_test.cc LIBS pmsnap::layout)
target_include_directories(pool_bad_env_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_test(manifest_golden_test SOURCES manifest_golden_test.cc LIBS pmsnap::layout)
target_include_directories(manifest_golden_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
# Power-loss simulator (testutil/power_loss.h) on the persistence seam: the
# PM path only (non-temporal stores, flushes and drains are what it models).
add_library(pmsnap_power_loss STATIC testutil/power_loss.cc)
target_include_directories(pmsnap_power_loss PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}
                                                     ${PROJECT_SOURCE_DIR}/pmem_layout)
target_link_libraries(pmsnap_power_loss PUBLIC pmsnap::layout PkgConfig::PMEMOBJ)
pmsnap_add_test(pool_power_loss_test SOURCES pool_power_loss_test.cc
                LIBS pmsnap_power_loss ENV "PMEM_IS_PMEM_FORCE=1")
# Simulated PM bandwidth (PmBandwidth): rates, the environment, refusals.
pmsnap_add_pool_test(pool_pm_bandwidth_test SOURCES pool_pm_bandwidth_test.cc LIBS pmsnap::layout)
