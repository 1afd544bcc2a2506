# Fuzzing smoke run: every libFuzzer target of tests/fuzz/ replays its
# regression corpus, then a fixed number of inputs with a fixed seed
# (scripts/fuzz.sh --smoke builds them with clang in build-fuzz/ beside this
# build). Skipped when clang with libFuzzer is missing.
add_test(NAME fuzz_smoke COMMAND ${PROJECT_SOURCE_DIR}/scripts/fuzz.sh --smoke)
set_tests_properties(fuzz_smoke PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 2400 LABELS fuzz)
