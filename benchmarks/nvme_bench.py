"""NVMe offload: raw disk bandwidth vs the swapper's effective bandwidth during optimizer steps, one run.

1. **Raw**: the target directory (``--path``; default ``$ZERO_STRATEGY_NVME_PATH``,
   else the system temp dir) with the swapper's access pattern: one file of
   ``--size`` (default 2 GiB) opened with ``O_DIRECT`` (buffered if the filesystem
   refuses it, e.g. tmpfs), split into ``--buffer-size`` requests (64 MiB) that a
   thread pool of ``--io-threads`` (4) serves with ``os.pwrite``/``os.preadv`` on
   4096-aligned host buffers, every request submitted at once, then ``fsync``.
   A first write allocates the file's blocks (reported apart: the swapper
   overwrites an allocated file); then ``--passes`` rounds of read, overwrite,
   and a mixed pass (half the file read while the other half is written, requests
   interleaved on the same pool: what a pipelined step does). Reads follow writes
   of the same bytes: ``O_DIRECT`` bypasses the page cache, so the guest cannot
   serve them from memory; in buffered mode the file's pages are dropped with
   ``posix_fadvise(DONTNEED)`` after the ``fsync`` (a cache in the hypervisor,
   below a virtual disk, is out of reach either way).

2. **Swapper**: a stack of ``--layers`` bias-free ``nn.Linear(d, d)`` in an
   ``nn.ModuleList`` (one unit, hence one flat group, each), ``--params`` in total
   (default 100M: master + Adam's two moments = 12 bytes/param = 1.2 GB swapped
   per rank), ``zs.setup`` at world size 1 on the CPU with ``precision="bf16"``
   and ``offload_optimizer={"device": "nvme", ...}`` (``--stage`` 2 or 3;
   ``--offload-params`` adds ``offload_params="nvme"`` at stage 3), the user's
   optimizer ``AdamW`` (``--adam fused``). Each step runs forward+backward
   (untimed), then ``zopt.step()`` (timed), then ``zero_grad``. The bytes moved
   are the deltas of ``engine.swap.file.bytes_read/bytes_written`` across
   ``zopt.step()`` (counted when requests are submitted; every request of a step
   completes inside it, as the step waits for its write-backs).

   Effective bandwidth:

   * ``eff_step`` = bytes / step time: **the number compared with the target**
     (>= 80 % of raw). The step is what training waits for; the swapper is meant
     to hide the CPU work under the I/O.
   * ``eff_minus_adam`` = bytes / (step time - pure CPU AdamW time). The AdamW
     time is measured apart, after the timed steps, on clones of the same master
     and state tensors held in RAM, stepped group by group the way the engine
     does. This is only an upper bound on the I/O rate: it assumes no overlap
     between the AdamW work and the I/O, while the pipeline overlaps them.
   * ``eff_busy`` = bytes / the time at least one swap request was in flight
     (every request of ``SwapFile._io_chunk`` is time-stamped by wrapping the
     method on the instance; no engine code changes). The gap between
     ``eff_step`` and ``eff_busy`` is the pipeline's idle disk time.

   **The raw reference is paired.** The disk under a shared virtual machine
   changes speed from minute to minute (1.2 to 2.3 GB/s reads within ten minutes
   here), so a raw figure from the start of the run says little about a step a
   minute later. Right after each timed step (outside its timing) the raw file
   (every other step: right before it, after forward+backward, so that neither
   side always follows the other's burst of I/O) gets (a) a *mixed* pass of the same read and write bytes in ``--buffer-size``
   requests, interleaved on one pool like a pipelined step (reads in one half of
   the file, writes in the other): the target is median over steps of
   ``eff_step / that pass``; and (b) a *replay* of the step's own requests
   (sizes, kinds, file offsets when the raw file is large enough, submission
   order), all submitted at once: the step's I/O without the pipeline's
   dependencies. The raw phase's serial figure ``(R+W) / (R/read + W/write)`` is
   printed too.

   With ``--cpu-reference`` (default on) the same model is also built with
   ``offload_optimizer="cpu"`` and its ``zopt.step()`` timed: the step without any
   swapping, so ``nvme step - cpu step`` is the time the swapping adds.

   A worker-thread profile splits the NVMe step: time blocked waiting for reads
   (``swap_in``), for a free slot (``SlotPool.acquire``), in AdamW, in the master
   cast/upload, in submitting write-backs, and the main thread's final wait for
   the write-backs; also the CPU time the process and the machine (``/proc/stat``:
   user/system/iowait/steal) spent during the timed steps and the bytes the block
   device actually moved (``/proc/diskstats``), to check that the I/O reached the disk.

    python benchmarks/nvme_bench.py                                   # 2 GiB raw file, 100M params
    python benchmarks/nvme_bench.py --size 1G --params 50M --steps 4  # quicker
    python benchmarks/nvme_bench.py --path /local_nvme --stage 3 --offload-params
    python benchmarks/nvme_bench.py --skip-engine                     # raw disk only

Writes ``benchmarks/out/nvme_bench.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import errno
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALIGN = 4096
TARGET_FRACTION = 0.80

try:
    import zero_strategy as zs
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(REPO, "src"))
    import zero_strategy as zs

import torch
from torch import nn


# ----------------------------------------------------------------------------- args
def parse_bytes(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def parse_count(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", default=os.environ.get("ZERO_STRATEGY_NVME_PATH") or tempfile.gettempdir(),
                   help="directory under test (default $ZERO_STRATEGY_NVME_PATH, else the temp dir)")
    p.add_argument("--size", default="2G", help="raw test file size (K/M/G = KiB/MiB/GiB; default 2G)")
    p.add_argument("--buffer-size", default="64M", help="request size, as offload buffer_size (64M)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--buffer-count", type=int, default=4)
    p.add_argument("--read-ahead", type=int, default=1)
    p.add_argument("--passes", type=int, default=3, help="raw read / overwrite / mixed passes")
    p.add_argument("--params", default="100M", help="model parameters (K/M/G = 1e3/1e6/1e9)")
    p.add_argument("--layers", type=int, default=16, help="nn.Linear layers = flat groups")
    p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--offload-params", action="store_true", help="stage 3: also offload_params=nvme")
    p.add_argument("--adam", default="fused", choices=("fused", "foreach", "forloop"))
    p.add_argument("--batch", type=int, default=8, help="rows of the random input")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the first creates and writes the state)")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--cpu-reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the same model with offload_optimizer='cpu'")
    p.add_argument("--skip-raw", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "out", "nvme_bench.json"))
    a = p.parse_args(argv)
    a.size = parse_bytes(a.size)
    a.buffer_size = parse_bytes(a.buffer_size)
    a.params = parse_count(a.params)
    if a.size % ALIGN or a.buffer_size % ALIGN:
        p.error("--size and --buffer-size must be multiples of 4096 bytes")
    if a.offload_params and a.stage != 3:
        p.error("--offload-params needs --stage 3")
    return a


# ----------------------------------------------------------------------- machine
def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def proc_stat() -> dict[str, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    names = ["user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"]
    return dict(zip(names, v))


def cpu_split(before: dict, after: dict) -> dict[str, float]:
    """Share of all CPUs' time in each state between two /proc/stat samples."""
    d = {k: after[k] - before[k] for k in before}
    total = sum(d.values()) or 1
    return {k: round(v / total, 3) for k, v in d.items() if k in ("user", "system", "idle", "iowait", "steal")}


