#!/usr/bin/env bash
# The scale model's measurements over tcp between processes on this machine (docs/sim.md,
# "Validation over tcp between processes"), all in one window, so the fabric is built from
# figures measured minutes before the runs it is set against (a fabric calibrated two days
# earlier missed the bulk hops by twice as much):
#   - the engine's own tcp link: `omnirig bench transfer --transport tcp --sizes 4K,16M` on the
#     multi-thread runtime `omnirig run` uses (a 4 KiB write's round trip, 16 MiB writes over
#     the engine's 4 streams);
#   - `omnirig simulate --calibrate-cpu`: this machine's CPU costs and a parked process's wake;
#   - `omnirig run DIR/scenario-cC.yaml --processes --transport tcp --report` of the scenarios
#     that `simulate --scenarios-out` writes for harness/scenarios/sim-validate.yaml, REPEATS
#     times at each concurrency (the measured reports `simulate --measured` takes).
#
#   ci/sim-validate-tcp.sh [OUT]   OUT (default $TMPDIR/omnirig-sim-tcp) gets link.json,
#                                  cal/cpu.yaml, cal/cpu-calibration.json, m-cC-I/report.json,
#                                  load.txt (the load average around each step), link-after.json
#                                  and drift.txt (the link measured again after the runs, against
#                                  before: how far the host moved meanwhile), cal-after/ (the
#                                  calibration again after the runs) and predicted/ (fabrics T,
#                                  W, E, C, K, L, P, Q, R, S and V from these figures, each scored
#                                  against the reports)
#   CONCURRENCY="1 4" (default), REPEATS=3 (default), ROUNDS=16 (default: each run's requests,
#   the scenario's three repeated until at least ROUNDS times the concurrency, 18 at 1 and 66
#   at 4; with 6 and 18, a run's p50 moved by up to 51% between one window's runs),
#   CHECK_NICE=N (default 10): the runs' `--check-nice`, the nice value of the stages' checks,
#   and the fabrics' `cpu.check_nice` (0: the checks at the data plane's priority, as every
#   window before 2026-12-07 measured them),
#   OMNIRIG=PATH: a release binary built elsewhere (a machine without a Rust toolchain);
#   without it the script builds one
# Run it on a quiet machine: the five stage processes share its cores with whatever else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${TMPDIR:-/tmp}/omnirig-sim-tcp}")
rm -rf "$out"
mkdir -p "$out"
t0=$SECONDS
if [[ -n ${OMNIRIG:-} ]]; then
  exe=$(readlink -f "$OMNIRIG")
else
  cargo build --release --locked --quiet --bin omnirig
  exe=target/release/omnirig
fi
conc=${CONCURRENCY:-1 4}
repeats=${REPEATS:-3}
rounds=${ROUNDS:-16}
nice=${CHECK_NICE:-10}
load() { echo "$1: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/load.txt"; }
load "$(nproc) cores, checks at nice $nice, built in $((SECONDS - t0)) s"

t=$SECONDS
"$exe" bench transfer --transport tcp --runtime multi --sizes 4K,16M --json "$out/link.json" \
  > "$out/link.log" 2>&1 || { echo "the link's bench failed:"; tail "$out/link.log"; exit 1; }
load "link"
echo "link: $((SECONDS - t)) s"
t=$SECONDS
"$exe" simulate --calibrate-cpu --out "$out/cal" > "$out/calibrate.log" 2>&1 \
  || { echo "the calibration failed:"; tail "$out/calibrate.log"; exit 1; }
load "calibration"
echo "calibration: $((SECONDS - t)) s"
"$exe" simulate --scenario harness/scenarios/sim-validate.yaml --concurrency "${conc// /,}" \
  --rounds "$rounds" --scenarios-out "$out/scenarios" > /dev/null
rc=0
# The concurrencies take turns, so a host that slows mid-window slows both alike.
for i in $(seq "$repeats"); do
  for c in $conc; do
    t=$SECONDS
    "$exe" run "$out/scenarios/scenario-c$c.yaml" --processes --transport tcp -q --check-nice "$nice" \
      --report "$out/m-c$c-$i" > "$out/run-c$c-$i.log" 2>&1 || rc=1
    load "c$c run $i"
    echo "c$c run $i: $((SECONDS - t)) s, $(grep -m1 'requests ok' "$out/run-c$c-$i.log" || echo failed)"
  done
done

