/*
 * The test harness: TEST(name) registers a test at load time, so a test file
 * only has to be linked in.  Assertions print both values and the location
 * and then fail the current test (a longjmp back to the runner); SKIP ends
 * it as skipped when something it needs is missing.  The same
 * macros serve the unit runner (each test in its own process) and the MPI
 * runner (every rank runs every test; a test passes when it passes on all
 * ranks).
 */
#ifndef CTRAIN_TEST_H
#define CTRAIN_TEST_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ctrain/ctrain.h"

typedef void (*ct_test_fn)(void);
void ct_test_register(const char *name, ct_test_fn fn, const char *file);
void ct_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 3, 4)));
/* Ends the running test as skipped: prints "    skipped: REASON" and the
 * runners count it as skipped, never as passed.  Free what the test holds
 * first (the runners check for leaks either way). */
void ct_test_skip(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
#define SKIP(...) ct_test_skip(__VA_ARGS__)
/* Directory for scratch files of the running test: made on first use
 * (unique, under $TMPDIR or /tmp) and removed with its contents when the
 * test ends, pass or fail (CTRAIN_TEST_KEEP_TMP=1 keeps a failed test's). */
const char *ct_test_tmpdir(void);
/* Removes path and everything under it (no symlinks followed); 0 when gone. */
int ct_test_rmtree(const char *path);

#define TEST(name)                                                            \
    static void test_##name(void);                                            \
    __attribute__((constructor)) static void test_reg_##name(void)            \
    {                                                                         \
        ct_test_register(#name, test_##name, __FILE__);                       \
    }                                                                         \
    static void test_##name(void)

#define ASSERT(c)                                                             \
    do {                                                                      \
        if (!(c)) ct_test_fail(__FILE__, __LINE__, "assertion failed: %s", #c); \
    } while (0)

#define ASSERT_EQ(a, b)                                                       \
    do {                                                                      \
        long long ct__a = (long long)(a), ct__b = (long long)(b);             \
        if (ct__a != ct__b)                                                   \
            ct_test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, ct__a, ct__b); \
    } while (0)

#define ASSERT_NEAR(a, b, tol)                                                \
    do {                                                                      \
        double ct__a = (double)(a), ct__b = (double)(b);                      \
        if (!(fabs(ct__a - ct__b) <= (double)(tol)))                          \
            ct_test_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (tol %g)", #a, #b, \
                         ct__a, ct__b, (double)(tol));                        \
    } while (0)

/* Relative-or-absolute closeness, for values of any size. */
#define ASSERT_CLOSE(a, b, rtol, atol)                                        \
    do {                                                                      \
        double ct__a = (double)(a), ct__b = (double)(b);                      \
        if (!(fabs(ct__a - ct__b) <= (double)(atol) + (double)(rtol) * fabs(ct__b))) \
            ct_test_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (rtol %g atol %g)", #a, #b, \
                         ct__a, ct__b, (double)(rtol), (double)(atol));        \
    } while (0)

#define ASSERT_STR_CONTAINS(hay, needle)                                      \
    do {                                                                      \
        const char *ct__h = (hay), *ct__n = (needle);                         \
        if (!ct__h || !strstr(ct__h, ct__n))                                  \
            ct_test_fail(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"", \
                         ct__h ? ct__h : "(null)", ct__n);                    \
    } while (0)

/* The call must succeed; on failure prints ctrain's error message. */
/* Destroys strategy s keeping its model whole (the explicit unwrap: summon
 * the full parameters, then destroy; collective), for tests that read the
 * model after a sharded strategy, whose plain destroy frees them. */
#define UNWRAP(s)                                                             \
    do {                                                                      \
        ASSERT_OK(ct_strategy_summon_full_params(s, 0, 0));                   \
        ct_strategy_destroy(s);                                               \
    } while (0)

#define ASSERT_OK(expr)                                                       \
    do {                                                                      \
        ct_status ct__s = (expr);                                             \
        if (ct__s != CT_OK)                                                   \
            ct_test_fail(__FILE__, __LINE__, "%s failed: %s: %s", #expr,       \
                         ct_strerror(ct__s), ct_last_error());                \
    } while (0)

/* The call must fail with code, and its message must contain needle. */
#define ASSERT_ERR(expr, code, needle)                                        \
    do {                                                                      \
        ct_clear_error();                                                     \
        ct_status ct__s = (expr);                                             \
        if (ct__s != (code))                                                  \
            ct_test_fail(__FILE__, __LINE__, "%s returned %d (%s), wanted %d; message: %s", \
                         #expr, ct__s, ct_strerror(ct__s), (code), ct_last_error()); \
        ASSERT_STR_CONTAINS(ct_last_error(), needle);                         \
    } while (0)

#endif
