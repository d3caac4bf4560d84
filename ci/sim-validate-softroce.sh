#!/usr/bin/env bash
# The scale model's measurements on the soft-RoCE pair (docs/sim.md, "Validation over the
# soft-RoCE pair"): two QEMU VMs (ci/softroce.sh run --vms 2), the five stages alternating
# between them as in ci/hil-softroce.sh, so every hop crosses the rdma link. In the VMs:
#   - ib_write_bw (1 MiB) and ib_write_lat (8 B) from VM 0 to VM 1: the link's figures;
#   - the engine's 4 KiB rdma write from VM 0 to an engine in VM 1, back to back and after a
#     10 ms pause, three times each: the wake across the link;
#   - the engine's 1 MiB rdma writes from VM 0 to VM 1, one at a time and in batches of 16
#     (bulk.json): the link's rate as the pipeline's engine sees it;
#   - `omnirig simulate --calibrate-cpu` on VM 0: a VM's CPU costs (the `cpu:` section);
#   - `omnirig run --cluster ... --transport rdma --report` of the scenarios that
#     `simulate --scenarios-out` writes for harness/scenarios/sim-validate.yaml, REPEATS times
#     at each concurrency (the measured reports `simulate --measured` takes).
#
#   ci/sim-validate-softroce.sh [OUT]   OUT (default $TMPDIR/omnirig-sim-softroce) gets
#                                       perftest.txt, cal/cpu.yaml, cal/cpu-calibration.json,
#                                       m-cC-I/report.json, wake-gapG-I.json, the agents' logs,
#                                       qemu-cpu.log (each QEMU process's host CPU, sampled
#                                       here every 0.2 s), host-cpu.txt (what ib_write_bw's
#                                       bytes cost this machine's cores, the engine's rate,
#                                       the wake), bulk-after.json and drift.txt (the engine's
#                                       bulk rate again after the runs, against before),
#                                       cal-after/ (VM 0's calibration again after the runs)
#                                       and predicted/ (fabrics A, E, W, S, Q and R from these
#                                       figures, each scored against the reports)
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
    # the host's sampler (below) reads both QEMU processes' CPU at these marks' times
    : > "$out/mark-$1-start"
    { echo "== $1 -s $2 -n $3 (VM 0 -> VM 1)"; "$1" -d rxe0 -i 1 -F -s "$2" -n "$3" -p "$4" -x "$gid" 10.77.0.2; } \
      >> "$out/perftest.txt" 2>&1
    : > "$out/mark-$1-end"
  fi
}
perf ib_write_bw 1048576 2000 18901
perf ib_write_lat 8 2000 18902
softroce_barrier perftest || exit 1
# the wake across the link: the engine's 4 KiB rdma write from VM 0 to an engine in VM 1,
# back to back and after a 10 ms pause (both VMs' threads park), three times each
if [ "$SOFTROCE_NODE" = 1 ]; then
  for _ in $(seq 6); do
    "$exe" bench peer --mode rdma-engine --listen 10.77.0.2:18950 --max-size 64K --wait-s 120 \
      >> "$out/wake-peer.log" 2>&1 || exit 1
  done
  # the engine's own bulk rate (below): 16 MiB, so a batch of 16 x 1 MiB lands apart
  "$exe" bench peer --mode rdma-engine --listen 10.77.0.2:18950 --max-size 16M --wait-s 120 \
    >> "$out/bulk-peer.log" 2>&1 || exit 1
else
  for i in 1 2 3; do
    for gap in 0 10000; do
      "$exe" bench transfer --transport rdma --peer 10.77.0.2:18950 --peer-wait-s 120 --sizes 4K \
        --min-iters 200 --max-iters 200 --budget 64M --perftest-seconds 1 --rounds 1 --gap-us "$gap" \
        --json "$out/wake-gap$gap-$i.json" >> "$out/wake.log" 2>&1 || echo "wake bench (gap $gap) failed"
    done
  done
  # the link's rate as the engine moves bytes (ib_write_bw busy-polls its completions, which
  # under TCG takes a host core from rxe; the engine parks): 1 MiB writes one at a time, in
  # batches of 16 (how a KV handoff arrives), and 2 and 4 batches in flight, with ib_write_bw
  # before and after in the same run
  "$exe" bench transfer --transport rdma --peer 10.77.0.2:18950 --peer-wait-s 120 --sizes 1M \
    --min-iters 16 --max-iters 16 --budget 16M --perftest-seconds 2 --rounds 1 \
    --json "$out/bulk.json" >> "$out/bulk.log" 2>&1 || echo "bulk bench failed"
