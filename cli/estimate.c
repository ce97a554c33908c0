/*
 * `ctrain estimate`: the per-rank bytes every strategy would take for a
 * model, from its shapes alone (the model is built, nothing runs).  The
 * figures are the library's (ct_strategy_plan, src/parallel/plan*.c): this
 * file parses the flags, turns them into the options `ctrain train` would
 * pass, and prints the table or JSON.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* The strategies, in the order of ct_strategy_list(). */
#define MAXKINDS 16
typedef struct {
    char names[MAXKINDS][32];
    int n;
} kind_list;

static void list_kinds(kind_list *k)
{
    char all[512];
    snprintf(all, sizeof all, "%s", ct_strategy_list());
    k->n = 0;
    for (char *s = strtok(all, ", "); s && k->n < MAXKINDS; s = strtok(NULL, ", "))
        snprintf(k->names[k->n++], sizeof k->names[0], "%s", s);
}

/* ---- the command -------------------------------------------------------- */

typedef struct {
    const char *model, *hidden, *optim, *mixed, *grad_compress, *strategy, *strategy_opt;
    const char *offload; /* --offload: fsdp's shard parts in the store */
    int64_t kernel, ranks, batch, grad_accum;
    cli_gpt_shape gpt;
    double dropout, momentum;
    int json, has_kernel, batchnorm, checkpoint_activation;
} est_opts;

static const char usage[] =
    "usage: ctrain estimate --model mlp|cnn|gpt --ranks N [options]\n\n"
    "Predicts the peak bytes per rank of every strategy for a model, from its shapes alone\n"
    "(nothing is trained): one row per strategy, in the categories of the memory report that\n"
    "'ctrain train' prints and writes as the last line of --metrics.";

static const char epilog[] =
    "Columns: param (f32 weights, buffers and, with --mixed bf16, bf16 compute copies), grad,\n"
    "optim (optimizer state), act (activations of one step for this rank's share of --batch,\n"
    "which is the global batch as in 'ctrain train', and its inputs), comm (communication\n"
    "buffers), resident = param + grad + optim, total = all five (the data set is not counted).\n"
    "Every figure is the largest rank's.  --strategy-opt keys apply to the strategies that take\n"
    "them ('ctrain estimate --strategy-opt help' lists them).  --json prints one object per\n"
    "strategy, in bytes.\n";

static int table(est_opts *o, cli_opt *t)
{
    int n = 0;
#define OPT(nm, ty, dst, mv, hl) t[n++] = (cli_opt){nm, ty, dst, mv, hl, 0}
    OPT("--model", OPT_STR, &o->model, "NAME", "model: mlp, cnn or gpt");
    OPT("--hidden", OPT_STR, &o->hidden, "LIST", "layer sizes (mlp 256,128; cnn conv channels then fc: 16,32,128)");
    OPT("--kernel", OPT_INT, &o->kernel, "K", "cnn: conv kernel size, odd (3)");
    OPT("--batchnorm", OPT_FLAG, &o->batchnorm, NULL, "cnn: BatchNorm2d after each conv");
    OPT("--dropout", OPT_NUM, &o->dropout, "P", "mlp: dropout after every hidden layer; gpt: nanoGPT's dropout (0)");
    n += cli_gpt_shape_opts(&o->gpt, t + n);
    OPT("--ranks", OPT_INT, &o->ranks, "N", "number of ranks (required)");
    OPT("--batch", OPT_INT, &o->batch, "B", "global batch size, split across ranks (64)");
    OPT("--optim", OPT_STR, &o->optim, "NAME", "sgd or adamw (adamw)");
    OPT("--momentum", OPT_NUM, &o->momentum, "M", "sgd momentum (0: no optimizer state)");
    OPT("--mixed", OPT_STR, &o->mixed, "DTYPE", "mixed precision: bf16 compute copies of the weights (none)");
    OPT("--grad-compress", OPT_STR, &o->grad_compress, "NAME",
        "gradients reduced as none (f32), bf16, f16 or powersgd:R (PowerSGD at rank R; ddp and zero1)");
    OPT("--grad-accum", OPT_INT, &o->grad_accum, "N", "micro-batches per step (1)");
    OPT("--strategy", OPT_STR, &o->strategy, "LIST", "only these strategies, comma separated (all that apply)");
    OPT("--strategy-opt", OPT_STR, &o->strategy_opt, "K=V,...", "strategy options, as for 'ctrain train'");
    OPT("--offload", OPT_STR, &o->offload, "PARTS", "fsdp: shard parts in the store: optim, params or all, as for 'ctrain train'");
    OPT("--checkpoint-activation", OPT_FLAG, &o->checkpoint_activation, NULL,
        "each gpt block (each layer of an mlp or cnn) keeps only its input, as 'ctrain train' does");
    OPT("--json", OPT_FLAG, &o->json, NULL, "one JSON object per strategy, in bytes");
#undef OPT
    return n;
}

