/*
 * Fine-tunes a GPT from a checkpoint with a loop of your own: validation
 * loss before and after, then a sample.  Any strategy, pipe included (its
 * stages of one pipeline must get the same rows: ct_strategy_local_rows
 * gives each rank its rows whatever the strategy).
 *
 *   gpt_finetune CHECKPOINT TEXT_DIR STEPS [STRATEGY]
 *   build/ctrain train --model gpt --layers 2 --dim 64 --steps 200 --save gpt.safetensors
 *   mpirun -np 2 build/examples/gpt_finetune gpt.safetensors mytexts/ 50 ddp
 *   mpirun -np 2 build/examples/gpt_finetune gpt.safetensors mytexts/ 50 pipe
 *
 * The checkpoint is a `ctrain train --model gpt --save` file: nanoGPT's
 * state_dict plus the model's configuration in its metadata, so the model
 * is rebuilt from the file alone.  TEXT_DIR is any folder of text files
 * (bytes are tokens; the first 90% train, the rest validate).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ctrain/ctrain.h>

#define BATCH 8        /* global rows (windows) per step */
#define VAL_WINDOWS 8  /* validation windows evaluated */
#define SAMPLE_TOKENS 60

#define CHECK(call)                                                              \
    do {                                                                         \
        ct_status rc_ = (call);                                                  \
        if (rc_ != CT_OK) {                                                      \
            fprintf(stderr, "gpt_finetune: %s: %s\n", #call, ct_last_error());   \
            ct_comm_abort("gpt_finetune failed");                                \
        }                                                                        \
    } while (0)

/* Mean loss per token over the first VAL_WINDOWS validation windows, on
 * every rank.  Collective: ct_strategy_predict runs the model however it is
 * placed, and only the ranks holding the output (a pipeline's last stage;
 * every rank otherwise) compute the loss; the maximum over ranks shares it. */
static float val_loss(ct_strategy *s, const ct_text *text, int64_t context)
{
    int64_t nw = ct_text_val_windows(text, context);
    if (nw > VAL_WINDOWS) nw = VAL_WINDOWS;
    ct_tensor *x, *y, *logits;
    CHECK(ct_text_val_batch(text, context, 0, nw, &x, &y));
    ct_fwd_ctx ctx = {.training = 0};
    CHECK(ct_strategy_predict(s, x, &ctx, &logits));
    float loss = -1.0f;
    if (logits) CHECK(ct_loss_cross_entropy(logits, y, NULL, &loss, NULL));
    CHECK(ct_group_allreduce(ct_group_world(), &loss, 1, CT_F32, CT_OP_MAX, NULL));
    ct_tensor_release(logits);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return loss;
}

/* Rank 0 samples from a whole copy of the trained weights: the state is
 * collective (a sharded or pipelined model is gathered), the copy is a plain
 * model that ct_gpt_gen reads with a KV cache. */
static void sample(ct_strategy *s, const ct_model_config *cfg, const char *prompt)
{
    ct_state st;
    CHECK(ct_strategy_model_state(s, &st));
    if (ct_group_rank(ct_group_world()) == 0) {
        ct_module *copy;
        ct_strategy *plain;
        ct_optim_opts sgd = ct_optim_defaults(CT_OPT_SGD);
        CHECK(ct_model_build(cfg, 0, &copy));
        /* "none" loads a state into a model on this process alone */
        CHECK(ct_strategy_create("none", copy, &sgd, NULL, NULL, &plain));
        CHECK(ct_strategy_load_state(plain, (const char *const *)st.names, st.tensors, st.n, 0));
        ct_strategy_destroy(plain);
        ct_gpt_gen *gen;
        CHECK(ct_gpt_gen_create(copy, cfg, &gen));
        ct_rng rng;
        ct_rng_init(&rng, 1, 0);
        const float *logits = NULL;
        printf("sample: %s", prompt);
        for (const char *p = prompt; *p; p++) CHECK(ct_gpt_gen_feed(gen, (unsigned char)*p, &logits));
        for (int i = 0; i < SAMPLE_TOKENS; i++) {
            int64_t tok = ct_gpt_sample_logits(logits, cfg->vocab, 0.8f, 20, &rng);
            putchar(tok >= 32 && tok < 127 ? (int)tok : tok == '\n' ? '\n' : '?');
            CHECK(ct_gpt_gen_feed(gen, tok, &logits));
        }
        printf("\n");
        ct_gpt_gen_destroy(gen);
        ct_module_destroy(copy);
    }
    ct_state_fini(&st);
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: gpt_finetune CHECKPOINT TEXT_DIR STEPS [STRATEGY]   (STRATEGY: %s; ddp)\n",
                ct_strategy_list());
        return 2;
    }
    const char *ckpt = argv[1], *dir = argv[2], *kind = argc > 4 ? argv[4] : "ddp";
    int64_t steps = atoll(argv[3]);
    CHECK(ct_comm_init(&argc, &argv));
    int rank = ct_group_rank(ct_group_world());

    /* The model, rebuilt from the checkpoint's metadata; its weights go in through the strategy. */
    ct_ckpt_info info;
    ct_model_config cfg;
    ct_module *model;
    CHECK(ct_checkpoint_info(ct_group_world(), ckpt, 0, &info));
    CHECK(ct_model_config_from_meta(&info.meta, &cfg));
    ct_ckpt_info_fini(&info);
    CHECK(ct_model_build(&cfg, 0, &model));
    ct_optim_opts adamw = ct_optim_defaults(CT_OPT_ADAMW);
    adamw.lr = 1e-3;
    ct_strategy *s;
    CHECK(ct_strategy_create(kind, model, &adamw, NULL, !strcmp(kind, "pipe") ? "stages=2,chunks=2" : NULL, &s));
    CHECK(ct_checkpoint_load(s, ckpt, 0)); /* the weights alone: fine-tuning starts a new optimizer */

    ct_text text;
    CHECK(ct_text_load(dir, &text));
    CHECK(ct_text_check(&text, cfg.context));
    float before = val_loss(s, &text, cfg.context);
    if (rank == 0) printf("gpt_finetune: %s, %lld steps; val loss before %.6f\n", kind, (long long)steps, before);

    for (int64_t step = 0; step < steps; step++) {
        int64_t first, count;
        CHECK(ct_strategy_local_rows(s, BATCH, &first, &count));
        ct_batch b = {.global_rows = BATCH, .sample0 = first};
        CHECK(ct_text_train_batch(&text, cfg.context, 5, (uint64_t)step, first, count, &b.x, &b.y));
        ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = (uint64_t)step};
        ct_strategy_zero_grad(s);
        CHECK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
        CHECK(ct_strategy_clip_grad_norm(s, 1.0f, 2.0, NULL));
        CHECK(ct_strategy_step(s));
        ct_tensor_release(b.x);
        ct_tensor_release(b.y);
    }
    float after = val_loss(s, &text, cfg.context);
    if (rank == 0) printf("val loss after %.6f\n", after);
    sample(s, &cfg, "The ");

    ct_text_fini(&text);
    ct_strategy_destroy(s);
    ct_module_destroy(model);
    ct_comm_finalize();
    return 0;
}
