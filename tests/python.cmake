# pytest suite of the Python binding (python/, issue 8), run with Debian's
# /usr/bin/python3 (python3-torch, python3-pytest) against the build tree's
# package: PYTHONPATH=<build>/python. Only when the binding is built.
if(TARGET pmsnap_python AND PMSNAP_PYTHON_BUILD_DIR)
  add_test(NAME python_tests
           COMMAND ${Python3_EXECUTABLE} -m pytest -q -p no:cacheprovider
                   ${CMAKE_CURRENT_SOURCE_DIR}/python)
  set(_pmsnap_python_env PYTHONPATH=${PMSNAP_PYTHON_BUILD_DIR} PMEM_IS_PMEM_FORCE=1
                         PYTHONDONTWRITEBYTECODE=1)
  set_tests_properties(python_tests PROPERTIES ENVIRONMENT "${_pmsnap_python_env}" TIMEOUT 300)
endif()
