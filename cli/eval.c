/*
 * `ctrain eval`: rebuilds a model from a checkpoint's metadata alone and
 * reports its test loss, accuracy and confusion matrix.  Under mpirun the
 * test set is split across the ranks.
 */
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: ctrain eval --checkpoint CKPT [--data fashion-mnist|fortunes] [--data-dir DIR] [--batch B]\n\n"
    "Rebuilds the model that CKPT describes (its metadata says which), evaluates it on the\n"
    "test set and prints the loss, the accuracy and the confusion matrix (rows: true class);\n"
    "for a gpt, on the text's validation split (its consecutive windows of context + 1 bytes):\n"
    "the loss per byte in nats and in bits, next to the unigram baseline.";

typedef struct {
    const char *ckpt, *data, *data_dir;
    int64_t batch, limit_test, threads;
} eval_opts;

static int table(eval_opts *o, cli_opt *t)
{
    int n = 0;
    t[n++] = (cli_opt){"--checkpoint", OPT_STR, &o->ckpt, "CKPT", "checkpoint written by ctrain train (a file, or a sharded directory)", 0};
    t[n++] = (cli_opt){"--data", OPT_STR, &o->data, "NAME", "data set: fashion-mnist, or fortunes for a gpt (the model's)", 0};
    t[n++] = (cli_opt){"--data-dir", OPT_STR, &o->data_dir, "DIR", "where the data files are (" CT_FASHION_MNIST_DIR "; fortunes: " CT_FORTUNES_DIR ")", 0};
    t[n++] = (cli_opt){"--batch", OPT_INT, &o->batch, "B", "samples per forward pass (500; gpt: 32 windows)", 0};
    t[n++] = (cli_opt){"--threads", OPT_INT, &o->threads, "N", "BLAS threads per rank (cores / ranks on the node)", 0};
    t[n++] = (cli_opt){"--limit-test", OPT_INT, &o->limit_test, "N", NULL, 0};
    return n;
}

static void print_confusion(const cli_eval *ev, int64_t C)
{
    char hdr[32];
    cli_out("confusion matrix (rows: true class, columns: predicted class)\n%-12s", "");
    for (int64_t j = 0; j < C; j++) {
        snprintf(hdr, sizeof hdr, "%.7s", ct_fashion_mnist_class((int)j));
        cli_out(" %7s", C == 10 ? hdr : (snprintf(hdr, sizeof hdr, "%lld", (long long)j), hdr));
    }
    cli_out("  %7s\n", "recall");
    for (int64_t i = 0; i < C; i++) {
        int64_t row = 0;
        for (int64_t j = 0; j < C; j++) row += ev->confusion[i * C + j];
        cli_out("%-12s", C == 10 ? ct_fashion_mnist_class((int)i) : (snprintf(hdr, sizeof hdr, "%lld", (long long)i), hdr));
        for (int64_t j = 0; j < C; j++) cli_out(" %7lld", (long long)ev->confusion[i * C + j]);
        cli_out("  %6.1f%%\n", row ? 100.0 * (double)ev->confusion[i * C + i] / (double)row : 0.0);
    }
}

