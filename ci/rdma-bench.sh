#!/usr/bin/env bash
# The engine over rdma beside perftest, in one soft-RoCE VM (or across two: RDMA_BENCH_VMS=2):
# `omnirig bench transfer --transport rdma` RUNS times. Each run times the whole engine
# (batches, grants, slicing: what the product runs) between perftest runs (ib_write_bw,
# ib_write_lat) on the same device or link and prints its ratios against perftest's median;
# this prints each ratio's median and spread over the runs.
#
#   ci/rdma-bench.sh [RUNS] [SECONDS] [--paired]
#       runs (default 3); seconds per ib_write_bw point (default 2); --paired: each run also
#       runs the engine as it was before issue 12's batching work (OMNIRIG_RDMA_BATCH=off: one
#       run per slice; --runtime current: one runtime thread), right after, in the same VM,
#       and the medians are printed per variant ("now" / "before"); RDMA_BENCH_VARIANTS
#       names other variants ("label:ENV=VALUE --bench-arg value;label2:...")
#   RDMA_BENCH_ROUNDS=N (default 1): each run interleaves N engine runs with N + 1 perftest runs
#       (`bench transfer --rounds N`) and reports the median engine run against perftest's
#       median; its lines also give the ratio against the best perftest run
#   RDMA_BENCH_VMS=2: across two VMs (two RoCE nodes on a virtual link) instead of one: VM 1
#       runs `omnirig bench peer --mode rdma-engine` (the target engine, and perftest's servers
#       on request), VM 0 `bench transfer --peer`, so the engine and perftest cross the same
#       link. Smaller budget (the link runs at 15-60 MB/s)
#
# Builds the release binary on the host first (the VM runs host binaries; OMNIRIG_BENCH_BIN
# names one already built instead). Bandwidth ratios are
# of MiB/s (perftest's MB/sec is 2^20 bytes/s); the 8-byte latency ratio is the engine's p50
# (post to acknowledged completion, a full round trip on RC) over twice ib_write_lat's
# t_typical (it prints half a ping-pong round trip).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
secs=${2:-2}
paired=${3:-}
rounds=${RDMA_BENCH_ROUNDS:-1}
variants=("now:")
[[ $paired == --paired ]] && variants+=("before:OMNIRIG_RDMA_BATCH=off --runtime current")
# RDMA_BENCH_VARIANTS="label:ENV=V --arg v;label2:..." replaces the variants (e.g. to tell the
# batching and the runtime apart)
if [[ -n ${RDMA_BENCH_VARIANTS:-} ]]; then
  IFS=';' read -r -a variants <<< "$RDMA_BENCH_VARIANTS"
fi
# OMNIRIG_BENCH_BIN: a binary already built (with --features rdma) to measure instead
if [[ -n ${OMNIRIG_BENCH_BIN:-} ]]; then
  omnirig=$(realpath "$OMNIRIG_BENCH_BIN")
else
  cargo build --release --locked --features rdma --bin omnirig >&2
  omnirig=$PWD/target/release/omnirig
fi
# The log stays (target/rdma-bench/) as the run's evidence; a temporary file under /tmp could be
# swept while a long VM run holds it.
mkdir -p target/rdma-bench
out=$PWD/target/rdma-bench/$(date +%Y%m%d-%H%M%S).log
t0=$SECONDS
vms=${RDMA_BENCH_VMS:-1}
[[ $vms == 1 || $vms == 2 ]] || { echo "RDMA_BENCH_VMS is 1 or 2, not $vms" >&2; exit 2; }
budget="--budget 256M --max-iters 2000"
# two VMs: VM 1 serves one benchmark per run and variant (a peer exits after each); VM 0's
# output is the log (the softroce script prints VM 1's after it, under its own header)
peer_loop=""
if [[ $vms == 2 ]]; then
  budget="--budget 64M --max-iters 1000"
  peer_loop="if [ \$SOFTROCE_NODE = 1 ]; then
  for k in \$(seq $((runs * ${#variants[@]}))); do
    $omnirig bench peer --mode rdma-engine --listen \$SOFTROCE_IP:7471 --max-size 1M --wait-s 600 || exit 1
  done
  exit 0
fi
peer=\"--peer \$SOFTROCE_PEER_IP:7471\""
fi
ci/softroce.sh run --vms "$vms" --timeout $((120 + runs * ${#variants[@]} * rounds * 240)) -- "set -o pipefail
peer=
$peer_loop
for i in \$(seq $runs); do
  for v in ${variants[*]@Q}; do
    label=\${v%%:*}; spec=\${v#*:}; envs=(); args=()
    for w in \$spec; do [[ \$w == *=* ]] && envs+=(\"\$w\") || args+=(\"\$w\"); done
    echo \"== run \$i of $runs variant \$label\"
    env \"\${envs[@]}\" $omnirig bench transfer --transport rdma --sizes 8,64K,1M $budget \\
      --perftest-seconds $secs --rounds $rounds \$peer \"\${args[@]}\" 2> /tmp/bench.err \\
      | sed \"s/^ratio /ratio[\$label] /\" || { cat /tmp/bench.err >&2; exit 1; }
  done
done" | tee "$out"
echo "== $runs runs on $vms VM(s) in $((SECONDS - t0)) s (VM boot included), log $out; median (min-max) over the runs:"
python3 - "$out" << 'PY'
import re, statistics, sys
ratios = {}
for line in open(sys.argv[1]):
    m = re.match(r"ratio\[(\S+)\] (\S+) (\S+): ([0-9.]+)x (\S+)", line)
    if m:
        ratios.setdefault((m[2], m[3], m[5], m[1]), []).append(float(m[4]))
if not ratios:
    sys.exit("no ratio lines: did perftest run in the VM?")
for (op, size, tool, label), v in sorted(ratios.items(), key=lambda kv: kv[0][:3]):
    target = "<= 1.3" if tool == "ib_write_lat" else ">= 0.9"
    # three decimals: a median of 0.895 is not "0.90", not at a target of 0.9
    print(f"{op:>12} {size:>4} [{label}]: {statistics.median(v):.3f}x ({min(v):.3f}-{max(v):.3f}) "
          f"{tool}{' round trip' if tool == 'ib_write_lat' else ''}, {len(v)} runs; target {target}")
PY
