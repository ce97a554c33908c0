#!/usr/bin/python3
"""PyTorch's own powerSGD_hook on one bucket, as the reference for ctrain's
PowerSGD (tests/test_powersgd.c).

    powersgd_ref.py IN.json OUT.json

IN: {"rank": r, "min_compression_rate": c, "error_feedback": 0|1,
     "warm_start": 0|1, "shapes": [[6, 5], [6], ...],  (the bucket's members, in order)
     "q": [...], "error": [...],  (the state ctrain's hook had after its first compressed step)
     "steps": [[...], ...]}       (the bucket's gradients, one flat list per step)
     "np": P's length (the hook's P memory must be there for its warm start)
OUT: raw float32, what the hook left in the bucket, step after step

A world of one process (gloo), so the allreduces are the identity and the
hook's arithmetic is what is compared: error feedback, warm start from the
given Q, which gradients are compressed, orthogonalisation (Gram-Schmidt,
or QR at ranks above 2), P = M Q, Q = M^T P and the product back.  The
hook is called on a stand-in for dist.GradBucket with the four methods it
uses.
"""
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps


class Bucket:
    def __init__(self, flat, shapes):
        self.flat = flat
        self.views = []
        at = 0
        for s in shapes:
            n = 1
            for d in s:
                n *= d
            self.views.append(flat[at:at + n].view(*s))
            at += n

    def buffer(self):
        return self.flat

    def index(self):
        return 0

    def gradients(self):
        return self.views

    def is_last(self):
        return True


def main():
    cfg = json.load(open(sys.argv[1]))
    fd, store = tempfile.mkstemp(prefix="powersgd_ref_")
    os.close(fd)
    os.unlink(store)
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=cfg["rank"],
                             start_powerSGD_iter=2, min_compression_rate=cfg["min_compression_rate"],
                             use_error_feedback=bool(cfg["error_feedback"]),
                             warm_start=bool(cfg["warm_start"]))
    state.iter = 3  # past the uncompressed start, as ctrain's hook is
    q = torch.tensor(cfg["q"], dtype=torch.float32)
    state.q_memory_dict[0] = q
    state.p_memory_dict[0] = torch.zeros(cfg["np"])  # present: warm start takes q
    if cfg["error_feedback"]:
        state.error_dict[0] = torch.tensor(cfg["error"], dtype=torch.float32)
    out = []
    for g in cfg["steps"]:
        flat = torch.tensor(g, dtype=torch.float32)
        res = ps.powerSGD_hook(state, Bucket(flat, cfg["shapes"])).wait()
        out.append(res.clone())
    torch.cat(out).numpy().astype("<f4").tofile(sys.argv[2])
    dist.destroy_process_group()
    try:
        os.unlink(store)
    except OSError:
        pass


if __name__ == "__main__":
    main()