fi
softroce_barrier wake || exit 1
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
  # the concurrencies take turns, so a host that slows mid-boot slows both alike
  for i in $(seq "$SIM_REPEATS"); do
    for c in $SIM_CONCURRENCY; do
      t=$SECONDS
      "$exe" run --cluster "$out/cluster.yaml" "$out/scenarios/scenario-c$c.yaml" --transport rdma -q \
        --report "$out/m-c$c-$i" > "$out/run-c$c-$i.log" 2>&1 || rc=1
      echo "c$c run $i: $((SECONDS - t)) s, $(grep -m1 'requests ok' "$out/run-c$c-$i.log")"
    done
  done
  kill "$agent" 2> /dev/null
  touch "$R/done"
  # the engine's bulk rate once more after the runs: the fabrics are built from the figures
  # before them, so a boot whose host moved meanwhile says so (drift.txt)
  "$exe" bench transfer --transport rdma --peer 10.77.0.2:18950 --peer-wait-s 120 --sizes 1M \
    --min-iters 16 --max-iters 16 --budget 16M --perftest-seconds 2 --rounds 1 \
    --json "$out/bulk-after.json" >> "$out/bulk-after.log" 2>&1 || echo "second bulk bench failed"
  # and the calibration: fabric R is built from the mean of both sides of the runs
  "$exe" simulate --calibrate-cpu --calibrate-mib 16 --out "$out/cal-after" > "$out/calibrate-after.log" 2>&1 \
    || { echo "second calibration failed"; tail "$out/calibrate-after.log"; rm -rf "$out/cal-after"; }
else
  for _ in $(seq 3000); do [ -e "$R/done" ] && break; sleep 1; done
  kill "$agent" 2> /dev/null
  "$exe" bench peer --mode rdma-engine --listen 10.77.0.2:18950 --max-size 16M --wait-s 120 \
    >> "$out/bulk-peer.log" 2>&1 || echo "second bulk peer failed"
fi
exit "$rc"
EOF
# Both VMs' vCPUs run on this machine's cores (TCG): sample each QEMU process's CPU time
# (utime + stime, clock ticks) to learn what a byte over rxe costs the host, from ib_write_bw.
sample_qemu() {
  local i t
  while :; do
    t=$(date +%s.%N)
    for i in 0 1; do
      local pid stat
      # QEMU itself, not the `timeout` that started it; none yet (or gone): "- -"
      pid=$(pgrep -f "^qemu-system-x86_64 .*sr\.node=$i " | head -1 || true)
      stat=$( [[ -n $pid ]] && cut -d' ' -f14,15 "/proc/$pid/stat" 2> /dev/null || true)
      t+=" ${stat:-- -}"
    done
    echo "$t"
    sleep 0.2
  done > "$out/qemu-cpu.log"
}
sample_qemu &
sampler=$!
trap 'kill "$sampler" 2> /dev/null || true' EXIT
rc=0
SIM_OUT=$out ci/softroce.sh run --vms 2 --timeout 2400 --share "$out" \
  --env SIM_OUT --env SIM_CONCURRENCY --env SIM_REPEATS -- "bash $out/vm.sh" || rc=$?
kill "$sampler" 2> /dev/null || true
python3 - "$out" << 'PY' || true
import glob, json, os, statistics, sys
out = sys.argv[1]
tick_ns = 1e9 / os.sysconf("SC_CLK_TCK")
rows = []
for line in open(f"{out}/qemu-cpu.log"):
    f = line.split()
    if len(f) == 5 and "-" not in f[1:]:
        rows.append((float(f[0]), int(f[1]) + int(f[2]), int(f[3]) + int(f[4])))
