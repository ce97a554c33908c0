/* A probe for tests/test_harness.c: with CTRAIN_TEST_PROBE=skip it skips on
 * every rank, and the suite must report it as skipped; otherwise it passes
 * and does nothing. */
#include <stdlib.h>

#include "../test.h"

TEST(harness_mpi_probe)
{
    const char *p = getenv("CTRAIN_TEST_PROBE");
    if (p && !strcmp(p, "skip")) SKIP("multi-rank probe asked to skip");
}
