/* Internals shared by the files of src/core (never called from other rooms). */
#ifndef CTRAIN_CORE_INTERNAL_H
#define CTRAIN_CORE_INTERNAL_H

#include "ctrain/core.h"

/* Fills the allocator's part of r: current and peak per category, totals,
 * resident and its peak, cached bytes (src/core/alloc.c). */
void ct__mem_counters(ct_mem_report *r);
/* Starts a new peak-RSS window at the current RSS (src/core/mem_report.c). */
void ct__rss_reset_peak(void);
/* The path ct_rng_uniform takes: "portable", "avx2" or "avx512"
 * (src/core/rng.c; tests check the one they ask for runs). */
const char *ct__rng_path(void);

#endif
