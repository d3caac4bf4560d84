#!/usr/bin/env bash
# Coverage-guided fuzzing of a decoder with AFL++ through cargo-afl (stable toolchain).
#
#   ci/fuzz.sh TARGET SECONDS        TARGET: frame | packet | control
#
# Builds fuzz/ (its own workspace) with `cargo afl build --release`, runs AFL++ for SECONDS
# (non-interactive) from the seeds in fuzz/seeds/TARGET into fuzz/out/TARGET, prints a summary
# of fuzz/out/TARGET/default/fuzzer_stats and exits non-zero if a crash was saved (or if AFL
# did not run). A saved hang is reported but does not fail the run.
#
# Environment:
#   FUZZ_BIN=path    use this instrumented binary, skip building (e.g. a binary built on
#                    another machine by `cargo afl build --release` in fuzz/)
#   AFL_FUZZ=path    use this afl-fuzz instead of `cargo afl fuzz`. cargo-afl 0.18 keeps it at
#                    ~/.local/share/afl.rs/rustc-<version>-<hash>/afl.rs-<afl version>/afl/bin/afl-fuzz
#                    (`cargo afl config --build` installs it; the AFLplusplus/ source tree next
#                    to it holds a copy too). Any AFL++ 4.x afl-fuzz works; it needs no Rust.
#   FUZZ_OUT=dir     output directory (default fuzz/out/TARGET); it is replaced on each run
#   AFL_* variables  passed through to afl-fuzz
#
#   That afl-fuzz links libpython3 (from the machine that built AFL++), so on another machine
#   use a static one with no Python: in a copy of ~/.local/share/afl.rs/AFLplusplus,
#   `rm -f afl-fuzz src/*.o; make afl-fuzz NO_PYTHON=1 STATIC=1`.
#
# From built binaries only (no Rust on the machine), e.g. with everything in fuzz/bin/
# (git-ignored: the three binaries from fuzz/target/release/ and the static afl-fuzz):
#   AFL_FUZZ=fuzz/bin/afl-fuzz FUZZ_BIN=fuzz/bin/packet ci/fuzz.sh packet 600
set -euo pipefail

usage() { echo "usage: $0 frame|packet|control SECONDS" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
target=$1 seconds=$2
case $target in frame|packet|control) ;; *) usage ;; esac
[[ $seconds =~ ^[0-9]+$ && $seconds -gt 0 ]] || usage

root=$(cd "$(dirname "$0")/.." && pwd)
seeds=$root/fuzz/seeds/$target
out=${FUZZ_OUT:-$root/fuzz/out/$target}
[[ -d $seeds ]] || { echo "no seeds in $seeds" >&2; exit 2; }

if [[ -n ${FUZZ_BIN:-} ]]; then
    bin=$FUZZ_BIN
else
    echo "== building fuzz/$target (cargo afl build --release)" >&2
    (cd "$root/fuzz" && CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/fuzz/target} \
        cargo afl build --release --bin "$target")
    bin=${CARGO_TARGET_DIR:-$root/fuzz/target}/release/$target
fi
[[ -x $bin ]] || { echo "$bin is not an executable" >&2; exit 2; }

if [[ -n ${AFL_FUZZ:-} ]]; then
    fuzz=("$AFL_FUZZ")
else
    fuzz=(cargo afl fuzz)
fi

export AFL_NO_UI=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 AFL_NO_AFFINITY=1
# A run is a fresh campaign; never wait for a prompt about a previous one.
rm -rf "$out"
mkdir -p "$(dirname "$out")"

echo "== fuzzing $target for ${seconds}s: $bin" >&2
set +e
# -V: stop after SECONDS; -t: per-input timeout (ms) above which an input counts as a hang.
"${fuzz[@]}" -i "$seeds" -o "$out" -V "$seconds" -t 1000 -- "$bin" > "$out.log" 2>&1
rc=$?
set -e
stats=$out/default/fuzzer_stats
if [[ ! -f $stats ]]; then
    echo "afl-fuzz exited $rc without writing $stats; its log ($out.log):" >&2
    tail -40 "$out.log" >&2
    exit 1
fi
stat() { awk -F' *: *' -v k="$1" '$1 == k { print $2 }' "$stats"; }
echo "== $target: $(stat afl_version), $(stat run_time)s"
for k in run_time execs_done execs_per_sec corpus_count corpus_found edges_found \
         total_edges bitmap_cvg stability saved_crashes saved_hangs peak_rss_mb; do
    printf '%-16s %s\n' "$k" "$(stat "$k")"
done
crashes=$(stat saved_crashes)
if [[ ${crashes:-0} -ne 0 ]]; then
    echo "FAIL: $crashes crash(es) saved in $out/default/crashes/" >&2
    ls "$out/default/crashes/" >&2
    exit 1
fi
if [[ $rc -ne 0 ]]; then
    echo "afl-fuzz exited $rc; its log: $out.log" >&2
    exit 1
fi
echo "OK: no crashes"
