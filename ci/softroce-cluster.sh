# Sourced inside the VMs by the two-VM lanes (ci/hil-softroce.sh, ci/sim-validate-softroce.sh)
# for the cluster they share: two soft-RoCE nodes, the stages alternating between them so
# every hop crosses the link, metadata through `omnirig metadata-server` on VM 0.

# Publishes this VM's GID index to the run folder and waits for the other VM's.
softroce_publish_gid() {
  echo "$SOFTROCE_GID_INDEX" > "$SOFTROCE_RUN/gid.$SOFTROCE_NODE"
  softroce_barrier gids
}

# Prints the cluster file: NAME, and a comment line saying who wrote it.
softroce_cluster_yaml() {
  cat << YAML
# $2
name: $1
coordinator: {address: 10.77.0.1}
metadata: {kind: http, url: "http://10.77.0.1:18080/metadata"}
nodes:
  - name: vm0
    host: 10.77.0.1
    rdma: {device: rxe0, port: 1, gid_index: $(cat "$SOFTROCE_RUN/gid.0")}
    netdev: $SOFTROCE_NETDEV
    stages: [encoder, thinker_decode, code2wav]
  - name: vm1
    host: 10.77.0.2
    rdma: {device: rxe0, port: 1, gid_index: $(cat "$SOFTROCE_RUN/gid.1")}
    netdev: $SOFTROCE_NETDEV
    stages: [thinker_prefill, talker]
YAML
}
