#!/usr/bin/env python3
"""nanoGPT's optimizer groups (configure_optimizers) and torch.optim.AdamW as
a reference for ctrain's parameter groups.

    gpt_groups_ref.py IN.safetensors OUT.safetensors

IN is what gpt_ref.py reads (a ctrain gpt's state_dict, the batch "__x" and
"__y", the model's ctrain.* metadata) plus metadata ref.steps, ref.lr,
ref.weight_decay, ref.beta1, ref.beta2, ref.eps and ref.nodecay_lr_scale.  The
groups are nanoGPT's configure_optimizers, line for line: every parameter
that requires grad, decayed when p.dim() >= 2, not otherwise.  The one
addition is a learning rate of its own for the no-decay group (lr times
ref.nodecay_lr_scale), to check per-group learning rates.  Then ref.steps
AdamW steps on the batch (zero_grad, forward, mean cross-entropy,
backward, step).  OUT gets "<name>" for every parameter after the steps and
metadata "nodecay": the no-decay group's names, comma-separated.  Exit code
3 when torch is missing (the test then skips).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_check  # noqa: E402  (exits 3 without torch)
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from gpt_ref import load_model  # noqa: E402


def configure_optimizers(model, weight_decay, learning_rate, betas, eps):
    """nanoGPT's model.py configure_optimizers (the device and fused parts left out)."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {'params': decay_params, 'weight_decay': weight_decay},
        {'params': nodecay_params, 'weight_decay': 0.0}
    ]
    nodecay_names = [n for n, p in param_dict.items() if p.dim() < 2]
    return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, eps=eps), nodecay_names


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model, x, y, meta = load_model(argv[1])
    if model is None:
        return 1
    lr = float(meta["ref.lr"])
    opt, nodecay = configure_optimizers(model, float(meta["ref.weight_decay"]), lr,
                                        (float(meta["ref.beta1"]), float(meta["ref.beta2"])), float(meta["ref.eps"]))
    opt.param_groups[1]["lr"] = lr * float(meta["ref.nodecay_lr_scale"])
    for _ in range(int(meta["ref.steps"])):
        opt.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        opt.step()
    out = {name: p.detach() for name, p in model.named_parameters()}
    st_check.save(argv[2], out, {"nodecay": ",".join(nodecay)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
