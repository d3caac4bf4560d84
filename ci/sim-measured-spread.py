#!/usr/bin/env python3
"""How far apart the measured medians of several sets of runs are (docs/sim.md).

    ci/sim-measured-spread.py SET SET [SET ...]

Each SET is a folder of one window's (or one boot's) measured reports of the scale model's
validation scenario: `m-cC-I.json` (or `m-cC-I.json.gz`, as committed), or `m-cC-I/report.json` as ci/sim-validate-tcp.sh and
ci/sim-validate-softroce.sh leave them. For each of the 18 figures `simulate --measured`
scores (per hop the transfer and handoff p50, and end to end, at concurrency 1 and 4) it
prints the median over the set's runs, per set, and max/min - 1 across the sets. A figure
whose medians differ by more than 20% between sets cannot be predicted within 20% of both.

It then takes each set's medians as a prediction of every other set's and scores it as
`simulate --measured` does (within 20% of the measured median): what a model that
reproduced one window exactly would score on the others, the ceiling the machine's own
repeatability puts on any prediction that does not follow it from window to window.
"""
import glob
import gzip
import json
import statistics
import sys

HOPS = ("encoder_embeddings", "kv_cache", "thinker_to_talker", "talker_to_code2wav")


def medians(folder):
    out = {}
    for c in (1, 4):
        files = sorted(glob.glob(f"{folder}/m-c{c}-*.json")) or sorted(
            glob.glob(f"{folder}/m-c{c}-*.json.gz")) or sorted(
            glob.glob(f"{folder}/m-c{c}-*/report.json"))
        if not files:
            sys.exit(f"{folder}: no measured reports at concurrency {c} (m-c{c}-*.json)")
        reports = [json.load(gzip.open(f) if f.endswith(".gz") else open(f)) for f in files]
        for r, f in zip(reports, files):
            if r.get("concurrency") != c:
                sys.exit(f"{f}: concurrency {r.get('concurrency')}, named {c}")
        for hop in HOPS:
            for fig in ("transfer", "handoff"):
                out[f"c{c} {hop} {fig} p50"] = statistics.median(
                    next(h for h in r["hops"] if h["hop"] == hop)[f"{fig}_ms_p50"] for r in reports)
        out[f"c{c} e2e p50"] = statistics.median(r["summary"]["e2e_p50_ms"] for r in reports)
    return out


def main():
    sets = sys.argv[1:]
    if len(sets) < 2:
        sys.exit(__doc__)
    meds = [medians(s) for s in sets]
    print("| figure | " + " | ".join(f"set {i + 1} ms" for i in range(len(sets))) + " | max/min |")
    print("|---|" + "---|" * len(sets) + "---|")
    over = 0
    for k in meds[0]:
        v = [m[k] for m in meds]
        spread = max(v) / min(v) - 1
        over += spread > 0.2
        print(f"| {k} | " + " | ".join(f"{x:.3f}" for x in v) + f" | +{spread * 100:.0f}% |")
    print()
    for i, s in enumerate(sets):
        print(f"set {i + 1}: {s}")
    print(f"{over} of {len(meds[0])} figures' medians differ by more than 20% between the sets.")
    print()
    # each set's medians as the prediction of each other set's, scored as simulate scores
    scores = [sum(abs(p[k] - m[k]) <= 0.2 * m[k] for k in m)
              for i, p in enumerate(meds) for j, m in enumerate(meds) if i != j]
    scores.sort()
    print(f"one set's medians as the prediction of another's ({len(scores)} pairs): "
          f"{statistics.median(scores):g} of {len(meds[0])} within 20% at the median, "
          f"{scores[0]} to {scores[-1]}; every figure in {scores.count(len(meds[0]))} pairs.")


main()