def block_device(path: str) -> str | None:
    """The /proc/diskstats name of the (whole) block device holding ``path``."""
    try:
        st = os.stat(path)
        sys_dir = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    except OSError:
        return None
    if not os.path.exists(sys_dir):
        return None  # tmpfs, overlay without a device, ...
    if os.path.exists(os.path.join(sys_dir, "partition")):
        sys_dir = os.path.dirname(sys_dir)
    return os.path.basename(sys_dir)


def disk_bytes(dev: str | None) -> tuple[int, int] | None:
    """(bytes read, bytes written) by the block device so far."""
    if dev is None:
        return None
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[5]) * 512, int(p[9]) * 512
    return None


def fs_type(path: str) -> str:
    best, fstype = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            p = line.split()
            mnt = p[1]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, p[2]
    return fstype


# --------------------------------------------------------------------------- raw
def aligned_buffer(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    buf = raw[off:off + nbytes]
    g = torch.Generator().manual_seed(0)
    buf.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, generator=g))
    return buf  # random bytes: nothing below can compress or deduplicate them


def _io(fd: int, write: bool, view: memoryview, offset: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    done = 0
    while done < len(view):  # the swapper's loop (SwapFile._io_chunk)
        n = os.pwrite(fd, view[done:], offset + done) if write else os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"no progress at byte {offset + done}")
        done += n
    return t0, time.perf_counter()


