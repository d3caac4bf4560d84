#!/usr/bin/env bash
# The hardware-in-the-loop mode on two "nodes" made of Linux network namespaces (no VMs, no
# RDMA): a bridge br-omnihil with the coordinator on 10.78.0.1, namespaces omnihil-a
# (10.78.0.2) and omnihil-b (10.78.0.3), an `omnirig agent` in each, a metadata store on the
# coordinator, then `cargo test --features hil` against that cluster. Needs root (ip netns).
#   ci/hil-netns.sh [p2p|http|etcd]     (default http; etcd needs the etcd binary)
set -euo pipefail
cd "$(dirname "$0")/.."
meta="${1:-http}"
work="$(mktemp -d "${TMPDIR:-/tmp}/omnirig-hil-netns.XXXXXX")"
pids=()
# The kernel tears a deleted namespace's veth ends down asynchronously, so a run right after
# another can meet them: delete the host ends explicitly and wait until they are gone.
remove_links() {
  for n in a b; do ip link del "omnihil-h$n" 2>/dev/null || true; done
  for n in a b; do ip netns del "omnihil-$n" 2>/dev/null || true; done
  ip link del br-omnihil 2>/dev/null || true
  for _ in $(seq 50); do
    ip link show br-omnihil >/dev/null 2>&1 || ip link show omnihil-ha >/dev/null 2>&1 \
      || ip link show omnihil-hb >/dev/null 2>&1 || return 0
    sleep 0.1
  done
}
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  remove_links
  rm -rf "$work"
}
trap cleanup EXIT
remove_links

ip link add br-omnihil type bridge
ip addr add 10.78.0.1/24 dev br-omnihil
ip link set br-omnihil up
i=2
for n in a b; do
  ip netns add "omnihil-$n"
  ip link add "omnihil-h$n" type veth peer name "omnihil-n$n"
  ip link set "omnihil-n$n" netns "omnihil-$n"
  ip link set "omnihil-h$n" master br-omnihil up
  ip -n "omnihil-$n" addr add "10.78.0.$i/24" dev "omnihil-n$n"
  ip -n "omnihil-$n" link set "omnihil-n$n" up
  ip -n "omnihil-$n" link set lo up
  i=$((i + 1))
done

cargo build --locked --quiet --features hil
exe="$PWD/target/debug/omnirig"
export OMNIRIG_AGENT_SECRET="netns-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"

case "$meta" in
  p2p) metadata="{kind: p2p}" ;;
  http)
    "$exe" metadata-server --listen 10.78.0.1:18080 >"$work/metadata.log" 2>&1 &
    pids+=($!)
    metadata='{kind: http, url: "http://10.78.0.1:18080/metadata"}' ;;
  etcd)
    etcd --data-dir "$work/etcd" --listen-client-urls http://10.78.0.1:12379 \
      --advertise-client-urls http://10.78.0.1:12379 --listen-peer-urls http://127.0.0.1:12380 \
      --initial-advertise-peer-urls http://127.0.0.1:12380 \
      --initial-cluster default=http://127.0.0.1:12380 >"$work/etcd.log" 2>&1 &
    pids+=($!)
    metadata='{kind: etcd, url: "http://10.78.0.1:12379", ttl_s: 5}' ;;
  *) echo "usage: $0 [p2p|http|etcd]" >&2; exit 2 ;;
esac

cat >"$work/cluster.yaml" <<YAML
name: netns-$meta
coordinator: {address: 10.78.0.1}
metadata: $metadata
nodes:
  - {name: ns-a, host: 10.78.0.2, stages: [encoder, thinker_prefill, thinker_decode]}
  - {name: ns-b, host: 10.78.0.3, stages: [talker, code2wav]}
YAML
for n in a b; do
  ip netns exec "omnihil-$n" "$exe" agent --cluster "$work/cluster.yaml" --node "ns-$n" \
    >"$work/agent-$n.log" 2>&1 &
  pids+=($!)
done

OMNIRIG_CLUSTER="$work/cluster.yaml" OMNIRIG_HIL_REQUIRED=1 \
  cargo test --locked --features hil --test hil -- --nocapture
