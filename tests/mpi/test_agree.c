/*
 * One configuration across ranks (ct_group_agree_settings): equal settings
 * pass; a setting that differs on the last rank, a key only one rank has,
 * and different numbers of settings are each an error on every rank with
 * the same message naming the setting and who holds what, and the group
 * stays usable afterwards (no rank is left inside a collective).
 */
#include "../test.h"
#include "ctrain/comm.h"

TEST(agree_settings_names_the_setting_and_the_ranks)
{
    ct_group *g = ct_group_world();
    int me = ct_group_rank(g), p = ct_group_size(g);
    const char *keys[3] = {"--steps", "--lr", "--strategy"};
    const char *same[3] = {"100", "0.1", "ddp"};
    ASSERT_OK(ct_group_agree_settings(g, "the command line", keys, same, 3));

    const char *last[3] = {"100", me == p - 1 ? "0.5" : "0.1", "ddp"};
    ASSERT_ERR(ct_group_agree_settings(g, "the command line", keys, last, 3), CT_EINVAL,
               "ranks disagree on the command line: --lr differs: rank");
    static const char *const want_by_size[] = {
        "", "", "rank 0 has '0.1', rank 1 has '0.5'", "ranks 0,1 have '0.1', rank 2 has '0.5'",
        "ranks 0,1,2 have '0.1', rank 3 has '0.5'"};
    const char *want = p <= 4 ? want_by_size[p] : "has '0.5'";
    ASSERT_STR_CONTAINS(ct_last_error(), want);

    /* A key rank 0 alone has; fewer settings elsewhere. */
    const char *k0[4] = {"--steps", "--lr", "--strategy", "--save"};
    const char *v0[4] = {"100", "0.1", "ddp", "x"};
    ASSERT_ERR(ct_group_agree_settings(g, "the command line", k0, v0, me == 0 ? 4 : 3), CT_EINVAL,
               "--save differs: rank 0 has 'x', ");
    ASSERT_STR_CONTAINS(ct_last_error(), "no such setting");

    /* Still in step: a collective after the failures sums as it should. */
    int64_t x = me + 1;
    ASSERT_OK(ct_group_allreduce(g, &x, 1, CT_I64, CT_OP_SUM, NULL));
    ASSERT_EQ(x, (int64_t)p * (p + 1) / 2);
}
