"""The `cpu:` section that ci/sim-validate-tcp.sh and ci/sim-validate-softroce.sh write into
the fabrics they build, from `omnirig simulate --calibrate-cpu`'s cpu.yaml (docs/sim.md)."""
import re


def _lines(cal, pattern):
    """The lines of calibration text `cal` that `pattern` matches, as written; "" where there
    are none (a calibration made before that figure was measured)."""
    m = re.search(pattern, cal, re.M)
    return m.group(0) if m else ""


def wake_after(cal):
    """The calibration's wake by time parked, its block as written."""
    return _lines(cal, r"^  wake_after:\n(?:    - .*\n)+")


def check(cal):
    """The calibration's whole-tensor check (rate and fixed cost), its lines as written."""
    return _lines(cal, r"^  check_ns_per_byte: .*\n  check_us: .*\n")


def per_write(cal):
    """The calibration's cost of each write beyond a transfer's first, its line as written."""
    return _lines(cal, r"^  write_us: .*\n")


def cold_write(cal):
    """The calibration's cost of each write beyond a transfer's first to an owner parked for
    long (a halted CPU woken for each), its line as written."""
    return _lines(cal, r"^  cold_write_us: .*\n")


def packet(cal):
    """The calibration's decode of a packet at the fence (per packet, per entry), its lines as
    written."""
    return _lines(cal, r"^  packet_us: .*\n  packet_entry_us: .*\n")


def cpu_section(cal, copy, hosts, curve=False, checked=False, writes=False, packets=False,
                threads=None, check_nice=None, cold=False):
    """The section from calibration text `cal`, with the copy cost `copy` (ns/B, formatted),
    the `hosts` lines (each ending in a newline), the wake by time parked when `curve`, the
    measured whole-tensor check when `checked`, each write's own cost when `writes`, a
    packet's decode when `packets`, and a transfer's copies on `threads` threads a side
    (`transfer_threads`) when set, the stages' checks at nice `check_nice` when set (the
    model's default otherwise: `omnirig run`'s, 10), and each write of a transfer to a
    long-parked owner at its measured extra cost (`cold_write_us`) when `cold`."""
    val = lambda k: re.search(rf"^  {k}: ([0-9.]+)", cal, re.M).group(1)
    return f"""cpu:
  generate_ns_per_byte: {val("generate_ns_per_byte")}
  digest_ns_per_byte: {val("digest_ns_per_byte")}
  copy_ns_per_byte: {copy}
  message_us: {val("message_us")}
{per_write(cal) if writes else ""}{cold_write(cal) if cold else ""}{f"  transfer_threads: {threads}{chr(10)}" if threads else ""}{packet(cal) if packets else ""}  kv_check_ns_per_byte: {val("kv_check_ns_per_byte")}
{check(cal) if checked else ""}{f"  check_nice: {check_nice}{chr(10)}" if check_nice is not None else ""}  wake_us: {val("wake_us")}
{wake_after(cal) if curve else ""}  hosts:
{hosts}"""


_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def mean_calibration(before, after):
    """Calibration text whose every figure is the mean of `before`'s and `after`'s (two
    calibrations of one binary around a window's runs, so a host that changed speed
    meanwhile is met halfway). Comments are `before`'s; the two must have the same lines
    apart from their figures, or this raises ValueError naming the first that differs."""
    b, a = before.splitlines(), after.splitlines()
    if len(b) != len(a):
        raise ValueError(f"the calibrations have {len(b)} and {len(a)} lines")
    out = []
    for x, y in zip(b, a):
        if x.lstrip().startswith("#"):
            out.append(x)
            continue
        if _NUMBER.sub("N", x) != _NUMBER.sub("N", y):
            raise ValueError(f"the calibrations differ beyond their figures: {x!r}, {y!r}")
        ys = iter(_NUMBER.findall(y))

        def mean(m):
            u, v = m.group(0), next(ys)
            if "." not in u and "." not in v:
                if u != v:  # counts (cores, nodes) are the host's, not a speed
                    raise ValueError(f"the calibrations differ in a count: {x!r}, {y!r}")
                return u
            places = max(len(u.partition(".")[2]), len(v.partition(".")[2]))
            return f"{(float(u) + float(v)) / 2:.{places}f}"

        out.append(_NUMBER.sub(mean, x))
    return "\n".join(out) + ("\n" if before.endswith("\n") else "")