def at(t):  # CPU ticks of both VMs at host time t (the nearest sample at or after it)
    return next(((a, b) for (s, a, b) in rows if s >= t), None)
with open(f"{out}/host-cpu.txt", "w") as w:
    try:
        t0 = os.path.getmtime(f"{out}/mark-ib_write_bw-start")
        t1 = os.path.getmtime(f"{out}/mark-ib_write_bw-end")
        a, b = at(t0), at(t1)
        if a is None or b is None:
            raise ValueError("qemu-cpu.log has no sample of both VMs at or after the marks")
        text = open(f"{out}/perftest.txt").read()
        # the -n of the ib_write_bw line: its iterations of 1 MiB
        head = next(l for l in text.splitlines() if l.startswith("== ib_write_bw"))
        size, iters = int(head.split("-s ")[1].split()[0]), int(head.split("-n ")[1].split()[0])
        moved = size * iters
        cpu0, cpu1 = (b[0] - a[0]) * tick_ns, (b[1] - a[1]) * tick_ns
        print(f"ib_write_bw {size} B x {iters} ({moved} B) over {t1 - t0:.2f} s: host CPU of VM 0 "
              f"{cpu0 / 1e9:.2f} s ({cpu0 / (t1 - t0) / 1e9:.2f} cores), VM 1 {cpu1 / 1e9:.2f} s "
              f"({cpu1 / (t1 - t0) / 1e9:.2f} cores)", file=w)
        print(f"host ns per byte moved: VM 0 (requester) {cpu0 / moved:.3f}, VM 1 (responder) "
              f"{cpu1 / moved:.3f}, per side {(cpu0 + cpu1) / 2 / moved:.3f}", file=w)
    except Exception as e:  # noqa: BLE001 -- a summary, not the measurement
        print(f"no host CPU figure: {e}", file=w)
    p50 = lambda f: next(r["omnirig"]["p50_us"] for r in json.load(open(f))["rows"] if r["op"] == "write")
    hot = [p50(f) for f in sorted(glob.glob(f"{out}/wake-gap0-*.json"))]
    cold = [p50(f) for f in sorted(glob.glob(f"{out}/wake-gap10000-*.json"))]
    # the engine's 1 MiB rates of a bulk bench (MB/s by op) and its rows
    def rates(name):
        rows = json.load(open(f"{out}/{name}"))["rows"]
        return {r["op"]: r["omnirig"]["gbps"] * 1e3 for r in rows if r["size"] == 1 << 20}, rows
    try:
        fig, rows_ = rates("bulk.json")
        base = next((r["baseline"]["gbps"] * 1e3 for r in rows_ if r["op"] == "write-x16"), None)
        print("engine rdma 1 MiB writes VM 0 -> VM 1, MB/s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in fig.items())
              + (f"; ib_write_bw in the same run {base:.2f}" if base else ""), file=w)
        x16 = fig["write-x16"]
        print(f"the link as the engine sees it (write-x16): {x16 * 1e6 / 1e9 * 8:.4f} Gb/s, "
              f"{1e3 / x16:.3f} ns per byte", file=w)
    except Exception as e:  # noqa: BLE001
        print(f"no engine bulk figure: {e}", file=w)
    if hot and cold:
        h, c = statistics.median(hot), statistics.median(cold)
        print(f"rdma 4 KiB write VM 0 -> VM 1, p50 us: back to back {[round(x, 1) for x in hot]}, after 10 ms {[round(x, 1) for x in cold]}; "
              f"medians {h:.1f} and {c:.1f}: wake_us {(c - h) / 2:.1f} (half: a cold write wakes both ends)",
              file=w)
    try:
        after, _ = rates("bulk-after.json")
        with open(f"{out}/drift.txt", "w") as d:
            print(f"drift over the runs: the engine's write-x16 {x16:.2f} -> {after['write-x16']:.2f} MB/s "
                  f"({(after['write-x16'] - x16) / x16:+.0%}), write {fig['write']:.2f} -> {after['write']:.2f} "
                  f"({(after['write'] - fig['write']) / fig['write']:+.0%})", file=d)
        print(open(f"{out}/drift.txt").read(), end="", file=w)
    except Exception as e:  # noqa: BLE001
        print(f"no drift figure: {e}", file=w)
