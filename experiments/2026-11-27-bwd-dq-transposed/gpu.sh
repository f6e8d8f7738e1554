#!/usr/bin/env bash
# The GPU half of this experiment, for one device call (H100; the project importable, torch and
# cupy present): the transposed points' GPU tests (p26-p32 on every shape, the deterministic
# launches, the bit-identical and zero-gradient checks), then the twins of
# twins.json, backward only, both dtypes, 2 rounds, next to SDPA and FA4 where it imports.
# Results: $OUT/bwd-dq-transposed-twins.json (for benchmarks/results/ once read).
set -uo pipefail
cd "$(dirname "$0")/../.."
python -m pytest -q tests/gpu/test_backward.py \
    -k "p26 or p27 or p28 or p29 or p30 or p31 or p32 or deterministic or zero_output" 2>&1 |
    tail -n 15
python benchmarks/train_step.py --points experiments/2026-11-27-bwd-dq-transposed/twins.json \
    --workloads 8,16,4096,128 2,32,8192,128 8,16,4096,128,causal 2,32,8192,128,causal \
    --dtypes bf16,fp16 --rounds 2 --bwd-only --every-bwd \
    --json "${OUT:-.}/bwd-dq-transposed-twins.json"
