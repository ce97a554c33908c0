/*
 * `ctrain sample`: rebuilds a gpt from a checkpoint and continues a prompt,
 * a byte per token, through the KV-cache generator (ct_gpt_gen).  One
 * process; the same seed gives the same text.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: ctrain sample --checkpoint CKPT [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--seed S]\n\n"
    "Generates N bytes of text from the gpt in CKPT after the prompt (a newline if none is given) and\n"
    "prints the prompt and its continuation.  Each byte is drawn from softmax(logits / T) over the K most\n"
    "likely bytes (T 0: always the most likely).  Past the model's context the window slides to the\n"
    "last context bytes.";

typedef struct {
    const char *ckpt, *prompt;
    int64_t tokens, top_k, seed;
    double temperature;
} sample_opts;

static ct_status run(const sample_opts *o)
{
    ct_ckpt_info ck;
    ct_module *model = NULL;
    ct_strategy *s = NULL;
    ct_gpt_gen *gen = NULL;
    ct_model_config cfg;
    ct_status r = ct_checkpoint_info(NULL, o->ckpt, 0, &ck);
    if (r == CT_OK && ct_model_config_from_meta(&ck.meta, &cfg) != CT_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", ct_last_error());
        r = ct_error(CT_EFORMAT, "%s: %s", o->ckpt, why);
    }
    if (r == CT_OK && cfg.kind != CT_MODEL_GPT)
        r = ct_error(CT_EINVAL, "%s holds a %s; sample generates text from a gpt (ctrain train --model gpt)", o->ckpt,
                     ct_model_kind_name(cfg.kind));
    if (r == CT_OK && cfg.vocab < 256)
        r = ct_error(CT_EINVAL, "%s has a vocabulary of %lld; sample reads and writes bytes (256)", o->ckpt,
                     (long long)cfg.vocab);
    if (r == CT_OK) r = ct_model_build(&cfg, 0, &model);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    if (r == CT_OK) r = ct_strategy_create("none", model, &oo, NULL, NULL, &s);
    if (r == CT_OK) r = ct_checkpoint_load(s, o->ckpt, 0);
    if (r == CT_OK) r = ct_gpt_gen_create(model, &cfg, &gen);
    if (r == CT_OK) {
        const char *p = o->prompt && *o->prompt ? o->prompt : "\n";
        size_t n = strlen(p);
        const float *logits = NULL;
        fwrite(p, 1, n, stdout);
        for (size_t i = 0; i < n && r == CT_OK; i++) r = ct_gpt_gen_feed(gen, (unsigned char)p[i], &logits);
        ct_rng rng;
        ct_rng_init(&rng, (uint64_t)o->seed, 0x73616d70 /* "samp" */);
        for (int64_t i = 0; i < o->tokens && r == CT_OK; i++) {
            int64_t tok = ct_gpt_sample_logits(logits, cfg.vocab, (float)o->temperature, o->top_k, &rng);
            putchar((int)tok);
            if (tok == '\n') fflush(stdout);
            if (i + 1 < o->tokens) r = ct_gpt_gen_feed(gen, tok, &logits);
        }
        putchar('\n');
        fflush(stdout);
    }
    ct_gpt_gen_destroy(gen);
    ct_strategy_destroy(s);
    ct_module_destroy(model);
    ct_ckpt_info_fini(&ck);
    return r;
}

int cli_sample(int argc, char **argv)
{
    sample_opts o = {NULL, NULL, 200, 0, 0, 1.0};
    cli_opt t[] = {
        {"--checkpoint", OPT_STR, &o.ckpt, "CKPT", "a gpt checkpoint written by ctrain train --save", 0},
        {"--prompt", OPT_STR, &o.prompt, "TEXT", "text to continue (a newline)", 0},
        {"--tokens", OPT_INT, &o.tokens, "N", "bytes to generate (200)", 0},
        {"--temperature", OPT_NUM, &o.temperature, "T", "softmax temperature; 0 picks the most likely byte (1)", 0},
        {"--top-k", OPT_INT, &o.top_k, "K", "draw from the K most likely bytes only (0: all)", 0},
        {"--seed", OPT_INT, &o.seed, "S", "seed of the draws (0)", 0},
    };
    int n = (int)(sizeof t / sizeof t[0]), help, npos;
    const char *pos[1];
    char err[1024];
    int rc = cli_parse("sample", argc, argv, t, n, pos, 0, &npos, &help, err, sizeof err);
    if (help) {
        cli_print_help(stdout, usage, t, n, NULL);
        return CLI_OK;
    }
    if (rc == 0) {
        if (!o.ckpt) snprintf(err, sizeof err, "ctrain sample: --checkpoint CKPT is required (a gpt saved by ctrain train --save)"), rc = CLI_USAGE;
        else if (o.tokens < 0) snprintf(err, sizeof err, "ctrain sample: --tokens %lld must not be negative", (long long)o.tokens), rc = CLI_USAGE;
        else if (!(o.temperature >= 0) || o.temperature > 1e6) /* past 1e6 every byte is as likely: noise */
            snprintf(err, sizeof err, "ctrain sample: --temperature %g must be between 0 and 1e6 (0 picks the most "
                     "likely byte; large values approach uniform noise)", o.temperature), rc = CLI_USAGE;
        else if (o.top_k < 0) snprintf(err, sizeof err, "ctrain sample: --top-k %lld must not be negative (0: all)", (long long)o.top_k), rc = CLI_USAGE;
        else if (o.seed < 0) snprintf(err, sizeof err, "ctrain sample: --seed %lld must not be negative", (long long)o.seed), rc = CLI_USAGE;
    }
    if (rc) {
        fprintf(stderr, "%s\n", err);
        return rc;
    }
    if (ct_comm_init(NULL, NULL) != CT_OK) { /* the checkpoint loads through a strategy */
        cli_err("sample", "cannot start communication: %s", ct_last_error());
        return CLI_RUNTIME;
    }
    ct_blas_set_threads(1); /* one position at a time: products too small to share */
    ct_status r = run(&o);
    if (r != CT_OK) {
        fflush(stdout);
        cli_err("sample", "%s", ct_last_error());
    }
    ct_comm_finalize();
    return r == CT_OK ? CLI_OK : CLI_RUNTIME;
}
