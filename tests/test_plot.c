/*
 * Pictures without set-up: a run's --metrics (logged steps, and with
 * --eval-every the validation loss as "eval" events) drawn by scripts/plot
 * (which installs gnuplot through scripts/deps.sh when it is missing) into
 * a PNG of the training loss, the validation loss and the learning rate.
 */
#include <sys/stat.h>

#include "cli_util.h"

static uint32_t be32(const unsigned char *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

TEST(plot_renders_train_loss_val_loss_and_lr)
{
    static char out[OUT_MAX];
    const char *tmp = ct_test_tmpdir(), *txt = small_text(300);
    char path[1100];
    FILE *f;
    ASSERT_EQ(RUN(out, "train --model gpt --layers 1 --heads 2 --dim 16 --context 16 --steps 40 --batch 8 "
                       "--data-dir %s --metrics %s/m.jsonl --log-every 10 --eval-every 20 --schedule cosine "
                       "--warmup 5 --lr 0.003", txt, tmp), 0);
    ASSERT_STR_CONTAINS(out, "step 20/40  val loss ");
    /* two evaluations (step 20, and the last step's, which the report reuses) */
    snprintf(path, sizeof path, "%s/m.jsonl", tmp);
    f = fopen(path, "r");
    ASSERT(f != NULL);
    static char metrics[OUT_MAX];
    metrics[fread(metrics, 1, sizeof metrics - 1, f)] = 0;
    fclose(f);
    ASSERT_EQ(occurrences(metrics, "{\"event\":\"eval\",\"step\":"), 2);
    ASSERT_STR_CONTAINS(metrics, "{\"event\":\"eval\",\"step\":40,");
    const char *last = strstr(metrics, "{\"event\":\"eval\",\"step\":40,");
    ASSERT(last != NULL);
    ASSERT_NEAR(number_after(last, "\"val_loss\":"), number_after(out, "\nval loss "), 1e-4); /* the report's */

    int rc = run_shell(0, out, "sh %s/../scripts/plot %s/m.jsonl %s/curve.png", cli_bin_dir(), tmp, tmp);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "scripts/plot failed (%d):\n%s", rc, out);
    ASSERT_STR_CONTAINS(out, "4 training loss and learning rate points, 2 validation loss points");
    snprintf(path, sizeof path, "%s/curve.png", tmp);
    f = fopen(path, "rb");
    ASSERT(f != NULL);
    unsigned char png[64];
    size_t n = fread(png, 1, sizeof png, f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    ASSERT(n >= 24 && !memcmp(png, "\x89PNG\r\n\x1a\n", 8) && !memcmp(png + 12, "IHDR", 4));
    ASSERT_EQ(be32(png + 16), 900);
    ASSERT_EQ(be32(png + 20), 720);
    ASSERT(size > 10000); /* axes, labels and three curves, not an empty canvas */

    /* a file that is not a metrics file: a clear error */
    rc = run_shell(0, out, "sh %s/../scripts/plot %s %s/x.png", cli_bin_dir(), txt, tmp);
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(out, "is it a ctrain --metrics file?");
}