print(open(f"{out}/host-cpu.txt").read(), end="")
PY
# The model, from this boot's figures alone: six fabrics, the same placement and the same
# calibrated `cpu:` costs, differing in the link's rate, in where a byte's copy runs and in
# which measured CPU terms they charge.
#   A: the link at ib_write_bw's rate, each VM a host of its own (the committed structure);
#   E: the link at the engine's write-x16 rate (bulk.json), each VM a host of its own;
#   W: as E, with the wake by time parked (`wake_after`) where the calibration measured it;
#   S: as E, but both VMs one host of this machine's cores (TCG runs every vCPU on them),
#      a byte's copy charged on each side at the responder's host CPU per byte during
#      ib_write_bw (VM 1 sleeps in that test; VM 0's figure includes perftest's busy-poll).
#   Q: as E, with the whole-tensor check (`check_ns_per_byte`, `check_us`) and the packet's
#      decode at the fence (`packet_us`, `packet_entry_us`) that VM 0's calibration measured:
#      tcp's fabric Q less `write_us`, which is a tcp frame's cost (ci/sim-validate-tcp.sh).
#   R: as Q, the engine's write-x16 rate and every calibrated cost the mean of those measured
#      before and after the runs (bulk-after.json, cal-after/): a host whose speed drifts
#      over the boot is met halfway.
# Each is set against this run's reports (`simulate --measured`) in predicted/.
python3 - "$out" "$(nproc)" << 'PY' && fabrics=ok || { fabrics=; echo "no fabrics: a figure is missing"; }
import json, os, re, sys
sys.path.insert(0, "ci")
from sim_fabric import check, cpu_section, mean_calibration, packet, wake_after
out, cores = sys.argv[1], int(sys.argv[2])
perf = open(f"{out}/perftest.txt").read()
def column(tool, name):  # the figure under `name` in the result line after tool's header
    block = perf.split(f"== {tool}")[1]
    lines = block.splitlines()
    i = next(i for i, l in enumerate(lines) if name in l)
    # column names: `#bytes`, or words ending in a bracketed unit (`BW average[MB/sec]`)
    head = [h.strip() for h in re.findall(r"#\w+|[^#\]]+?\[[^\]]*\]", lines[i])]
    return float(lines[i + 1].split()[head.index(name)])
bw_mib = column("ib_write_bw", "BW average[MB/sec]")
lat = column("ib_write_lat", "t_typical[usec]")
def write_x16(name):  # the engine's write-x16 rate in a bulk bench, GB/s (None: not there)
    rows = json.load(open(f"{out}/{name}"))["rows"]
    return next((r["omnirig"]["gbps"] for r in rows if r["op"] == "write-x16"), None)
x16 = write_x16("bulk.json")
host = open(f"{out}/host-cpu.txt").read()
responder = float(re.search(r"VM 1 \(responder\) ([0-9.]+)", host).group(1))
cpu = open(f"{out}/cal/cpu.yaml").read()
bw_gbps = bw_mib * 1048576 * 8 / 1e9
# the figures of fabric R: the write-x16 rate and the calibration, each the mean of before
# and after the runs, where both were measured again
both = None
if os.path.exists(f"{out}/bulk-after.json") and os.path.exists(f"{out}/cal-after/cpu.yaml"):
    x16_after = write_x16("bulk-after.json")
    try:
        if x16_after:
            both = ((x16 + x16_after) / 2, mean_calibration(cpu, open(f"{out}/cal-after/cpu.yaml").read()))
    except ValueError as e:  # the other fabrics still stand
        print(f"no fabric R: {e}")