#define MAXOPT 24
#define BAD(...) (snprintf(err, errn, "ctrain estimate: " __VA_ARGS__), CLI_USAGE)

static int in_list(const char *v, const char *list)
{
    size_t len = strlen(v);
    for (const char *p = list; (p = strstr(p, v)); p += len)
        if ((p == list || p[-1] == ',' || p[-1] == ' ') && (p[len] == 0 || p[len] == ',')) return 1;
    return 0;
}

/* Does kind take key?  Its help lines start "  key=default". */
static int takes(const char *kind, const char *key)
{
    char help[4096], pat[160];
    if (ct_strategy_help(kind, help, sizeof help) != CT_OK) return 0;
    snprintf(pat, sizeof pat, "  %s=", key);
    return strstr(help, pat) != NULL;
}

/* The rows to print: --strategy's, or every kind (those that cannot plan
 * the world, as none on several ranks, are left out when planned). */
static int chosen(const est_opts *o, const char *kind)
{
    if (o->strategy) return in_list(kind, o->strategy);
    return cli_powersgd_rank(o->grad_compress) > 0 ? !strcmp(kind, "ddp") || !strcmp(kind, "zero1") : 1;
}

/* The options string of kind (the flags', then --strategy-opt's keys it
 * takes), as `ctrain train` would pass them, into opts (n bytes); checked. */
static int resolve(const est_opts *o, const char *kind, char *opts, size_t n, char *err, size_t errn)
{
    int psgd = cli_powersgd_rank(o->grad_compress);
    if (psgd > 0 && strcmp(kind, "ddp") && strcmp(kind, "zero1"))
        return BAD("--grad-compress %s applies to --strategy ddp and zero1 (PowerSGD compresses their gradient "
                   "buckets), not %s; use bf16 or f16 with %s", o->grad_compress, kind, kind);
    int len = snprintf(opts, n, "grad_accum=%lld,param_dtype=%s,reduce_dtype=%s", (long long)o->grad_accum,
                       strcmp(o->mixed, "none") ? o->mixed : "f32",
                       strcmp(o->grad_compress, "none") && !psgd ? o->grad_compress : "f32");
    if (psgd > 0) len += snprintf(opts + len, n - (size_t)len, ",powersgd_rank=%d", psgd);
    ct_model_kind mk = CT_MODEL_MLP;
    if (!strcmp(kind, "fsdp") && ct_model_parse_kind(o->model, &mk) == CT_OK) { /* as `ctrain train` passes it */
        char wrap[64];
        CLI_FSDP_WRAP(wrap, sizeof wrap, mk == CT_MODEL_GPT, CLI_FSDP_WRAP_MIN_PARAMS, 0);
        len += snprintf(opts + len, n - (size_t)len, ",%s", wrap);
        if (o->offload) len += snprintf(opts + len, n - (size_t)len, ",offload=%s", o->offload);
    }
    for (const char *p = o->strategy_opt; p && *p;) {
        size_t pl = strcspn(p, ","), kl = strcspn(p, "=,");
        char key[128];
        snprintf(key, sizeof key, "%.*s", (int)(kl < sizeof key ? kl : sizeof key - 1), p);
        if (pl && (kl == pl || takes(kind, key)))
            len += snprintf(opts + len, len < (int)n ? n - (size_t)len : 0, ",%.*s", (int)pl, p);
        p += pl + (p[pl] == ',');
    }
    if (len >= (int)n) return BAD("--strategy-opt is too long");
    if (ct_strategy_check_opts(kind, opts, NULL, 0) != CT_OK) return BAD("--strategy-opt: %s", ct_last_error());
    return 0;
}

