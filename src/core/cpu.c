/*
 * The CPU features the vector paths choose by (half.c's casts, gemm.c's
 * transpose, rng.c's Philox, the attention kernels), asked of cpuid once
 * each, and the one cap over all of them: CTRAIN_ISA=portable, avx2,
 * avx512, avx512bf16 or amx makes every feature above it count as absent,
 * for ctrain's own kernels and for oneDNN's (src/core/gemm.c caps oneDNN
 * to the same level), so tests can hold each path against the portable one
 * on a CPU that has them all.  Any thread may ask first (the comm thread
 * casts too), hence the atomics; a race only asks twice.
 */
#include <cpuid.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Cap levels, lowest first; a feature's level is its index here. */
static const char *const levels[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};
#define NLEVELS (int)(sizeof levels / sizeof *levels)

int ct__cpu_cap(void)
{
    static int cap = -1;
    int c = __atomic_load_n(&cap, __ATOMIC_RELAXED);
    if (c < 0) {
        const char *e = getenv("CTRAIN_ISA");
        c = NLEVELS - 1;
        for (int i = 0; e && i < NLEVELS; i++)
            if (!strcmp(e, levels[i])) c = i;
        __atomic_store_n(&cap, c, __ATOMIC_RELAXED);
    }
    return c;
}

static int hardware_has(ct__cpu_feature f)
{
    __builtin_cpu_init();
    /* __builtin_cpu_supports takes only a literal */
    switch (f) {
    case CT__CPU_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CT__CPU_AVX512F: return __builtin_cpu_supports("avx512f") != 0;
    case CT__CPU_AVX512BF16: return __builtin_cpu_supports("avx512bf16") != 0;
    case CT__CPU_AMX: return __builtin_cpu_supports("amx-bf16") != 0;
    default: return 0;
    }
}

int ct__cpu_has(ct__cpu_feature f)
{
    static int have[CT__CPU_NFEATURES] = {-1, -1, -1, -1};
    int h = __atomic_load_n(&have[f], __ATOMIC_RELAXED);
    if (h < 0) {
        h = hardware_has(f) && (int)f + 1 <= ct__cpu_cap();
        __atomic_store_n(&have[f], h, __ATOMIC_RELAXED);
    }
    return h;
}

int ct_cpu_has_avx512_bf16(void) { return ct__cpu_has(CT__CPU_AVX512BF16); }

const char *ct_cpu_isa(void)
{
    int best = 0;
    for (int f = 0; f < CT__CPU_NFEATURES; f++)
        if (ct__cpu_has((ct__cpu_feature)f)) best = f + 1;
    return levels[best];
}

const char *ct_cpu_model(void)
{
    static char name[49];
    static int done;
    if (__atomic_load_n(&done, __ATOMIC_ACQUIRE)) return name;
    unsigned r[12] = {0};
    char buf[49] = "unknown CPU";
    if (__get_cpuid_max(0x80000000u, NULL) >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
        memcpy(buf, r, 48);
        buf[48] = 0;
    }
    const char *s = buf;
    while (*s == ' ') s++; /* the brand string is padded on the left on some CPUs */
    snprintf(name, sizeof name, "%s", s);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
    return name;
}
