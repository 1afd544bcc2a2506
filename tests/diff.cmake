# diff: embedding checkpoints (policies, retention, recovery, crash, corruption).
pmsnap_add_test(diff_checkpoints_test SOURCES diff_checkpoints_test.cc
                LIBS pmsnap::diff ENV "PMEM_IS_PMEM_FORCE=1")
target_include_directories(diff_checkpoints_test PRIVATE ${PROJECT_SOURCE_DIR}/diff
                           ${PROJECT_SOURCE_DIR}/pmem_layout)
pmsnap_add_pool_test(diff_crash_test SOURCES diff_crash_test.cc LIBS pmsnap::diff)
pmsnap_add_test(diff_chunk_format_test SOURCES diff_chunk_format_test.cc LIBS pmsnap::diff)
target_include_directories(diff_chunk_format_test PRIVATE ${PROJECT_SOURCE_DIR}/diff)
# Power loss at every persist point of every embedding policy's chunks.
pmsnap_add_test(diff_power_loss_test SOURCES diff_power_loss_test.cc
                LIBS pmsnap::diff pmsnap_power_loss ENV "PMEM_IS_PMEM_FORCE=1")
# LowDiff's differential log: batched differential chunks, replay bit-exact
# after a crash, the loss bound, truncation on resume, Eq. 10, merges.
pmsnap_add_test(diff_differential_log_test SOURCES diff_differential_log_test.cc
                LIBS pmsnap::diff ENV "PMEM_IS_PMEM_FORCE=1")
# CPR: PLS (Eq. 3), intervals (Eq. 4), the full/partial decision, MFU / SSU.
pmsnap_add_test(diff_cpr_test SOURCES diff_cpr_test.cc LIBS pmsnap::diff ENV "PMEM_IS_PMEM_FORCE=1")
# LowDiff's controller: full-checkpoint steps, retirement, the ranks'
# agreement on Eq. 10's values, the replay reach (both front ends use it).
pmsnap_add_test(diff_lowdiff_controller_test SOURCES diff_lowdiff_controller_test.cc
                LIBS pmsnap::diff ENV "PMEM_IS_PMEM_FORCE=1")