static int parse(int argc, char **argv, est_opts *o, int *help, char *err, size_t errn)
{
    memset(o, 0, sizeof *o);
    o->batch = 64;
    o->optim = "adamw";
    o->mixed = "none";
    o->grad_compress = "none";
    o->grad_accum = 1;
    o->gpt = cli_gpt_shape_default();
    cli_opt t[MAXOPT];
    int n = table(o, t), npos;
    const char *pos[1];
    int r = cli_parse("estimate", argc, argv, t, n, pos, 0, &npos, help, err, errn);
    if (r || *help) return r;
    for (int i = 0; i < n; i++)
        if (t[i].given > 1) return BAD("%s is given %d times; give it once", t[i].name, t[i].given);
#define GIVEN(nm) (cli_find(t, n, nm)->given != 0)
    /* --strategy-opt help only lists keys: no model needed (cli_estimate answers it). */
    if (o->strategy_opt && !strcmp(o->strategy_opt, "help")) return 0;
    if (!o->model) return BAD("--model is required; choose one of: %s", ct_model_list());
    ct_model_kind kind;
    if (ct_model_parse_kind(o->model, &kind) != CT_OK) return BAD("--model: %s", ct_last_error());
    if (!GIVEN("--ranks")) return BAD("--ranks is required: give the number of ranks, e.g. --ranks 2");
    if (o->ranks < 1) return BAD("--ranks %lld must be at least 1", (long long)o->ranks);
    if (o->ranks > 65536) return BAD("--ranks %lld is more than this estimate handles (65536)", (long long)o->ranks);
    o->has_kernel = GIVEN("--kernel");
    if (GIVEN("--kernel") && kind != CT_MODEL_CNN) return BAD("--kernel applies to --model cnn only");
    if (o->batchnorm && kind != CT_MODEL_CNN) return BAD("--batchnorm applies to --model cnn only");
    if (o->hidden || o->has_kernel) {
        ct_model_config c = ct_model_config_default(kind);
        if (o->hidden && ct_model_config_parse_hidden(&c, o->hidden) != CT_OK) return BAD("--hidden: %s", ct_last_error());
        if (o->has_kernel) c.kernel = o->kernel < 0 || o->kernel > 99 ? 0 : (int)o->kernel;
        if (ct_model_config_validate(&c) != CT_OK)
            return BAD("%s: %s", o->has_kernel ? "--kernel" : "--hidden", ct_last_error());
    }
    if (GIVEN("--dropout") && kind == CT_MODEL_CNN) return BAD("--dropout applies to --model mlp and gpt only");
    if (cli_gpt_shape_given(t, n) && kind != CT_MODEL_GPT) return BAD(CLI_GPT_SHAPE_FLAGS " apply to --model gpt only");
    if (kind == CT_MODEL_GPT && cli_gpt_shape_check(&o->gpt) != CT_OK) return BAD("%s", ct_last_error());
    if (GIVEN("--dropout") && !(o->dropout >= 0 && o->dropout < 1)) return BAD("--dropout %g must be in [0, 1)", o->dropout);
    ct_optim_kind ok;
    if (ct_optim_parse(o->optim, &ok)) return BAD("unknown optimizer '%s' for --optim; choose sgd or adamw", o->optim);
    if (GIVEN("--momentum") && ok != CT_OPT_SGD) return BAD("--momentum applies to --optim sgd only (adamw has betas)");
    if (o->momentum < 0) return BAD("--momentum %g must not be negative", o->momentum);
    if (strcmp(o->mixed, "none") && strcmp(o->mixed, "bf16")) return BAD("unknown --mixed '%s'; choose none or bf16", o->mixed);
    if (strcmp(o->grad_compress, "none") && strcmp(o->grad_compress, "bf16") && strcmp(o->grad_compress, "f16") &&
        cli_powersgd_rank(o->grad_compress) <= 0)
        return BAD("unknown --grad-compress '%s'; choose none, bf16, f16 or powersgd:R (R a rank from 1, such as "
                   "powersgd:4)", o->grad_compress);
    if (o->grad_accum < 1) return BAD("--grad-accum %lld must be at least 1", (long long)o->grad_accum);
    if (o->batch < o->ranks && o->grad_accum == 1)
        return BAD("--batch %lld is smaller than the %lld ranks; every rank needs at least one sample per step: use "
                   "--batch %lld or more", (long long)o->batch, (long long)o->ranks, (long long)o->ranks);
    if (o->batch < o->ranks * o->grad_accum)
        return BAD("--batch %lld is smaller than %lld ranks x %lld micro-batches; every rank needs a sample per "
                   "micro-batch: use --batch %lld or more", (long long)o->batch, (long long)o->ranks,
                   (long long)o->grad_accum, (long long)(o->ranks * o->grad_accum));
#undef GIVEN
    kind_list kl;
    list_kinds(&kl);
    if (o->strategy) {
        char list[256];
        snprintf(list, sizeof list, "%s", o->strategy);
        for (char *s = strtok(list, ","); s; s = strtok(NULL, ",")) {
            int k = 0;
            while (k < kl.n && strcmp(kl.names[k], s)) k++;
            if (k == kl.n) return BAD("unknown strategy '%s' in --strategy; choose from: %s", s, ct_strategy_list());
        }
    }
    /* A --strategy-opt key applies to the strategies that take it; one that
     * none of the estimated strategies takes is a mistake. */
    for (const char *p = o->strategy_opt; p && *p;) {
        size_t pl = strcspn(p, ","), kn = strcspn(p, "=,");
        char key[128], who[256] = "";
        snprintf(key, sizeof key, "%.*s", (int)(kn < sizeof key ? kn : sizeof key - 1), p);
        int shown = 0;
        for (int k = 0; pl && kn < pl && k < kl.n; k++) {
            int tk = takes(kl.names[k], key);
            if (tk) snprintf(who + strlen(who), sizeof who - strlen(who), "%s%s", *who ? ", " : "", kl.names[k]);
            if (chosen(o, kl.names[k])) shown += tk;
        }
        if (pl && kn < pl && !shown && *who)
            return BAD("--strategy-opt %s: no strategy estimated here takes it (%s do); drop it or add one of "
                       "those to --strategy", key, who);
        if (pl && kn < pl && !shown)
            return BAD("--strategy-opt %s: no strategy takes this key; drop it ('ctrain estimate --strategy-opt "
                       "help' lists the keys)", key);
        p += pl + (p[pl] == ',');
    }
    return 0;
}

