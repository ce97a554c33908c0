/* Fuzz target: the local pieces a checkpoint saved with --state-dict local
 * holds ("<tensor>@<offset>", each rank's part of a tensor).  Each input is
 * a list of lines "NAME LEN": a tensor called NAME of LEN floats (LEN taken
 * mod 40; a line without LEN is an I64 tensor of one element).  The list
 * is loaded into a small model (0: Linear 4->3, 1: Linear 3->2; AdamW) as
 * its model state, or, when the input starts with '#', as its optimizer
 * state, through ct_strategy_load_state, the call a resume makes: the
 * pieces are parsed, sorted and checked to tile their tensor (gaps,
 * overlaps, offsets past the end or negative or huge, names of no tensor)
 * before anything is copied. */
#include "fuzz.h"

static ct_module *model;
static ct_strategy *strat;

static void setup(void)
{
    model = ct_sequential_create();
    if (!model || ct_module_add(model, NULL, ct_linear_create(4, 3, 1)) != CT_OK ||
        ct_module_add(model, NULL, ct_linear_create(3, 2, 1)) != CT_OK)
        abort();
    ct_module_init_params(model, 1);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    if (ct_strategy_create("none", model, &oo, NULL, NULL, &strat) != CT_OK) abort();
}

#define MAXT 64

static void run(const uint8_t *data, size_t n, int check);

/* AdamW makes its moments on the first optimizer load: once, here, so the
 * leak check sees only what an input leaves. */
static const char warm[] = "#step\n0.weight.exp_avg 12\n0.weight.exp_avg_sq 12\n0.bias.exp_avg 3\n"
                           "0.bias.exp_avg_sq 3\n1.weight.exp_avg 6\n1.weight.exp_avg_sq 6\n1.bias.exp_avg 2\n"
                           "1.bias.exp_avg_sq 2\n";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (!model) {
        setup();
        run((const uint8_t *)warm, sizeof warm - 1, 0);
        if (ct_strategy_load_state(strat, NULL, NULL, 0, 1) == CT_OK) abort(); /* no step: must fail */
        ct_clear_error();
    }
    run(data, n, 1);
    return 0;
}

static void run(const uint8_t *data, size_t n, int check)
{
    int optim = n > 0 && data[0] == '#';
    char *text = malloc(n + 1);
    if (!text) abort();
    memcpy(text, data, n);
    text[n] = 0;
    size_t before = fuzz_mem_now();
    const char *names[MAXT];
    ct_tensor *ts[MAXT];
    int k = 0;
    for (char *line = text + optim, *next; line && *line && k < MAXT; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *sp = strrchr(line, ' ');
        if (sp) *sp = 0;
        if (sp) {
            int len = atoi(sp + 1);
            len = ((len % 40) + 40) % 40;
            ts[k] = ct_tensor_create1(len, CT_MEM_OTHER);
            for (int i = 0; ts[k] && i < len; i++) ct_f32(ts[k])[i] = (float)i;
        } else {
            ts[k] = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
            if (ts[k]) ((int64_t *)ct_tensor_data(ts[k]))[0] = 3;
        }
        if (!ts[k]) abort();
        names[k++] = line;
    }
    (void)ct_strategy_load_state(strat, names, ts, k, optim); /* any status; never a crash or a leak */
    ct_clear_error();
    for (int i = 0; i < k; i++) ct_tensor_release(ts[i]);
    if (check) fuzz_check_no_leak(before);
    free(text);
}
