/* Private to src/models: the builders behind ct_model_build. */
#ifndef CTRAIN_MODELS_INTERNAL_H
#define CTRAIN_MODELS_INTERNAL_H

#include "ctrain/models.h"

/* Build the module tree of a validated config (parameters left zero). */
ct_status ct__mlp_build(const ct_model_config *cfg, ct_module **out);
ct_status ct__cnn_build(const ct_model_config *cfg, ct_module **out);
ct_status ct__gpt_build(const ct_model_config *cfg, ct_module **out);
/* nanoGPT's initialisation of a built gpt. */
void ct__gpt_init(ct_module *m, const ct_model_config *cfg, uint64_t seed);
/* The gpt part of ct_model_config_validate. */
ct_status ct__gpt_validate(const ct_model_config *cfg);

/* Appends kid to the sequential seq under the next index; frees kid if
 * that fails (ct_module_add leaves it with the caller then). */
ct_status ct__seq_push(ct_module *seq, ct_module *kid);

/* Parses a comma-separated list of positive integers into out (room for
 * max); what names the list in messages ("--hidden"). */
ct_status ct__parse_int_list(const char *list, int64_t *out, int max, int *n, const char *what);

#endif
