/*
 * The gpt's shape flags, --layers, --heads, --dim, --context and --vocab,
 * which train and estimate both take: their table entries, their defaults
 * (the library's default gpt) and their check, defined once so the two
 * commands cannot drift apart.
 */
#include "cli.h"

cli_gpt_shape cli_gpt_shape_default(void)
{
    ct_model_config d = ct_model_config_default(CT_MODEL_GPT);
    return (cli_gpt_shape){d.layers, d.heads, d.dim, d.context, d.vocab};
}

int cli_gpt_shape_opts(cli_gpt_shape *s, cli_opt *t)
{
    int n = 0;
    t[n++] = (cli_opt){"--layers", OPT_INT, &s->layers, "L", "gpt: transformer blocks (4)", 0};
    t[n++] = (cli_opt){"--heads", OPT_INT, &s->heads, "H", "gpt: attention heads per block (4)", 0};
    t[n++] = (cli_opt){"--dim", OPT_INT, &s->dim, "D", "gpt: model width, a multiple of --heads (256)", 0};
    t[n++] = (cli_opt){"--context", OPT_INT, &s->context, "T", "gpt: tokens per sequence (128)", 0};
    t[n++] = (cli_opt){"--vocab", OPT_INT, &s->vocab, "V", "gpt: vocabulary size (256: bytes)", 0};
    CT_ASSERT(n == CLI_GPT_SHAPE_NOPTS);
    return n;
}

int cli_gpt_shape_given(cli_opt *t, int n)
{
    static const char *const names[] = {"--layers", "--heads", "--dim", "--context", "--vocab"};
    for (int i = 0; i < CLI_GPT_SHAPE_NOPTS; i++)
        if (cli_find(t, n, names[i])->given) return 1;
    return 0;
}

void cli_gpt_shape_apply(const cli_gpt_shape *s, ct_model_config *cfg)
{
    ct_model_config_gpt(cfg, s->layers, s->heads, s->dim, s->context, s->vocab);
}

ct_status cli_gpt_shape_check(const cli_gpt_shape *s)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    cli_gpt_shape_apply(s, &c);
    return ct_model_config_validate(&c);
}
