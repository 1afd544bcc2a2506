# runtime: Engine pipeline, devices, policies.
pmsnap_add_pool_test(runtime_engine_test SOURCES runtime_engine_test.cc LIBS pmsnap::runtime)
pmsnap_add_pool_test(runtime_engine_staging_test SOURCES runtime_engine_staging_test.cc
                     LIBS pmsnap::runtime)
pmsnap_add_pool_test(runtime_engine_fork_test SOURCES runtime_engine_fork_test.cc
                     LIBS pmsnap::runtime)
pmsnap_add_test(runtime_device_test SOURCES runtime_device_test.cc LIBS pmsnap::runtime)
# Every-k with a moving anchor, CheckFreq's Algorithm 1 interval.
pmsnap_add_test(runtime_policy_test SOURCES runtime_policy_test.cc LIBS pmsnap::runtime)
pmsnap_add_test(runtime_registration_test SOURCES runtime_registration_test.cc
                LIBS pmsnap::runtime ENV "PMEM_IS_PMEM_FORCE=1")
pmsnap_add_test(runtime_epoch_agreement_test SOURCES runtime_epoch_agreement_test.cc
                LIBS pmsnap::runtime)
pmsnap_add_test(runtime_engine_ranks_test SOURCES runtime_engine_ranks_test.cc LIBS pmsnap::runtime
                ENV "PMEM_IS_PMEM_FORCE=1")
pmsnap_add_test(runtime_sharding_test SOURCES runtime_sharding_test.cc LIBS pmsnap::runtime)
pmsnap_add_test(common_cpu_affinity_test SOURCES common_cpu_affinity_test.cc LIBS pmsnap::common)
pmsnap_add_test(runtime_copy_hold_budget_test SOURCES runtime_copy_hold_budget_test.cc
                LIBS pmsnap::runtime)
target_include_directories(runtime_copy_hold_budget_test PRIVATE ${PROJECT_SOURCE_DIR}/runtime)
# Power loss at every persist point of the Engine's epoch flow (simulator:
# testutil/power_loss.h, defined in pmem_layout.cmake).
pmsnap_add_test(runtime_engine_power_loss_test SOURCES runtime_engine_power_loss_test.cc
                LIBS pmsnap::runtime pmsnap_power_loss ENV "PMEM_IS_PMEM_FORCE=1")
pmsnap_add_test(runtime_async_device_test SOURCES runtime_async_device_test.cc
                LIBS pmsnap::runtime)
pmsnap_add_test(runtime_staging_ring_test SOURCES runtime_staging_ring_test.cc LIBS pmsnap::runtime)
target_include_directories(runtime_staging_ring_test PRIVATE ${PROJECT_SOURCE_DIR}/runtime)
# On a GPU machine (scripts/gpu_check.sh); skips, saying so, without a GPU.
if(PMSNAP_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  pmsnap_add_test(runtime_cuda_test SOURCES runtime_cuda_test.cc
                  LIBS pmsnap::conflict CUDA::cudart ENV "PMEM_IS_PMEM_FORCE=1")
endif()
