#!/usr/bin/env bash
# One launch of ours or of FlashAttention-4 on the d64 row still behind it (bf16 16,16,2048,64,
# no mask) under ncu: throughput, pipes, issue, stalls. Usage (repository root, $OUT set):
#   bash experiments/2026-11-27-wgmma-d64-ncu/profile.sh ours|fa4
# POINT='{...}' in the environment profiles another of our points (default: the 11-24 winner,
# static schedule, as profiled on 2026-11-27).
set -euo pipefail
who=$1
POINT=${POINT:-'{"BLOCK_M":192,"BLOCK_N":128,"STAGES":3,"SWIZZLE":128,"P_FROM":"regs","INTRA_WG_OVERLAP":true,"PINGPONG":true,"PERSISTENT":true,"TILE_ORDER":"head","SCHEDULER":"static","PACK_GQA":false,"P_BARRIER":"warpgroup","O_STAGE":"own_or_q"}'}
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats
          --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats
          --section MemoryWorkloadAnalysis"
if [ "$who" = ours ]; then
  args=(--family wgmma --params "$POINT"); kernel="regex:attn_fwd"
else
  args=(--fa4); kernel="regex:(?i)flash|fwd"
fi
ncu --clock-control none -k "$kernel" -s 4 -c 1 $SECTIONS -o "$OUT/$who-d64" \
  python benchmarks/profile_point.py 16,16,2048,64 --dtype bf16 --calls 8 "${args[@]}"
ncu -i "$OUT/$who-d64.ncu-rep" --page details > "$OUT/$who-d64.txt"
ncu -i "$OUT/$who-d64.ncu-rep" --page raw --csv > "$OUT/$who-d64-raw.csv"
grep -E "Duration|Executed Ipc A|Issue Slots Busy|Issued Warp|No Eligible|Registers Per|Threads|Grid Size|Block Size|Compute \(SM\)|Executed Instructions  " "$OUT/$who-d64.txt" || true
