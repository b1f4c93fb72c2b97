#!/usr/bin/env bash
# For a lent GPU machine whose calls last at most 10 minutes: runs a longer sequence across several calls.
#   scripts/gpu_lease.sh start ITEMS [SECONDS]  starts `gpu_check.sh ITEMS` detached (setsid; `a,b/c` runs
#                                               a,b then c; `a+b/c` runs a beside b, then c: for a build that
#                                               needs no GPU beside a GPU job), its logs in /tmp/gpu-lease,
#                                               then waits like `wait`
#   scripts/gpu_lease.sh wait [SECONDS]         waits up to SECONDS (default 560) for it to finish
# Either way the logs so far go to $OUT (summary.txt, console.log, and results.tgz with all of them), and
# "lease: running" or "lease: done rc=N" is printed last. Environment for gpu_check.sh (LAYERSTREAM_*) is
# passed through on start. The machine must be called again within its idle time to keep it (and the job).
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=/tmp/gpu-lease
what=${1:?start ITEMS or wait}
if [[ $what == start ]]; then
  rm -rf "$DIR" && mkdir -p "$DIR/out"
  # ITEMS: gpu_check items, comma-separated; groups separated by '/' run one after another in that order, and
  # the parts of a group separated by '+' side by side (each its own gpu_check.sh, the same $OUT).
  setsid nohup bash -c 'rc=0; IFS=/; for group in $1; do
      pids=(); IFS=+; for part in $group; do OUT=$2/out scripts/gpu_check.sh "$part" & pids+=($!); done; IFS=/
      for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    done
    echo $rc >"$2/rc"' _ "${2:?items}" "$DIR" </dev/null >"$DIR/console.log" 2>&1 &
  shift 2
else
  shift 1
fi
limit=${1:-560}
for ((t = 0; t < limit; t += 5)); do
  [[ -e $DIR/rc ]] && break
  sleep 5
done
mkdir -p "${OUT:?}"
# At most 8 files come back from a call: the summary, the console, and everything else in one archive.
cp "$DIR"/console.log "$DIR/out/summary.txt" "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tgz" -C "$DIR/out" . 2>/dev/null
tail -n 40 "$DIR/out/summary.txt" 2>/dev/null
if [[ -e $DIR/rc ]]; then echo "lease: done rc=$(cat "$DIR/rc")"; else echo "lease: running"; fi
