/* Internals shared by the files of src/core (never called from other rooms). */
#ifndef CTRAIN_CORE_INTERNAL_H
#define CTRAIN_CORE_INTERNAL_H

#include "ctrain/core.h"

/* Fills the allocator's part of r: current and peak per category, totals,
 * resident and its peak, cached bytes (src/core/alloc.c). */
void ct__mem_counters(ct_mem_report *r);
/* Starts a new peak-RSS window at the current RSS (src/core/mem_report.c). */
void ct__rss_reset_peak(void);
/* CPU features, asked of cpuid once each (src/core/cpu.c), in the order of
 * CTRAIN_ISA's levels above portable. */
typedef enum { CT__CPU_AVX2, CT__CPU_AVX512F, CT__CPU_AVX512BF16, CT__CPU_AMX, CT__CPU_NFEATURES } ct__cpu_feature;
/* 1 if this CPU has feature f and CTRAIN_ISA does not cap it away. */
int ct__cpu_has(ct__cpu_feature f);
/* CTRAIN_ISA's level: 0 portable, 1 avx2, 2 avx512, 3 avx512bf16, 4 amx (unset: 4). */
int ct__cpu_cap(void);
/* The path ct_rng_uniform takes: "portable", "avx2" or "avx512"
 * (src/core/rng.c; tests check the one they ask for runs). */
const char *ct__rng_path(void);

/* A bf16 product through f32 OpenBLAS, for CPUs where oneDNN has no bf16 matmul
 * (src/core/gemm_widen.c); onednn_gemm's contract, bias given or NULL. */
ct_status ct__gemm_bf16_widened(int ta, int tb, int m, int n, int k, float alpha, const uint16_t *a, int lda,
                                const uint16_t *b, int ldb, const float *bias, float beta, void *c, int c_bf16,
                                int ldc);

#endif
