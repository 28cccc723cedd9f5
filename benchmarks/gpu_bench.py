"""One-GPU benchmark: plain GPU training vs zero_strategy (with and without CPU offload) vs peers, one run.

The peers' published anchor model: a Llama-style ``LlamaForCausalLM`` with
940.6M parameters (hidden 2048, 16 layers, 16 heads, intermediate 5504, vocab
32000, SDPA attention), batch 8 x 2048 tokens of random ids, the same batch every
step, world size 1.

Systems, in this order (the most important first, so a time-budget cut loses the
least), each built from the same seed and freed before the next:

* ``plain``: fp32 parameters on the GPU, ``torch.autocast(bfloat16)``,
  ``torch.optim.AdamW(fused=True)``;
* ``zero2_offload`` / ``zero3_offload`` (and ``*_overlap``: the same with ``overlap_step=True``): ``zs.setup(model, AdamW(fused=True),
  ZeroConfig.preset(...,precision="bf16"))``; the user's fused AdamW steps the fp32
  master shards on the CPU (stage 3 also rests the bf16 parameter shards in host memory);
* ``zero3_offload_nvme`` (opt-in: only when named in ``--systems``): the same with
  ``"zero3_offload_nvme"``: master shards, AdamW state and bf16 parameter shards rest in a
  swap file under ``$ZERO_STRATEGY_NVME_PATH`` (else ``/tmp``) and visit host memory
  while used; preset I/O settings (64 MiB requests, 4 I/O threads). Its JSON adds the
  swap traffic of the optimizer steps and their effective GB/s (compare with
  ``benchmarks/nvme_bench.py`` on the same directory). No target: nothing comparable
  runs in the same process;
* ``ds2_offload`` / ``ds3_offload``: DeepSpeed ZeRO-2 (optimizer offload) / ZeRO-3
  (optimizer + parameter offload) to pinned CPU memory, bf16, DeepSpeedCPUAdam
  (AdamW mode), ``gradient_clipping: 0``;
* ``fsdp2_offload``: ``fully_shard`` on each decoder layer then the root with
  ``CPUOffloadPolicy()`` and ``MixedPrecisionPolicy(bf16 params, fp32 reduce)``,
  ``torch.optim.AdamW`` (its default foreach kernel, as in ANCHORS.md) on the CPU;
* ``zero1`` / ``zero2`` / ``zero3``: our stages without offload, bf16.

The peers need a process group: a one-rank NCCL group is created from environment
variables (MASTER_ADDR/PORT, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0) just before the
first peer runs. A peer that cannot be imported gets a "not installed" row; on a
machine without CUDA the peers get "needs CUDA".

DeepSpeed compiles its CPUAdam op (a JIT C++ build, ~45 s) on first use: the
script loads it once at start-up when a DeepSpeed system is wanted, reports that
time as ``ds_cpu_adam_load_s`` and excludes it from every system's time (a warm
torch-extensions cache, e.g. from ``gpu_run.sh``, makes it ~1 s).

Per system: seconds per step (median of ``--steps`` after ``--warmup``, with
``torch.cuda.synchronize`` around each step), TFLOP/s = 6 * params * tokens / step
time, peak GPU memory (``torch.cuda.max_memory_allocated`` from after set-up
through the steps; the set-up peak is in the JSON), peak host memory, the loss of
every step, the ratio to ``plain`` and (offload rows) to DeepSpeed ZeRO-2 offload,
and the largest |loss - plain's loss| over the steps. Offload rows then run one
extra step with a synchronize between forward+backward and the optimizer step
(``--split``) to show where the time goes; it is not part of the median.

[Note: host memory]
The peak RSS of the process (VmHWM) is monotone over the whole run, so it cannot
tell the systems apart. Instead a sampling thread reads the resident set size
(``/proc/self/statm``) every ``--rss-interval`` seconds (20 ms); a system's host
memory is max(RSS while it runs) - RSS just before it was built, after the previous
system was freed (gc, ``empty_cache``, pinned host cache emptied, ``malloc_trim``).
``host_setup_peak_gib`` covers the build; ``host_peak_gib`` covers the steps.
Pinned (page-locked) host memory is resident, so it is counted. Peaks shorter
than the interval can be missed. Our rows also give ``zs.memory_report`` (the
model-state bytes the engine holds, by placement) for comparison.

    python benchmarks/gpu_bench.py                     # H200: under 5 minutes
    python benchmarks/gpu_bench.py --small             # 2 layers, hidden 256
    python benchmarks/gpu_bench.py --small --device cpu  # smoke test without a GPU
    python benchmarks/gpu_bench.py --systems plain,zero2_offload,ds2_offload
    ZERO_STRATEGY_NVME_PATH=/local_nvme python benchmarks/gpu_bench.py --systems plain,zero3_offload,zero3_offload_nvme
    /tmp/dsvenv/bin/python benchmarks/gpu_bench.py --small --device cpu --peers-on-cpu  # peers' code paths on CPU

Writes ``$OUT/gpu_bench.json`` if ``OUT`` is set, else ``benchmarks/out/gpu_bench.json``,
after every system (a run cut short still leaves the systems that finished).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SYSTEMS = ("plain", "zero2_offload", "zero3_offload", "zero2_offload_overlap", "zero3_offload_overlap",
           "zero3_offload_nvme", "ds2_offload", "ds3_offload", "fsdp2_offload", "zero1", "zero2", "zero3")
#: run only when named in --systems: the anchor model moves ~30 GB through the swap file per step (12 B/param
#: of master + AdamW state read and written, bf16 shards read in forward, backward and the step), ~15-20 s at
#: the device machine's 1.3-1.9 GB/s disk (ANCHORS.md); by default it would spend the time budget before the
#: DeepSpeed/FSDP2 rows the targets are checked against
OPT_IN = ("zero3_offload_nvme",)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in OPT_IN)
#: *_overlap: the same preset with overlap_step=True (each group's CPU step starts during backward)
OURS_OFFLOAD = ("zero2_offload", "zero3_offload", "zero2_offload_overlap", "zero3_offload_overlap")
#: our NVMe row: no step/memory target (nothing comparable in the same run), split step and swap I/O reported
OURS_NVME = ("zero3_offload_nvme",)
OFFLOAD = OURS_OFFLOAD + OURS_NVME + ("ds2_offload", "ds3_offload", "fsdp2_offload")
PEERS = ("ds2_offload", "ds3_offload", "fsdp2_offload")
#: targets for our offload rows (ANCHORS.md): step time vs DeepSpeed ZeRO-2 offload in the same run
STEP_TARGET_VS_DS2 = 0.60
#: our offload row -> the DeepSpeed row whose peak GPU memory it must not exceed
GPU_MEM_REFERENCE = {"zero2_offload": "ds2_offload", "zero3_offload": "ds3_offload",
                     "zero2_offload_overlap": "ds2_offload", "zero3_offload_overlap": "ds3_offload"}
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01  # torch AdamW defaults, used by every system

try:
    import zero_strategy as zs
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(REPO, "src"))
    import zero_strategy as zs

import torch

T_START = time.perf_counter()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="2 layers, hidden 256 (smoke test)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test only)")
    p.add_argument("--batch", type=int, default=None, help="default 8 (--small: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (--small: 128)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma list of " + ",".join(SYSTEMS) + " (default: all but " + ",".join(OPT_IN) + ")")
    p.add_argument("--no-split", dest="split", action="store_false",
                   help="skip the extra step that times forward+backward and the optimizer step apart")
    p.add_argument("--budget", type=float, default=270.0,
                   help="seconds since start after which remaining systems/steps are skipped")
    p.add_argument("--reserve", type=float, default=15.0,
                   help="do not start a new system with fewer than this many seconds of budget left")
    p.add_argument("--peers-on-cpu", action="store_true",
                   help="smoke-test the DeepSpeed/FSDP2 code paths with --device cpu (gloo, DS_ACCELERATOR=cpu)")
    p.add_argument("--rss-interval", type=float, default=0.02, help="host RSS sampling period, seconds")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json or benchmarks/out/)")
    a = p.parse_args(argv)
    if a.batch is None:
        a.batch = 2 if a.small else 8
    if a.seq is None:
        a.seq = 128 if a.small else 2048
    if a.out is None:
        base = os.environ.get("OUT") or os.path.join(HERE, "out")
        a.out = os.path.join(base, "gpu_bench.json")
    return a


def elapsed() -> float:
    return time.perf_counter() - T_START


def is_cuda(dev: torch.device) -> bool:
    return dev.type == "cuda"


def sync(dev):
    if is_cuda(dev):
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------- host memory
class RssSampler:
    """Samples this process's resident set size in a daemon thread (see [Note: host memory])."""

    def __init__(self, interval: float):
        self.interval = interval
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.baseline = self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:  # not Linux
            import psutil
            return psutil.Process().memory_info().rss

    def _run(self):
        while not self._stop.wait(self.interval):
            r = self.rss()
            if r > self.peak:
                self.peak = r

    def start_system(self) -> None:
        self.baseline = self.peak = self.rss()

    def restart_peak(self) -> None:
        self.peak = self.rss()

    def peak_delta_gib(self) -> float:
        return (max(self.peak, self.rss()) - self.baseline) / 2**30

    def stop(self) -> None:
        self._stop.set()