/* The model (built with every storage it would train with) and the run as ct_strategy_plan reads it. */
static ct_status build_input(const est_opts *o, ct_model_config *cfg, ct_module **model, ct_plan_spec *spec)
{
    ct_model_kind kind;
    CT_TRY(ct_model_parse_kind(o->model, &kind));
    *cfg = ct_model_config_default(kind);
    if (o->hidden) CT_TRY(ct_model_config_parse_hidden(cfg, o->hidden));
    if (o->has_kernel) cfg->kernel = o->kernel < 0 || o->kernel > 99 ? 0 : (int)o->kernel;
    cfg->dropout = (float)o->dropout;
    cfg->batchnorm = o->batchnorm;
    if (kind == CT_MODEL_GPT) cli_gpt_shape_apply(&o->gpt, cfg);
    CT_TRY(ct_model_config_validate(cfg));
    memset(spec, 0, sizeof *spec);
    spec->world = (int)o->ranks;
    spec->batch = o->batch;
    int64_t sh[CT_MAX_DIMS + 1];
    spec->in_ndim = ct_model_input_shape(cfg, 1, sh) - 1;
    for (int d = 0; d < spec->in_ndim; d++) spec->in_shape[d] = sh[d + 1];
    spec->sample_bytes = ct_model_sample_bytes(cfg);
    ct_optim_kind ok;
    ct_optim_parse(o->optim, &ok);
    spec->optim = ct_optim_defaults(ok);
    if (ok == CT_OPT_SGD) spec->optim.momentum = (float)o->momentum;
    /* Shapes are all a plan reads: built shape-only, a 2B-parameter model is
     * planned in a moment instead of drawing 2B initial values (5 minutes). */
    int was = ct_module_shape_only(1);
    ct_status built = ct_model_build(cfg, 0, model);
    ct_module_shape_only(was);
    CT_TRY(built);
    /* the wrappers `ctrain train --checkpoint-activation` puts in (their act_cost keeps the input only) */
    ct_status st = o->checkpoint_activation ? ct_module_apply_activation_checkpointing(*model, NULL, NULL, NULL) : CT_OK;
    if (st != CT_OK) {
        ct_module_destroy(*model);
        *model = NULL;
    }
    return st;
}

/* The runtime's fixed overhead: this process's RSS with communication and
 * BLAS started and no model, which is an empty run's (under mpirun -np N,
 * the largest rank's at N ranks).  0 where it cannot be measured. */
static uint64_t fixed_overhead(void)
{
    int mine = !ct_comm_initialized();
    if (mine && ct_comm_init(NULL, NULL) != CT_OK) return 0;
    float a[64 * 64] = {0}, c[64 * 64];
    ct_sgemm(0, 0, 64, 64, 64, 1.0f, a, 64, a, 64, 0.0f, c, 64); /* BLAS sets up its buffers at its first product */
    ct_group *g = ct_group_world();
    int n = ct_group_size(g);
    ct_mem_report *all = ct_alloc(sizeof *all * (size_t)n, CT_MEM_OTHER);
    uint64_t v = 0;
    if (all && ct_group_mem_reports(g, all) == CT_OK)
        for (int r = 0; r < n; r++) v = all[r].rss > v ? all[r].rss : v;
    ct_free(all);
    return v;
}

