"""PyTorch 1.13 DDP (gloo) on bench/ddp's reference model, for bench/compare-pytorch.

Same model (8 x Linear(1024,1024)+ReLU), batch 64 per rank, AdamW, cross-entropy
over 1024 classes, one intra-op thread per rank.  Ranks are started by the
caller with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (torchrun is broken on
Debian's Python 3.11).  Rank 0 prints "torch_ddp step_ms=<median>".
With a second argument "bf16" the forward and loss run under
torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's CPU mixed precision.
With "zero" the optimizer is torch.distributed.optim.ZeroRedundancyOptimizer
wrapping AdamW (PyTorch's ZeRO-1: each rank keeps the AdamW state of its
share of the parameters and broadcasts them after its step), the model still
in DDP; rank 0 then prints "torch_zero step_ms=<median>".
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, DEPTH, BATCH = 1024, 8, 64


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    mode = sys.argv[2] if len(sys.argv) > 2 else "f32"
    if mode not in ("f32", "bf16", "zero"):
        sys.exit("ddp_torch.py: mode is f32, bf16 or zero (got %r)" % mode)
    bf16 = mode == "bf16"
    warmup = 3
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = DDP(nn.Sequential(*layers))
    if mode == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.tensor([(i * 37 + rank) % WIDTH for i in range(BATCH)])
    loss_fn = nn.CrossEntropyLoss()
    times = []
    for it in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        if it >= warmup:
            times.append(t1 - t0)
    if rank == 0:
        print("torch_%s step_ms=%.3f (torch %s, gloo, %d ranks, BLAS %s, %s)" % (
            "zero" if mode == "zero" else "ddp", statistics.median(times) * 1e3, torch.__version__,
            dist.get_world_size(), os.environ.get("OPENBLAS_CORETYPE", "default"),
            {"f32": "f32", "bf16": "autocast bf16", "zero": "f32, ZeroRedundancyOptimizer(AdamW)"}[mode]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
