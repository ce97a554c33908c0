#!/usr/bin/env python3
"""Interoperability check between ctrain's safetensors files and PyTorch.

Reads and writes the safetensors format by hand (json + torch.frombuffer),
so it needs only torch, not the safetensors package:

    st_check.py write OUT.safetensors   writes known tensors of every dtype + metadata
    st_check.py read IN.safetensors     prints "name DTYPE [shape] sum" per tensor and
                                        "meta <hex key> <hex value>" per metadata entry
    st_check.py read DIR | X.safetensors.index.json
                                        the same for a sharded checkpoint, read through
                                        its Hugging Face index

Exits 3 if torch cannot be imported, 1 if the file breaks the format.
"""
import json
import os
import struct
import sys

try:
    import torch
except ImportError:
    print("torch is not importable", file=sys.stderr)
    sys.exit(3)

DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
}
NAMES = {v: k for k, v in DTYPES.items()}


def load(path):
    """Returns ({name: tensor}, {key: value}) from a safetensors file, checking the layout."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("file shorter than 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError("header length past end of file")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    spans = []
    out = {}
    for name, info in header.items():
        dtype = DTYPES[info["dtype"]]
        shape = list(info["shape"])
        begin, end = info["data_offsets"]
        numel = 1
        for d in shape:
            numel *= d
        esize = torch.tensor([], dtype=dtype).element_size()
        if end - begin != numel * esize:
            raise ValueError(f"{name}: size mismatch")
        spans.append((begin, end, name))
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        else:
            buf = bytearray(data[base + begin:base + end])
            out[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"{name}: hole or overlap at {begin}")
        at = end
    if at != len(data) - base:
        raise ValueError("data section not fully used")
    return out, meta


def load_checkpoint(path):
    """load() for a safetensors file, or for a sharded checkpoint: its index
    (*.safetensors.index.json) or a directory holding model.safetensors.index.json.
    Checks what Hugging Face's loaders assume: shard names are bare file names,
    every shard holds exactly the tensors the index gives it, and total_size is
    the bytes of all tensors.  Metadata comes from the index."""
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors.index.json")
    if not path.endswith(".safetensors.index.json"):
        return load(path)
    with open(path, "rb") as f:
        index = json.loads(f.read().decode("utf-8"))
    meta = {k: str(v) for k, v in (index.get("metadata") or {}).items()}
    weight_map = index["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        if "/" in shard or "\\" in shard or ".." in shard:
            raise ValueError(f"{shard}: not a bare file name")
        tensors, _ = load(os.path.join(os.path.dirname(path), shard))
        listed = {name for name, f in weight_map.items() if f == shard}
        if set(tensors) != listed:
            raise ValueError(f"{shard} holds {sorted(tensors)} but the index gives it {sorted(listed)}")
        out.update(tensors)
    total = sum(t.numel() * t.element_size() for t in out.values())
    if "total_size" in meta and int(meta["total_size"]) != total:
        raise ValueError(f"total_size {meta['total_size']} but the tensors hold {total} bytes")
    return out, meta


def save(path, tensors, meta=None):
    """Writes {name: tensor} (+ string metadata) laid out as the Python library does."""
    items = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header = {}
    if meta:
        header["__metadata__"] = meta
    blobs = []
    off = 0
    for name, t in items:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(header).encode("utf-8")  # ensure_ascii: exercises \uXXXX escapes
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def known_tensors():
    """The tensors tests/test_io_pytorch.c expects, value for value."""
    return {
        "model.layers.0.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5 - 1.0,
        "bf16": torch.tensor([1.5, -2.25, 3072.0, 0.0078125], dtype=torch.bfloat16),
        "f16": torch.tensor([[0.5, -1.0], [65504.0, 2.0 ** -24]], dtype=torch.float16),
        "i64": torch.tensor([0, -1, 2 ** 40 + 3, -(2 ** 62)], dtype=torch.int64),
        "i32": torch.tensor([[-2147483648, 2147483647, 7]], dtype=torch.int32),
        "u8": torch.tensor([0, 1, 127, 128, 255], dtype=torch.uint8),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
    }


KNOWN_META = {
    "format": "pt",
    "note": "quote \" backslash \\ newline \n tab \t \u00e9 \u2713 \U0001F600",
    "ctl": "\x01",
}


def main(argv):
    if len(argv) != 3 or argv[1] not in ("read", "write"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[1] == "write":
        save(argv[2], known_tensors(), KNOWN_META)
        return 0
    try:
        tensors, meta = load_checkpoint(argv[2])
    except (ValueError, KeyError, UnicodeDecodeError, OSError) as e:
        print(f"{argv[2]}: {e}", file=sys.stderr)
        return 1
    for name in sorted(tensors):
        t = tensors[name]
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        print(f"{name} {NAMES[t.dtype]} {shape} {float(t.double().sum())!r}")
    for k in sorted(meta):
        print(f"meta {k.encode('utf-8').hex()} {meta[k].encode('utf-8').hex()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
