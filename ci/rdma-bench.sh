#!/usr/bin/env bash
# The rdma transport beside perftest on the same soft-RoCE device in the same VM run:
# ib_write_bw (64 KiB, 1 MiB), ib_write_lat (8 B), then transports/examples/rdma_bench, and the
# ratios. Builds the example (release) first, on the host, before the VM boots.
#
#   ci/rdma-bench.sh [SECONDS]        seconds per bandwidth point (default 3)
#
# Units: perftest's MB/sec is 2^20 bytes/s; rdma_bench prints MiB/s too. ib_write_lat reports
# half a ping-pong round trip (t_typical); rdma_bench's 8-byte latency is post -> acknowledged
# completion, a full round trip on RC, so both ratios are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-3}
cargo build --release --locked -p omnirig-transports --features rdma --example rdma_bench >&2
cargo build --release --locked --features rdma --bin omnirig >&2
bin=$PWD/target/release/examples/rdma_bench
omnirig=$PWD/target/release/omnirig
exec ci/softroce.sh run --timeout 600 -- "set -o pipefail; secs=$secs; bin=$bin; omnirig=$omnirig; $(cat << 'IN'
gid=$SOFTROCE_GID_INDEX port=18900
perf() { # TOOL ARGS...: server in the background, client against it; prints the result line
  port=$((port + 1))
  "$1" -d rxe0 -x "$gid" -F -p "$port" "${@:2}" > /tmp/server.out 2>&1 &
  local srv=$! ok=0
  for _ in $(seq 60); do
    sleep 0.3
    if "$1" -d rxe0 -x "$gid" -F -p "$port" "${@:2}" "$SOFTROCE_IP" > /tmp/client.out 2>&1; then ok=1; break; fi
    grep -q "Couldn't connect" /tmp/client.out || break
  done
  wait $srv || true
  [ $ok = 1 ] || { echo "perftest failed: $*" >&2; cat /tmp/client.out >&2; return 1; }
  grep -A1 '#bytes' /tmp/client.out | tail -n 1
}
# perftest before and after ours (the host is shared and TCG is noisy); ratios use the better
# perftest figure of the two, so noise cannot flatter us
perftest() {
  bw64=$(perf ib_write_bw -s 65536 -D "$secs" | awk '{print $4}')
  bw1m=$(perf ib_write_bw -s 1048576 -D "$secs" | awk '{print $4}')
  lat=$(perf ib_write_lat -s 8 -n 2000 | awk '{print $5}')
  echo "ib_write_bw 65536 B: $bw64 MiB/s; ib_write_bw 1048576 B: $bw1m MiB/s; ib_write_lat 8 B t_typical: $lat us"
}
perftest | tee /tmp/perf1.out
"$bin" "$secs" | tee /tmp/omnirig.out
# the whole engine (batches, grants, slicing) over rdma: omnirig bench transfer
"$omnirig" bench transfer --transport rdma --sizes 8,64K,1M --budget 256M --max-iters 2000 2> /dev/null \
  | tee /tmp/engine.out
perftest | tee /tmp/perf2.out
best() { awk -v f="$1" -v low="$2" '{ v = $f + 0; if (m == "" || (low ? v < m : v > m)) m = v } END { print m }' /tmp/perf1.out /tmp/perf2.out; }
bw64=$(best 4 0); bw1m=$(best 9 0); lat=$(best 15 1)
# the best completion-wait mode of each measurement
o64=$(awk '/WRITE 65536 B/ {if ($6 > m) m = $6} END {print m}' /tmp/omnirig.out)
o1m=$(awk '/WRITE 1048576 B/ {if ($6 > m) m = $6} END {print m}' /tmp/omnirig.out)
olat=$(awk '/via Link::execute/ {for (i = 1; i < NF; i++) if ($i == "median") v = $(i + 1); if (m == "" || v < m) m = v} END {print m}' /tmp/omnirig.out)
awk -v a="$o64" -v b="$bw64" -v c="$o1m" -v d="$bw1m" -v e="$olat" -v f="$lat" 'BEGIN {
  printf "ratio bandwidth 64 KiB: %.2fx ib_write_bw (target >= 0.9)\n", a / b
  printf "ratio bandwidth 1 MiB: %.2fx ib_write_bw (target >= 0.9)\n", c / d
  printf "ratio latency 8 B: %.2fx ib_write_lat t_typical as printed (half round trip); %.2fx its full round trip (target <= 1.3)\n", e / f, e / (2 * f)
}'
# engine rows: GB/s is 1e9 bytes/s; p50 in us
awk -v b64="$bw64" -v b1m="$bw1m" -v l="$lat" '$1 == "write" && $2 == "64K" { printf "engine ratio bandwidth 64 KiB, one request at a time: %.2fx ib_write_bw\n", $3 * 1e9 / 1048576 / b64 }
  $1 == "write" && $2 == "1M" { printf "engine ratio bandwidth 1 MiB, one request at a time: %.2fx ib_write_bw\n", $3 * 1e9 / 1048576 / b1m }
  $1 == "write-x16" && $2 == "64K" { printf "engine ratio bandwidth 64 KiB, 16 per batch: %.2fx ib_write_bw (target >= 0.9)\n", $3 * 1e9 / 1048576 / b64 }
  $1 == "write-x16" && $2 == "1M" { printf "engine ratio bandwidth 1 MiB, 16 per batch: %.2fx ib_write_bw (target >= 0.9)\n", $3 * 1e9 / 1048576 / b1m }
  $1 == "write" && $2 == "8" { printf "engine ratio latency 8 B: %.2fx ib_write_lat full round trip (p50 %s us; target <= 1.3)\n", $4 / (2 * l), $4 }' /tmp/engine.out
IN
)"
