/*
 * ctrain models: ready models built from the public nn API only, and their
 * configuration as a string map that travels in a checkpoint's safetensors
 * metadata, so a checkpoint alone is enough to rebuild and evaluate its
 * model.  Every model is an nn.Sequential whose children are numbered as
 * PyTorch numbers them, so a model's state dict (names, shapes, layouts) is
 * exactly the state_dict of the same torch.nn.Sequential.
 *
 *   mlp  Sequential(Linear(in, h1), ReLU, Linear(h1, h2), ReLU, ..., Linear(hk, classes))
 *        input [N, in]                        ("0.weight" [h1, in], "0.bias", "2.weight", ...)
 *        with dropout p > 0: Linear, ReLU, Dropout(p), Linear, ... ("0.weight", "3.weight", ...)
 *   cnn  Sequential(Conv2d(C, c1, k, pad k/2), ReLU, MaxPool2d(2), ..., Flatten,
 *                   Linear(ck*H'*W', f), ReLU, Linear(f, classes))
 *        input [N, C, H, W]; hidden lists the conv channels then the width f
 *        of the fully connected layer ("16,32,128"); each pool halves H and W.
 *   gpt  nanoGPT's GPT (decoder-only transformer, bias=True), as a flat
 *        sequential whose children carry nanoGPT's state_dict names:
 *          "transformer"        token+position embeddings (wte, wpe, drop)
 *          "transformer.h.{i}"  pre-LN block i (ln_1, attn.c_attn, attn.c_proj,
 *                               ln_2, mlp.c_fc, mlp.c_proj), i < layers
 *          "transformer.ln_f"   final LayerNorm
 *          "lm_head"            Linear(dim, vocab, bias=False) whose weight IS
 *                               transformer.wte.weight (tied: one parameter,
 *                               saved once under that name)
 *        input token indices [N, T] (I32/I64, T <= context); output logits
 *        [N, T, vocab].  Blocks are the natural FSDP units and pipeline
 *        stages (children 1..layers); the tied weight lives in children 0
 *        and layers+2.  Weights as nanoGPT initialises them: normal(0, 0.02),
 *        the residual projections (c_proj) normal(0, 0.02/sqrt(2 layers)),
 *        biases 0, LayerNorm 1/0.
 *
 * Ownership: ct_model_config is a plain value (no heap); ct_meta is
 * caller-owned (ct_meta_fini); the module from ct_model_build is the
 * caller's (ct_module_destroy).
 */
#ifndef CTRAIN_MODELS_H
#define CTRAIN_MODELS_H

#include "nn.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_MODEL_MLP = 0, CT_MODEL_CNN, CT_MODEL_GPT, CT_NMODELS } ct_model_kind;

#define CT_MODEL_MAX_HIDDEN 16

typedef struct {
    ct_model_kind kind;
    int in_ndim;        /* dims of one sample: 1 for mlp ([784]), 3 for cnn ([1, 28, 28]) */
    int64_t in[3];      /* one sample's input shape */
    int nhidden;
    int64_t hidden[CT_MODEL_MAX_HIDDEN]; /* mlp: layer widths; cnn: conv channels, then fc width */
    int64_t classes;
    int kernel;         /* cnn: square kernel size (odd; padding kernel/2 keeps H, W) */
    int batchnorm;      /* cnn: BatchNorm2d (eps 1e-5, momentum 0.1) after each conv, whose bias it
                           makes redundant (the convs then have none), as torchvision's models do */
    float dropout;      /* mlp: Dropout(p) after every hidden ReLU when > 0 (0);
                           gpt: nanoGPT's dropout (embeddings, attention, residuals) */
    /* gpt (in[0] is the context and classes the vocabulary, so a sample is
     * [context] tokens with a target per position) */
    int64_t layers, heads, dim, context, vocab;
} ct_model_config;

/* "mlp, cnn": the names ct_model_parse_kind accepts. */
const char *ct_model_list(void);
/* "mlp" or "cnn" ("?" outside the enum). */
const char *ct_model_kind_name(ct_model_kind kind);
/* Parses a model name into *kind; CT_EINVAL listing the known names otherwise. */
ct_status ct_model_parse_kind(const char *name, ct_model_kind *kind);
/* Defaults for Fashion-MNIST: mlp in [784], hidden 256,128; cnn in [1,28,28],
 * hidden 16,32,128, kernel 3 (2.5x faster than 5 on CPUs, as accurate
 * here); classes 10.  gpt: 4 layers, 4 heads, dim 256, context 128, vocab
 * 256 (bytes). */
ct_model_config ct_model_config_default(ct_model_kind kind);
/* Sets cfg's hidden list from "256,128" (positive integers, comma separated,
 * at most CT_MODEL_MAX_HIDDEN); cfg is unchanged and CT_EINVAL names the bad
 * entry on failure. */
ct_status ct_model_config_parse_hidden(ct_model_config *cfg, const char *list);
/* Writes the hidden list as "256,128" into buf (n bytes); returns buf. */
char *ct_model_config_hidden_str(const ct_model_config *cfg, char *buf, size_t n);
/* CT_OK, or CT_EINVAL naming the field that makes the config unbuildable
 * (cnn: at least one conv and the fc width; images too small for the pools). */