def empty_host_caches() -> None:
    """Give freed pinned blocks and freed malloc arenas back to the OS so RSS reflects what is live."""
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None and torch.cuda.is_available():
            try:
                fn()
                break
            except Exception:  # noqa: BLE001 - best effort
                pass
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def pinned_stats() -> dict | None:
    """The CUDA caching host (pinned) allocator's counters, when available."""
    if not torch.cuda.is_available():
        return None
    try:
        st = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001
        return None
    return {k: v for k, v in st.items() if "bytes" in k and ("current" in k or "peak" in k)}


# --------------------------------------------------------------------------- model and data
def make_model(a, dev):
    from transformers import LlamaConfig, LlamaForCausalLM
    if a.small:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=max(2048, a.seq))
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=32000, max_position_embeddings=max(2048, a.seq))
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    with torch.device(dev):  # every system is built on the same device so all start from the same weights
        model = LlamaForCausalLM(cfg)
    model.train()
    return model


def make_batch(a, dev, vocab):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (a.batch, a.seq), generator=g).to(dev)


def mem_gib(dev, peak=True):
    if not is_cuda(dev):
        return None
    return (torch.cuda.max_memory_allocated(dev) if peak else torch.cuda.memory_allocated(dev)) / 2**30


def free_all(dev):
    gc.collect()
    if is_cuda(dev):
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    empty_host_caches()


