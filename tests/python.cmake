# pytest suite of the Python binding (python/), run with the interpreter the
# binding was built for (scripts/pmsnap.sh's venv: torch 2.x, pytest) against
# the build tree's package: PYTHONPATH=<build>/python. Only when it is built.
if(TARGET pmsnap_python AND PMSNAP_PYTHON_BUILD_DIR)
  add_test(NAME python_tests
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_ddp_resume.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_interop.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_lowdiff.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_cpr.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_cpr_ranks.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_training_state.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_lightning.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_hf.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_examples.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_sharded.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_one_step.py
                   --ignore=${CMAKE_CURRENT_SOURCE_DIR}/python/test_torchrec.py
                   ${CMAKE_CURRENT_SOURCE_DIR}/python)
  # A sanitizer build (scripts/sanitize.sh) runs the interpreter with libasan
  # preloaded and an instrumented extension: several times slower.
  set(_pmsnap_timeout_scale 1)
  if(PMSNAP_SANITIZE)
    set(_pmsnap_timeout_scale 6)
  endif()
  math(EXPR _pmsnap_python_timeout "600 * ${_pmsnap_timeout_scale}")
  math(EXPR _pmsnap_ddp_timeout "900 * ${_pmsnap_timeout_scale}")
  set(_pmsnap_python_env PYTHONPATH=${PMSNAP_PYTHON_BUILD_DIR} PMEM_IS_PMEM_FORCE=1
                         PYTHONDONTWRITEBYTECODE=1 PMSNAP_CLI=$<TARGET_FILE:pmsnap>)
  # Its limit is the multi-process tests': 372 s idle on one 2-vCPU VM, 590 s
  # there with a benchmark beside it, too near 600 (bench/RESULTS.md, "Fresh-clone CI").
  set_tests_properties(python_tests PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # Twenty torchrun launches of a 2-rank DDP job, each SIGKILLed once
  # ($PMSNAP_DDP_KILLS), then one to the end: on its own so it runs beside
  # the rest of the Python suite.
  add_test(NAME python_ddp_resume_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_ddp_resume.py)
  set_tests_properties(python_ddp_resume_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # FSDP2 and DTensor parameters: 2-rank torchrun jobs SIGKILLed and resumed
  # ($PMSNAP_SHARDED_KILLS per model), against an uninterrupted run; and no
  # committed epoch of an FSDP2 job mixing two steps.
  add_test(NAME python_sharded_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_sharded.py
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_one_step.py)
  set_tests_properties(python_sharded_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # torchrec's DLRM under DistributedModelParallel (fused tables, table-wise
  # and row-wise): 2-rank torchrun jobs SIGKILLed and resumed, loaded into
  # another plan on 3 and 4 ranks, and the one-step check.
  add_test(NAME python_torchrec_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_torchrec.py)
  set_tests_properties(python_torchrec_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # LowDiff: 2-rank DDP runs under torchrun with PowerSGD and top-k, SIGKILLed
  # and restored ($PMSNAP_LOWDIFF_KILLS trials each), and the one-process
  # tests of pmsnap.lowdiff; on its own like the DDP resume test.
  add_test(NAME python_lowdiff_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_lowdiff.py)
  set_tests_properties(python_lowdiff_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # Checkpoints that leave the pool (load_state_dict, export, the list/export/
  # prune/diff commands, DCP): on its own, its 1 GiB export measures peak memory.
  add_test(NAME python_interop_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_interop.py)
  set_tests_properties(python_interop_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_ddp_timeout})
  # CPR partial recovery: emulated shards, 2 gloo ranks restarted together,
  # PLS across restarts and in `pmsnap info`.
  add_test(NAME python_cpr_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_cpr.py)
  set_tests_properties(python_cpr_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_python_timeout})
  # Whole training processes: TrainingState, Lightning and the HF Trainer
  # SIGKILLed and resumed, and the runnable examples as a user runs them; on
  # their own beside the rest.
  foreach(_pmsnap_file training_state lightning hf examples)
    add_test(NAME python_${_pmsnap_file}_test
             COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                     ${CMAKE_CURRENT_SOURCE_DIR}/python/test_${_pmsnap_file}.py)
    set_tests_properties(python_${_pmsnap_file}_test PROPERTIES
                         ENVIRONMENT "${_pmsnap_python_env}" TIMEOUT ${_pmsnap_python_timeout})
  endforeach()
  add_test(NAME python_cpr_ranks_test
           COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python/test_cpr_ranks.py)
  set_tests_properties(python_cpr_ranks_test PROPERTIES ENVIRONMENT "${_pmsnap_python_env}"
                       TIMEOUT ${_pmsnap_python_timeout})
endif()

# `pip install .` into a fresh venv, then checkpoint, SIGKILL and restore with
# the installed package (pyproject.toml). Builds the extension once more.
if(TARGET pmsnap_python AND PMSNAP_PYTHON_BUILD_DIR)
  add_test(NAME python_package_test
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/python_package_test.sh ${Python_EXECUTABLE})
  set_tests_properties(python_package_test PROPERTIES TIMEOUT 900)
endif()

# scripts/gpu_check.sh's own logic without a GPU, and the GPU stall
# benchmark's code on the CPU at a tiny size.
if(TARGET pmsnap_python AND PMSNAP_PYTHON_BUILD_DIR)
  add_test(NAME gpu_check_script_test
           COMMAND ${CMAKE_CURRENT_SOURCE_DIR}/gpu_check_script_test.sh ${Python_EXECUTABLE}
                   ${PMSNAP_PYTHON_BUILD_DIR})
  set_tests_properties(gpu_check_script_test PROPERTIES ENVIRONMENT "PMEM_IS_PMEM_FORCE=1"
                       TIMEOUT 1500)
endif()
