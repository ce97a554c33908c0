#!/usr/bin/env python3
"""nanoGPT's GPT (bias=True, no flash attention: PyTorch 1.13 has none) as a
reference for ctrain's gpt.

    gpt_ref.py IN.safetensors OUT.safetensors

IN holds a ctrain gpt's state_dict (transformer.wte.weight, ..., no
lm_head.weight: it is tied) plus the batch "__x" and "__y" (I64 [B, T]);
its metadata gives ctrain.layers, heads, dim, context and vocab.  The model
is built here as nanoGPT builds it, lm_head.weight tied to wte, loaded
strictly (only lm_head.weight may be missing, being the same tensor), then
one forward (eval: no dropout), mean cross-entropy and backward.  OUT gets
"logits", "loss" and "grad.<name>" for every parameter.  Exit code 3 when
torch is missing (the test then skips).
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_check  # noqa: E402  (exits 3 without torch)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
                             persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long).unsqueeze(0)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def load_model(path):
    """The GPT ctrain wrote to path (its config from the metadata), the batch
    (__x, __y) and the metadata; None for the model when the state dict does
    not fit (said on stderr)."""
    tensors, meta = st_check.load(path)
    x, y = tensors.pop("__x"), tensors.pop("__y")
    cfg = [int(meta["ctrain." + k]) for k in ("layers", "heads", "dim", "context", "vocab")]
    model = GPT(*cfg)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or missing not in ([], ["lm_head.weight"]):
        print(f"state_dict mismatch: missing {missing}, unexpected {unexpected}", file=sys.stderr)
        return None, x, y, meta
    return model, x, y, meta


def main(argv):
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    model, x, y, meta = load_model(argv[1])
    if model is None:
        return 1
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        print("lm_head.weight is not tied to transformer.wte.weight", file=sys.stderr)
        return 1
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    out = {"logits": logits.detach(), "loss": loss.detach().reshape(1)}
    for name, p in model.named_parameters():  # the tied weight once, as transformer.wte.weight
        out["grad." + name] = p.grad
    st_check.save(argv[2], out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