# --------------------------------------------------------------------------- peers
def peer_status(name: str, dev, on_cpu: bool = False) -> str | None:
    """None if the peer can run here, else the reason for its row."""
    if not is_cuda(dev) and not on_cpu:
        return "needs CUDA"
    if not is_cuda(dev):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if name.startswith("ds"):
            import deepspeed  # noqa: F401
        else:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: F401
    except ImportError as e:
        return f"not installed ({type(e).__name__}: {str(e)[:100]})"
    except Exception as e:  # noqa: BLE001 - installed but broken
        return f"import failed ({type(e).__name__}: {str(e)[:100]})"
    return None


def init_one_rank_group(use_deepspeed: bool) -> None:
    """A world of one for the peers: NCCL from environment variables (idempotent)."""
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"  # gloo: --peers-on-cpu smoke test only
    if use_deepspeed:
        import deepspeed
        deepspeed.init_distributed(dist_backend=backend)
    else:
        dist.init_process_group(backend)


def load_ds_cpu_adam(report: dict) -> None:
    """Build (or load from the torch-extensions cache) DeepSpeed's CPUAdam op, outside every timing."""
    t0 = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load()
        report["ds_cpu_adam_load_s"] = time.perf_counter() - t0
        print(f"[gpu_bench] DeepSpeed CPUAdam op ready in {report['ds_cpu_adam_load_s']:.1f} s "
              "(JIT build or cache load; not counted in any system)", flush=True)
    except Exception as e:  # noqa: BLE001 - the ds rows will fail with the same error
        report["ds_cpu_adam_load_error"] = f"{type(e).__name__}: {e}"[:500]
        traceback.print_exc()


