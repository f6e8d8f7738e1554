#!/usr/bin/env bash
# After the cross re-time's change (a rung's candidates include the other series' rung at its
# lengths): a short tune of the same config (fwd, lengths up to 2048, 3 minutes: one device
# call, so not the 10-minute check's conditions), then entries.py on the module it exports,
# 1-4 sequences of 1029 and 1400 tokens, to see whether the dispatch's kernel is now the
# module's fastest at calls of a few sequences.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs}
mkdir -p runs "$out"
rm -f runs/few.db
python3 -m evoengine tune benchmarks/configs/llama3.2-1b.json --kinds fwd --max-seq 2048 \
  --timeout 3m --store runs/few.db --name few -o runs/few_attention.py > "$out/few-tune.log" 2>&1
echo "tune: exit $?"
grep -E "cross|wrote|done in" "$out/few-tune.log" | tail -n 12
python3 experiments/2026-11-29-d64-small-calls/entries.py runs/few_attention.py \
  --config benchmarks/configs/llama3.2-1b.json --batches 1,2,3,4 --lengths 1029,1400 \
  --json "$out/entries-after.json" 2>&1 | tail -n 10
