"""CPU benchmark: checkpoint save and load throughput against the disk's raw O_DIRECT write and read,
2 ranks, gloo (issue 42 item 5, issue 44 item 1: at least 80% of the raw write and read).

The model is a Llama (``--layers`` x ``--hidden``, default 12 x 1024, vocab 32000: 219.7M parameters)
at stage 3 with AdamW after one step, so each rank's file holds its fp32 master shard and both
moments (12 bytes a parameter, 2.6 GB over the 2 ranks). Each round measures, in turns (the order
rotated each round, so a neighbour's load falls on every system alike):

* ``raw_write``: each rank writes a file of its checkpoint file's size (rounded up to 4 KiB) to the
  same directory with ``O_DIRECT`` from an aligned buffer (an anonymous ``mmap``) in ``--chunk``
  pieces, then fsyncs it: the disk's write limit for this pattern;
* ``save``: ``zero_strategy.checkpoint.save_checkpoint`` (every byte hashed, fsynced, metadata,
  atomic replacement of the previous round's checkpoint);
* ``raw_read``: each rank reads the file ``raw_write`` left with ``O_DIRECT``;
* ``load``: a resume: ``zero_strategy.checkpoint.load_checkpoint`` into a model and optimizer set
  up afresh before the round, as a new process has them (no optimizer state yet; every file's
  digest checked before anything is copied, the optimizer state read while it is hashed), after
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the checkpoint's files
  so they come from the disk, not the page cache (only our own files are dropped: the disk is
  shared, and ``drop_caches`` would change other jobs' figures).

Throughput is the bytes of both ranks over the slower rank's time; each figure is the median over
rounds, the ratio ``save / raw_write`` and ``load / raw_read`` the median of the per-round ratios,
with the 1-minute load average at each measurement. After the rounds, one more save and load run with
rank 0 under ``cProfile``, to split its time into hashing, writing or reading, fsync and the rest
(the profiler slows the rest; the split is a guide, the rounds are the figures).

Usage (from the repository root)::

    python benchmarks/checkpoint_io_bench.py                         # 3 rounds, 219.7M parameters
    python benchmarks/checkpoint_io_bench.py --layers 2 --hidden 256 --rounds 1   # quick check

It re-launches itself under ``torch.distributed.run --nproc-per-node 2``; rank 0 prints the table
and writes ``benchmarks/out/checkpoint_io_bench.json`` (``--out``). ``--dir``: where the files go
(default: a temporary directory under the system's temporary root; the disk under test).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import mmap
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_OUT = os.path.join(HERE, "out", "checkpoint_io_bench.json")
ALIGN = 4096
SYSTEMS = ["raw_write", "save", "raw_read", "load"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunk", type=int, default=64, help="MiB per O_DIRECT write or read")
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--no-profile", action="store_true", help="skip the profiled save")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args) -> int:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if os.path.exists(args.out):
        os.remove(args.out)
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    subprocess.run(cmd, env=env, cwd=REPO, timeout=3600)
    return 0 if os.path.exists(args.out) else 1


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden,
                      intermediate_size=int(args.hidden * 2.75), num_attention_heads=max(1, args.hidden // 64),
                      vocab_size=args.vocab, tie_word_embeddings=False, use_cache=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------ the raw disk
def raw_write(path: str, nbytes: int, buf: mmap.mmap) -> None:
    """Write ``nbytes`` (a multiple of ALIGN) to ``path`` with O_DIRECT from ``buf``, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        view, done = memoryview(buf), 0
        while done < nbytes:
            done += os.write(fd, view[:min(len(buf), nbytes - done)])
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_read(path: str, buf: mmap.mmap) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = 0
        while True:
            n = os.readv(fd, [buf])
            got += n
            if n < len(buf):
                return got
    finally:
        os.close(fd)