static void print_row(const est_opts *o, const char *kind, const ct_mem_plan *r, uint64_t fixed)
{
    if (o->json) {
        printf("{\"strategy\":\"%s\",\"ranks\":%lld,\"param\":%llu,\"grad\":%llu,\"optim\":%llu,\"act\":%llu,"
               "\"comm\":%llu,\"resident\":%llu,\"total\":%llu,\"flat\":%llu,\"cache\":%llu,\"shared\":%llu,\"setup\":%llu,"
               "\"save\":%llu,\"life\":%llu,\"life_phase\":\"%s\",\"fixed\":%llu,\"rss\":%llu,\"store\":%llu,\"moved\":%llu}\n", kind,
               (long long)o->ranks, (unsigned long long)r->param, (unsigned long long)r->grad,
               (unsigned long long)r->optim, (unsigned long long)r->act, (unsigned long long)r->comm,
               (unsigned long long)r->resident, (unsigned long long)r->total, (unsigned long long)r->flat,
               (unsigned long long)r->cache, (unsigned long long)r->shared, (unsigned long long)r->setup, (unsigned long long)r->save,
               (unsigned long long)r->life, ct_mem_phase_name((ct_mem_phase)r->life_phase),
               (unsigned long long)fixed, (unsigned long long)(fixed + r->life), (unsigned long long)r->store,
               (unsigned long long)r->moved);

        return;
    }
    const uint64_t v[] = {r->param, r->grad, r->optim, r->act, r->comm, r->resident, r->total};
    char b[32];
    printf("  %-9s", kind);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) printf("%11s", cli_bytes((double)v[i], b, sizeof b));
    printf("\n");
}

static void print_life_row(const char *kind, const ct_mem_plan *r, uint64_t fixed)
{
    const uint64_t v[] = {r->setup, r->shared + r->total, r->save, r->shared, r->cache, fixed + r->life};
    char b[32];
    printf("  %-9s", kind);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) printf("%11s", cli_bytes((double)v[i], b, sizeof b));
    printf("  %s\n", ct_mem_phase_name((ct_mem_phase)r->life_phase));
}

static int estimate_rows(const est_opts *o, const kind_list *kl, char (*opts)[2048], uint64_t fixed, int quiet);

int cli_estimate(int argc, char **argv)
{
    est_opts o;
    char err[1024];
    int help;
    int rc = parse(argc, argv, &o, &help, err, sizeof err);
    if (help) {
        est_opts d;
        cli_opt t[MAXOPT];
        cli_print_help(stdout, usage, t, table(&d, t), epilog);
        return CLI_OK;
    }
    if (rc) {
        fprintf(stderr, "%s\n", err);
        return rc;
    }
    kind_list kl;
    list_kinds(&kl);
    if (o.strategy_opt && !strcmp(o.strategy_opt, "help")) {
        char buf[4096];
        for (int k = 0; k < kl.n; k++) {
            if (!chosen(&o, kl.names[k]) || ct_strategy_help(kl.names[k], buf, sizeof buf) != CT_OK) continue;
            printf("--strategy %s takes --strategy-opt KEY=VALUE,... with these keys (defaults shown):\n%s",
                   kl.names[k], buf);
        }
        return CLI_OK;
    }
    char opts[MAXKINDS][2048];
    for (int k = 0; k < kl.n; k++)
        if (chosen(&o, kl.names[k]) && (rc = resolve(&o, kl.names[k], opts[k], sizeof opts[k], err, sizeof err))) {
            fprintf(stderr, "%s\n", err);
            return rc;
        }
    /* First, before the model exists: what any run costs. */
    int own_comm = !ct_comm_initialized();
    uint64_t fixed = fixed_overhead();
    int quiet = ct_comm_initialized() && ct_group_rank(ct_group_world()) != 0; /* under mpirun: rank 0 prints */
    rc = estimate_rows(&o, &kl, opts, fixed, quiet);
    if (own_comm && ct_comm_initialized()) ct_comm_finalize();
    return rc;
}