# The link once more after the runs (4 s): the fabric is built from the figures before them,
# so a window whose host changed speed meanwhile says so (drift.txt).
if ! "$exe" bench transfer --transport tcp --runtime multi --sizes 4K,16M \
  --json "$out/link-after.json" > "$out/link-after.log" 2>&1; then
  echo "the link's second bench failed (no drift.txt; the runs are still scored):"
  tail "$out/link-after.log"
  rc=1
else
  load "link after"
fi
# And the calibration once more: fabrics R and S are built from the mean of the figures
# measured on both sides of the runs.
if ! "$exe" simulate --calibrate-cpu --out "$out/cal-after" > "$out/calibrate-after.log" 2>&1; then
  echo "the second calibration failed (no fabric R or S; the others are still scored):"
  tail "$out/calibrate-after.log"
  rm -rf "$out/cal-after"
  rc=1
else
  load "calibration after"
fi

# The model, from this window's figures alone: up to sixteen fabrics, five stage processes as five
# nodes on one host of this machine's cores, the path's latency from the engine's 4 KiB
# round trip and the link at its 16 MiB write rate, differing in what a byte's copy costs,
# the wake, the check, the loopback's capacity and a transfer's threads:
#   T: one socket stream's wall time per byte (the calibration's copy), one wake for any
#      pause (`wake_us`, after 10 ms): the committed structure, harness/fabrics/tcp-localhost.yaml;
#   W: as T, the wake by how long the process was parked (`wake_after`, measured after 1, 10
#      and 100 ms);
#   E: as T, the copy at the engine's own 16 MiB write rate on each side (its 4 streams, as
#      the pipeline moves a bulk transfer);
#   C: as T, a whole tensor's check at the stubs' measured check (`check_ns_per_byte`,
#      `check_us`) instead of the bulk rates;
#   K: as W, with the measured check (C and W together);
#   L: as K, the loopback's capacity (the NICs and the switch) times max(1, cores / 4). The
#      16 MiB write rate is one transfer on 4 streams, whose threads take about 4 cores; on
#      loopback the wire is those cores, so a machine of more cores runs that many such
#      transfers side by side at the full rate (on 2 or 4 cores, L is K);
#   P: as L, each write of a transfer beyond its first at its measured cost (`write_us`:
#      an engine's 32 writes of 4 KiB in one transfer against one write);
#   Q: as P, the packet connector's consumer decoding the packet at the fence (`packet_us`,
#      `packet_entry_us`: msgpack and its entries, timed after a 10 ms pause).
#   R: as Q, every figure (the link's and the calibration's) the mean of the two measured
#      before the runs and the two after them (link-after.json, cal-after/): a host whose
#      speed drifts over the window is met halfway.
#   S: as R, a transfer's copies on min(4, cores) threads a side (`transfer_threads`: the
#      engine's 4 streams on the process's runtime workers, one per core), so while the
#      cores are contended a transfer gets that many shares of them, as Linux shares cores
#      by thread.
#   H: as S, each write beyond a transfer's first to an owner parked 2 ms or more, while a
#      core of its host is idle, pays the calibration's `cold_write_us` (an engine's 32 writes after a 10 ms pause against one
#      write after it): on a virtual machine whose CPUs halt when idle, every handoff of
#      such a transfer wakes a halted CPU (docs/sim.md).
#   O: as S, the copy at its wall time per byte on the engine's 4 streams of 512 KiB writes
#      (the mean of both calibrations' `copy_streams_ns_per_byte`): on two cores the
#      pipeline's bulk KV rate, on 16 three times the engine's (docs/sim.md).
#   G: as S, a transfer's copies at the engine's own CPU time per byte a side, on the threads
#      a side it kept busy, rounded (the mean of both calibrations' `engine_copy_ns_per_byte`
#      and `engine_copy_threads`: its 8 writes of 16 MiB to a peer process, both processes'
#      CPU time read from /proc).
#   J: as G, with H's cold writes.
#   V: as S, the stages' checks at the data plane's priority (`check_nice: 0`) while the runs
#      had them at CHECK_NICE: what the model says without the checks' own pool (no V when
#      CHECK_NICE is 0). Every other fabric has the runs' `check_nice`.
python3 - "$out" "$(nproc)" "$nice" << 'PY'
import json, os, re, sys
sys.path.insert(0, "ci")
from sim_fabric import check, cold_write, cpu_section, mean_calibration, packet, per_write, wake_after
out, cores, nice = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def link(name):  # a link bench's 4 KiB write round trip (us) and 16 MiB write rate (GB/s)
    rows = json.load(open(f"{out}/{name}"))["rows"]
    fig = lambda op, size: next(r["omnirig"] for r in rows if r["op"] == op and r["size"] == size)
    return fig("write", 4096)["p50_us"], fig("write", 16 << 20)["gbps"]
