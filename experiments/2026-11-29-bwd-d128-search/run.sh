#!/usr/bin/env bash
# The d128 GQA backward searched with DS_BUFFERS, DS_STORE, MAIN_LAUNCH and KV_LOAD in the
# space (docs/NOTES.md, seventeenth session): one 2-minute search per dtype, fresh stores, seed
# 7, priors on, FA4 in the final re-time where it imports (FA4 installed to /tmp/fa4site).
#   bash experiments/2026-11-29-bwd-d128-search/run.sh bf16 fp16
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs}
mkdir -p runs "$out"
for dtype in "$@"; do
  store=runs/bwd-d128-$dtype.db
  rm -f "$store"
  python3 -W ignore benchmarks/with_site.py /tmp/fa4site -m evoengine \
    search --kind bwd --shape 4,32,4096,128 --kv-heads 8 --causal --dtype "$dtype" --seed 7 \
    --timeout 2m --store "$store" --json "$out/bwd-d128-search-$dtype.json" \
    > "$out/bwd-d128-search-$dtype.log" 2>&1
  echo "search $dtype: exit $?"
  tail -n 14 "$out/bwd-d128-search-$dtype.log"
done
