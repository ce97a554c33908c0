/*
 * The CPU features the vector paths choose by (half.c's casts, gemm.c's
 * transpose, rng.c's Philox, the attention kernels), asked of cpuid once
 * each.  Any thread may ask first (the comm thread casts too), hence the
 * atomics; a race only asks twice.
 */
#include "internal.h"

int ct__cpu_has(ct__cpu_feature f)
{
    static int have[CT__CPU_NFEATURES] = {-1, -1, -1};
    int h = __atomic_load_n(&have[f], __ATOMIC_RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        /* __builtin_cpu_supports takes only a literal */
        h = f == CT__CPU_AVX2 ? __builtin_cpu_supports("avx2") != 0
            : f == CT__CPU_AVX512F ? __builtin_cpu_supports("avx512f") != 0
                                   : __builtin_cpu_supports("avx512bf16") != 0;
        __atomic_store_n(&have[f], h, __ATOMIC_RELAXED);
    }
    return h;
}

int ct_cpu_has_avx512_bf16(void) { return ct__cpu_has(CT__CPU_AVX512BF16); }
