#!/usr/bin/env python3
"""Check the committed golden safetensors files from Python.

For every `<stem>.safetensors` under the golden folder with a
`<stem>.packet.json` next to it:

- the reference `safetensors` library opens the file and lists the same
  tensors and metadata as the raw header says;
- every packet entry's dtype, shape and byte length match the file;
- XXH3-128 (seed 0) over the tensor's exact raw bytes equals the packet's
  digest (the same digest omnirig computes in Rust);
- tensors of dtypes numpy has (not BF16) are also loaded through
  `safetensors.numpy` and must have the very same bytes.

BF16 has no numpy dtype, so its bytes are sliced from the file using the
header's data_offsets; the digest is over those bytes, never over a
converted array.

Usage: check_golden_safetensors.py [GOLDEN_DIR]   (default: <repo>/golden)
Needs: pip install safetensors numpy xxhash
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np
import xxhash
from safetensors import safe_open
from safetensors.numpy import load_file

NUMPY_DTYPES = {"F16", "F32", "F64", "I64", "I32", "I16", "U8"}
ELEMENT_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "U8": 1}
REQUIRED = {
    "thinker_to_talker": [
        "embed.prefill",
        "embed.tts_bos",
        "embed.tts_eos",
        "embed.tts_pad",
        "hidden_states.output",
    ],
    "talker_to_code2wav": ["codes.audio"],
}


def read_raw(path):
    """Header dict and the data section, from the bytes on disk."""
    blob = path.read_bytes()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_len])
    return header, blob[8 + header_len :]


def check(st_path, packet_path):
    errors = []
    packet = json.loads(packet_path.read_text())
    header, data = read_raw(st_path)
    metadata = header.pop("__metadata__", {})

    if packet.get("packet_version") != 1:
        errors.append(f"packet_version is {packet.get('packet_version')!r}, expected 1")
    names = [e["name"] for e in packet["entries"]]
    for required in REQUIRED.get(packet["payload_kind"], []):
        if required not in names:
            errors.append(f"packet lacks required entry {required!r}")

    with safe_open(str(st_path), framework="numpy") as f:
        if sorted(f.keys()) != sorted(header):
            errors.append(f"safetensors lists {sorted(f.keys())}, header has {sorted(header)}")
        if (f.metadata() or {}) != metadata:
            errors.append(f"metadata differs: {f.metadata()} vs {metadata}")

    loaded = {}
    if all(rec["dtype"] in NUMPY_DTYPES for rec in header.values()):
        loaded = load_file(str(st_path))

    for i, entry in enumerate(packet["entries"]):
        name = entry["name"]
        rec = header.get(name)
        if rec is None:
            errors.append(f"entries[{i}] {name!r}: not in the file")
            continue
        begin, end = rec["data_offsets"]
        raw = data[begin:end]
        if rec["dtype"] != entry["dtype"]:
            errors.append(f"entries[{i}].dtype: packet {entry['dtype']}, file {rec['dtype']}")
        if rec["shape"] != entry["shape"]:
            errors.append(f"entries[{i}].shape: packet {entry['shape']}, file {rec['shape']}")
        expected_len = ELEMENT_BYTES[rec["dtype"]] * int(np.prod(rec["shape"], dtype=np.uint64))
        if not (len(raw) == end - begin == entry["byte_length"] == expected_len):
            errors.append(
                f"entries[{i}].byte_length: packet {entry['byte_length']}, span {end - begin}, "
                f"dtype x shape {expected_len}"
            )
        digest = xxhash.xxh3_128(raw).hexdigest()
        if digest != entry["digest"]:
            errors.append(f"entries[{i}].digest: packet {entry['digest']}, file bytes {digest}")
        if name in loaded:
            arr = loaded[name]
            le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            if le.tobytes() != raw:
                errors.append(f"entries[{i}] {name!r}: safetensors.numpy bytes differ from the raw span")
            if name == "codes.audio" and not ((arr >= 0).all() and (arr < 2048).all()):
                errors.append(f"entries[{i}] codes.audio: codes outside 0..2048")
    return errors, len(packet["entries"])


def main():
    golden = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "golden"
    files = sorted(golden.glob("*.safetensors"))
    if not files:
        print(f"no safetensors files under {golden}", file=sys.stderr)
        return 1
    failed = 0
    for st_path in files:
        packet_path = st_path.with_name(st_path.name[: -len(".safetensors")] + ".packet.json")
        if not packet_path.exists():
            print(f"FAIL {st_path.name}: no {packet_path.name} next to it")
            failed += 1
            continue
        errors, count = check(st_path, packet_path)
        if errors:
            failed += 1
            print(f"FAIL {st_path.name}")
            for e in errors:
                print(f"  {e}")
        else:
            print(f"ok   {st_path.name}: {count} tensors, digests match {packet_path.name}")
    print(f"{len(files) - failed}/{len(files)} golden files verified")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
