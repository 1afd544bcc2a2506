# The thread-safety lane: pmsnap's libraries built with clang -Wthread-safety
# as errors (scripts/thread_safety.sh, in build-thread-safety/ beside this
# build), after checking that tests/thread_safety/unguarded_access.cc is
# rejected. Skipped when clang is missing.
add_test(NAME thread_safety_lane
         COMMAND ${CMAKE_COMMAND} -E env "CMAKE_PREFIX_PATH=${CMAKE_PREFIX_PATH}"
                 ${PROJECT_SOURCE_DIR}/scripts/thread_safety.sh)
set_tests_properties(thread_safety_lane PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 1800
                     LABELS thread_safety)
