# Benchmarks over the libtorch hooks (pmsnap::torch).
include(${CMAKE_CURRENT_LIST_DIR}/stall.cmake)
