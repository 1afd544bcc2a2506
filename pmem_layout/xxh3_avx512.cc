// XXH3 kernels for the avx512 instruction set (see detail/xxh3_kernels.h).
#define PMSNAP_XXH3_KERNELS kXxh3Avx512
#define PMSNAP_XXH3_NAME "avx512"
#include "detail/xxh3_kernel_impl.inc"
