/* Internals shared by the files of src/core (never called from other rooms). */
#ifndef CTRAIN_CORE_INTERNAL_H
#define CTRAIN_CORE_INTERNAL_H

#include "ctrain/core.h"

/* Fills the allocator's part of r: current and peak per category, totals,
 * resident and its peak, cached bytes (src/core/alloc.c). */
void ct__mem_counters(ct_mem_report *r);
/* Starts a new peak-RSS window at the current RSS (src/core/mem_report.c). */
void ct__rss_reset_peak(void);
/* CPU features, asked of cpuid once each (src/core/cpu.c). */
typedef enum { CT__CPU_AVX2, CT__CPU_AVX512F, CT__CPU_AVX512BF16, CT__CPU_NFEATURES } ct__cpu_feature;
/* 1 if this CPU has feature f. */
int ct__cpu_has(ct__cpu_feature f);
/* The path ct_rng_uniform takes: "portable", "avx2" or "avx512"
 * (src/core/rng.c; tests check the one they ask for runs). */
const char *ct__rng_path(void);

#endif