class RawFile:
    def __init__(self, directory: str, size: int, chunk: int, threads: int):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"nvme_bench.{os.getpid()}.bin")
        self.size, self.chunk = size, chunk
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, flags | (os.O_DIRECT if self.direct else 0), 0o600)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False
            self.fd = os.open(self.path, flags, 0o600)
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="bench-io")
        # a ring of 2 x threads request buffers (the swapper's slots are at most buffer_count sets)
        self.nslots = max(1, min(-(-size // chunk), 2 * threads))
        self.buf = aligned_buffer(self.nslots * chunk)
        self.view = memoryview(self.buf.numpy())

    def layout(self, ops: list[tuple[bool, int]]) -> list[tuple[bool, int, int]]:
        """Offsets for a list of (write, nbytes): reads walk the first half of the file, writes the
        second half, each wrapping around (so any byte count fits; no read races a write)."""
        half = (self.size // 2) // ALIGN * ALIGN
        pos = {False: 0, True: 0}
        out = []
        for write, n in ops:
            n = -(-n // ALIGN) * ALIGN
            lo, room = (half, self.size - half) if write else (0, half)
            if pos[write] + n > room:
                pos[write] = 0
            out.append((write, lo + pos[write], n))
            pos[write] += n
        return out

    def requests(self, lo: int, hi: int) -> list[tuple[int, int]]:
        return [(o, min(self.chunk, hi - o)) for o in range(lo, hi, self.chunk)]

    def run(self, reqs: list[tuple[bool, int, int]]) -> dict:
        """Submit every (write, offset, nbytes) at once, wait, fsync (after writes)."""
        t0 = time.perf_counter()
        futs = []
        for k, (write, off, n) in enumerate(reqs):
            slot = (k % self.nslots) * self.chunk
            futs.append(self.pool.submit(_io, self.fd, write, self.view[slot:slot + n], off))
        spans = [f.result() for f in futs]
        t1 = time.perf_counter()
        wrote = any(w for w, _, _ in reqs)
        if wrote:
            os.fsync(self.fd)
        t2 = time.perf_counter()
        if not self.direct:  # buffered: drop the now clean pages so the next read hits the disk
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        nbytes = sum(n for _, _, n in reqs)
        busy = sum(b - a for a, b in spans)
        return {"bytes": nbytes, "s": t2 - t0, "s_before_fsync": t1 - t0, "fsync_s": t2 - t1,
                "gbps": nbytes / (t2 - t0) / 1e9, "gbps_before_fsync": nbytes / (t1 - t0) / 1e9,
                "per_request_gbps": nbytes / busy / 1e9 if busy else None,
                "mean_in_flight": busy / (t1 - t0)}

    def close(self):
        self.pool.shutdown(wait=True)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def raw_bench(a, f: RawFile, dev: str | None) -> dict:
    out = {"file": f.path, "o_direct": f.direct, "size": a.size, "request_bytes": a.buffer_size,
           "io_threads": a.io_threads, "ring_buffers": f.nslots, "block_device": dev,
           "page_cache": ("bypassed: O_DIRECT" if f.direct else
                          "buffered I/O (O_DIRECT refused): pages dropped with posix_fadvise(DONTNEED) after fsync; "
                          "on tmpfs the file *is* memory"),
           "passes": []}
    try:
        whole = f.requests(0, a.size)
        d0 = disk_bytes(dev)
        out["first_write"] = f.run([(True, o, n) for o, n in whole])
        half = (a.size // 2) // ALIGN * ALIGN
        for k in range(a.passes):
            rd = f.run([(False, o, n) for o, n in whole])
            wr = f.run([(True, o, n) for o, n in whole])
            # mixed: read the first half while the second half is written, interleaved like a pipelined step
            r_req = [(False, o, n) for o, n in f.requests(0, half)]
            w_req = [(True, o, n) for o, n in f.requests(half, a.size)]
            mixed = [x for pair in zip(r_req, w_req) for x in pair] + r_req[len(w_req):] + w_req[len(r_req):]
            mx = f.run(mixed)
            out["passes"].append({"read": rd, "write": wr, "mixed": mx})
            print(f"[nvme_bench] raw pass {k}: read {rd['gbps']:.2f}  write+fsync {wr['gbps']:.2f}  "
                  f"mixed {mx['gbps']:.2f} GB/s", flush=True)
        d1 = disk_bytes(dev)
        if d0 and d1:
            out["device_bytes"] = {"read": d1[0] - d0[0], "written": d1[1] - d0[1],
                                   "expected_read": a.size * a.passes + half * a.passes,
                                   "expected_written": a.size * (1 + a.passes) + (a.size - half) * a.passes}
    except BaseException:
        f.close()
        raise
    for kind in ("read", "write", "mixed"):
        vals = [p[kind]["gbps"] for p in out["passes"]]
        out[f"{kind}_gbps"] = statistics.median(vals)
        out[f"{kind}_gbps_all"] = vals
    out["write_no_fsync_gbps"] = statistics.median(p["write"]["gbps_before_fsync"] for p in out["passes"])
    return out


# ------------------------------------------------------------------------ engine
class Stack(nn.Module):
    """``layers`` bias-free d x d linear layers; each is one unit (a ModuleList child), one flat group."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))
        for layer in self.layers:  # variance-preserving: activations and gradients stay O(1), no denormals
            nn.init.normal_(layer.weight, std=d ** -0.5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def adam_kwargs(kind: str) -> dict:
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "forloop": {"foreach": False, "fused": False}}[kind]


HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


class Trace:
    """Time-stamps on the engine's objects, by wrapping methods on the instances only."""

    def __init__(self):
        self.on = False
        self.io: list[tuple[float, float, bool, int, int]] = []  # (start, end, write, bytes, file offset)
        self.calls: dict[str, list[tuple[float, float, str]]] = {}
        self._lock = threading.Lock()

    def wrap(self, obj, name: str, label: str | None = None):
        fn = getattr(obj, name)
        label = label or name

        @functools.wraps(fn)
        def timed(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                t1 = time.perf_counter()
                with self._lock:
                    self.calls.setdefault(label, []).append((t0, t1, threading.current_thread().name))
        setattr(obj, name, timed)

    def wrap_io(self, swap_file):
        fn = swap_file._io_chunk

        def timed(write, buf, offset):
            t0 = time.perf_counter()
            fn(write, buf, offset)
            if self.on:
                t1 = time.perf_counter()
                with self._lock:
                    self.io.append((t0, t1, write, buf.numel(), offset))
        swap_file._io_chunk = timed

    def reset(self):
        self.io, self.calls = [], {}


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def analyse_step(tr: Trace, t0: float, t1: float) -> dict:
    """What the disk and the worker thread did between t0 and t1 (one zopt.step())."""
    io = [x for x in tr.io if x[0] >= t0 - 1e-6 and x[1] <= t1 + 1e-6]
    wall = t1 - t0
    busy = union_length([(x[0], x[1]) for x in io])
    rd = [x for x in io if not x[2]]
    wr = [x for x in io if x[2]]
    req_time = sum(x[1] - x[0] for x in io)
    out = {"wall_s": wall, "io_requests": len(io), "read_requests": len(rd), "write_requests": len(wr),
           "mean_request_mib": (sum(x[3] for x in io) / len(io) / 2**20) if io else 0.0,
           "io_busy_s": busy, "io_idle_s": wall - busy,
           "read_busy_s": union_length([(x[0], x[1]) for x in rd]),
           "write_busy_s": union_length([(x[0], x[1]) for x in wr]),
           "mean_in_flight_when_busy": req_time / busy if busy else 0.0,
           "first_request_after_s": (min(a for a, *_ in io) - t0) if io else None,
           "last_request_end_before_s": (t1 - max(b for _, b, *_ in io)) if io else None}
    per = {}
    for label, spans in tr.calls.items():
        inside = [(a, b, th) for a, b, th in spans if a >= t0 - 1e-6 and b <= t1 + 1e-6]
        if inside:
            per[label] = {"s": sum(b - a for a, b, _ in inside), "calls": len(inside),
                          "threads": sorted({th for *_, th in inside})}
    out["calls"] = per
    return out


def nvme_policy(a) -> dict:
    return {"device": "nvme", "path": a.path, "buffer_size": a.buffer_size, "io_threads": a.io_threads,
            "buffer_count": a.buffer_count, "read_ahead": a.read_ahead}


def build(a, offload: str):
    d = max(1, round(math.sqrt(a.params / a.layers)))
    torch.manual_seed(0)
    model = Stack(d, a.layers)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), **HYPER, **adam_kwargs(a.adam))
    kw = {"stage": a.stage, "precision": "bf16"}
    if offload == "nvme":
        kw["offload_optimizer"] = nvme_policy(a)
        if a.offload_params:
            kw["offload_params"] = nvme_policy(a)
    else:
        kw["offload_optimizer"] = "cpu"
        if a.offload_params:
            kw["offload_params"] = "cpu"
    cfg = zs.ZeroConfig(**kw)
    model, zopt = zs.setup(model, opt, cfg)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(a.batch, d, generator=g), torch.randn(a.batch, d, generator=g))
    return model, opt, zopt, x, n, d, cfg


def fwd_bwd(model, zopt, xy):
    x, y = xy
    loss = (model(x).float() - y).square().mean()
    zopt.backward(loss)
    return float(loss.detach())


def pure_adam(engine, zopt, a, repeats: int = 5) -> dict:
    """AdamW on clones of the swapped master + state held in RAM, group by group like the engine."""
    groups = [g for g in zopt.groups if g.master is not None]
    masters, states = [], []
    for g in groups:
        with g.resident(write_back=False):
            masters.append(nn.Parameter(g.master.detach().clone()))
            st = zopt.optimizer.state.get(g.master, {})
            states.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()})
    opt = torch.optim.AdamW(masters, **HYPER, **adam_kwargs(a.adam))
    for p, st in zip(masters, states):
        if st:
            opt.state[p] = st
    grads = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(2)) * 1e-3 for p in masters]

    def one_step():
        for p, gr in zip(masters, grads):
            p.grad = gr
            opt.step()
            p.grad = None

    one_step()  # warm (allocates state if the clones had none)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in masters)
    del masters, states, opt, grads
    gc.collect()
    return {"s": statistics.median(times), "times_s": times, "params": n,
            "mparams_per_s": n / statistics.median(times) / 1e6}


