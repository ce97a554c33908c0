#!/usr/bin/env python3
"""Loads a ctrain checkpoint into the equivalent PyTorch module, strictly.

    scripts/load_in_pytorch.py CHECKPOINT [CHECKPOINT...]

CHECKPOINT is what `ctrain train --save` wrote: a .safetensors file, or a
sharded directory (or its index).  Its metadata says which model it is:

  mlp, cnn  torch.nn.Sequential numbered as ctrain numbers its children
            (Linear, ReLU, [Dropout,] ... / Conv2d, ReLU, MaxPool2d, ...,
            Flatten, Linear, ReLU, Linear): the file is its state_dict.
  gpt       nanoGPT's GPT with bias=True (scripts/gpt_ref.py's copy).  The
            LM head is tied to the token embedding: ctrain saves the one
            tensor once, as transformer.wte.weight (PyTorch's
            named_parameters order), while nanoGPT's state_dict lists it under
            both names, so a strict load gets lm_head.weight = the same tensor:
                sd["lm_head.weight"] = sd["transformer.wte.weight"]
                model.load_state_dict(sd, strict=True)

Then one forward on zeros, to show the module runs.  Prints "loaded PATH
strictly: KIND, N tensors, output [shape]" per checkpoint.  Reads the file
with scripts/st_check.py (json + torch.frombuffer: torch only, not the
safetensors package).  Exits 3 when torch cannot be imported, 1 on a load
that is not strict (missing or unexpected keys, shapes).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st_check  # noqa: E402  (exits 3 without torch)
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def ints(text):
    return [int(v) for v in text.split(",") if v]


def build(meta):
    """The module and an input for one forward, from the ctrain.* metadata."""
    kind = meta["ctrain.model"]
    dropout = float(meta.get("ctrain.dropout", "0"))
    if kind == "gpt":
        from gpt_ref import GPT
        g = {k: int(meta["ctrain." + k]) for k in ("layers", "heads", "dim", "context", "vocab")}
        model = GPT(g["layers"], g["heads"], g["dim"], g["context"], g["vocab"])
        return model, torch.zeros(1, g["context"], dtype=torch.long)
    shape, hidden, classes = ints(meta["ctrain.in"]), ints(meta["ctrain.hidden"]), int(meta["ctrain.classes"])
    layers = []
    if kind == "mlp":
        width = shape[0]
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout > 0 else [])
            width = h
        layers.append(nn.Linear(width, classes))
    elif kind == "cnn":
        k = int(meta["ctrain.kernel"])
        c, hgt, wid = shape
        for ch in hidden[:-1]:
            layers += [nn.Conv2d(c, ch, k, padding=k // 2), nn.ReLU(), nn.MaxPool2d(2)]
            c, hgt, wid = ch, hgt // 2, wid // 2
        layers += [nn.Flatten(), nn.Linear(c * hgt * wid, hidden[-1]), nn.ReLU(), nn.Linear(hidden[-1], classes)]
    else:
        raise ValueError(f"ctrain.model is '{kind}': this script knows mlp, cnn and gpt")
    return nn.Sequential(*layers), torch.zeros(1, *shape)


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv[1:]:
        tensors, meta = st_check.load_checkpoint(path)
        model, x = build(meta)
        sd = dict(tensors)
        if meta["ctrain.model"] == "gpt":
            sd["lm_head.weight"] = sd["transformer.wte.weight"]  # the tied head: one tensor, two names
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            print(f"{path}: not a strict load: {e}", file=sys.stderr)
            return 1
        model.eval()
        with torch.no_grad():
            out = model(x)
        print(f"loaded {path} strictly: {meta['ctrain.model']}, {len(tensors)} tensors, output {list(out.shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