rtt, gbs = link("link.json")
if os.path.exists(f"{out}/link-after.json"):  # the link again after the runs: drift.txt
    r1, g1 = link("link-after.json")
    drift = (f"drift over the runs: 4 KiB round trip {rtt:.1f} -> {r1:.1f} us ({(r1 - rtt) / rtt:+.0%}), "
             f"16 MiB writes {gbs:.3f} -> {g1:.3f} GB/s ({(g1 - gbs) / gbs:+.0%})")
    open(f"{out}/drift.txt", "w").write(drift + "\n")
    print(drift)
# The figures a fabric is built from: those measured before the runs, and where the link and
# the calibration were measured again after them, the mean of both.
sources = {"before": (rtt, gbs, open(f"{out}/cal/cpu.yaml").read(),
                      "link.json", "cal/cpu.yaml")}
if os.path.exists(f"{out}/link-after.json") and os.path.exists(f"{out}/cal-after/cpu.yaml"):
    try:
        sources["both"] = ((rtt + r1) / 2, (gbs + g1) / 2,
                           mean_calibration(sources["before"][2], open(f"{out}/cal-after/cpu.yaml").read()),
                           "the mean of link.json and link-after.json",
                           "the mean of cal/cpu.yaml and cal-after/cpu.yaml")
    except ValueError as e:  # the other fabrics still stand
        print(f"no fabric R or S: {e}")
copy_of = lambda cpu: float(re.search(r"^  copy_ns_per_byte: ([0-9.]+)", cpu, re.M).group(1))
def on_streams():  # the calibrations' copy on the engine's 4 streams (the mean of both), or None
    got = [json.load(open(f"{out}/{d}/cpu-calibration.json")).get("copy_streams_ns_per_byte")
           for d in ("cal", "cal-after") if os.path.exists(f"{out}/{d}/cpu-calibration.json")]
    return sum(got) / len(got) if len(got) == 2 and None not in got else None
