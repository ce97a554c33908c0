/*
 * bench/ckpt: what a FULL checkpoint of an fsdp-sharded GPT costs rank 0 in
 * memory.  "stream" is ct_checkpoint_save (each tensor gathered, written at
 * its place and freed); "gather" does what a save did before it: the whole
 * model state, then the whole optimizer state, on rank 0 before each file
 * is written.  Prints, per rank, the rise of tracked memory over the save
 * (the per-category peak rises summed: a bound on the total's) next to the
 * model's f32 bytes.  A first save runs unmeasured (AdamW makes its moments
 * when first asked).
 *
 *   mpirun -np 2 build/bench/ckpt [--layers 4] [--dim 256] [--dir /tmp]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ctrain/ctrain.h>

#define CHECK(x)                                                                                 \
    do {                                                                                         \
        if ((x) != CT_OK) {                                                                      \
            fprintf(stderr, "bench/ckpt: %s: %s\n", #x, ct_last_error());                        \
            ct_comm_abort("bench/ckpt failed");                                                  \
        }                                                                                        \
    } while (0)

/* The old way: the whole state on rank 0, then the file. */
static ct_status gather_save(ct_strategy *s, const char *path)
{
    for (int optim = 0; optim < 2; optim++) {
        ct_state st;
        CT_TRY(optim ? ct_strategy_optim_state(s, &st) : ct_strategy_model_state(s, &st));
        char file[1100];
        snprintf(file, sizeof file, "%s%s", path, optim ? ".optim" : "");
        ct_status r = ct_group_rank(ct_group_world()) == 0
                          ? ct_safetensors_save(file, (const char *const *)st.names, st.tensors, st.n, NULL, NULL, 0)
                          : CT_OK;
        ct_state_fini(&st);
        CT_TRY(r);
    }
    return CT_OK;
}

static int64_t save_rise(ct_strategy *s, const char *path, int stream)
{
    size_t base[CT_MEM_NCAT];
    ct_mem_reset_peak();
    for (int c = 0; c < CT_MEM_NCAT; c++) base[c] = ct_mem_current((ct_mem_cat)c);
    if (stream) CHECK(ct_checkpoint_save(s, path, NULL, NULL, NULL));
    else CHECK(gather_save(s, path));
    int64_t rise = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) rise += (int64_t)(ct_mem_peak((ct_mem_cat)c) - base[c]);
    return rise;
}

int main(int argc, char **argv)
{
    int64_t layers = 4, dim = 256;
    const char *dir = "/tmp";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layers")) layers = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--dim")) dim = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
    }
    CHECK(ct_comm_init(&argc, &argv));
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_model_config cfg = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&cfg, layers, 4, dim, 128, 256);
    ct_module *m;
    CHECK(ct_model_build(&cfg, 1, &m));
    int64_t model_bytes = ct_module_num_params(m) * 4;
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    CHECK(ct_strategy_create("fsdp", m, &oo, g, "wrap_kinds=block", &s));
    char path[1024], side[1100];
    snprintf(path, sizeof path, "%s/bench-ckpt.safetensors", dir);
    CHECK(ct_checkpoint_save(s, path, NULL, NULL, NULL)); /* unmeasured: AdamW's moments appear */
    int64_t rise[2];
    rise[0] = save_rise(s, path, 0);
    rise[1] = save_rise(s, path, 1);
    int64_t *all = malloc(sizeof *all * 2 * (size_t)world);
    CHECK(ct_group_allgather(g, rise, all, 2, CT_I64, NULL));
    if (rank == 0) {
        printf("gpt %lld layers, dim %lld: %.2f MiB of f32 weights (AdamW state twice that), fsdp over %d ranks\n",
               (long long)layers, (long long)dim, (double)model_bytes / 1048576.0, world);
        printf("tracked memory rise over a FULL save (model + optimizer files), per rank:\n");
        for (int r = 0; r < world; r++)
            printf("  rank %d: gathered first %.2f MiB, streamed %.2f MiB\n", r, (double)all[2 * r] / 1048576.0,
                   (double)all[2 * r + 1] / 1048576.0);
        remove(path);
        ct_checkpoint_optim_path(path, side, sizeof side);
        remove(side);
        snprintf(side, sizeof side, "%s.optim", path);
        remove(side);
    }
    free(all);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    ct_comm_finalize();
    return 0;
}
