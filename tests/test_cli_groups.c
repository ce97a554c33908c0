/*
 * Parameter groups through the ctrain program: the gpt's default is
 * nanoGPT's configure_optimizers (no decay below 2 dimensions, betas 0.9,
 * 0.95) and changes the numbers, --no-decay and --betas are saved with the
 * optimizer state and a resume without them continues the run bit for bit,
 * and bad values are one clear line.  (Under every strategy:
 * test_cli_gpt.c's cli_gpt_strategies_match_one_process runs the gpt's
 * default groups.)
 */
#include "cli_util.h"

#define GPT_FLAGS "--model gpt --layers 1 --heads 2 --dim 32 --context 24 --batch 8 --lr 0.01 --threads 1 --log-every 0"

TEST(cli_groups_gpt_default_is_nanogpt)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = small_text(200);
    int rc = RUN(a, "train " GPT_FLAGS " --steps 6 --weight-decay 0.5 --data-dir %s", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    /* per block 2 LayerNorms x 2 and 4 biases, ln_f's 2 */
    ASSERT_STR_CONTAINS(a, "weight decay 0.5, none on 10 parameters (--no-decay ndim<2), betas (0.9, 0.95)");
    /* the same betas with every parameter decayed is another run */
    rc = RUN(b, "train " GPT_FLAGS " --steps 6 --weight-decay 0.5 --no-decay none --data-dir %s", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "none on 0 parameters (--no-decay none)");
    ASSERT(number_after(a, "final train loss ") != number_after(b, "final train loss "));
    /* globs select by name: the biases only (4 Linears', 3 LayerNorms') */
    rc = RUN(b, "train " GPT_FLAGS " --steps 1 --no-decay '*.bias' --betas 0.8,0.99 --data-dir %s", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "none on 7 parameters (--no-decay *.bias), betas (0.8, 0.99)");
    /* the mlp decays everything, with PyTorch's betas, as before */
    rc = RUN(b, "train --model mlp --steps 1 --limit-train 64 --limit-test 10 --log-every 0 --data-dir %s", tiny_data());
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "none on 0 parameters (--no-decay none), betas (0.9, 0.999)");
}

/* The groups are the checkpoint's: a resume that does not repeat them
 * trains on with them, exactly as the run that never stopped. */
TEST(cli_groups_resume_keeps_them)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = small_text(200);
    char ck[700];
    snprintf(ck, sizeof ck, "%s/r.safetensors", ct_test_tmpdir());
#define GROUPS "--weight-decay 0.3 --no-decay '*.bias,ln_*' --betas 0.85,0.97"
    int rc = RUN(a, "train " GPT_FLAGS " " GROUPS " --steps 12 --data-dir %s", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    rc = RUN(b, "train " GPT_FLAGS " " GROUPS " --steps 6 --data-dir %s --save %s", dir, ck);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", b);
#undef GROUPS
    rc = RUN(b, "inspect %s", path_in("r.optim.safetensors"));
    ASSERT_STR_CONTAINS(b, "ctrain.no_decay = *.bias,ln_*");
    rc = RUN(b, "train --steps 12 --resume %s --data-dir %s --threads 1 --log-every 0", ck, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "(--no-decay *.bias,ln_*), betas (0.85, 0.97)");
    ASSERT_EQ(number_after(a, "final train loss "), number_after(b, "final train loss "));
    ASSERT_EQ(number_after(a, "val loss "), number_after(b, "val loss "));
}

TEST(cli_groups_usage_errors)
{
    static char out[OUT_MAX];
    struct {
        const char *args, *needle;
    } cases[] = {
        {"train --model gpt --steps 1 --no-decay 'ndim<x'", "--no-decay: parameter rule 'ndim<x'"},
        {"train --model gpt --steps 1 --no-decay '*.bias,'", "is empty"},
        {"train --model gpt --steps 1 --betas 0.9", "--betas 0.9 is not two numbers"},
        {"train --model gpt --steps 1 --betas 0.9,1.5", "in [0, 1)"},
        {"train --model gpt --steps 1 --optim sgd --betas 0.9,0.95", "--betas applies to --optim adamw only"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = RUN(out, "%s", cases[i].args);
        if (rc != 2 || !strstr(out, cases[i].needle))
            ct_test_fail(__FILE__, __LINE__, "'%s' gave %d (want 2) and:\n%s(want '%s')", cases[i].args, rc, out,
                         cases[i].needle);
    }
}
