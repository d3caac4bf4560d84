#!/usr/bin/env python3
"""The current path, for real: stage payloads as Python objects over ZMQ.

vLLM-Omni moves stage payloads today as Python objects: pickled (the shared-memory and
async-chunk wire default) and sent over ZMQ. This program does exactly that with the same
bytes omnirig moves, so `omnirig bench hop` and `omnirig bench pipeline` can compare
tensor-native transfer with it in the same run.

Two processes on tcp://127.0.0.1:

  driver    started by omnirig; reads commands (JSON lines) on stdin and answers JSON lines
            on stdout; starts the receiver itself and sends to it.
  receiver  receives, unpickles (the objects are then usable), replies with a 1-frame ack.

One round trip, timed at the sender: build the message (pickle.dumps of a dict of numpy
arrays, with the hop's tensor names, dtypes and shapes) -> send -> the receiver has the
objects (pickle.loads) -> ack. Modes:

  pickle       pickle.dumps(obj, protocol=HIGHEST): every array is copied into the pickle,
               then ZMQ copies the frame (the default wire format).
  pickle5-oob  pickle protocol 5 with out-of-band buffers: the pickle carries only the
               metadata; each array travels as its own ZMQ frame, zero-copy on both sides
               (send(copy=False), recv(copy=False), arrays rebuilt as views on the frames).
  pickle-shm   the same-host wire: the pickle is written into a shared-memory segment
               (multiprocessing.shared_memory, created once) and only its length travels
               over ZMQ; the receiver unpickles straight from the segment. The fair
               comparison for omnirig's shm transport.

bf16 has no numpy dtype: it travels as uint16 of the same shape (the same bytes), as vLLM
does with views. The payload bytes come from a file omnirig wrote (its own fixtures), and the
receiver checks each tensor's XXH3-128 digest on the first (warm-up) message of every series,
so the baseline proves it moved the right bytes.

Commands (stdin, one JSON object per line):
  {"cmd": "load", "manifest": PATH}        -> {"ok": true, "cases": N}
  {"cmd": "hop", "case": I, "mode": M, "iters": N, "warmup": W}
                                           -> {"ok": true, "lat_us": [...], "verified": bool}
  {"cmd": "quit"}
The manifest: {"cases": [{"name", "payload": PATH, "tensors": [{"name", "dtype", "shape",
"offset", "len", "digest"}]}]}.

Needs numpy and pyzmq (xxhash for the digest check): ci/baseline/setup.sh installs them.
"""

import faulthandler
import json
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import zmq

try:
    import xxhash
except ImportError:  # the digest check is skipped, and the result says so
    xxhash = None

DTYPES = {
    "BF16": np.uint16,  # no numpy bf16: same bytes as uint16
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "U8": np.uint8,
}


def load_cases(manifest_path):
    with open(manifest_path) as f:
        manifest = json.load(f)
    cases = []
    for c in manifest["cases"]:
        with open(c["payload"], "rb") as f:
            blob = f.read()
        tensors = {}
        for t in c["tensors"]:
            raw = blob[t["offset"] : t["offset"] + t["len"]]
            # Each tensor its own array (as a model's outputs are), not a view on the blob.
            arr = np.frombuffer(raw, dtype=DTYPES[t["dtype"]]).reshape(t["shape"]).copy()
            tensors[t["name"]] = arr
        cases.append({"name": c["name"], "tensors": tensors, "spec": c["tensors"]})
    return cases


def check(obj, spec):
    """XXH3-128 of every tensor's bytes against omnirig's digests; '' when all match."""
    if xxhash is None:
        return ""
    for t in spec:
        arr = obj["tensors"].get(t["name"])
        if arr is None:
            return "missing " + t["name"]
        if str(arr.dtype) != np.dtype(DTYPES[t["dtype"]]).name or list(arr.shape) != t["shape"]:
            return "%s: %s %s" % (t["name"], arr.dtype, arr.shape)
        if xxhash.xxh3_128(memoryview(np.ascontiguousarray(arr)).cast("B")).hexdigest() != t["digest"]:
            return "digest of %s differs" % t["name"]
    return ""


# The pickle-shm segment: created by the driver, attached by the receiver by name.
SHM_SEGMENT = None


def shm_segment(name=None, size=0):
    global SHM_SEGMENT
    if SHM_SEGMENT is None:
        from multiprocessing import shared_memory, resource_tracker

        if name is None:
            SHM_SEGMENT = shared_memory.SharedMemory(create=True, size=size)
        else:
            SHM_SEGMENT = shared_memory.SharedMemory(name=name)
            # The driver owns it; keep this process's tracker from unlinking it at exit.
            resource_tracker.unregister(SHM_SEGMENT._name, "shared_memory")
    return SHM_SEGMENT


