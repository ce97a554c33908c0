#!/usr/bin/env python3
"""ctrain's cnn with --batchnorm in PyTorch, as the reference for its
batchnorm under SyncBatchNorm (whose math on one process is BatchNorm2d's;
torch 1.13's SyncBatchNorm itself refuses CPU tensors).

    cnn_bn_ref.py IN.safetensors OUT.safetensors

IN holds the model's state_dict (nn.Sequential names: Conv2d without bias,
BatchNorm2d, ReLU, MaxPool2d(2) per conv width, then Flatten, Linear, ReLU,
Linear), batches "__x<k>" [N, C, H, W] and "__y<k>" [N] (I32) for k <
ref.steps, and metadata ctrain.in, ctrain.hidden, ctrain.classes,
ctrain.kernel and ref.lr.  Each step is SGD(lr) in training mode: zero_grad,
forward, mean cross-entropy, backward, step.  OUT gets the state_dict after
the steps (running statistics included, num_batches_tracked as F32).  Exit
code 3 when torch is missing (the test then skips).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_check  # noqa: E402  (exits 3 without torch)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    tensors, meta = st_check.load(argv[1])
    c, h, w = (int(v) for v in meta["ctrain.in"].split(","))
    hidden = [int(v) for v in meta["ctrain.hidden"].split(",")]
    k = int(meta["ctrain.kernel"])
    layers = []
    for width in hidden[:-1]:
        layers += [nn.Conv2d(c, width, k, padding=k // 2, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                   nn.MaxPool2d(2)]
        c, h, w = width, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c * h * w, hidden[-1]), nn.ReLU(),
               nn.Linear(hidden[-1], int(meta["ctrain.classes"]))]
    model = nn.Sequential(*layers)
    steps = int(meta["ref.steps"])
    batches = [(tensors.pop(f"__x{s}"), tensors.pop(f"__y{s}").long()) for s in range(steps)]
    model.load_state_dict(tensors, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=float(meta["ref.lr"]))
    model.train()
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    out = {n: t.detach().float() for n, t in model.state_dict().items()}
    st_check.save(argv[2], out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