# name: (figures, copy ns/B (None: the calibration's), wake by time parked, measured check,
# loopback capacity factor, each write's cost, a packet's decode, a transfer's threads a side
# (None: one), why)
scale = max(1, cores // 4)
threads = min(4, cores)
variants = {
    "T": ("before", None, False, False, 1, False, False, None, f"copy at one socket stream's wall time, one wake"),
    "W": ("before", None, True, False, 1, False, False, None, f"as T, the wake by time parked (wake_after)"),
    "E": ("before", 1 / gbs, False, False, 1, False, False, None, f"copy per side at the engine's 16 MiB write rate ({gbs:.3f} GB/s), one wake"),
    "C": ("before", None, False, True, 1, False, False, None, f"as T, a whole tensor's check at the stubs' measured check"),
    "K": ("before", None, True, True, 1, False, False, None, f"as W, with the measured check"),
    "L": ("before", None, True, True, scale, False, False, None, f"as K, the loopback's capacity times max(1, cores / 4) = {scale}"),
    "P": ("before", None, True, True, scale, True, False, None, f"as L, each write beyond a transfer's first at its measured cost"),
    "Q": ("before", None, True, True, scale, True, True, None, f"as P, a packet's decode at the fence at its measured cost"),
    "R": ("both", None, True, True, scale, True, True, None, f"as Q, every figure the mean of those measured before and after the runs"),
    "S": ("both", None, True, True, scale, True, True, threads, f"as R, a transfer's copies on min(4, cores) = {threads} threads a side"),
}
if on_streams() is not None:
    variants["O"] = ("both", on_streams(), True, True, scale, True, True, threads,
                     "as S, the copy at its wall time on the engine's 4 streams of 512 KiB writes")
def engine_copy():  # the engine's copy a side (ns/B) and its threads a side (the mean of both), or None
    got = [json.load(open(f"{out}/{d}/cpu-calibration.json"))
           for d in ("cal", "cal-after") if os.path.exists(f"{out}/{d}/cpu-calibration.json")]
    got = [(c.get("engine_copy_ns_per_byte", 0), c.get("engine_copy_threads", 0)) for c in got]
    if len(got) != 2 or any(ns <= 0 or th <= 0 for ns, th in got):
        return None
    return sum(ns for ns, _ in got) / 2, sum(th for _, th in got) / 2
if engine_copy() is not None:
    ns, th = engine_copy()
    side = max(1, min(16, round(th)))
    variants["G"] = variants["S"][:1] + (ns,) + variants["S"][2:7] + (side, f"as S, the copy at the engine's own CPU time a side ({ns:.4f} ns/B) on the {th:.2f} threads a side it kept busy, rounded to {side}")
    variants["J"] = variants["G"][:-1] + ("as G, with H's cold writes",)
# H: S with each write of a transfer to a long-parked owner at its measured extra cost.
variants["H"] = variants["S"][:-1] + ("as S, each write beyond a transfer's first to an owner parked 2 ms or more, a core of its host idle, at its measured extra cost (cold_write_us)",)
cold_of = {"H", "J"}
# Every fabric has the runs' nice value but V, which is S without the checks' priority.
nice_of = {}
if nice:
    variants["V"] = variants["S"][:-1] + (f"as S, the checks at the data plane's priority (check_nice: 0) while the runs had them at nice {nice}",)
    nice_of["V"] = 0
os.makedirs(f"{out}/predicted", exist_ok=True)
names = ["encoder", "thinker_prefill", "thinker_decode", "talker", "code2wav"]
for name, (figures, copy, curve, checked, scale, writes, packets, threads, why) in variants.items():
    if figures not in sources:
        continue
    rtt_f, gbs_f, cpu, link_from, cpu_from = sources[figures]
    copy = copy_of(cpu) if copy is None else copy
    switch = max(rtt_f / 2 - 4, 0)  # one way: 2 us in each process's socket, the rest in the loopback
    gbps = f"{gbs_f * 8 * scale:.3f}"  # the loopback's NICs and switch
    if ((curve and not wake_after(cpu)) or (checked and not check(cpu))
            or (writes and not per_write(cpu)) or (packets and not packet(cpu))
            or (name in cold_of and not cold_write(cpu))):
        continue
    nodes = "".join(f"  - {{ name: {n}, nics: [{{ name: lo, gbps: {gbps}, latency_us: 2 }}], "
                    f"local: {{ gbps: 80, latency_us: 1 }} }}\n" for n in names)
    text = f"""# Fabric {name}, written by ci/sim-validate-tcp.sh from this window's figures: {why}.
# The engine's tcp link ({link_from}):
# a 4 KiB write's round trip p50 {rtt_f:.1f} us, 16 MiB writes {gbs_f:.3f} GB/s.
# `cpu:` from `omnirig simulate --calibrate-cpu` ({cpu_from}),
# a byte's copy at {copy:.4f} ns. The engine's tcp defaults: 512 KiB slices, 4 streams.
slice_bytes: 524288
in_flight: 4
seed: 1
nodes:
{nodes}switch: {{ gbps: {gbps}, latency_us: {switch:.2f} }}
placement: {{ {", ".join(f"{n}: {n}" for n in names)} }}
""" + cpu_section(cpu, f"{copy:.4f}",
                  f"    - {{ name: localhost, cores: {cores}, nodes: [{', '.join(names)}] }}\n", curve,
                  checked, writes, packets, threads, nice_of.get(name, nice), name in cold_of)
    open(f"{out}/predicted/fabric-{name}.yaml", "w").write(text)
print(f"link: 4 KiB round trip {rtt:.1f} us, 16 MiB writes {gbs:.3f} GB/s")
PY
if compgen -G "$out/m-c*-*/report.json" > /dev/null; then
  for f in T W E C K L P Q R S V O H G J; do
    [[ -e $out/predicted/fabric-$f.yaml ]] || continue
    "$exe" simulate --fabric "$out/predicted/fabric-$f.yaml" \
      --scenario harness/scenarios/sim-validate.yaml --concurrency "${conc// /,}" \
      --rounds "$rounds" --measured "$out"/m-c*-*/report.json --out "$out/predicted/$f" > "$out/predicted/$f.log" 2>&1 \
      && echo "fabric $f: $(tail -1 "$out/predicted/$f/simulate.md")" \
      || echo "fabric $f: simulate failed (predicted/$f.log)"
  done
fi
echo "sim-validate-tcp: took $((SECONDS - t0)) s; results in $out"
exit $rc