def encode(obj, mode):
    if mode == "pickle-shm":
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        seg = SHM_SEGMENT
        if len(data) > seg.size:
            raise ValueError("pickle of %d bytes exceeds the %d-byte segment" % (len(data), seg.size))
        seg.buf[: len(data)] = data
        return [("%s %d" % (seg.name, len(data))).encode()], True
    if mode == "pickle":
        return [pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)], True
    if mode == "pickle5-oob":
        bufs = []
        head = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        return [head] + [b.raw() for b in bufs], False
    raise ValueError("unknown mode " + mode)


def decode(frames, mode):
    if mode == "pickle-shm":
        name, n = frames[0].decode().split(" ")
        seg = shm_segment(name=name)
        return pickle.loads(seg.buf[: int(n)])
    if mode == "pickle":
        return pickle.loads(frames[0])
    return pickle.loads(frames[0].buffer, buffers=[f.buffer for f in frames[1:]])


# ---------------------------------------------------------------- receiver


def receiver(addr):
    # The receiving side's CPU, when the bench pins each side of a hop (before ZMQ starts its
    # I/O thread, which inherits it).
    cpu = os.environ.get("OMNIRIG_BASELINE_RECEIVER_CPU")
    if cpu:
        os.sched_setaffinity(0, {int(cpu)})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(addr)
    cases = None
    while True:
        frames = sock.recv_multipart(copy=False)
        kind = frames[0].bytes[:1]
        if kind == b"L":  # load the manifest (digests) too
            cases = load_cases(frames[0].bytes[1:].decode())
            sock.send(b"ok")
            continue
        if kind == b"Q":
            sock.send(b"bye")
            return
        # b"M": mode, case, verify, then the message frames.
        _, mode, case, verify = frames[0].bytes.decode().split(" ")
        payload = frames[1:]
        obj = decode([f.bytes if mode in ("pickle", "pickle-shm") else f for f in payload], mode)
        if verify == "1":
            err = check(obj, cases[int(case)]["spec"])
            sock.send(b"bad " + err.encode() if err else b"ok")
        else:
            sock.send(b"k")


# ---------------------------------------------------------------- pipeline (chained stages)


def stage_process(in_addr, out_addr, manifest, hop_index):
    """One pipeline stage: receive the inbound hop's object, then send its outbound hop.

    Messages carry (request id, case); the stage unpickles what arrives (the objects are
    usable), then pickles and sends the request's next hop payload from its preloaded cases.
    The last stage answers the driver with the request id.
    """
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    cases = json.load(open(manifest))["pipeline"]
    payloads = {}
    for ci, c in enumerate(cases):
        if hop_index < len(c["hops"]) and c["hops"][hop_index] is not None:
            payloads[ci] = load_cases(c["hops"][hop_index])[0]["tensors"]
    while True:
        frames = pull.recv_multipart(copy=False)
        head = frames[0].bytes.decode()
        if head == "Q":
            push.send_multipart([b"Q"])
            return
        rid, case, mode = head.split(" ")
        if len(frames) > 1:
            decode([f if mode != "pickle" else f.bytes for f in frames[1:]], mode)
        out = payloads.get(int(case))
        if out is None:
            push.send_multipart([head.encode()])
        else:
            parts, copy = encode({"request_id": rid, "tensors": out}, mode)
            push.send_multipart([head.encode()] + parts, copy=copy)


# ---------------------------------------------------------------- driver


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def recv_from(sock, child, who):
    """`sock.recv()`, or an error naming `who` if its process `child` exited meanwhile (the
    socket's receive timeout makes the check; no cost while messages flow)."""
    while True:
        try:
            return sock.recv()
        except zmq.Again:
            if child.poll() is not None:
                raise RuntimeError("%s exited (status %s)" % (who, child.returncode))


def send_to(sock, parts, copy, child, who):
    """`sock.send_multipart(parts)`, or an error naming `who` if its process `child` exited
    (a PAIR socket whose peer is gone blocks its sender for ever)."""
    while True:
        try:
            return sock.send_multipart(parts, copy=copy)
        except zmq.Again:
            if child.poll() is not None:
                raise RuntimeError("%s exited (status %s)" % (who, child.returncode))