# --------------------------------------------------------------------------- systems
class Built:
    """A system ready to train: ``fwd_bwd() -> loss``, ``opt_step()``, and what to free."""

    def __init__(self, fwd_bwd, opt_step, keep, params, info=None, report=None):
        self.fwd_bwd, self.opt_step, self.keep, self.params = fwd_bwd, opt_step, keep, params
        self.info = info or {}
        self.report = report  # optional () -> dict, measured after the steps
        self.close = lambda: None


def build_plain(a, dev, ids):
    model = make_model(a, dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)

    def fwd_bwd():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Built(fwd_bwd, opt_step, [model, opt], n)


def nvme_path() -> str:
    """Where zero3_offload_nvme puts its swap file: $ZERO_STRATEGY_NVME_PATH, else /tmp."""
    return os.environ.get("ZERO_STRATEGY_NVME_PATH") or "/tmp"


def build_ours(name, a, dev, ids):
    model = make_model(a, dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    overrides = {}
    if name in OURS_NVME:  # preset defaults (buffer_size 64 MiB, 4 I/O threads, ...) with the path set
        overrides = {"offload_optimizer": {"device": "nvme", "path": nvme_path()},
                     "offload_params": {"device": "nvme", "path": nvme_path()}}
    if name.endswith("_overlap"):
        name, overrides = name[:-len("_overlap")], {"overlap_step": True}
    # zero1/2/3, zero2_offload, zero3_offload, zero3_offload_nvme
    cfg = zs.ZeroConfig.preset(name, precision="bf16", **overrides)
    model, zopt = zs.setup(model, opt, cfg)
    swap = zs.api._engine_of(model).swap
    # swap traffic of the optimizer steps after the first (which creates AdamW's state and writes it whole)
    io = {"step_s": 0.0, "read": 0, "written": 0, "steps": 0, "calls": 0}

    def fwd_bwd():
        loss = model(input_ids=ids, labels=ids).loss
        zopt.backward(loss)
        return loss

    def opt_step():
        if swap is None:
            zopt.step()
        else:
            r, w, t = swap.file.bytes_read, swap.file.bytes_written, time.perf_counter()
            zopt.step()
            io["calls"] += 1
            if io["calls"] > 1:
                io["step_s"] += time.perf_counter() - t
                io["read"] += swap.file.bytes_read - r
                io["written"] += swap.file.bytes_written - w
                io["steps"] += 1
        zopt.zero_grad()

    def report():
        rep = zs.memory_report(model)
        return {"model_state_gib": {k: v / 2**30 for k, v in rep.by_category.items()},
                "model_state_by_placement_gib": {pl: {k: v / 2**30 for k, v in d.items() if v}
                                                 for pl, d in rep.by_placement.items()},
                "model_state_device_gib": rep.device_bytes / 2**30,
                "model_state_host_gib": rep.host_bytes / 2**30,
                **({} if swap is None else {"nvme": nvme_report()})}

    def nvme_report():
        # steps after the first (later warm-up, timed and split steps); optimizer-step bytes / step time: the swapper's
        # effective bandwidth, to compare with `python benchmarks/nvme_bench.py --path <same dir>`
        f = swap.file
        return {"path": str(f.path.parent), "o_direct": f.direct, "swap_file_gib": f.size / 2**30,
                "total_read_gib": f.bytes_read / 2**30, "total_written_gib": f.bytes_written / 2**30,
                "opt_steps": io["steps"],
                "opt_step_read_gib_per_step": io["read"] / max(1, io["steps"]) / 2**30,
                "opt_step_written_gib_per_step": io["written"] / max(1, io["steps"]) / 2**30,
                "opt_step_gbps": (io["read"] + io["written"]) / io["step_s"] / 1e9 if io["step_s"] else None}

    info = {"config": cfg.to_dict() if hasattr(cfg, "to_dict") else repr(cfg)}
    if swap is not None:
        info["nvme_path"] = str(swap.file.path.parent)
    built = Built(fwd_bwd, opt_step, [model, opt, zopt], n, info, report)
    if swap is not None:  # remove the swap file now, not at garbage collection
        built.close = lambda: zs.teardown(model, keep_weights=False)
    return built


def build_deepspeed(stage, a, dev, ids):
    import deepspeed
    init_one_rank_group(use_deepspeed=True)
    # The model is built normally (on the GPU, like every other system, so all start
    # from the same weights) and handed to deepspeed.initialize; no deepspeed.zero.Init:
    # ANCHORS.md saw an HF model built inside zero.Init start from wrong weights
    # (first loss 178 instead of ~10.9). Without zero.Init, ZeRO-3 partitions (and
    # offloads) the parameters inside initialize; only the set-up peak sees them whole.
    model = make_model(a, dev)
    n = sum(p.numel() for p in model.parameters())
    zo = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
          "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zo["offload_param"] = {"device": "cpu", "pin_memory": True}
    conf = {
        "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 by default: off, like every other system
        "bf16": {"enabled": True}, "zero_optimization": zo,
        # with offload_optimizer this is DeepSpeedCPUAdam(adamw_mode=True) (checked below)
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                  "weight_decay": WEIGHT_DECAY}},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    inner = getattr(optimizer, "optimizer", optimizer)
    info = {"deepspeed": deepspeed.__version__, "ds_config": conf, "cpu_optimizer": type(inner).__name__}

    def fwd_bwd():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        return loss

    def opt_step():
        engine.step()

    b = Built(fwd_bwd, opt_step, [engine, optimizer, model], n, info)
    b.close = lambda: engine.destroy() if hasattr(engine, "destroy") else None
    return b


