/*
 * The train command's guards (issue 13), kept out of the loop's file: the
 * optimizer file's settings checked like any input, --resume given an
 * optimizer file, --resume latest, every output writable before training,
 * the run as loaded compared across ranks, and divergence.  Each takes
 * plain values, so the loop calls it in one line.
 */
#include <math.h>
#include <string.h>

#include "train.h"

ct_status train_check_saved(const train_opts *o, int64_t step, int64_t epoch, int64_t pos, const char *side)
{
    const char *bad = NULL;
    char val[64] = "";
#define RANGE(cond, key, fmt, v) if (!bad && !(cond)) { bad = key; snprintf(val, sizeof val, fmt, v); }
    RANGE(step >= 0, "ctrain.step", "%lld", (long long)step);
    RANGE(epoch >= 0, "ctrain.epoch", "%lld", (long long)epoch);
    RANGE(pos >= 0, "ctrain.position", "%lld", (long long)pos);
    RANGE(o->seed >= 0, "ctrain.seed", "%lld", (long long)o->seed);
    RANGE(o->batch >= 1, "ctrain.batch", "%lld", (long long)o->batch);
    RANGE(o->grad_accum >= 1 && o->grad_accum <= (1 << 30), "ctrain.grad_accum", "%lld", (long long)o->grad_accum);
    RANGE(o->warmup >= 0, "ctrain.warmup", "%lld", (long long)o->warmup);
    RANGE(isfinite(o->lr) && o->lr >= 0, "ctrain.lr", "%g", o->lr);
    RANGE(isfinite(o->weight_decay) && o->weight_decay >= 0, "ctrain.weight_decay", "%g", o->weight_decay);
    RANGE(isfinite(o->momentum) && o->momentum >= 0, "ctrain.momentum", "%g", o->momentum);
    RANGE(isfinite(o->clip) && o->clip >= 0, "ctrain.clip", "%g", o->clip);
#undef RANGE
    if (bad)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' is %s, which no run can have; the file is damaged or was "
                        "edited: resume from another checkpoint, or use --init for the weights alone", side, bad, val);
    return CT_OK;
}

ct_status train_check_resume_name(const char *resume)
{
    static const char osuf[] = ".optim.safetensors", oidx[] = "optim.safetensors.index.json";
    size_t rl = strlen(resume), sl = sizeof osuf - 1, il = sizeof oidx - 1;
    int idx = rl >= il && !strcmp(resume + rl - il, oidx);
    if (!idx && !(rl >= sl && !strcmp(resume + rl - sl, osuf))) return CT_OK;
    return ct_error(CT_EINVAL, "--resume %s names the optimizer state; give the model checkpoint it belongs to "
                    "(%.*s%s), and the optimizer state is found beside it", resume, (int)(rl - (idx ? il : sl)),
                    resume, idx ? "model.safetensors.index.json" : ".safetensors");
}

ct_status train_resolve_latest(ct_group *g, train_opts *o, char *buf, size_t n, int *usage)
{
    CT_TRY(ct_checkpoint_latest(g, o->save, buf, n));
    if (buf[0]) {
        cli_out("--resume latest: continuing from %s\n", buf);
        o->resume = buf;
        return CT_OK;
    }
    if (!o->has_model) {
        *usage = 1;
        return ct_error(CT_EINVAL, "--resume latest: %s has no checkpoint yet; give --model (and its flags) to "
                        "start the run", o->save);
    }
    cli_out("--resume latest: no checkpoint of %s yet; starting a new run\n", o->save);
    o->resume = NULL;
    return CT_OK;
}

void train_trace_path(const char *trace, int rank, int world, char *buf, size_t n)
{
    const char *slash = strrchr(trace, '/'), *dot = strrchr(trace, '.');
    if (world == 1) snprintf(buf, n, "%s", trace);
    else if (dot && (!slash || dot > slash + 1)) snprintf(buf, n, "%.*s.rank%d%s", (int)(dot - trace), trace, rank, dot);
    else snprintf(buf, n, "%s.rank%d", trace, rank);
}

ct_status train_check_outputs(const train_opts *o, int rank, int world, int sharded)
{
    char p[4096];
    if (o->save && (rank == 0 || sharded)) {
        if (o->keep_last) ct_checkpoint_series_path(o->save, 0, p, sizeof p);
        else snprintf(p, sizeof p, "%s", o->save);
        CT_TRY(cli_check_output("--save", p, sharded));
    }
    if (o->metrics && rank == 0) CT_TRY(cli_check_output("--metrics", o->metrics, 0));
    if (o->trace) {
        train_trace_path(o->trace, rank, world, p, sizeof p);
        CT_TRY(cli_check_output("--trace", p, 0));
    }
    return CT_OK;
}

ct_status train_agree_loaded(ct_group *g, const train_opts *o, const ct_model_config *cfg, int64_t train_n,
                             int64_t test_n, const int64_t pos[4], uint64_t seed, double lr, const char *optim)
{
    enum { N = 12 };
    char v[N][320];
    const char *k[N] = {"the model", "the training samples", "the test samples", "the start step", "the epoch",
                        "the position in the epoch", "the last step", "the seed", "--batch", "--lr",
                        "the optimizer", "--grad-accum"};
    cli_config_str(cfg, v[0], sizeof v[0]);
    snprintf(v[1], sizeof v[1], "%lld", (long long)train_n);
    snprintf(v[2], sizeof v[2], "%lld", (long long)test_n);
    for (int i = 0; i < 4; i++) snprintf(v[3 + i], sizeof v[3 + i], "%lld", (long long)pos[i]);
    snprintf(v[7], sizeof v[7], "%llu", (unsigned long long)seed);
    snprintf(v[8], sizeof v[8], "%lld", (long long)o->batch);
    snprintf(v[9], sizeof v[9], "%.17g", lr);
    snprintf(v[10], sizeof v[10], "%s", optim);
    snprintf(v[11], sizeof v[11], "%lld", (long long)o->grad_accum);
    const char *vals[N];
    for (int i = 0; i < N; i++) vals[i] = v[i];
    return ct_group_agree_settings(g, "the run as loaded (checkpoint and data files)", k, vals, N);
}

ct_status train_nonfinite(ct_group *g, const char *mode, int64_t step, double loss_sum, float norm, int *skip,
                          int64_t *skipped)
{
    int64_t flag[2] = {!isfinite(loss_sum), !isfinite(norm)};
    *skip = 0;
    if (ct_group_size(g) > 1 && ct_group_allreduce(g, flag, 2, CT_I64, CT_OP_MAX, NULL) != CT_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", ct_last_error());
        return ct_error(CT_ECOMM, "%s", why); /* the loop ends the job: peers may be waiting */
    }
    if (!flag[0] && !flag[1]) return CT_OK;
    const char *what = flag[0] ? "the loss" : "the gradient norm";
    if (!strcmp(mode, "skip")) {
        if ((*skipped)++ == 0)
            cli_out("step %lld: %s is not finite; skipping the step (--on-nonfinite skip)\n", (long long)step + 1,
                    what);
        *skip = 1;
        return CT_OK;
    }
    return ct_error(CT_EINVAL, "step %lld: %s is not finite: the run diverged, and stops before the step is "
                    "applied or saved; lower --lr, use --clip or --warmup, and resume from the last checkpoint "
                    "(or skip such steps with --on-nonfinite skip)", (long long)step + 1, what);
}