def driver():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.RCVTIMEO, 1000)  # see recv_from
    sock.setsockopt(zmq.SNDTIMEO, 1000)  # see send_to
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "receiver", "tcp://127.0.0.1:%d" % port]
    )
    cases = []
    pipe = None
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            c = cmd["cmd"]
            if c == "load":
                cases = load_cases(cmd["manifest"])
                # Room for the largest case's pickle (the arrays plus a little framing).
                biggest = max((sum(t["len"] for t in c["spec"]) for c in cases), default=0)
                shm_segment(size=biggest + (1 << 20))
                send_to(sock, [b"L" + cmd["manifest"].encode()], True, child, "the receiver")
                recv_from(sock, child, "the receiver")
                reply({"ok": True, "cases": len(cases), "xxhash": xxhash is not None})
            elif c == "hop":
                case, mode = int(cmd["case"]), cmd["mode"]
                obj = {"request_id": "bench-%d" % case, "tensors": cases[case]["tensors"]}
                lat, verified = [], False
                for i in range(cmd["warmup"] + cmd["iters"]):
                    verify = i == 0
                    t = time.perf_counter()
                    parts, copy = encode(obj, mode)
                    send_to(
                        sock,
                        [("M %s %d %d" % (mode, case, verify)).encode()] + parts,
                        copy,
                        child,
                        "the receiver",
                    )
                    ack = recv_from(sock, child, "the receiver")
                    dt = time.perf_counter() - t
                    if verify:
                        if ack != b"ok":
                            reply({"ok": False, "error": ack.decode()})
                            break
                        verified = xxhash is not None
                    if i >= cmd["warmup"]:
                        lat.append(dt * 1e6)
                else:
                    reply({"ok": True, "lat_us": lat, "verified": verified})
            elif c == "pipeline_start":
                pipe = Pipeline(ctx, cmd["manifest"], cmd["hops"])
                reply({"ok": True})
            elif c == "pipeline":
                reply(pipe.run(cmd["cases"], cmd["concurrency"], cmd["mode"], cmd["warmup"]))
            elif c == "quit":
                break
    finally:
        if SHM_SEGMENT is not None:
            SHM_SEGMENT.close()
            SHM_SEGMENT.unlink()
        try:
            sock.send(b"Q")
            sock.recv()
        except Exception:
            pass
        child.wait(timeout=10)
        if pipe is not None:
            pipe.stop()


class Pipeline:
    """The five stages as processes chained by ZMQ PUSH/PULL; the driver is the source
    (it sends the first hop) and the sink (the last stage answers it)."""

    def __init__(self, ctx, manifest, hops):
        self.ctx = ctx
        self.sink = ctx.socket(zmq.PULL)
        sink_port = self.sink.bind_to_random_port("tcp://127.0.0.1")
        ports = []
        for _ in range(hops):
            s = ctx.socket(zmq.PULL)
            ports.append(s.bind_to_random_port("tcp://127.0.0.1"))
            s.close(linger=0)
        self.procs = []
        addrs = ["tcp://127.0.0.1:%d" % p for p in ports] + ["tcp://127.0.0.1:%d" % sink_port]
        for i in range(hops):
            # Stage i+1 receives hop i and sends hop i+1 (none after the last).
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "stage", addrs[i], addrs[i + 1],
                     manifest, str(i + 1)]
                )
            )
        self.src = ctx.socket(zmq.PUSH)
        self.src.connect(addrs[0])
        m = json.load(open(manifest))["pipeline"]
        self.first = [load_cases(c["hops"][0])[0]["tensors"] if c["hops"][0] else None for c in m]
        time.sleep(0.5)

    def run(self, cases, concurrency, mode, warmup):
        """Closed loop: `concurrency` requests in flight; one request = the driver sends the
        first hop, every stage forwards its hop, the last stage answers."""
        seq = [int(c) for c in cases]  # the first `warmup` are not timed
        total = len(seq)
        start, lat = {}, []
        sent = done = 0
        t0 = None

        def send(i):
            case = seq[i]
            head = ("r%d %d %s" % (i, case, mode)).encode()
            start[i] = time.perf_counter()
            out = self.first[case]
            if out is None:
                self.src.send_multipart([head])
            else:
                parts, copy = encode({"request_id": "r%d" % i, "tensors": out}, mode)
                self.src.send_multipart([head] + parts, copy=copy)

        while sent < min(concurrency, total):
            send(sent)
            sent += 1
        # A stage that died (a crash, the OOM killer) would leave this waiting for ever: a
        # receive that times out checks on them (no cost while messages flow).
        self.sink.setsockopt(zmq.RCVTIMEO, 1000)
        while done < total:
            try:
                head = self.sink.recv_multipart()[0].decode()
            except zmq.Again:
                dead = [(i + 1, p.returncode) for i, p in enumerate(self.procs) if p.poll() is not None]
                if dead:
                    # The rest would wait on the dead one for ever: end them too.
                    for p in self.procs:
                        if p.poll() is None:
                            p.kill()
                            p.wait()
                    return {
                        "ok": False,
                        "error": "baseline stage %d exited (status %s) with %d of %d requests done"
                        % (dead[0][0], dead[0][1], done, total),
                    }
                continue
            i = int(head.split(" ")[0][1:])
            now = time.perf_counter()
            if i == warmup:
                t0 = start[i]
            if i >= warmup:
                lat.append((now - start[i]) * 1e6)
            done += 1
            if sent < total:
                send(sent)
                sent += 1
        wall = time.perf_counter() - (t0 if t0 is not None else now)
        return {"ok": True, "lat_us": lat, "wall_s": wall}

    def stop(self):
        self.src.send_multipart([b"Q"])
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    # A crash in a native extension (numpy, zmq) prints where it happened.
    faulthandler.enable()
    if len(sys.argv) >= 2 and sys.argv[1] == "receiver":
        receiver(sys.argv[2])
    elif len(sys.argv) >= 2 and sys.argv[1] == "stage":
        stage_process(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        driver()