def build_fsdp2(a, dev, ids):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    init_one_rank_group(use_deepspeed=False)
    # built on the GPU (same weights as every other system), then moved to the host:
    # with CPUOffloadPolicy fully_shard expects the parameters on the CPU
    model = make_model(a, dev).to("cpu")
    n = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # pinned host memory needs an accelerator: unpinned only in the --peers-on-cpu smoke test
    off = CPUOffloadPolicy() if torch.cuda.is_available() else CPUOffloadPolicy(pin_memory=False)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    # torch AdamW's default (foreach) kernel on the CPU shards, as in ANCHORS.md
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)

    def fwd_bwd():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def opt_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Built(fwd_bwd, opt_step, [model, opt], n, {"optimizer": "torch.optim.AdamW (foreach, CPU)"})


def build(name, a, dev, ids) -> Built:
    if name == "plain":
        return build_plain(a, dev, ids)
    if name.startswith("zero"):
        return build_ours(name, a, dev, ids)
    if name.startswith("ds"):
        return build_deepspeed(int(name[2]), a, dev, ids)
    return build_fsdp2(a, dev, ids)


def run_system(name, a, dev, ids, res, rss: RssSampler):
    """Build, train ``warmup + steps`` steps (+ one split step), fill ``res``; frees everything on return."""
    if is_cuda(dev):
        torch.cuda.reset_peak_memory_stats(dev)
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except Exception:  # noqa: BLE001 - older torch
            pass
    rss.start_system()
    res["host_rss_before_gib"] = rss.baseline / 2**30
    t0 = time.perf_counter()
    b = build(name, a, dev, ids)
    sync(dev)
    res.update(params=b.params, setup_s=time.perf_counter() - t0, setup_peak_gib=mem_gib(dev),
               host_setup_peak_gib=rss.peak_delta_gib(), **b.info)
    if is_cuda(dev):
        torch.cuda.reset_peak_memory_stats(dev)
    rss.restart_peak()
    times, losses = [], []
    try:
        for i in range(a.warmup + a.steps):
            if elapsed() > a.budget:
                res["note"] = f"stopped after {i} steps: time budget {a.budget:.0f} s spent"
                break
            sync(dev)
            t = time.perf_counter()
            loss = b.fwd_bwd()
            b.opt_step()
            sync(dev)
            dt = time.perf_counter() - t
            losses.append(float(loss.detach().float().item()))
            if i >= a.warmup:
                times.append(dt)
            print(f"[gpu_bench] {name} step {i}: {dt:.3f} s loss {losses[-1]:.4f}", flush=True)
        res.update(step_times_s=times, losses=losses, peak_gib=mem_gib(dev), host_peak_gib=rss.peak_delta_gib(),
                   pinned=pinned_stats())
        if a.split and name in OFFLOAD and times and elapsed() < a.budget:
            # one more step, synchronized between the phases: where the time goes (not in the median)
            sync(dev)
            t = time.perf_counter()
            loss = b.fwd_bwd()
            sync(dev)
            t1 = time.perf_counter()
            b.opt_step()
            sync(dev)
            t2 = time.perf_counter()
            res["split_s"] = {"fwd_bwd": t1 - t, "opt_step": t2 - t1, "loss": float(loss.detach().float().item())}
            print(f"[gpu_bench] {name} split step: forward+backward {t1 - t:.3f} s, optimizer step "
                  f"{t2 - t1:.3f} s", flush=True)
        if b.report is not None:
            res.update(b.report())
    finally:
        try:
            b.close()
        except Exception as e:  # noqa: BLE001
            res["close_error"] = f"{type(e).__name__}: {e}"[:200]
        b.keep.clear()
        del b
        gc.collect()


