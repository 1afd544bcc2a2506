# pmem_layout: pool format, recovery, bad input, crash consistency.
pmsnap_add_test(manifest_test SOURCES manifest_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_roundtrip_test SOURCES pool_roundtrip_test.cc LIBS pmsnap::layout)
pmsnap_add_pool_test(pool_bad_input_test SOURCES pool_bad_input_test.cc
                     LIBS pmsnap::layout PkgConfig::PMEMOBJ)
target_include_directories(pool_bad_input_test PRIVATE ${PROJECT_SOURCE_DIR}/pmem_layout)