def paired_raw(f: RawFile, chunk: int, io: list[tuple[float, float, bool, int, int]], r: int, w: int) -> dict:
    """Right after a step, on the raw file: (a) the same bytes as raw mixed requests of ``chunk``,
    interleaved read/write, reads in one half of the file and writes in the other; (b) a replay of
    the step's own requests (sizes, kinds, submission order and, when the raw file is large enough,
    the same file offsets), all submitted at once: the step's I/O without the pipeline's dependencies."""
    ops_r = [(False, min(chunk, r - o)) for o in range(0, r, chunk)]
    ops_w = [(True, min(chunk, w - o)) for o in range(0, w, chunk)]
    mixed = [x for pair in zip(ops_r, ops_w) for x in pair] + ops_r[len(ops_w):] + ops_w[len(ops_r):]
    m = f.run(f.layout(mixed))
    reqs = sorted(io)
    same_offsets = bool(reqs) and max(off + n for *_, n, off in reqs) <= f.size
    rp = f.run([(wr, off, n) for _, _, wr, n, off in reqs] if same_offsets
               else f.layout([(wr, n) for _, _, wr, n, _ in reqs]))
    rp["same_offsets"] = same_offsets
    return {"raw_mixed": m, "replay": rp}


def engine_bench(a, dev: str | None, raw_file: RawFile | None = None) -> dict:
    out: dict = {}
    t0 = time.perf_counter()
    model, opt, zopt, x, n, d, cfg = build(a, "nvme")
    engine = zs.api._engine_of(model)
    swap = engine.swap
    out.update(params=n, d=d, layers=a.layers, groups=len(zopt.groups), stage=a.stage,
               offload_params=a.offload_params, adam=a.adam, setup_s=time.perf_counter() - t0,
               swap_file=str(swap.file.path), swap_file_bytes=swap.bytes_on_disk(), o_direct=swap.file.direct,
               config=cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg),
               slot_pool=len(swap.pool._free), worker_intraop_threads=engine.transfers.pool.submit(
                   torch.get_num_threads).result())
    print(f"[nvme_bench] engine: {n / 1e6:.1f}M params in {len(zopt.groups)} groups, swap file "
          f"{swap.bytes_on_disk() / 1e9:.2f} GB, O_DIRECT {swap.file.direct}, set up in {out['setup_s']:.1f} s",
          flush=True)

    tr = Trace()
    tr.wrap_io(swap.file)
    for name in ("swap_in", "prefetch", "swap_out", "adopt", "wait_writes"):
        tr.wrap(swap, name)
    tr.wrap(swap.pool, "acquire", "pool.acquire")
    tr.wrap(zopt.optimizer, "step", "adamw.step")
    for g in zopt.groups:
        tr.wrap(g, "stage_master_upload", "stage_master_upload")
        tr.wrap(g, "master_grad", "master_grad")

    steps, losses = [], []
    last = None
    acc = {"wall": 0.0, "cpu_user": 0.0, "cpu_sys": 0.0, "stat": None, "disk": [0, 0]}
    for i in range(a.warmup + a.steps):
        timed = i >= a.warmup
        losses.append(fwd_bwd(model, zopt, x))
        j = i - a.warmup
        pr = None
        if timed and raw_file is not None and j % 2 == 1 and last is not None:
            # every other step the raw passes go *before* the step (after forward+backward), so that neither
            # side always follows the other's burst of I/O (a host-side write-back cache or throttle)
            pr = paired_raw(raw_file, a.buffer_size, last["io"], last["read_bytes"], last["written_bytes"])
            pr["order"] = "before the step"
        r0, w0 = swap.file.bytes_read, swap.file.bytes_written
        tr.reset()
        tr.on = timed
        st0, c0, dk0 = proc_stat(), os.times(), disk_bytes(dev)
        ts = time.perf_counter()
        zopt.step()
        te = time.perf_counter()
        st1, c1, dk1 = proc_stat(), os.times(), disk_bytes(dev)
        tr.on = False
        if timed:  # machine / process / block-device figures over the timed zopt.step() calls only
            acc["wall"] += te - ts
            acc["cpu_user"] += c1.user - c0.user
            acc["cpu_sys"] += c1.system - c0.system
            acc["stat"] = ({k: st1[k] - st0[k] for k in st0} if acc["stat"] is None
                           else {k: acc["stat"][k] + st1[k] - st0[k] for k in st0})
            if dk0 and dk1:
                acc["disk"] = [acc["disk"][0] + dk1[0] - dk0[0], acc["disk"][1] + dk1[1] - dk0[1]]
        rec = {"step_s": te - ts, "read_bytes": swap.file.bytes_read - r0,
               "written_bytes": swap.file.bytes_written - w0}
        t = time.perf_counter()
        zopt.zero_grad()
        rec["zero_grad_s"] = time.perf_counter() - t
        msg = ""
        if timed:
            rec["profile"] = analyse_step(tr, ts, te)
            last = {"io": list(tr.io), "read_bytes": rec["read_bytes"], "written_bytes": rec["written_bytes"]}
            if raw_file is not None:
                if pr is None:
                    pr = paired_raw(raw_file, a.buffer_size, tr.io, rec["read_bytes"], rec["written_bytes"])
                    pr["order"] = "after the step"
                rec["paired"] = pr
                moved = rec["read_bytes"] + rec["written_bytes"]
                rec["eff_step_gbps"] = moved / rec["step_s"] / 1e9
                rec["fraction_of_paired_raw"] = rec["eff_step_gbps"] / pr["raw_mixed"]["gbps"]
                msg = (f"; raw {pr['order'].split()[0]}: mixed {pr['raw_mixed']['gbps']:.2f} GB/s, replay of "
                       f"the step's requests {pr['replay']['gbps']:.2f} GB/s; step {rec['eff_step_gbps']:.2f} GB/s "
                       f"= {rec['fraction_of_paired_raw']:.0%} of raw mixed")
            steps.append(rec)
        print(f"[nvme_bench] nvme step {i}{'' if timed else ' (warm-up)'}: {rec['step_s']:.3f} s, read "
              f"{rec['read_bytes'] / 1e9:.2f} GB, written {rec['written_bytes'] / 1e9:.2f} GB, loss "
              f"{losses[-1]:.4f}{msg}", flush=True)
    out["timed_steps_s"] = acc["wall"]
    out["machine_cpu_split"] = cpu_split({k: 0 for k in acc["stat"]}, acc["stat"])
    out["process_cpu_cores"] = (acc["cpu_user"] + acc["cpu_sys"]) / acc["wall"]
    out["process_cpu_system_share"] = acc["cpu_sys"] / max(1e-9, acc["cpu_user"] + acc["cpu_sys"])
    if dev is not None:
        out["device_bytes_timed_steps"] = {"read": acc["disk"][0], "written": acc["disk"][1],
                                           "swap_read": sum(s["read_bytes"] for s in steps),
                                           "swap_written": sum(s["written_bytes"] for s in steps)}
    out["steps"] = steps
    out["losses"] = losses
    med = statistics.median(s["step_s"] for s in steps)
    k = min(range(len(steps)), key=lambda j: abs(steps[j]["step_s"] - med))
    out["step_s"] = med
    out["median_step_index"] = k
    out["read_bytes"] = steps[k]["read_bytes"]
    out["written_bytes"] = steps[k]["written_bytes"]
    out["io_busy_s"] = statistics.median(s["profile"]["io_busy_s"] for s in steps)

    t = time.perf_counter()
    out["pure_adam"] = pure_adam(engine, zopt, a)
    print(f"[nvme_bench] pure CPU AdamW on the same tensors in RAM: {out['pure_adam']['s']:.3f} s "
          f"({out['pure_adam']['mparams_per_s']:.0f} M params/s; {time.perf_counter() - t:.1f} s)", flush=True)
    del model, opt, zopt, engine, swap, tr
    gc.collect()

    if a.cpu_reference:
        model, opt, zopt, x, *_ = build(a, "cpu")
        times = []
        for i in range(a.warmup + a.steps):
            fwd_bwd(model, zopt, x)
            ts = time.perf_counter()
            zopt.step()
            dt = time.perf_counter() - ts
            zopt.zero_grad()
            if i >= a.warmup:
                times.append(dt)
        out["cpu_offload_step_s"] = statistics.median(times)
        out["cpu_offload_step_times_s"] = times
        print(f"[nvme_bench] same model, offload_optimizer='cpu': step {out['cpu_offload_step_s']:.3f} s", flush=True)
        del model, opt, zopt
        gc.collect()
    return out


