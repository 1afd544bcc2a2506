# Tests of the libtorch hooks (hooks/, issue 3). Only with libtorch.
if(PMSNAP_WITH_TORCH AND TARGET pmsnap::torch)
  pmsnap_add_test(hooks_optimizer_equivalence_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_optimizer_equivalence_test.cc
                  LIBS pmsnap::torch)
  pmsnap_add_test(hooks_checkpointed_optimizer_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_checkpointed_optimizer_test.cc
                  LIBS pmsnap::torch
                  ENV "PMEM_IS_PMEM_FORCE=1")
  pmsnap_add_test(hooks_lowdiff_plus_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_lowdiff_plus_test.cc
                  LIBS pmsnap::torch
                  ENV "PMEM_IS_PMEM_FORCE=1")
  pmsnap_add_test(hooks_update_in_backward_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_update_in_backward_test.cc
                  LIBS pmsnap::torch pmsnap::conflict pmsnap::diff
                  ENV "PMEM_IS_PMEM_FORCE=1")

  # The torch wheel ships no gloo headers, which ProcessGroupGloo.hpp needs
  # to make a real gloo group in the test; Debian's libgloo-dev provides them
  # (C10dCoordinator itself needs only c10d/Backend.hpp).
  find_path(PMSNAP_GLOO_INCLUDE_DIR gloo/algorithm.h)
  if(PMSNAP_GLOO_INCLUDE_DIR)
    pmsnap_add_test(hooks_c10d_coordinator_test
                    SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_c10d_coordinator_test.cc
                    LIBS pmsnap::torch)
    target_include_directories(hooks_c10d_coordinator_test PRIVATE ${PMSNAP_GLOO_INCLUDE_DIR})
    pmsnap_add_test(hooks_lowdiff_test
                    SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_lowdiff_test.cc
                    LIBS pmsnap::torch
                    ENV "PMEM_IS_PMEM_FORCE=1")
    target_include_directories(hooks_lowdiff_test PRIVATE ${PMSNAP_GLOO_INCLUDE_DIR})
  else()
    message(STATUS "gloo headers not found (libgloo-dev): hooks_c10d_coordinator_test and "
                   "hooks_lowdiff_test not built")
  endif()

  pmsnap_add_test(hooks_state_arena_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_state_arena_test.cc
                  LIBS pmsnap::torch)
  # StateArena is internal to hooks/.
  target_include_directories(hooks_state_arena_test PRIVATE ${PROJECT_SOURCE_DIR}/hooks)

  pmsnap_add_test(hooks_embedding_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_embedding_test.cc
                  LIBS pmsnap::torch pmsnap::diff
                  ENV "PMEM_IS_PMEM_FORCE=1")

  # Crash and resume: the test (no libtorch) spawns this trainer and kills it.
  add_executable(hooks_resume_trainer ${CMAKE_CURRENT_LIST_DIR}/hooks_resume_trainer.cc)
  target_link_libraries(hooks_resume_trainer PRIVATE pmsnap::torch pmsnap::workloads)
  target_include_directories(hooks_resume_trainer PRIVATE ${CMAKE_CURRENT_LIST_DIR})
  pmsnap_add_test(hooks_resume_test
                  SOURCES ${CMAKE_CURRENT_LIST_DIR}/hooks_resume_test.cc
                  LIBS pmsnap::common
                  ENV "PMEM_IS_PMEM_FORCE=1")
  target_compile_definitions(hooks_resume_test
                             PRIVATE PMSNAP_HOOKS_TRAINER="$<TARGET_FILE:hooks_resume_trainer>")
  add_dependencies(hooks_resume_test hooks_resume_trainer)
endif()

# The training demo end to end at a small size (exit status 0 = bit-exact),
# with its overhead measured in interleaved rounds (the table must appear).
if(TARGET pmsnap-demo)
  add_test(NAME hooks_demo_smoke
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/demo_smoke.sh $<TARGET_FILE:pmsnap-demo>
                   --iterations=60 --seed=3)
  set_tests_properties(hooks_demo_smoke PROPERTIES ENVIRONMENT "PMEM_IS_PMEM_FORCE=1" TIMEOUT 120)
  # The previous configuration (tables written in full like the dense
  # weights, strategy 2, not pinned; the default above is intermittent
  # differential, adaptive, pinned): still bit-exact after the kill.
  add_test(NAME hooks_demo_smoke_full_tables
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/demo_smoke.sh $<TARGET_FILE:pmsnap-demo>
                   --iterations=60 --seed=5 --table-checkpoints=full --strategy=2
                   --pin=off --rounds=0)
  set_tests_properties(hooks_demo_smoke_full_tables PROPERTIES
                       ENVIRONMENT "PMEM_IS_PMEM_FORCE=1" TIMEOUT 120)
endif()
