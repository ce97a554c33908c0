/*
 * The one check that a checkpoint loads (ct_checkpoint_verify), shared by
 * `inspect --verify`, ct_checkpoint_latest (which member of a series counts
 * as a checkpoint) and keep_last (prune only once the new member passes it).  It does what
 * a resume does short of training: finish an interrupted commit, load the
 * model file and its optimizer state (every tensor against its checksum,
 * every shard a regular file beside its index), check that the two are
 * from one save (the check every load makes), build the model the
 * metadata describes and load both states into it through
 * ct__ckpt_load_tensors, the very call a resume makes under any strategy (local
 * pieces are assembled there, names and shapes checked).  So verify passes
 * exactly when a load would, and no second set of rules can drift from it.
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* Builds the model model's metadata describes and loads model (and optim,
 * when given) into it as a one-process resume would; *is_ctrain 0 when the
 * metadata describes no ctrain model (a file another tool wrote). */
static ct_status load_into_model(const char *path, const ct_safetensors *model, const ct_safetensors *optim,
                                 int *is_ctrain)
{
    ct_meta m = {0};
    ct_model_config cfg;
    *is_ctrain = 0;
    ct_status r = ct__ckpt_file_meta(model, &m);
    if (r == CT_OK) r = ct_model_config_from_meta(&m, &cfg);
    ct_meta_fini(&m);
    if (r == CT_ENOMEM) return r;
    if (r != CT_OK) {
        ct_clear_error();
        return CT_OK;
    }
    *is_ctrain = 1;
    ct_optim_kind kind = CT_OPT_SGD;
    const char *oname = optim ? ct_safetensors_meta(optim, "ctrain.optim") : NULL;
    if (oname && ct_optim_parse(oname, &kind))
        return ct_error(CT_EFORMAT, "%s: its optimizer state names the unknown optimizer '%s'; save it again", path,
                        oname);
    ct_optim_opts oo = ct_optim_defaults(kind);
    ct_module *net = NULL;
    ct_strategy *s = NULL;
    ct_status st = ct_model_build(&cfg, 0, &net);
    if (st == CT_OK) st = ct_strategy_create("none", net, &oo, NULL, NULL, &s);
    if (st == CT_OK) st = ct__ckpt_load_tensors(s, model, 0);
    if (st == CT_OK && optim) st = ct__ckpt_load_tensors(s, optim, 1);
    if (st != CT_OK && st != CT_ENOMEM) {
        char why[1024];
        snprintf(why, sizeof why, "%s", ct_last_error());
        st = ct_error(st, "%s does not load: %s", path, why);
    }
    ct_strategy_destroy(s);
    ct_module_destroy(net);
    return st;
}

ct_status ct_checkpoint_verify(const char *path, int need_optim, ct_ckpt_verified *out)
{
    char side[4096];
    ct_safetensors *model = NULL, *optim = NULL;
    memset(out, 0, sizeof *out);
    if (!path) return ct_error(CT_EINVAL, "ct_checkpoint_verify: path is NULL");
    CT_TRY(ct__ckpt_check_regular(path));
    CT_TRY(ct__ckpt_recover(NULL, path));
    CT_TRY(ct__ckpt_read(path, "the checkpoint", 0, &model));
    ct_checkpoint_optim_path(path, side, sizeof side);
    ct_status st = CT_OK;
    /* A training checkpoint (it has a step) comes with its optimizer state. */
    int training = ct_safetensors_meta(model, "ctrain.step") != NULL;
    if (training && access(side, F_OK) == 0) {
        out->has_optim = 1;
        st = ct__ckpt_read(side, "the optimizer state", 0, &optim);
        ct_meta mm = {0}, om = {0};
        if (st == CT_OK) st = ct__ckpt_file_meta(model, &mm);
        if (st == CT_OK) st = ct__ckpt_file_meta(optim, &om);
        if (st == CT_OK) st = ct__ckpt_same_save(path, &mm, side, &om);
        ct_meta_fini(&mm);
        ct_meta_fini(&om);
    } else if (need_optim) {
        st = ct_error(CT_EIO, "%s has no optimizer state %s (%s); it cannot be resumed: use --init %s for the "
                      "weights alone", path, side, training ? strerror(ENOENT) : "it was not written by a training run",
                      path);
    }
    if (st == CT_OK) st = load_into_model(path, model, optim, &out->is_ctrain);
    ct_safetensors_destroy(optim);
    ct_safetensors_destroy(model);
    return st;
}