# ------------------------------------------------------------------------ report
def summarize(rep: dict) -> None:
    raw, eng = rep.get("raw"), rep.get("engine")
    if not eng:
        return
    moved = eng["read_bytes"] + eng["written_bytes"]
    s = eng["step_s"]
    e = {"bytes_per_step": moved, "eff_step_gbps": moved / s / 1e9,
         "eff_busy_gbps": moved / eng["io_busy_s"] / 1e9 if eng["io_busy_s"] else None}
    adam = eng["pure_adam"]["s"]
    e["eff_minus_adam_gbps"] = moved / (s - adam) / 1e9 if s > adam else None
    if eng.get("cpu_offload_step_s") is not None and s > eng["cpu_offload_step_s"]:
        e["eff_minus_cpu_step_gbps"] = moved / (s - eng["cpu_offload_step_s"]) / 1e9
    if raw:
        r, w = eng["read_bytes"], eng["written_bytes"]
        serial = moved / (r / (raw["read_gbps"] * 1e9) + w / (raw["write_gbps"] * 1e9)) / 1e9
        e["raw_mixed_gbps"] = raw["mixed_gbps"]
        e["raw_serial_gbps"] = serial
        e["raw_reference_gbps"] = raw["mixed_gbps"]
        e["fraction_of_raw"] = e["eff_step_gbps"] / raw["mixed_gbps"]
        e["target_fraction"] = TARGET_FRACTION
        e["target_ok"] = e["fraction_of_raw"] >= TARGET_FRACTION
        e["step_s_at_raw"] = moved / (raw["mixed_gbps"] * 1e9)
    paired = [st for st in eng["steps"] if "paired" in st]
    if paired:  # the reference the target uses: raw passes right after each step (same load on the machine)
        e["paired_raw_mixed_gbps"] = statistics.median(st["paired"]["raw_mixed"]["gbps"] for st in paired)
        e["paired_replay_gbps"] = statistics.median(st["paired"]["replay"]["gbps"] for st in paired)
        e["paired_replay_in_flight"] = statistics.median(st["paired"]["replay"]["mean_in_flight"] for st in paired)
        e["fraction_of_raw"] = statistics.median(st["fraction_of_paired_raw"] for st in paired)
        e["fraction_of_raw_all"] = [st["fraction_of_paired_raw"] for st in paired]
        for order in ("after", "before"):
            fr = [st["fraction_of_paired_raw"] for st in paired if st["paired"]["order"].startswith(order)]
            e[f"fraction_of_raw_raw_{order}"] = statistics.median(fr) if fr else None
        e["raw_reference_gbps"] = e["paired_raw_mixed_gbps"]
        e["raw_reference"] = "raw mixed pass of the same bytes right after each step (median of per-step ratios)"
        e["target_fraction"] = TARGET_FRACTION
        e["target_ok"] = e["fraction_of_raw"] >= TARGET_FRACTION
        e["step_s_at_raw"] = moved / (e["paired_raw_mixed_gbps"] * 1e9)
    elif raw:
        e["raw_reference"] = "raw mixed pass of the raw phase (not paired: --skip-raw or no raw file)"
    rep["effective"] = e


