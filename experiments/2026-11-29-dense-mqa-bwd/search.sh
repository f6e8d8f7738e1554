#!/usr/bin/env bash
# Dense backward searches with GROUP_SPLIT admitted, next to FlashAttention-4's backward (its
# final re-time has FA4 as an anchor when flash_attn.cute imports). Run on the device after
# the FA4 install (README.md here); writes one JSON per workload under $OUT.
set -u
py() { python3 benchmarks/with_site.py /tmp/fa4site -m evoengine "$@"; }
T=${T:-100s}
[ "${VARLEN:-0}" = 1 ] || for w in "mqa-d64 --shape 8,16,2048,64 --kv-heads 1" "gqa-d128 --shape 4,32,4096,128 --kv-heads 8"; do
  set -- $w; name=$1; shift
  py search --kind bwd "$@" --causal --dtype fp16 --timeout "$T" --seed 7 \
     --store sqlite:////tmp/evo-bwd.db --json "$OUT/$name.json" 2>&1 | tail -12
done
# The ragged d64 MQA batch, searched with the split admitted (no --untested), then re-timed
# next to FA4's varlen backward: VARLEN=1 bash search.sh
if [ "${VARLEN:-0}" = 1 ]; then
  py search --kind varlen_bwd --seqlens random:32:64:2048:1 --heads 16 --kv-heads 1 --head-dim 64 \
     --causal --dtype fp16 --timeout "$T" --seed 7 --store sqlite:////tmp/evo-vbwd.db \
     --json "$OUT/varlen-search.json" 2>&1 | tail -8
  python3 benchmarks/with_site.py /tmp/fa4site benchmarks/varlen_bench.py \
     --kind varlen_bwd --seqlens random:32:64:2048:1 --heads 16 --kv-heads 1 --head-dim 64 \
     --points "$OUT/varlen-search.json" --keep 3 --rounds 3 --json "$OUT/varlen-fa4.json" 2>&1 | tail -8
fi
