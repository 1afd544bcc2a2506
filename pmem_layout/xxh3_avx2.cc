// XXH3 kernels for the avx2 instruction set (see detail/xxh3_kernels.h).
#define PMSNAP_XXH3_KERNELS kXxh3Avx2
#define PMSNAP_XXH3_NAME "avx2"
#include "detail/xxh3_kernel_impl.inc"