def drop_cached(paths) -> None:
    """Drop our own files from the page cache (clean pages: they were fsynced)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_of(d: str) -> list[str]:
    return [os.path.join(d, f) for f in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, f))]


# ------------------------------------------------------------------ the ranks
def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zero_strategy as zs
    from zero_strategy.checkpoint import load_checkpoint, save_checkpoint
    from zero_strategy.checkpoint._layout import rank_file_name

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    holder = [args.dir or (tempfile.mkdtemp(prefix="checkpoint_io_bench-") if rank == 0 else None)]
    dist.broadcast_object_list(holder, src=0)
    root = holder[0]
    os.makedirs(root, exist_ok=True)
    model = build(args)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = zs.setup(model, optimizer, zs.ZeroConfig(stage=3))
    ids = torch.randint(0, args.vocab, (1, 8), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()  # one step: the Adam moments exist
    optimizer.step()
    optimizer.zero_grad()

    ckpt = os.path.join(root, "ckpt")
    save_checkpoint(ckpt, model, optimizer)  # warm-up; its size sets the raw files'
    my_file = os.path.join(ckpt, rank_file_name(rank, dist.get_world_size()))
    ckpt_bytes = sum(os.path.getsize(f) for f in files_of(ckpt))
    mine = os.path.getsize(my_file)
    raw_bytes = -(-mine // ALIGN) * ALIGN
    raw_path = os.path.join(root, f"raw-{rank}.bin")
    buf = mmap.mmap(-1, args.chunk << 20)  # page-aligned: O_DIRECT's alignment
    buf.write(os.urandom(1 << 20) * (args.chunk))
    total_raw = torch.tensor([raw_bytes], dtype=torch.int64)
    dist.all_reduce(total_raw)
    total_raw = int(total_raw)
    raw_write(raw_path, raw_bytes, buf)
    resumed: list = []  # the model and optimizer a load resumes, set up afresh for each

    def fresh() -> tuple:
        if resumed:
            zs.teardown(resumed.pop()[0], keep_weights=False)
        m = build(args)
        resumed.append(zs.setup(m, torch.optim.AdamW(m.parameters(), lr=1e-4), zs.ZeroConfig(stage=3)))
        return resumed[-1]

    def one(name: str) -> float:
        if name == "load":
            target = fresh()
            if rank == 0:
                drop_cached(files_of(ckpt))
        elif name == "raw_read":
            drop_cached([raw_path])
        dist.barrier()
        t = time.perf_counter()
        if name == "raw_write":
            raw_write(raw_path, raw_bytes, buf)
        elif name == "save":
            save_checkpoint(ckpt, model, optimizer)
        elif name == "raw_read":
            assert raw_read(raw_path, buf) == raw_bytes
        else:
            load_checkpoint(ckpt, *target)
        took = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return float(took)

    secs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    loads: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    for r in range(args.rounds):
        order = SYSTEMS[r % 4:] + SYSTEMS[:r % 4]
        for name in order:
            loads[name].append(os.getloadavg()[0])
            secs[name].append(one(name))
    profile = None if args.no_profile else {
        "save": profiled("save", ckpt, model, optimizer, rank), "load": profiled("load", ckpt, *fresh(), rank)}
    if rank == 0:
        report(args, n_params, ckpt_bytes, total_raw, secs, loads, profile)
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    else:
        os.remove(raw_path)
    dist.destroy_process_group()


def profiled(kind: str, ckpt, model, optimizer, rank) -> dict | None:
    """Rank 0's time in one save or load (its files dropped from the page cache first), split by
    where cProfile finds it; both ranks run it, only rank 0 profiles. A load is a resume, as in
    the rounds: ``model`` and ``optimizer`` freshly set up."""
    import torch.distributed as dist

    from zero_strategy.checkpoint import load_checkpoint, save_checkpoint

    if kind == "load" and rank == 0:
        drop_cached(files_of(ckpt))
    dist.barrier()
    prof = cProfile.Profile() if rank == 0 else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    if kind == "save":
        save_checkpoint(ckpt, model, optimizer)
    else:
        load_checkpoint(ckpt, model, optimizer)
    if prof is None:
        return None
    prof.disable()
    total = time.perf_counter() - t
    split = {"hash": 0.0, "write": 0.0, "read": 0.0, "fsync": 0.0, "lock waits": 0.0}
    for (_, _, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        if "HASH" in func or "xxhash" in func:  # hashlib's sha256, xxhash's xxh3_128
            split["hash"] += tottime
        elif func in ("<method 'write' of '_io.BufferedWriter' objects>", "<built-in method posix.write>"):
            split["write"] += tottime
        elif "readinto" in func or func in ("<built-in method posix.preadv>",
                                            "<method 'get_slice' of 'builtins.safe_open' objects>",
                                            "<method 'get_tensor' of 'builtins.safe_open' objects>"):
            split["read"] += tottime
        elif "fsync" in func:
            split["fsync"] += tottime
        elif "acquire" in func:
            split["lock waits"] += tottime
    split = {k: v for k, v in split.items() if v > 0}
    split["other"] = total - sum(split.values())
    split["total"] = total
    return split


def report(args, n_params, ckpt_bytes, raw_bytes, secs, loads, profile) -> None:
    nbytes = {"raw_write": raw_bytes, "raw_read": raw_bytes, "save": ckpt_bytes, "load": ckpt_bytes}
    gbs = {s: [nbytes[s] / t / 1e9 for t in secs[s]] for s in SYSTEMS}
    med = {s: statistics.median(gbs[s]) for s in SYSTEMS}
    ratio = {"save/raw_write": statistics.median(a / b for a, b in zip(gbs["save"], gbs["raw_write"])),
             "load/raw_read": statistics.median(a / b for a, b in zip(gbs["load"], gbs["raw_read"]))}
    rows = [f"{'system':<10}{'GB/s (median)':>15}{'per round':>30}{'load average':>22}"]
    for s in SYSTEMS:
        rows.append(f"{s:<10}{med[s]:>15.3f}{', '.join(f'{x:.3f}' for x in gbs[s]):>30}"
                    f"{', '.join(f'{x:.1f}' for x in loads[s]):>22}")
    print("\n".join(rows))
    print(f"save / raw write {ratio['save/raw_write']:.3f}; load / raw read {ratio['load/raw_read']:.3f} "
          f"(median of per-round ratios); {n_params / 1e6:.1f}M parameters, checkpoint {ckpt_bytes / 1e9:.3f} GB, "
          f"raw {raw_bytes / 1e9:.3f} GB in {args.chunk} MiB pieces")
    for kind, split in (profile or {}).items():
        print(f"rank 0's profiled {kind}, s: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "dir")},
           "parameters": n_params, "checkpoint_bytes": ckpt_bytes, "raw_bytes": raw_bytes,
           "seconds": secs, "gb_per_s": gbs, "median_gb_per_s": med, "ratios": ratio,
           "load_average_1min": loads, "rank0_profile_s": profile,
           "page_cache": "posix_fadvise(DONTNEED) on our own files before each read; raw I/O is O_DIRECT"}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