ct_status ct_model_config_validate(const ct_model_config *cfg);
/* Number of elements in one sample's input (784). */
int64_t ct_model_input_numel(const ct_model_config *cfg);
/* Shape of a batch of n inputs ([n, 784] or [n, 1, 28, 28]) into shape
 * (room for 4); returns its ndim. */
int ct_model_input_shape(const ct_model_config *cfg, int64_t n, int64_t *shape);
/* Bytes of one sample as the loaders hand it to a step (ct_batch), input and
 * target: f32 pixels and an i32 label (src/io/idx.c), or the gpt's i64
 * tokens and i64 next tokens (src/io/text.c).  For memory planning
 * (ct_plan_spec.sample_bytes). */
uint64_t ct_model_sample_bytes(const ct_model_config *cfg);
/* Sets cfg (a gpt) to layers, heads, dim, context, vocab (and keeps in[0]
 * and classes in step); checks nothing (ct_model_config_validate does). */
void ct_model_config_gpt(ct_model_config *cfg, int64_t layers, int64_t heads, int64_t dim, int64_t context,
                         int64_t vocab);
/* Builds the model and initialises it as PyTorch does (ct_module_init_params
 * with seed; gpt as nanoGPT does); under ct_module_shape_only, shapes and
 * rules only (a strategy makes the values).  *out is the caller's; NULL with
 * the error set on failure. */
ct_status ct_model_build(const ct_model_config *cfg, uint64_t seed, ct_module **out);

/* ---- generating text from a gpt (KV cache) ------------------------------ */

/* A generator over a built gpt's parameters (read in place, f32; the model
 * must outlive it) that keeps every position's keys and values, so a token
 * costs one position's work.  Past the context the window slides to the
 * last context tokens (positions restart, the cache is rebuilt), as
 * nanoGPT's generate crops its input. */
typedef struct ct_gpt_gen ct_gpt_gen;
/* CT_EINVAL if cfg is not a gpt or the model lacks one of its weights. */
ct_status ct_gpt_gen_create(ct_module *model, const ct_model_config *cfg, ct_gpt_gen **out);
/* NULL is a no-op. */
void ct_gpt_gen_destroy(ct_gpt_gen *g);
/* Appends token to the sequence and points *logits at the next token's
 * logits [vocab] (valid until the next call).  A token outside the
 * vocabulary is CT_EINVAL. */
ct_status ct_gpt_gen_feed(ct_gpt_gen *g, int64_t token, const float **logits);
/* Forgets the sequence (the next token is position 0). */
void ct_gpt_gen_reset(ct_gpt_gen *g);
/* Draws a token from softmax(logits / temperature) over the top_k largest
 * logits (top_k <= 0: all), one uniform number from rng; temperature <= 0
 * gives the argmax. */
int64_t ct_gpt_sample_logits(const float *logits, int64_t vocab, float temperature, int64_t top_k, ct_rng *rng);

/* ---- string map for checkpoint metadata -------------------------------- */

/* An ordered string map (keys unique, keys and values of any length, so it
 * holds whatever a checkpoint's metadata holds, "ctrain.crc32" included).
 * Caller-owned: a zeroed struct is an empty map; ct_meta_fini frees it. */
typedef struct {
    int n, cap;
    char **key; /* [n] */
    char **val; /* [n] */
} ct_meta;

/* Sets key to the printf-formatted value (replacing an existing value).
 * CT_EINVAL for an empty key, CT_ENOMEM when memory runs out (m unchanged). */
ct_status ct_meta_set(ct_meta *m, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Value of key, or NULL. */
const char *ct_meta_get(const ct_meta *m, const char *key);
/* Fills keys[i] and vals[i] (room for m->n each) with pointers into m, for
 * ct_safetensors_save. */
void ct_meta_arrays(const ct_meta *m, const char **keys, const char **vals);
/* Replaces *dst (freed first) by a copy of src; on CT_ENOMEM *dst is empty. */
ct_status ct_meta_copy(ct_meta *dst, const ct_meta *src);
/* Frees the entries and zeroes m; safe on a zeroed or finished map. */
void ct_meta_fini(ct_meta *m);

/* Adds the config under "ctrain.model", "ctrain.in" ("784" or "1,28,28"),
 * "ctrain.hidden", "ctrain.classes" and, for cnn, "ctrain.kernel"; for gpt
 * "ctrain.layers", "ctrain.heads", "ctrain.dim", "ctrain.context",
 * "ctrain.vocab" instead of in, hidden and classes. */
ct_status ct_model_config_to_meta(const ct_model_config *cfg, ct_meta *m);
/* Rebuilds a config from those keys; CT_EFORMAT naming the missing or bad
 * key (a file not written by ctrain has no "ctrain.model"). */
ct_status ct_model_config_from_meta(const ct_meta *m, ct_model_config *cfg);

#ifdef __cplusplus
}
#endif
#endif