variants = {
    "A": (bw_gbps, 1e9 / (bw_mib * 1048576), False,
          f"link at ib_write_bw's {bw_mib:.2f} MiB/s; copy per side at that rate; a host per VM"),
    "E": (x16 * 8, 1 / x16, False,
          f"link at the engine's write-x16 {x16 * 1e3:.2f} MB/s; copy per side at that rate; a host per VM"),
    "W": (x16 * 8, 1 / x16, False,
          f"as E, the wake by time parked (wake_after, the calibration's tcp writes in VM 0)"),
    "S": (x16 * 8, responder, True,
          f"link at the engine's write-x16 {x16 * 1e3:.2f} MB/s; copy per side {responder:.3f} ns/B "
          f"(the responder's host CPU during ib_write_bw); both VMs one host of {cores} cores"),
    "Q": (x16 * 8, 1 / x16, False,
          f"as E, the whole-tensor check and the packet's decode at their measured costs (VM 0)"),
}
if both:
    variants["R"] = (both[0] * 8, 1 / both[0], False,
                     f"as Q, the write-x16 rate ({both[0] * 1e3:.2f} MB/s) and the calibration the mean "
                     f"of before and after the runs")
os.makedirs(f"{out}/predicted", exist_ok=True)
for name, (gbps, copy, shared, why) in variants.items():
    cal = both[1] if name == "R" else cpu
    cal_from = "the mean of cal/cpu.yaml and cal-after/cpu.yaml" if name == "R" else "cal/cpu.yaml"
    measured = name in ("Q", "R")
    if (name == "W" and not wake_after(cal)) or (measured and not (check(cal) and packet(cal))):
        continue
    hosts = (f"    - {{ name: machine, cores: {cores}, nodes: [vm0, vm1] }}\n" if shared else
             "    - { name: vm0, cores: 2, nodes: [vm0] }\n    - { name: vm1, cores: 2, nodes: [vm1] }\n")
    link = f"{gbps:.4f}"
    text = f"""# Fabric {name}, written by ci/sim-validate-softroce.sh from this boot's figures: {why}.
# ib_write_lat t_typical {lat:.2f} us one way, less 1 us in each rxe device.
# `cpu:` from `omnirig simulate --calibrate-cpu` in VM 0 ({cal_from}).
# The engine's rdma defaults: 4 MiB slices, two in flight.
slice_bytes: 4194304
in_flight: 2
seed: 1
nodes:
  - {{ name: vm0, nics: [{{ name: rxe0, gbps: {link}, latency_us: 1 }}], local: {{ gbps: {link}, latency_us: 1 }} }}
  - {{ name: vm1, nics: [{{ name: rxe0, gbps: {link}, latency_us: 1 }}], local: {{ gbps: {link}, latency_us: 1 }} }}
links: [{{ between: [vm0, vm1], gbps: {link}, latency_us: {lat - 2:.2f} }}]
placement: {{ encoder: vm0, thinker_prefill: vm1, thinker_decode: vm0, talker: vm1, code2wav: vm0 }}
""" + cpu_section(cal, f"{copy:.3f}", hosts, curve=name == "W",
                  checked=measured, packets=measured)
    open(f"{out}/predicted/fabric-{name}.yaml", "w").write(text)
PY
if [[ -n ${fabrics:-} ]] && compgen -G "$out/m-c*-*/report.json" > /dev/null; then
  for f in A E W S Q R; do
    [[ -e $out/predicted/fabric-$f.yaml ]] || continue
    target/release/omnirig simulate --fabric "$out/predicted/fabric-$f.yaml" \
      --scenario harness/scenarios/sim-validate.yaml --concurrency "${SIM_CONCURRENCY// /,}" \
      --measured "$out"/m-c*-*/report.json --out "$out/predicted/$f" > "$out/predicted/$f.log" 2>&1 \
      && echo "fabric $f: $(tail -1 "$out/predicted/$f/simulate.md")" \
      || echo "fabric $f: simulate failed (predicted/$f.log)"
  done
fi
echo "sim-validate-softroce: took $((SECONDS - t0)) s; results in $out"
exit $rc
