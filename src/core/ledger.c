/*
 * Where a step's time goes: seconds spent in matrix products, in the
 * attention core and in the optimizer's updates, summed over the run, so a
 * report can name them beside the step time (the rest is the elementwise
 * layers, casts and bookkeeping; communication waits are the strategy's).
 * Only the outermost timed region of the thread that starts a team counts:
 * the products inside attention are attention's, and a team's other
 * threads run inside regions already timed.  Two clock reads per region,
 * tens of nanoseconds against products of microseconds at least.
 */
#include <omp.h>
#include <stdatomic.h>

#include "ctrain/core.h"

static _Atomic int64_t spent[CT_LEDGER_N]; /* nanoseconds */
static _Thread_local int depth;

double ct_ledger_begin(void)
{
    if (depth++ || omp_in_parallel()) return -1.0;
    return ct_now();
}

void ct_ledger_end(ct_ledger_kind k, double t0)
{
    depth--;
    if (t0 < 0 || k < 0 || k >= CT_LEDGER_N) return;
    atomic_fetch_add(&spent[k], (int64_t)((ct_now() - t0) * 1e9));
}

void ct_ledger_read(double *seconds)
{
    for (int k = 0; k < CT_LEDGER_N; k++) seconds[k] = (double)atomic_load(&spent[k]) * 1e-9;
}
