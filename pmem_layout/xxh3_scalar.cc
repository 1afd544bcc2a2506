// XXH3 kernels for the scalar instruction set (see detail/xxh3_kernels.h).
#define PMSNAP_XXH3_KERNELS kXxh3Scalar
#define PMSNAP_XXH3_NAME "scalar"
#include "detail/xxh3_kernel_impl.inc"