# --------------------------------------------------------------------------- main
def summarize(report, tokens) -> None:
    systems = report["systems"]

    def med(name):
        r = systems.get(name, {})
        return statistics.median(r["step_times_s"]) if r.get("step_times_s") else None

    plain_s, ds2_s = med("plain"), med("ds2_offload")
    plain_losses = systems.get("plain", {}).get("losses") or []
    for name, res in systems.items():
        s = med(name)
        if s is None:
            continue
        res["step_s"] = s
        res["tflops"] = 6 * res["params"] * tokens / s / 1e12
        res["ratio_vs_plain"] = s / plain_s if plain_s else None
        if name in OFFLOAD:
            res["ratio_vs_ds2_offload"] = s / ds2_s if ds2_s else None
        pairs = list(zip(res.get("losses", []), plain_losses))
        res["max_abs_dloss_vs_plain"] = max(abs(x - y) for x, y in pairs) if pairs and name != "plain" else None
        if name in OURS_OFFLOAD:
            ref = systems.get(GPU_MEM_REFERENCE[name], {})
            t = {"step_vs_ds2_max": STEP_TARGET_VS_DS2,
                 "step_ok": (s / ds2_s <= STEP_TARGET_VS_DS2) if ds2_s else None,
                 "gpu_peak_reference": GPU_MEM_REFERENCE[name],
                 "gpu_peak_ok": (res["peak_gib"] <= ref["peak_gib"])
                 if res.get("peak_gib") is not None and ref.get("peak_gib") is not None and ref.get("step_times_s")
                 else None}
            res["targets"] = t
    devs = [r["max_abs_dloss_vs_plain"] for r in systems.values() if r.get("max_abs_dloss_vs_plain") is not None]
    report["max_abs_dloss_vs_plain"] = max(devs) if devs else None


