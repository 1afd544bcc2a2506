# pmem_layout: pool format, recovery, bad input, crash consistency.
pmsnap_add_test(manifest_test SOURCES manifest_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_roundtrip_test SOURCES pool_roundtrip_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_bad_input_test SOURCES pool_bad_input_test.cc
                     LIBS pmsnap::layout PkgConfig::PMEMOBJ)
target_include_directories(pool_bad_input_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(pool_crash_test SOURCES pool_crash_test.cc LIBS pmsnap::layout)
pmsnap_add_test(cli_test SOURCES cli_test.cc LIBS pmsnap::layout ENV "PMEM_IS_PMEM_FORCE=1")
target_compile_definitions(cli_test PRIVATE PMSNAP_CLI_PATH="$<TARGET_FILE:pmsnap>")
add_dependencies(cli_test pmsnap)
pmsnap_add_test(checksum_test SOURCES checksum_test.cc LIBS pmsnap::layout PkgConfig::XXHASH)
target_include_directories(checksum_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(pool_prefault_test SOURCES pool_prefault_test.cc LIBS pmsnap::layout)
target_include_directories(pool_prefault_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
