#!/usr/bin/env bash
# Issue #17's check of one model config on a device whose calls stop at 10 minutes: a
# `--kinds fwd --timeout 10m` tune from scratch in two calls on the same warm machine, then
# the exported module at 20 seeded shapes (benchmarks/model_check.py). The store, the log and
# the seconds spent stay in runs/ between the calls (ignored, so kept while the machine is warm).
#
#   bash benchmarks/tune_check.sh 1 benchmarks/configs/qwen2.5-7b.json   # ~540 s: searches, cut
#   bash benchmarks/tune_check.sh 2 benchmarks/configs/qwen2.5-7b.json   # the rest, export, check
#
# Part 2 resumes the tune with what is left of the 10 minutes (the finished searches are
# skipped), then writes $OUT/<name>-tune-check.json (the rows and summary of model_check.py),
# then the same shapes with the other mask and the other dtype, which the tune did not search
# ($OUT/<name>-tune-check-{noncausal,fp16,...}.json; VARIANTS=0 skips them), and copies the
# module, its log and its store (every candidate's time on every workload of the cross re-time;
# it does not come back if over the device's 16 MiB a file) to $OUT. Part 1 copies its log.
# Run part 1 again to start over.
set -uo pipefail
part=${1:?part 1 or 2}
config=${2:?a model config.json}
name=$(basename "$config" .json)
cd "$(dirname "$0")/.."
out=${OUT:-runs}
mkdir -p runs "$out"
store=runs/$name-check.db module=runs/${name}_attention.py
tune=(python -m evoengine tune "$config" --kinds fwd --store "$store" -o "$module")
case $part in
  1)
    rm -f "$store" "runs/$name-check.seconds"
    start=$(date +%s)
    timeout -s INT "${PART1_S:-535}" "${tune[@]}" --timeout 10m > "runs/$name-tune1.log" 2>&1
    echo "tune part 1: exit $? after $(( $(date +%s) - start )) s"
    echo $(( $(date +%s) - start )) > "runs/$name-check.seconds"
    grep -E "done in|interrupted in|tune " "runs/$name-tune1.log" | tail -n 12
    cp "runs/$name-tune1.log" "$out/" 2>/dev/null || true
    ;;
  2)
    [ -f "runs/$name-check.seconds" ] || { echo "no part 1 here (the machine was not warm)"; exit 3; }
    left=$(( 600 - $(cat "runs/$name-check.seconds") ))
    (( left > 0 )) || left=1
    start=$(date +%s)
    "${tune[@]}" --timeout "${left}s" > "runs/$name-tune2.log" 2>&1
    status=$? spent=$(( $(date +%s) - start ))
    echo "tune part 2 (${left} s left): exit $status after $spent s;" \
      "the tune took $(( $(cat "runs/$name-check.seconds") + spent )) s of 600 in all"
    grep -E "done in|cross|wrote|tune " "runs/$name-tune2.log" | tail -n 14
    cp "runs/$name-tune2.log" "$module" "$store" "$out/" 2>/dev/null || true
    timeout "${CHECK_S:-300}" python benchmarks/model_check.py "$module" --config "$config" \
      --shapes 20 --seed 0 --json "$out/$name-tune-check.json" 2>&1 | tail -n 22
    # The variants the tune did not search, at the same shapes (VARIANTS=0 skips them): the
    # other mask, then the other dtype.
    if [ "${VARIANTS:-1}" = 1 ]; then
      python -c "from evoengine.geometry import from_config as f
g = f('$config')
print('--causal', *(('no', 'noncausal') if g.causal else ('yes', 'causal')))
print('--dtype', *(('bf16',) if g.dtype == 'fp16' else ('fp16',)) * 2)" |
      while read -r opt value tag; do
        timeout "${CHECK_S:-300}" python benchmarks/model_check.py "$module" --config "$config" \
          --shapes 20 --seed 0 "$opt" "$value" --json "$out/$name-tune-check-$tag.json" \
          < /dev/null 2>&1 |
          tail -n 1
      done
    fi
    ;;
  *) echo "part must be 1 or 2" >&2; exit 2 ;;
esac