/* The plans of the chosen strategies, printed (not when quiet). */
static int estimate_rows(const est_opts *o, const kind_list *kl, char (*opts)[2048], uint64_t fixed, int quiet)
{
    ct_model_config cfg;
    ct_module *model = NULL;
    ct_plan_spec spec;
    ct_mem_plan rows[MAXKINDS];
    int shown[MAXKINDS] = {0};
    ct_status st = build_input(o, &cfg, &model, &spec);
    /* Every row first, so that a strategy that cannot plan is one line, not a half-printed table. */
    for (int k = 0; st == CT_OK && k < kl->n; k++) {
        if (!chosen(o, kl->names[k])) continue;
        st = ct_strategy_plan(kl->names[k], model, opts[k], &spec, &rows[k]);
        if (st == CT_EUNSUPPORTED && !o->strategy) { /* none on several ranks: not a row of this table */
            st = CT_OK;
            continue;
        }
        if (st == CT_EUNSUPPORTED) {
            if (!quiet) fprintf(stderr, "ctrain estimate: --strategy %s runs every rank alone; it applies to --ranks 1 only (drop "
                    "it from --strategy)\n", kl->names[k]);
            ct_module_destroy(model);
            return CLI_USAGE;
        }
        shown[k] = 1;
    }
    if (st != CT_OK) {
        cli_err("estimate", "%s", ct_last_error());
        ct_module_destroy(model);
        return st == CT_EINVAL ? CLI_USAGE : CLI_RUNTIME;
    }
    if (!o->json && !quiet) {
        char desc[300];
        int64_t rows_per = o->batch / o->ranks + (o->batch % o->ranks != 0);
        printf("ctrain estimate: %s (%lld parameters), %s%s, %lld rank%s, batch %lld (%lld rows per rank%s)%s%s%s%s\n",
               cli_config_str(&cfg, desc, sizeof desc), (long long)ct_module_num_params(model), o->optim,
               spec.optim.kind == CT_OPT_SGD && o->momentum ? " with momentum" : "", (long long)o->ranks,
               o->ranks == 1 ? "" : "s", (long long)o->batch, (long long)rows_per, o->grad_accum > 1 ? ", accumulated" : "",
               strcmp(o->mixed, "none") ? ", mixed bf16" : "",
               strcmp(o->grad_compress, "none") ? ", " : "", strcmp(o->grad_compress, "none") ? o->grad_compress : "",
               strcmp(o->grad_compress, "none") ? " reduce" : "");
        printf("peak bytes per rank (the largest rank's):\n  %-9s%11s%11s%11s%11s%11s%11s%11s\n", "strategy", "param",
               "grad", "optim", "act", "comm", "resident", "total");
    }
    for (int k = 0; k < kl->n && !quiet; k++)
        if (shown[k]) print_row(o, kl->names[k], &rows[k], fixed);
    for (int k = 0; k < kl->n && !quiet && !o->json; k++)
        if (shown[k] && rows[k].store) {
            char b[32], c[32];
            printf("  %s offload: %s per rank in the store, %s read and written per step; the step stays compute-bound\n"
                   "  while the disk moves that within the step's compute time (e.g. %.0f MB/s for a 1 s step)\n",
                   kl->names[k], cli_bytes((double)rows[k].store, b, sizeof b), cli_bytes((double)rows[k].moved, c, sizeof c),
                   (double)rows[k].moved / 1e6);
        }
    if (!o->json && !quiet) {
        char b[32];
        printf("  (resident = param + grad + optim; total adds act and comm; the data set is not counted)\n");
        printf("whole life per rank, as the kernel sees it (resident set):\n  %-9s%11s%11s%11s%11s%11s%11s  %s\n",
               "strategy", "setup", "train", "save", "shared", "cache", "peak rss", "peak in");
        for (int k = 0; k < kl->n; k++)
            if (shown[k]) print_life_row(kl->names[k], &rows[k], fixed);
        printf("  (setup: the model built shape-only, then made by the strategy: whole by ddp and zero, its shards by fsdp,\n"
               "   its stage by pipe, a slice at a time by offload; train: total above; save: a full save on rank 0;\n"
               "   shared: the other ranks' shared-memory buckets mapped in each (one node), in the three;\n   cache: the allocator's bound on freed blocks kept; peak rss = the runtime's fixed %s (an "
               "empty run's RSS,\n   measured in this process: MPI and libraries) + the largest of setup, train with the "
               "cache (at most\n   its bound and a step's act, comm and two flats), and save)\n", fixed ? cli_bytes((double)fixed, b, sizeof b) : "? (not measurable here)");
    }
    ct_module_destroy(model);
    return CLI_OK;
}
