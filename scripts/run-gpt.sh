#!/bin/sh
# `make run-gpt`: trains a small GPT (4 layers, 4 heads, width 128, context
# 128 bytes, 0.84M parameters, weights tied as nanoGPT's) on the fortunes
# package's text, byte-level, with DDP over 2 local ranks (AdamW, lr 2e-3,
# 100 warm-up steps then cosine, global batch 32 sequences, bf16 matrix
# products on f32 master weights, 1 BLAS thread per rank), then prints the
# validation loss next to the unigram baseline (the entropy of the byte
# distribution) and a sample.  About 4 minutes on 2 cores: val loss 1.768
# nats per byte, 46.8% below the unigram 3.321 (the issue asks for 35% in 10).
set -e
B=${B:-build}
STEPS=${STEPS:-1600}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
start=$(date +%s)
mpirun -np 2 --oversubscribe --bind-to none "$B/ctrain" train \
    --model gpt --layers 4 --heads 4 --dim 128 --context 128 --data fortunes \
    --steps "$STEPS" --batch 32 --lr 0.002 --warmup 100 --schedule cosine --mixed bf16 \
    --seed 0 --threads 1 --log-every 100 --save "$B/gpt.safetensors" --metrics "$B/gpt.metrics.jsonl"
end=$(date +%s)
echo "make run-gpt: trained and evaluated in $((end - start)) s"
echo "a sample (ctrain sample --checkpoint $B/gpt.safetensors --prompt 'Q: ' --tokens 300 --top-k 40 --seed 1):"
"$B/ctrain" sample --checkpoint "$B/gpt.safetensors" --prompt "Q: " --tokens 300 --temperature 0.8 --top-k 40 --seed 1
echo "evaluate it again:   $B/ctrain eval --checkpoint $B/gpt.safetensors"
echo "more text:           $B/ctrain sample --checkpoint $B/gpt.safetensors --prompt 'Your fortune: ' --tokens 500"
