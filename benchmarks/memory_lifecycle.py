"""Memory through a model's whole life: load, train, eval, save, resume, HF save, full state
dict and the offline export, measured as what each rank's process holds.

Why this and not ``zs.memory_report``: the report counts the engine's own model-state
tensors; a user runs out of memory on what the process holds (gathered units, gradient
buckets, staging buffers, a state dict being built, the allocator's leftovers). Each rank
samples its anonymous resident memory (``RssAnon`` of ``/proc/self/status``: heap and
anonymous mmaps, where tensors live; mapped files and the page cache left out) every 5 ms
in a thread and reports, per phase, the peak above its baseline (after imports and the
process group), in MiB and as a multiple of W, the model's fp32 weight bytes (4 bytes per
parameter). On a GPU it also reports ``torch.cuda.max_memory_allocated`` per phase. The
engine's own figure (``memory_report``) at the end of each phase stands beside it for our
presets, with the working set's peak of the phase; and beside the train phase, the estimate
a user choosing the preset is given (``estimate_memory`` from the model before setup:
resting model states + working set, device and host), recorded per system as ``estimate``.
glibc's allocator is left at its defaults, as in a user's process.

The model is a Llama of ``--layers``/``--hidden``/``--intermediate``/``--vocab`` (default
12/2048/5632/32000: 748M parameters, W = 2.99 GB), saved once as a bf16 Hugging Face
directory under ``--workdir`` and loaded from it by every system the way its users load.
What each system does per phase is in ``lifecycle_systems.py``.

Usage (from the repository root)::

    python benchmarks/memory_lifecycle.py                          # every preset, DeepSpeed, FSDP2
    python benchmarks/memory_lifecycle.py --systems zero3_offload_nvme,ds3_nvme --layers 4 --hidden 1024

Each system runs in fresh processes (``--nproc`` ranks, gloo on CPU, NCCL with ``--device
cuda``), then its export runs in one more process. The table goes to stdout, the figures to
``benchmarks/out/memory_lifecycle.json``. Memory figures do not depend on the machine's load
the way times do, but the load average is recorded beside them all the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SYSTEMS = ("zero1,zero2,zero2_offload,zero3,zero3_offload,zero3_offload_nvme,"
                   "ds3,ds3_offload,ds3_nvme,fsdp2,fsdp2_offload")
MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", default=DEFAULT_SYSTEMS)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--phases", default=None,
                   help="comma-separated phases to run, in their order (default: all; the cost curve runs load,train; "
                        "the export runs only after save)")
    p.add_argument("--ds-sub-group-size", dest="ds_sub_group_size", type=float, default=1e8,
                   help="DeepSpeed's zero_optimization.sub_group_size (elements)")
    p.add_argument("--floor", action="store_true",
                   help="NVMe systems of ours: after the phases, each rank moves its median timed step's swap bytes "
                        "with raw O_DIRECT requests (both ranks at once): the disk's floor for that step")
    p.add_argument("--warmup", type=int, default=1, help="steps of the train phase left out of --floor's median")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", default=None, help="model directory, checkpoints and swap files (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per system before its ranks are killed")
    p.add_argument("--out", default=os.path.join(HERE, "out", "memory_lifecycle.json"))
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # system name: run as one rank
    p.add_argument("--export", default=None, help=argparse.SUPPRESS)  # system name: run its export
    p.add_argument("--model-dir", dest="model_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--system-dir", dest="system_dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def anon_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakSampler:
    """The process's anonymous RSS sampled every ``interval`` seconds; ``peak`` since the last ``reset``."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.peak, self._stop = interval, anon_rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, anon_rss())

    def reset(self) -> None:
        self.peak = anon_rss()

    def read(self) -> int:
        return max(self.peak, anon_rss())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ensure_model(args, workdir: str) -> tuple[str, int]:
    """The bf16 Hugging Face directory of the benchmark's model (built once); its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                      max_position_embeddings=max(256, args.seq), tie_word_embeddings=False, use_cache=False)
    path = os.path.join(workdir, f"llama-{args.layers}x{args.hidden}x{args.intermediate}-v{args.vocab}")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path + ".tmp", safe_serialization=True, max_shard_size="2GB")
        del model
        os.replace(path + ".tmp", path)
    return path, n_params


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    """One rank: every phase in order, each bracketed by the sampler; writes its JSON."""
    import torch
    import torch.distributed as dist
    sys.path.insert(0, HERE)
    import lifecycle_systems as ls

    rank = int(os.environ["RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    import datetime
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=1800))
    cls = ls.system_class(args.worker)
    if cls is ls.DeepSpeed:
        import deepspeed  # noqa: F401  (its import is part of the baseline, as ours is)
    import transformers  # noqa: F401
    import zero_strategy  # noqa: F401
    sampler = PeakSampler()
    baseline = anon_rss()
    system = cls(args.worker, args, args.system_dir)
    phases, error = {}, None
    for phase in selected_phases(args):
        dist.barrier()
        sampler.reset()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            getattr(system, phase)()
        except Exception as e:  # a phase that fails is a finding: record it, stop this system
            error = f"{phase}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            break
        row = {"peak_anon": sampler.read() - baseline, "after_anon": anon_rss() - baseline}
        if args.device == "cuda":
            row["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        row.update(system.engine_report() if hasattr(system, "optimizer") else {})
        phases[phase] = row
        system.__dict__.pop("kept", None)
    sampler.stop()
    floor = None
    if args.floor and error is None and getattr(system, "io_probe", None) and getattr(system, "steps", None):
        dist.barrier()
        floor = disk_floor(system, args)
    with open(os.path.join(args.system_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "baseline_anon": baseline, "phases": phases, "error": error,
                   "estimate": getattr(system, "estimate", None), "steps": getattr(system, "steps", None),
                   "floor": floor}, f)
    dist.destroy_process_group()
    os._exit(0)


def selected_phases(args) -> list:
    import lifecycle_systems as ls
    if not args.phases:
        return list(ls.PHASES)
    wanted = args.phases.split(",")
    unknown = set(wanted) - set(ls.PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}: choose from {', '.join(ls.PHASES)}")
    return [p for p in ls.PHASES if p in wanted]


def disk_floor(system, args) -> dict:
    """The disk's time for this rank's step bytes, measured now: the median timed step's swap
    reads R and writes W replayed as raw O_DIRECT requests of the store's own request size on as
    many threads (nvme_bench.RawFile), both ranks at once (they share the disk as their steps
    do): R read alone, W written alone (with fsync), then R and W interleaved. The file is at most
    4 GiB (reads wrap around in its first half, writes in its second): O_DIRECT goes past the
    guest's page cache either way."""
    import statistics

    import torch.distributed as dist
    from nvme_bench import RawFile
    timed = system.steps[args.warmup:] or system.steps
    r = int(statistics.median(s["read_bytes"] for s in timed))
    w = int(statistics.median(s["written_bytes"] for s in timed))
    store_file = system.io_probe.file
    chunk, threads = store_file.chunk, len(store_file._io._threads)
    size = min(4 << 30, max(2 * chunk, -(-(r + w) // 4096) * 4096))
    f = RawFile(os.path.dirname(str(store_file.path)), size, chunk, threads)
    ops = lambda n, write: [(write, min(chunk, n - o)) for o in range(0, n, chunk)]  # noqa: E731
    try:
        f.run([(True, o, n) for o, n in f.requests(0, size)])  # allocate the blocks (the swap file's are)
        out = {"read_bytes": r, "written_bytes": w, "request_bytes": chunk, "threads": threads,
               "file_bytes": size, "o_direct": f.direct}
        for kind, reqs in (("read", ops(r, False)), ("write", ops(w, True)),
                           ("mixed", [x for pair in zip(ops(r, False), ops(w, True)) for x in pair]
                            + ops(r, False)[len(ops(w, True)):] + ops(w, True)[len(ops(r, False)):])):
            dist.barrier()
            res = f.run(f.layout(reqs))
            out[kind] = {"s": res["s"], "gbps": res["gbps"], "load_average": os.getloadavg()[0]}
        out["floor_s"] = out["read"]["s"] + out["write"]["s"]
        return out
    finally:
        f.close()


def export_worker(args) -> None:
    sys.path.insert(0, HERE)
    import lifecycle_systems as ls
    cls = ls.system_class(args.export)
    import torch  # noqa: F401
    import zero_strategy  # noqa: F401
    if cls is ls.DeepSpeed:
        import deepspeed  # noqa: F401
    sampler = PeakSampler()
    baseline = anon_rss()
    try:
        error = cls.export(args.system_dir)
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    row = {"peak_anon": sampler.read() - baseline, "error": error}
    sampler.stop()
    with open(os.path.join(args.system_dir, "export.json"), "w") as f:
        json.dump(row, f)
    os._exit(0)


def _common_argv(args) -> list:
    return [sys.executable, os.path.abspath(__file__), "--layers", str(args.layers), "--hidden", str(args.hidden),
            "--intermediate", str(args.intermediate), "--heads", str(args.heads), "--vocab", str(args.vocab),
            "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
            "--precision", args.precision, "--device", args.device, "--ds-sub-group-size", str(args.ds_sub_group_size),
            "--warmup", str(args.warmup)] + (["--phases", args.phases] if args.phases else []) + \
        (["--floor"] if args.floor else [])


def run_system(args, name: str, model_dir: str, workdir: str) -> dict:
    system_dir = os.path.join(workdir, name)
    shutil.rmtree(system_dir, ignore_errors=True)
    os.makedirs(system_dir)
    argv = _common_argv(args) + ["--model-dir", model_dir, "--system-dir", system_dir]
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.nproc),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    logs = [open(os.path.join(system_dir, f"rank{r}.log"), "w+") for r in range(args.nproc)]
    procs = [subprocess.Popen(argv + ["--worker", name], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(args.nproc)]
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    ranks = []
    for r in range(args.nproc):
        path = os.path.join(system_dir, f"rank{r}.json")
        ranks.append(json.load(open(path)) if os.path.exists(path)
                     else {"rank": r, "phases": {}, "error": f"no report (exit {procs[r].returncode})"})
        logs[r].seek(0)
        printed = logs[r].read()
        logs[r].close()
        sys.stdout.write(printed)  # what the rank printed, as before, once it is done
        if ranks[-1]["error"]:  # what it printed is the finding when it fails (kept: the dir is removed below)
            ranks[-1]["printed_tail"] = printed[-3000:]
    export = {"error": "not run: the ranks failed"}
    if "save" not in selected_phases(args):
        export = {"error": "not run: no save phase"}
    elif not any(r["error"] for r in ranks):
        subprocess.run(argv + ["--export", name], env=env, timeout=args.timeout)
        path = os.path.join(system_dir, "export.json")
        export = json.load(open(path)) if os.path.exists(path) else {"error": "no report"}
    shutil.rmtree(system_dir, ignore_errors=True)  # checkpoints and swap files of a large model fill the disk
    return {"ranks": ranks, "export": export, "load_average": os.getloadavg()[0],
            "estimate": ranks[0].get("estimate")}


def format_table(rep: dict) -> str:
    import lifecycle_systems as ls
    w = rep["W_bytes"]
    cols = list(ls.PHASES) + ["export"]
    lines = [f"per rank peak anonymous RSS above baseline, multiples of W = {w / 1e9:.2f} GB "
             f"(fp32 weights of {rep['parameters'] / 1e6:.0f}M parameters); rank 0 / rank 1; "
             "'-' = the phase did not run"]
    lines.append(f"{'system':20} " + " ".join(f"{c:>15}" for c in cols) + "  load  note")
    for name, res in rep["systems"].items():
        cells = []
        for c in ls.PHASES:
            vals = [r["phases"].get(c, {}).get("peak_anon") for r in res["ranks"]]
            cells.append("/".join("-" if v is None else f"{v / w:.2f}" for v in vals[:2]))
        e = res["export"]
        cells.append("fails" if e.get("error") else f"{e['peak_anon'] / w:.2f}")
        note = "; ".join(filter(None, [r.get("error") for r in res["ranks"][:1]] + [e.get("error")]))
        lines.append(f"{name:20} " + " ".join(f"{c:>15}" for c in cells) + f"  {res['load_average']:.1f}  {note}")
    estimates = [_estimate_line(name, res, w) for name, res in rep["systems"].items() if res.get("estimate")]
    if estimates:
        lines.append("estimate_memory beside the measured train phase, rank 0, multiples of W: estimated peak = "
                     "resting model states + working set (stage 1's buckets and NVMe's pool counted once); "
                     "measured: peak anonymous RSS above baseline (and cuda max_memory_allocated), the engine's own working-set peak")
        lines += estimates
    return "\n".join(lines)


def _estimate_line(name: str, res: dict, w: int) -> str:
    est, train = res["estimate"], res["ranks"][0]["phases"].get("train", {})
    x = lambda b: "n/a" if b is None else f"{b / w:.2f}"  # noqa: E731
    dev = (f"device: resting {x(est['total_device'])}, working set {x(est['working_set_device'])}, "
           f"peak {x(est['peak_device'])}")
    host = (f"host: resting {x(est['total_host'])}, working set {x(est['working_set_host'])}, "
            f"peak {x(est['peak_host'])}")
    both = None if est["peak_device"] is None else est["peak_device"] + est["peak_host"]
    measured = f"measured RSS {x(train.get('peak_anon'))}"
    if "cuda_max_allocated" in train:
        measured += f", cuda {x(train['cuda_max_allocated'])}"
    measured += f", engine working set {x(train.get('engine_peak_working_set'))}"
    return f"  {name:18} {dev}, {host} (sum {x(both)}); {measured}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    if args.export:
        export_worker(args)
    sys.path.insert(0, HERE)
    import lifecycle_systems as ls
    for name in args.systems.split(","):
        ls.system_class(name)  # unknown names fail before anything runs
    workdir = args.workdir or tempfile.mkdtemp(prefix="zs-lifecycle-")
    model_dir, n_params = ensure_model(args, workdir)
    import torch
    rep = {"parameters": n_params, "W_bytes": 4 * n_params, "config": {k: v for k, v in vars(args).items()
           if k not in ("worker", "export", "model_dir", "system_dir")}, "torch": torch.__version__, "systems": {}}
    for name in args.systems.split(","):
        print(f"running {name} ...", flush=True)
        rep["systems"][name] = run_system(args, name, model_dir, workdir)
    print(format_table(rep), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
