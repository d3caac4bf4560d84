#!/usr/bin/env bash
# The hardware-in-the-loop mode end to end on two soft-RoCE VMs (ci/softroce.sh run --vms 2):
# two RoCE nodes (rxe0 on a virtio-net link, 10.77.0.1 and 10.77.0.2) that share nothing with
# the host but a run folder, so the coordinator runs in VM 0. Each VM writes its GID index to
# the run folder; VM 0 writes the cluster file (stages alternate between the nodes, so every
# hop crosses the link, each node's rxe0 / port 1 / GID index; metadata through
# `omnirig metadata-server` on VM 0); both start `omnirig agent`; VM 0 runs the
# `cargo test --features hil --test hil` binary against that cluster (OMNIRIG_HIL_REQUIRED=1:
# hops over rdma, bit-exact, plus the real-link fault cases), then `omnirig evidence`.
#
#   ci/hil-softroce.sh [OUT]    OUT (default $TMPDIR/omnirig-hil-softroce) gets the cluster
#                               file, the agents' logs, the test's output and evidence/
#                               (evidence.json, evidence.md, plots, the runs' report pages)
# Needs what ci/softroce.sh needs (qemu, apt for the VM pieces) plus cmake and libclang to build.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(readlink -f "${1:-${TMPDIR:-/tmp}/omnirig-hil-softroce}")
rm -rf "$out"
mkdir -p "$out"
t0=$SECONDS

cargo build --locked --quiet --features hil --bin omnirig
testbin=$(cargo test --locked --features hil --test hil --no-run 2>&1 |
  sed -n 's/.*Executable tests\/hil.rs (\(.*\))$/\1/p' | tail -n 1)
[[ -x $testbin ]] || { echo "hil-softroce: no hil test binary" >&2; exit 1; }
testbin=$(readlink -f "$testbin")
OMNIRIG_AGENT_SECRET="softroce-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export OMNIRIG_AGENT_SECRET
echo "hil-softroce: built in $((SECONDS - t0)) s; booting two VMs"

cat > "$out/vm.sh" << 'EOF'
set -uo pipefail
exe=$PWD/target/debug/omnirig node=vm$SOFTROCE_NODE R=$SOFTROCE_RUN out=$HIL_OUT
. ci/softroce-cluster.sh
softroce_publish_gid || exit 1
if [ "$SOFTROCE_NODE" = 0 ]; then
  "$exe" metadata-server --listen 10.77.0.1:18080 > "$out/metadata.log" 2>&1 &
  softroce_cluster_yaml softroce-2vm "written by ci/hil-softroce.sh: two soft-RoCE VMs, stages alternating so every hop crosses" \
    > "$out/cluster.yaml"
fi
softroce_barrier cluster || exit 1
# The agent relays its stage processes' stderr to its own (the coordinator has them log the
# rdma transport's device selection) and keeps those lines for `omnirig evidence`.
"$exe" agent --cluster "$out/cluster.yaml" --node "$node" > "$out/agent-$node.log" 2>&1 &
agent=$!
if [ "$SOFTROCE_NODE" = 0 ]; then
  rc=0
  t=$SECONDS
  # The cluster tests; the binary's other two (a node killed, evidence on 127.0.0.1) need no
  # cluster and run on the host in CI.
  OMNIRIG_CLUSTER=$out/cluster.yaml OMNIRIG_HIL_REQUIRED=1 "$HIL_TESTBIN" --test-threads=1 \
    --nocapture _on_the_cluster > "$out/test.log" 2>&1 || rc=$?
  echo "hil test: exit $rc in $((SECONDS - t)) s"
  grep -E '^test |test result|cluster|killed|deadline' "$out/test.log"
  t=$SECONDS erc=0
  # Two golden cases of different sizes, four times each: every hop at two sizes, eight
  # samples per CDF, in minutes under TCG (long_audio's 108 MiB KV alone takes 18 s a request).
  printf 'name: evidence-softroce\nconcurrency: 1\nrequests:\n%s' \
    "$(for c in text_short image_audio; do printf '  - {case: %s, repeat: 4, vary_seed: true}\n' $c; done)" \
    > "$out/evidence-scenario.yaml"
  "$exe" evidence --cluster "$out/cluster.yaml" --out "$out/evidence" \
    --scenario "$out/evidence-scenario.yaml" > "$out/evidence.log" 2>&1 || erc=$?
  echo "evidence: exit $erc in $((SECONDS - t)) s"
  [ "$rc" = 0 ] && rc=$erc
  tail -n 3 "$out/evidence.log"
  touch "$R/done"
else
  for _ in $(seq 3000); do [ -e "$R/done" ] && break; sleep 1; done
  rc=0
fi
kill "$agent" 2> /dev/null
exit "$rc"
EOF
rc=0
HIL_OUT=$out HIL_TESTBIN=$testbin ci/softroce.sh run --vms 2 --timeout 1500 --share "$out" \
  --env HIL_OUT --env HIL_TESTBIN -- "bash $out/vm.sh" || rc=$?
echo "hil-softroce: lane took $((SECONDS - t0)) s; evidence in $out/evidence"
exit $rc