def write_json(report, path) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = torch.device(a.device)
    if is_cuda(dev) and not torch.cuda.is_available():
        print("gpu_bench: CUDA is not available; use --small --device cpu for a smoke test", file=sys.stderr)
        return 2
    import transformers
    wanted = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in wanted if s not in SYSTEMS]
    if bad:
        print(f"gpu_bench: unknown systems {bad}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    vocab = 32000
    ids = make_batch(a, dev, vocab)
    tokens = a.batch * a.seq
    report = {
        "benchmark": "gpu_bench", "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(dev) if is_cuda(dev) else platform.processor() or "cpu",
        "host": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "model": "LlamaForCausalLM " + ("small (2L, hidden 256)" if a.small else "anchor (16L, hidden 2048)"),
        "batch": [a.batch, a.seq], "tokens_per_step": tokens, "warmup": a.warmup, "steps": a.steps,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "zero_strategy": zs.__version__, "python": sys.version.split()[0]},
        "budget_s": a.budget, "rss_interval_s": a.rss_interval,
        "targets": {"offload_step_vs_ds2_offload_max": STEP_TARGET_VS_DS2,
                    "offload_peak_gpu": "<= the same-stage DeepSpeed offload row"},
        "systems": {},
    }
    unavailable = {s: peer_status(s, dev, a.peers_on_cpu) for s in wanted if s in PEERS}
    if any(s.startswith("ds") and unavailable.get(s) is None for s in wanted):
        import deepspeed
        report["versions"]["deepspeed"] = deepspeed.__version__
        load_ds_cpu_adam(report)
    rss = RssSampler(a.rss_interval)
    try:
        for name in wanted:
            res = {"system": name}
            report["systems"][name] = res
            if unavailable.get(name):
                res["status"] = unavailable[name]
                print(f"[gpu_bench] {name}: {res['status']}", flush=True)
                continue
            if elapsed() > a.budget - a.reserve:
                res["status"] = f"skipped: time budget {a.budget:.0f} s (less than {a.reserve:.0f} s left)"
                print(f"[gpu_bench] {name}: {res['status']}", flush=True)
                continue
            free_all(dev)
            res["gib_in_use_before"] = mem_gib(dev, peak=False)
            t0 = time.perf_counter()
            try:
                run_system(name, a, dev, ids, res, rss)
                res["status"] = "ok" if res.get("step_times_s") else "no timed steps"
            except torch.cuda.OutOfMemoryError as e:
                res["status"] = "OOM"
                res["error"] = str(e).splitlines()[0][:300]
                res["peak_gib"] = mem_gib(dev)
            except Exception as e:  # noqa: BLE001 - record and go on to the next system
                traceback.print_exc()
                res["status"] = "error"
                res["error"] = f"{type(e).__name__}: {e}"[:500]
            res["wall_s"] = time.perf_counter() - t0
            free_all(dev)
            print(f"[gpu_bench] {name}: {res['status']} in {res['wall_s']:.1f} s (total {elapsed():.0f} s)",
                  flush=True)
            summarize(report, tokens)
            report["total_wall_s"] = elapsed()
            write_json(report, a.out)
    finally:
        rss.stop()
    summarize(report, tokens)
    report["total_wall_s"] = elapsed()
    print(format_table(report), flush=True)
    write_json(report, a.out)
    print(f"gpu_bench: wrote {a.out} ({report['total_wall_s']:.0f} s)")
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def format_table(rep) -> str:
    cols = ["system", "s/step", "vs plain", "vs ds2off", "TFLOP/s", "GPU GiB", "host GiB", "setup s",
            "max|dloss|", "target"]
    rows = []
    for name, r in rep["systems"].items():
        if "step_s" not in r:
            rows.append([name, f"{r.get('status', '?')} {r.get('error', '')}".strip()])
            continue
        target = ""
        t = r.get("targets")
        if t:
            ok = lambda v: "?" if v is None else ("ok" if v else "MISS")  # noqa: E731
            target = f"step<={t['step_vs_ds2_max']:.2f}x {ok(t['step_ok'])}; GPU<=ds {ok(t['gpu_peak_ok'])}"
        rows.append([name, f"{r['step_s']:.3f}", _f(r.get("ratio_vs_plain"), ".3f"),
                     _f(r.get("ratio_vs_ds2_offload"), ".3f"), f"{r['tflops']:.1f}",
                     _f(r.get("peak_gib"), ".1f"), _f(r.get("host_peak_gib"), ".1f"), f"{r['setup_s']:.1f}",
                     _f(r.get("max_abs_dloss_vs_plain"), ".4f"), target])
    full = [r for r in rows if len(r) == len(cols)]
    w = [max([len(c)] + [len(r[i]) for r in full]) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i in (0, len(cols) - 1) else c.rjust(w[i])  # noqa: E731
                              for i, c in enumerate(r)).rstrip()
    out = [f"{rep['model']}, batch {rep['batch'][0]}x{rep['batch'][1]}, {rep['device']}, "
           f"median of {rep['steps']} steps after {rep['warmup']} warm-up",
           fmt(cols), "  ".join("-" * x for x in w)]
    for r in rows:
        out.append(fmt(r) if len(r) == len(cols) else f"{r[0].ljust(w[0])}  {r[1]}")
    out.append("")
    out.append("losses per step (warm-up included):")
    for name, r in rep["systems"].items():
        if r.get("losses"):
            out.append(f"  {name.ljust(w[0])}  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    splits = [(n, r["split_s"]) for n, r in rep["systems"].items() if r.get("split_s")]
    if splits:
        out.append("one extra step, synchronized between phases (s): forward+backward / optimizer step")
        for n, s in splits:
            out.append(f"  {n.ljust(w[0])}  {s['fwd_bwd']:.3f} / {s['opt_step']:.3f}")
    for n, r in rep["systems"].items():
        nv = r.get("nvme")
        if nv:
            out.append(f"{n}: swap file in {nv['path']} ({nv['swap_file_gib']:.1f} GiB, O_DIRECT {nv['o_direct']}); "
                       f"per optimizer step {nv['opt_step_read_gib_per_step']:.2f} GiB read / "
                       f"{nv['opt_step_written_gib_per_step']:.2f} GiB written = {_f(nv['opt_step_gbps'], '.2f')} GB/s "
                       f"over the step time")
    if rep.get("ds_cpu_adam_load_s") is not None:
        out.append(f"DeepSpeed CPUAdam op build/load at start-up: {rep['ds_cpu_adam_load_s']:.1f} s (not in any row)")
    out.append(f"max |loss - plain loss| over all systems and steps: {_f(rep.get('max_abs_dloss_vs_plain'), '.4f')}")
    out.append("plain: fp32 params + bf16 autocast + fused AdamW; zero*: zero_strategy bf16, fused AdamW on fp32 "
               "master shards (offload: on the CPU; _nvme: swapped to a file on disk); ds*_offload: DeepSpeed bf16 + CPUAdam; fsdp2_offload: "
               "fully_shard + CPUOffloadPolicy, bf16 params / fp32 reduce, foreach AdamW on the CPU; world size 1. "
               "TFLOP/s = 6*params*tokens/step. GPU GiB: max_memory_allocated during the steps. host GiB: "
               "max RSS during the steps minus RSS before the system was built. vs ds2off: step time / DeepSpeed "
               "ZeRO-2 offload's (targets: ours <= 0.60x, peak GPU <= the same-stage DeepSpeed row's).")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
