#!/usr/bin/env bash
# The backward's main kernel under ncu, ours and FlashAttention-4's (after its two-call
# install), one launch each: throughput, pipes, issue, stalls, memory. Usage (repository root,
# $OUT set, FA4's site directory in FA4SITE; POINTS, another points file; WHO, "ours" or "fa4"
# alone):
#   bash experiments/2026-11-29-bwd-kernel-split/ncu.sh 16,16,2048,64,causal bf16
set -euo pipefail
workload=$1 dtype=$2
here=experiments/2026-11-29-bwd-kernel-split
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats
          --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats
          --section MemoryWorkloadAnalysis"}
run() {  # name, kernel regex
  ncu --clock-control none -k "$2" -s 2 -c 1 $SECTIONS -o "$OUT/$1" \
    python3 -W ignore benchmarks/with_site.py "${FA4SITE:-/nonexistent}" "$here/split.py" --points "${POINTS:-$here/points.json}" --workloads "$workload" --dtypes "$dtype" \
    --only "$1" --calls 4 > "$OUT/$1-run.log" 2>&1 || { tail -5 "$OUT/$1-run.log"; return 0; }
  ncu -i "$OUT/$1.ncu-rep" --page details > "$OUT/$1.txt"
  ncu -i "$OUT/$1.ncu-rep" --page raw --csv > "$OUT/$1-raw.csv"
  if [[ "$SECTIONS" == *SourceCounters* ]]; then
    ncu -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1-sass.csv"
  fi
}
case ${WHO:-both} in ours|both) run ours 'regex:attn_bwd$' ;; esac
case ${WHO:-both} in fa4|both) run fa4 'regex:FlashAttentionBackwardSm90' ;; esac
for who in ours fa4; do
  [ -f "$OUT/$who.txt" ] || continue
  echo "== $who"
  grep -E "^ +(Duration|Elapsed Cycles|SM Active Cycles|Executed Ipc Active|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Registers Per Thread|Block Size|Grid Size|Executed Instructions  |Memory Throughput|L1/TEX Hit Rate|L2 Hit Rate|DRAM Throughput|Dynamic Shared Memory Per Block|Warp Cycles Per Issued Instruction) " "$OUT/$who.txt" || true
done