def _g(v, fmt=".2f"):
    return "-" if v is None else format(v, fmt)


def format_table(rep: dict) -> str:
    out = [f"nvme_bench: {rep['path']} ({rep['fs_type']}, block device {rep['block_device']}), "
           f"load average {rep['loadavg_start']} at start, {rep['loadavg_end']} at end, {rep['host']['cpus']} CPUs"]
    if rep["fs_type"] in ("tmpfs", "ramfs"):
        out.append(f"NOTE: {rep['path']} is {rep['fs_type']}: the file lives in RAM, these are not disk figures")
    raw = rep.get("raw")
    if not raw:
        out.append("Raw: skipped (--skip-raw): no raw reference, no target check")
    if raw:
        out.append(f"Raw: {raw['size'] / 2**30:.2f} GiB file, {'O_DIRECT' if raw['o_direct'] else 'BUFFERED'}, "
                   f"{raw['io_threads']} threads x {raw['request_bytes'] / 2**20:.0f} MiB requests, median of "
                   f"{len(raw['passes'])} passes (page cache: {raw['page_cache']})")
        out.append(f"  {'pass':<28}{'GB/s':>8}   all passes")
        out.append(f"  {'first write (allocating)':<28}{raw['first_write']['gbps']:>8.2f}")
        rows = [("read", "read"), ("write (overwrite) + fsync", "write"), ("mixed: read + write, 1 pool", "mixed")]
        for label, k in rows:
            out.append(f"  {label:<28}{raw[k + '_gbps']:>8.2f}   " + " ".join(f"{v:.2f}" for v in raw[k + "_gbps_all"]))
        out.append(f"  {'write without the fsync':<28}{raw['write_no_fsync_gbps']:>8.2f}")
        if raw.get("device_bytes"):
            db = raw["device_bytes"]
            out.append(f"  block device moved {db['read'] / 1e9:.2f} GB read / {db['written'] / 1e9:.2f} GB written "
                       f"(expected {db['expected_read'] / 1e9:.2f} / {db['expected_written'] / 1e9:.2f})")
    eng = rep.get("engine")
    if eng:
        e = rep["effective"]
        out.append(f"Swapper: {eng['params'] / 1e6:.1f}M params, {eng['groups']} groups, stage {eng['stage']}"
                   f"{' + params on NVMe' if eng['offload_params'] else ''}, bf16, AdamW({eng['adam']}), "
                   f"median of {len(eng['steps'])} steps after warm-up; swap file O_DIRECT {eng['o_direct']}")
        out.append(f"  {'quantity':<52}{'value':>10}")
        rows = [
            ("zopt.step() [s]", _g(eng["step_s"], ".3f")),
            ("  swap read / written per step [GB]",
             f"{eng['read_bytes'] / 1e9:.2f}/{eng['written_bytes'] / 1e9:.2f}"),
            ("  disk busy (>=1 swap request in flight) [s]", _g(eng["io_busy_s"], ".3f")),
            ("  pure CPU AdamW, same tensors in RAM [s]", _g(eng["pure_adam"]["s"], ".3f")),
            ("  same model, offload_optimizer='cpu' step [s]", _g(eng.get("cpu_offload_step_s"), ".3f")),
            ("  step time if the swap ran at raw mixed speed [s]", _g(e.get("step_s_at_raw"), ".3f")),
            ("eff_step = bytes / step  [GB/s]  (target metric)", _g(e["eff_step_gbps"])),
            ("eff_minus_adam = bytes / (step - AdamW) [GB/s]", _g(e["eff_minus_adam_gbps"])),
            ("bytes / (step - cpu-offload step) [GB/s]", _g(e.get("eff_minus_cpu_step_gbps"))),
            ("eff_busy = bytes / disk-busy time [GB/s]", _g(e["eff_busy_gbps"])),
            ("raw phase: mixed / serial mix of read+write [GB/s]",
             f"{_g(e.get('raw_mixed_gbps'))}/{_g(e.get('raw_serial_gbps'))}"),
            ("after each step: raw mixed (REFERENCE) [GB/s]", _g(e.get("paired_raw_mixed_gbps"))),
            ("after each step: replay of the step's requests [GB/s]", _g(e.get("paired_replay_gbps"))),
        ]
        for label, v in rows:
            out.append(f"  {label:<52}{v:>10}")
        if "fraction_of_raw" in e:
            out.append(f"  eff_step / reference = {e['fraction_of_raw']:.0%} (target >= {TARGET_FRACTION:.0%}): "
                       f"{'ok' if e['target_ok'] else 'MISS'}; per step: "
                       + " ".join(f"{v:.0%}" for v in e.get("fraction_of_raw_all", []))
                       + f" (raw after / before the step: {_g(e.get('fraction_of_raw_raw_after'), '.0%')} / "
                       f"{_g(e.get('fraction_of_raw_raw_before'), '.0%')})")
        p = eng["steps"][eng["median_step_index"]]["profile"]
        c = p["calls"]

        def cs(k):
            return c.get(k, {}).get("s", 0.0)
        out.append(f"  profile of the median step ({p['wall_s']:.3f} s): disk idle {p['io_idle_s']:.3f} s; "
                   f"{p['read_requests']} reads + {p['write_requests']} writes, mean {p['mean_request_mib']:.1f} MiB, "
                   f"{p['mean_in_flight_when_busy']:.2f} in flight when busy; first request after "
                   f"{_g(p['first_request_after_s'], '.3f')} s, last ends {_g(p['last_request_end_before_s'], '.3f')} s "
                   f"before the end")
        out.append(f"  worker: swap_in (waits for reads) {cs('swap_in'):.3f} s, pool.acquire {cs('pool.acquire'):.3f} s, "
                   f"AdamW {cs('adamw.step'):.3f} s, master_grad {cs('master_grad'):.3f} s, "
                   f"stage_master_upload {cs('stage_master_upload'):.3f} s, swap_out submit {cs('swap_out'):.3f} s, "
                   f"prefetch submit {cs('prefetch'):.3f} s; main: wait_writes {cs('wait_writes'):.3f} s")
        out.append(f"  during the timed steps: process used {eng['process_cpu_cores']:.2f} cores "
                   f"({eng['process_cpu_system_share']:.0%} in the kernel); machine {eng['machine_cpu_split']}")
        if eng.get("device_bytes_timed_steps"):
            db = eng["device_bytes_timed_steps"]
            out.append(f"  block device during the timed steps: {db['read'] / 1e9:.2f} GB read / {db['written'] / 1e9:.2f} "
                       f"GB written; swap counters {db['swap_read'] / 1e9:.2f} / {db['swap_written'] / 1e9:.2f}")
    out.append("eff_step is compared with a raw *mixed* pass (reads and writes in flight together on one pool, as in a "
               "step) of the same bytes in buffer_size requests, run right after (or, every other step, right before) "
               "each step so that both see the same load on the shared machine; the replay submits the step's own requests (sizes, kinds, order) at once. "
               "eff_minus_adam assumes AdamW never overlaps the I/O, so it is an upper bound; eff_busy is the rate "
               "while swap requests were in flight (its gap to eff_step is pipeline idle time).")
    return "\n".join(out)


