#!/usr/bin/env bash
# The scale model's measurements on the soft-RoCE pair (docs/sim.md, "Validation over the
# soft-RoCE pair"): two QEMU VMs (ci/softroce.sh run --vms 2), the five stages alternating
# between them as in ci/hil-softroce.sh, so every hop crosses the rdma link. In the VMs:
#   - ib_write_bw (1 MiB) and ib_write_lat (8 B) from VM 0 to VM 1: the link's figures;
#   - `omnirig simulate --calibrate-cpu` on VM 0: a VM's CPU costs (the `cpu:` section);
#   - `omnirig run --cluster ... --transport rdma --report` of the scenarios that
#     `simulate --scenarios-out` writes for harness/scenarios/sim-validate.yaml, REPEATS times
#     at each concurrency (the measured reports `simulate --measured` takes).
#
#   ci/sim-validate-softroce.sh [OUT]   OUT (default $TMPDIR/omnirig-sim-softroce) gets
#                                       perftest.txt, cpu.yaml, cpu-calibration.json,
#                                       m-cC-I/report.json and the agents' logs
#   CONCURRENCY="1 4" (default), REPEATS=3 (default)
# Needs what ci/hil-softroce.sh needs. Builds the release binary with --features hil (the
# stages' generation and digests run under TCG: a debug build would measure the build).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(readlink -f "${1:-${TMPDIR:-/tmp}/omnirig-sim-softroce}")
rm -rf "$out"
mkdir -p "$out"
t0=$SECONDS
cargo build --release --locked --quiet --features hil --bin omnirig
OMNIRIG_AGENT_SECRET="softroce-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export OMNIRIG_AGENT_SECRET
SIM_CONCURRENCY=${CONCURRENCY:-1 4}
SIM_REPEATS=${REPEATS:-3}
export SIM_CONCURRENCY SIM_REPEATS
echo "sim-validate-softroce: built in $((SECONDS - t0)) s; booting two VMs"

cat > "$out/vm.sh" << 'EOF'
set -uo pipefail
exe=$PWD/target/release/omnirig node=vm$SOFTROCE_NODE R=$SOFTROCE_RUN out=$SIM_OUT
gid=$SOFTROCE_GID_INDEX
. ci/softroce-cluster.sh
softroce_publish_gid || exit 1
# the link: VM 1 serves, VM 0 measures (one server per test; each exits after its client)
perf() { # TOOL SIZE ITERS PORT
  if [ "$SOFTROCE_NODE" = 1 ]; then
    "$1" -d rxe0 -i 1 -F -s "$2" -n "$3" -p "$4" -x "$gid" > "$out/$1-server.txt" 2>&1 &
    sleep 1
    softroce_barrier "$1" || exit 1
    wait
  else
    softroce_barrier "$1" || exit 1
    sleep 1
    { echo "== $1 -s $2 -n $3 (VM 0 -> VM 1)"; "$1" -d rxe0 -i 1 -F -s "$2" -n "$3" -p "$4" -x "$gid" 10.77.0.2; } \
      >> "$out/perftest.txt" 2>&1
  fi
}
perf ib_write_bw 1048576 2000 18901
perf ib_write_lat 8 2000 18902
softroce_barrier perftest || exit 1
if [ "$SOFTROCE_NODE" = 0 ]; then
  "$exe" metadata-server --listen 10.77.0.1:18080 > "$out/metadata.log" 2>&1 &
  softroce_cluster_yaml softroce-2vm "written by ci/sim-validate-softroce.sh: two soft-RoCE VMs, stages alternating" \
    > "$out/cluster.yaml"
  t=$SECONDS
  "$exe" simulate --calibrate-cpu --calibrate-mib 16 --out "$out/cal" > "$out/calibrate.log" 2>&1 \
    || { echo "calibration failed"; tail "$out/calibrate.log"; }
  echo "calibration: $((SECONDS - t)) s"
  "$exe" simulate --scenario harness/scenarios/sim-validate.yaml --concurrency "${SIM_CONCURRENCY// /,}" \
    --scenarios-out "$out/scenarios" > /dev/null 2>&1 || echo "scenarios-out failed"
fi
softroce_barrier cluster || exit 1
"$exe" agent --cluster "$out/cluster.yaml" --node "$node" > "$out/agent-$node.log" 2>&1 &
agent=$!
rc=0
if [ "$SOFTROCE_NODE" = 0 ]; then
  for c in $SIM_CONCURRENCY; do
    for i in $(seq "$SIM_REPEATS"); do
      t=$SECONDS
      "$exe" run --cluster "$out/cluster.yaml" "$out/scenarios/scenario-c$c.yaml" --transport rdma -q \
        --report "$out/m-c$c-$i" > "$out/run-c$c-$i.log" 2>&1 || rc=1
      echo "c$c run $i: $((SECONDS - t)) s, $(grep -m1 'requests ok' "$out/run-c$c-$i.log")"
    done
  done
  touch "$R/done"
else
  for _ in $(seq 3000); do [ -e "$R/done" ] && break; sleep 1; done
fi
kill "$agent" 2> /dev/null
exit "$rc"
EOF
rc=0
SIM_OUT=$out ci/softroce.sh run --vms 2 --timeout 2400 --share "$out" \
  --env SIM_OUT --env SIM_CONCURRENCY --env SIM_REPEATS -- "bash $out/vm.sh" || rc=$?
echo "sim-validate-softroce: took $((SECONDS - t0)) s; results in $out"
exit $rc
