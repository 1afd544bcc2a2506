# conflict: strategies 1-4 and the adaptive selector, bit-exact under conflicts.
pmsnap_add_test(conflict_strategies_test SOURCES conflict_strategies_test.cc
                LIBS pmsnap::conflict ENV "PMEM_IS_PMEM_FORCE=1")
pmsnap_add_test(conflict_async_ordering_test SOURCES conflict_async_ordering_test.cc
                LIBS pmsnap::conflict ENV "PMEM_IS_PMEM_FORCE=1")
