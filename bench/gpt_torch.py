"""PyTorch 1.13 on `make run-gpt`'s model, for bench/gpt: nanoGPT's GPT
(scripts/gpt_ref.py: 4 layers, 4 heads, width 128, context 128, vocab 256,
tied head), AdamW, random byte windows, eager mode.

    gpt_torch.py STEPS BATCH f32|bf16 THREADS [LAYERS HEADS DIM CONTEXT [HOOK]]

LAYERS HEADS DIM CONTEXT give another size (bench/cluster: 6 6 384 128);
HOOK powersgd:R registers PyTorch's powerSGD_hook at rank R on the DDP model
(start_powerSGD_iter=2, its other settings PyTorch's defaults), so the
timed steps are compressed; the model is then one bucket (see below).

One process, or DDP (gloo) when the caller sets RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT (BATCH is then the global batch, split across ranks).  bf16 runs
the forward and loss under torch.autocast("cpu", dtype=torch.bfloat16).  Rank
0 prints "torch_gpt step_ms=<median> tokens_per_s=<global>".
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import gpt_ref  # noqa: E402

L, H, D, T, V = 4, 4, 128, 128, 256


def main():
    global L, H, D, T
    steps, batch, mode, threads = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if len(sys.argv) > 8:
        L, H, D, T = (int(a) for a in sys.argv[5:9])
    hook = sys.argv[9] if len(sys.argv) > 9 else "none"
    torch.set_num_threads(threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(1)
    model = gpt_ref.GPT(L, H, D, T, V)
    if world > 1:
        # PowerSGD's chained allreduces of two buckets get mixed up on gloo
        # (gloo::EnforceNotMet "op.preamble.length <= op.nbytes" on the 6 x
        # 384 GPT): one bucket for it
        cap = 100000 if hook.startswith("powersgd:") else 25
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        if hook.startswith("powersgd:"):
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=int(hook[9:]),
                                     start_powerSGD_iter=2)
            model.register_comm_hook(state, ps.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7 + rank)
    per = batch // world
    x = torch.randint(0, V, (per, T), generator=g)
    y = torch.randint(0, V, (per, T), generator=g)
    times = []
    for step in range(steps + 3):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 3:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1000
    if rank == 0:
        print("torch_gpt step_ms=%.3f tokens_per_s=%.1f" % (ms, batch * T / (ms / 1000)))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