def main(argv=None) -> int:
    a = parse_args(argv)
    a.path = os.path.abspath(a.path)
    os.makedirs(a.path, exist_ok=True)
    dev = block_device(a.path)
    rep = {"benchmark": "nvme_bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "command": "python benchmarks/nvme_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "path": a.path, "fs_type": fs_type(a.path), "block_device": dev,
           "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "torch_threads": torch.get_num_threads()},
           "versions": {"torch": torch.__version__, "zero_strategy": zs.__version__, "python": sys.version.split()[0]},
           "loadavg_start": loadavg()}
    t0 = time.perf_counter()
    raw_file = None if a.skip_raw else RawFile(a.path, a.size, a.buffer_size, a.io_threads)
    try:
        if raw_file is not None:
            rep["raw"] = raw_bench(a, raw_file, dev)
        rep["loadavg_after_raw"] = loadavg()
        if not a.skip_engine:
            rep["engine"] = engine_bench(a, dev, raw_file)
    finally:
        if raw_file is not None:
            raw_file.close()
    rep["loadavg_end"] = loadavg()
    rep["total_s"] = time.perf_counter() - t0
    summarize(rep)
    print(format_table(rep), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rep, f, indent=1, default=str)
    print(f"nvme_bench: wrote {a.out} ({rep['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