static ct_status run(const eval_opts *o)
{
    ct_group *g = ct_group_world();
    ct_ckpt_info ck;
    ct_dataset test = {0};
    ct_text text = {0};
    ct_module *model = NULL;
    ct_strategy *s = NULL;
    int64_t *conf = NULL;
    ct_model_config cfg;
    const ct_meta *m = &ck.meta;
    ct_status r = ct_checkpoint_info(g, o->ckpt, 0, &ck); /* finishes a save a crash interrupted first */
    if (r == CT_OK && ct_model_config_from_meta(m, &cfg) != CT_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", ct_last_error());
        r = ct_error(CT_EFORMAT, "%s: %s", o->ckpt, why);
    }
    const char *data = o->data ? o->data : r == CT_OK ? cli_data_default(&cfg) : "";
    if (r == CT_OK) r = cli_check_data_kind(&cfg, data);
    int is_text = r == CT_OK && cfg.kind == CT_MODEL_GPT;
    if (is_text) r = cli_load_text(&cfg, o->data_dir, &text);
    else if (r == CT_OK) r = cli_load_data(data, o->data_dir, 0, o->limit_test, &test);
    if (r == CT_OK && !is_text) r = cli_check_input(&cfg, &test);
    if (r == CT_OK) r = ct_model_build(&cfg, 0, &model);
    /* The weights go in through the strategy's loader, the same checks as training. */
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    if (r == CT_OK) r = ct_strategy_create("none", model, &oo, g, NULL, &s);
    r = ct_group_check(g, r);
    if (r == CT_OK) {
        r = ct_checkpoint_load(s, o->ckpt, 0);
        if (r != CT_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", ct_last_error());
            r = ct_error(r, "%s does not match the model its metadata describes: %s", o->ckpt, why);
        }
    }
    if (r == CT_OK && !is_text && !(conf = ct_alloc_zeroed(sizeof *conf * (size_t)(cfg.classes * cfg.classes), CT_MEM_OTHER)))
        r = CT_ENOMEM;
    r = ct_group_check(g, r);
    cli_eval ev;
    if (r == CT_OK && is_text)
        r = cli_evaluate_text(NULL, model, &cfg, &text, o->batch ? o->batch : 32, o->limit_test, g, &ev);
    else if (r == CT_OK) r = cli_evaluate(NULL, model, &cfg, &test, o->batch ? o->batch : 500, g, &ev, conf);
    if (r == CT_OK) {
        char buf[512], desc[300];
        cli_out("model: %s (%lld parameters) from %s", cli_config_str(&cfg, desc, sizeof desc),
                (long long)ct_module_num_params(model), o->ckpt);
        const char *step = ct_meta_get(m, "ctrain.step");
        char shown[1100];
        cli_out(step ? ", step %s\n" : "\n", step ? cli_printable(step, shown, sizeof shown) : "");
        if (is_text) {
            cli_out("data: %s, %d files, %lld bytes, validation from byte %lld (%lld windows of %lld + 1)\n",
                    o->data_dir ? o->data_dir : CT_FORTUNES_DIR, text.nfiles, (long long)text.n,
                    (long long)text.ntrain, (long long)ct_text_val_windows(&text, cfg.context), (long long)cfg.context);
            cli_out("%s\n", cli_eval_text_str(&ev, ct_text_unigram_entropy(&text), buf, sizeof buf));
        } else {
            cli_out("test: %s\n", cli_eval_str(&ev, buf, sizeof buf));
            print_confusion(&ev, cfg.classes);
        }
    }
    ct_free(conf);
    ct_strategy_destroy(s);
    ct_module_destroy(model);
    ct_dataset_fini(&test);
    ct_text_fini(&text);
    ct_ckpt_info_fini(&ck);
    return r;
}

int cli_eval_cmd(int argc, char **argv)
{
    eval_opts o = {NULL, NULL, NULL, 0, 0, 0}; /* data and batch: the model's defaults */
    cli_opt t[8];
    int n = table(&o, t), help, npos;
    const char *pos[1];
    char err[1024];
    int rc = cli_parse("eval", argc, argv, t, n, pos, 0, &npos, &help, err, sizeof err);
    if (rc == 0 && !help) {
        if (!o.ckpt) snprintf(err, sizeof err, "ctrain eval: --checkpoint CKPT is required (a file written by ctrain train --save)"), rc = CLI_USAGE;
        else if (o.data && strcmp(o.data, "fashion-mnist") && strcmp(o.data, "fortunes")) snprintf(err, sizeof err, "ctrain eval: unknown data set '%s' for --data; this ctrain knows: fashion-mnist, fortunes", o.data), rc = CLI_USAGE;
        else if (cli_find(t, n, "--batch")->given && o.batch < 1) snprintf(err, sizeof err, "ctrain eval: --batch %lld must be at least 1", (long long)o.batch), rc = CLI_USAGE;
        else if (o.threads < 0 || o.threads > 4096)
            snprintf(err, sizeof err, "ctrain eval: --threads %lld must be in 0..4096 (0: automatic)", (long long)o.threads), rc = CLI_USAGE;
        else if (o.limit_test < 0) snprintf(err, sizeof err, "ctrain eval: --limit-test must not be negative"), rc = CLI_USAGE;
    }
    cli_rank = cli_launcher_rank();
    if (help) {
        if (cli_rank == 0) cli_print_help(stdout, usage, t, n, NULL);
        return CLI_OK;
    }
    if (rc) {
        if (cli_rank == 0) fprintf(stderr, "%s\n", err);
        return rc;
    }
    if (ct_comm_init(NULL, NULL) != CT_OK) {
        cli_err("eval", "cannot start communication: %s", ct_last_error());
        return CLI_RUNTIME;
    }
    cli_rank = ct_group_rank(ct_group_world());
    cli_world = ct_group_size(ct_group_world());
    ct_blas_set_threads(o.threads ? (int)o.threads : cli_default_threads(ct_group_world()));
    ct_status r = run(&o);
    if (r != CT_OK) cli_err("eval", "%s", ct_last_error());
    ct_comm_finalize();
    return r == CT_OK ? CLI_OK : CLI_RUNTIME;
}
