"""The systems `memory_lifecycle.py` compares, each doing every phase the way its users do it.

A system is one class with one method per phase; the driver times nothing and only
samples memory around each call, so what a method does is exactly what is measured:

* ``Zero``: our presets. Load is ``zero_strategy.transformers.from_pretrained`` (the model
  built empty) and ``zs.setup``, which reads each rank's slices of the safetensors; save is ``zs.save_checkpoint``; the Hugging Face save is
  ``model.save_pretrained(d, is_main_process=rank == 0)`` on every rank (what a user of
  ``PreTrainedModel`` writes); the export is ``zero-strategy consolidate`` in one process.
* ``DeepSpeed``: ZeRO-3 the way its Hugging Face users do it: ``HfDeepSpeedConfig`` kept
  alive, then ``from_pretrained`` (which then loads under ``zero.Init``), ``deepspeed.initialize``
  with its own optimizer section (CPUAdam when offloaded), ``save_checkpoint``/``load_checkpoint``,
  ``save_16bit_model``, and ``zero_to_fp32`` for the export. ``sub_group_size`` is 1e8:
  with the default 1e9 both ranks of the 748M model reach ~11 GiB at load.
* ``FSDP2``: ``fully_shard`` on every decoder layer and the root after a meta build,
  ``to_empty`` and ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
  from rank 0's read of the files (the torch DCP tutorial's way), DCP save/load, and
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` for the full state dict.
  Export is ``dcp_to_torch_save``.

Every phase method takes no argument and returns nothing, except ``export`` (a classmethod
run in a fresh single process after the ranks are gone), which returns an error string or None.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import torch
import torch.distributed as dist

ZERO_PRESETS = ("zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "zero3_offload_nvme")
DEEPSPEED = {"ds3": (None, None), "ds3_offload": ("cpu", "cpu"), "ds3_nvme": ("nvme", "nvme")}
FSDP = {"fsdp2": False, "fsdp2_offload": True}
PHASES = ("load", "train", "eval", "save", "resume", "hf_save", "full_state_dict")


def _batch(args, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)


def _dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.precision == "bf16" else torch.float32


class System:
    """Common phases: train and eval only differ in how a step is written."""

    def __init__(self, name: str, args, workdir: str):
        self.name, self.args, self.workdir = name, args, workdir
        self.rank = dist.get_rank()
        self.device = torch.device(args.device if args.device == "cpu" else f"cuda:{self.rank}")
        self.ckpt = os.path.join(workdir, "ckpt")
        self.hf_out = os.path.join(workdir, "hf_out")

    def forward_loss(self, ids):
        return self.model(input_ids=ids.to(self.device), labels=ids.to(self.device)).loss

    def train(self) -> None:
        """``--steps`` steps, each timed by part (forward, then what ``backward_step`` reports):
        the cost curve (infinity_curve.py) reads them from ``steps`` in the rank's JSON."""
        self.model.train()  # (from_pretrained returns a model in eval mode)
        self.steps = []
        for step in range(self.args.steps):
            probe = getattr(self, "io_probe", None)
            mark = probe.mark() if probe else None
            t0 = time.perf_counter()
            loss = self.forward_loss(_batch(self.args, step, self.rank))
            t1 = time.perf_counter()
            parts = self.backward_step(loss) or {}
            t2 = time.perf_counter()
            rec = {"wall_s": t2 - t0, "forward_s": t1 - t0, **parts, "load_average": os.getloadavg()[0]}
            if probe:
                rec.update(probe.since(mark, t0, t2))
            self.steps.append(rec)

    def eval(self) -> None:
        self.model.eval()
        with torch.no_grad():
            self.forward_loss(_batch(self.args, 10**6, self.rank))
        self.model.train()


class Zero(System):
    def load(self) -> None:
        import zero_strategy as zs
        from transformers import AutoModelForCausalLM
        from zero_strategy.transformers import from_pretrained

        model = from_pretrained(AutoModelForCausalLM, self.args.model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        kw = {}
        if "nvme" in self.name:
            nvme = zs.NVMeOffload(path=os.path.join(self.workdir, "swap"))
            kw = dict(offload_optimizer=nvme, offload_params=nvme)
        config = zs.ZeroConfig.preset(self.name, precision=self.args.precision, **kw)
        # what a user choosing this preset is told, from the model before setup (issue 27 item 6)
        self.estimate = zs.estimate_memory(model, world_size=dist.get_world_size(), config=config, optimizer="adamw",
                                           device=self.device.type).to_dict()
        self.model, self.optimizer = zs.setup(model, optimizer, config, device=self.device)
        if "nvme" in self.name:
            self.io_probe = SwapProbe(zs.api._engine_of(self.model).swap)

    def backward_step(self, loss) -> dict:
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self.optimizer.zero_grad()
        return {"backward_s": t1 - t0, "optimizer_s": t2 - t1, "zero_grad_s": time.perf_counter() - t2}

    def save(self) -> None:
        import zero_strategy as zs
        zs.save_checkpoint(self.ckpt, self.model, self.optimizer)

    def resume(self) -> None:
        import zero_strategy as zs
        zs.load_checkpoint(self.ckpt, self.model, self.optimizer)

    def hf_save(self) -> None:
        self.model.save_pretrained(self.hf_out, is_main_process=self.rank == 0)

    def full_state_dict(self) -> None:
        import zero_strategy as zs
        self.kept = zs.full_state_dict(self.model, rank0_only=True)  # held to the phase's end, as a user would

    def engine_report(self) -> dict:
        import zero_strategy as zs
        rep = zs.memory_report(self.model, reset_peak=True)  # the working set's peak of this phase
        return {"engine_total": rep.total, "engine_host": rep.host_bytes, "engine_device": rep.device_bytes,
                "engine_peak_working_set": rep.peak_working_set_bytes}

    @classmethod
    def export(cls, workdir: str) -> str | None:
        from zero_strategy.checkpoint import consolidate
        consolidate(os.path.join(workdir, "ckpt"), os.path.join(workdir, "export"))
        return None


class DeepSpeed(System):
    def _config(self) -> dict:
        off_opt, off_par = DEEPSPEED[self.name]
        sub_group = int(getattr(self.args, "ds_sub_group_size", 1e8))
        zero = {"stage": 3, "sub_group_size": sub_group, "stage3_gather_16bit_weights_on_model_save": True}
        swap = os.path.join(self.workdir, "swap")
        for key, where in (("offload_optimizer", off_opt), ("offload_param", off_par)):
            if where == "nvme":
                zero[key] = {"device": "nvme", "nvme_path": swap, "pin_memory": False}
            elif where == "cpu":
                zero[key] = {"device": "cpu", "pin_memory": False}
        return {
            "train_micro_batch_size_per_gpu": self.args.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
            "bf16": {"enabled": self.args.precision == "bf16"},
            "steps_per_print": 10**9, "wall_clock_breakdown": False,
        }

    def load(self) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM
        from transformers.integrations import HfDeepSpeedConfig

        conf = self._config()
        self._hf_ds = HfDeepSpeedConfig(conf)  # must stay alive: from_pretrained then loads under zero.Init
        model = AutoModelForCausalLM.from_pretrained(self.args.model_dir, dtype=_dtype(self.args))
        self.model, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                config=conf)

    def backward_step(self, loss) -> dict:
        t0 = time.perf_counter()
        self.model.backward(loss)
        t1 = time.perf_counter()
        self.model.step()
        return {"backward_s": t1 - t0, "optimizer_s": time.perf_counter() - t1}

    def save(self) -> None:
        self.model.save_checkpoint(self.ckpt)

    def resume(self) -> None:
        self.model.load_checkpoint(self.ckpt)

    def hf_save(self) -> None:
        self.model.save_16bit_model(self.hf_out)

    def full_state_dict(self) -> None:
        self.kept = self.model._zero3_consolidated_16bit_state_dict()

    def engine_report(self) -> dict:
        return {}

    @classmethod
    def export(cls, workdir: str) -> str | None:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        try:
            get_fp32_state_dict_from_zero_checkpoint(os.path.join(workdir, "ckpt"))
        except Exception as e:  # the finding is the failure itself: record it, don't hide it
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        return None


class FSDP2(System):
    def load(self) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.from_pretrained(self.args.model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        kw = {}
        if self.args.precision == "bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if FSDP[self.name]:
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        model.to_empty(device=self.device)
        with torch.no_grad():  # rotary buffers are computed at construction, not stored: rebuild them
            for module in model.modules():
                if hasattr(module, "inv_freq") and hasattr(module, "config"):
                    fresh = type(module)(module.config)
                    for name, buf in fresh.named_buffers(recurse=False):
                        getattr(module, name).copy_(buf)
        full = {}
        if self.rank == 0:
            for f in sorted(os.listdir(self.args.model_dir)):
                if f.endswith(".safetensors"):
                    full.update(load_file(os.path.join(self.args.model_dir, f)))
            if cfg.tie_word_embeddings:
                full.pop("lm_head.weight", None)
            full = {k: v.float() for k, v in full.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                   strict=False))
        del full
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def backward_step(self, loss) -> dict:
        t0 = time.perf_counter()
        loss.backward()
        t1 = time.perf_counter()
        self.optimizer.step()
        t2 = time.perf_counter()
        self.optimizer.zero_grad()
        return {"backward_s": t1 - t0, "optimizer_s": t2 - t1, "zero_grad_s": time.perf_counter() - t2}

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self) -> None:
        import torch.distributed.checkpoint as dcp
        if self.rank == 0:
            shutil.rmtree(self.ckpt, ignore_errors=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=self.ckpt)

    def resume(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        state = self._state()
        dcp.load(state, checkpoint_id=self.ckpt)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def _full(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def hf_save(self) -> None:
        full = self._full()
        if self.rank == 0:
            self.model.save_pretrained(self.hf_out, state_dict=full)
        dist.barrier()

    def full_state_dict(self) -> None:
        self.kept = self._full()

    def engine_report(self) -> dict:
        return {}

    @classmethod
    def export(cls, workdir: str) -> str | None:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(os.path.join(workdir, "ckpt"), os.path.join(workdir, "export.pt"))
        return None


class SwapProbe:
    """What the NVMe store's disk and the training thread did during a step, without engine changes.

    Methods are wrapped on the instances (the swap file's ``_io_chunk``, the store's
    ``wait_writes`` and its pool's ``acquire``) and the ``wait_all`` the NVMe modules imported:
    every I/O request is time-stamped (disk busy = the union of their spans), and the time the
    training path spends inside a wait is the union of those waits' spans on its two threads: the
    main thread's (forward and backward read parameters) and the CPU step worker's
    (``zero-cpu-step``: the optimizer step runs there while the main thread waits for it,
    unwrapped, so nothing counts twice); the I/O threads and the write-back finisher are not
    the step's path. Bytes are the swap file's own counters (counted when requests are submitted).
    """

    def __init__(self, store):
        from zero_strategy._mechanisms import nvme, nvme_stream
        self.file, self.io, self.waits = store.file, [], []
        self._lock = threading.Lock()
        chunk = self.file._io_chunk

        def timed_io(write, buf, offset):
            t0 = time.perf_counter()
            chunk(write, buf, offset)
            with self._lock:
                self.io.append((t0, time.perf_counter(), write, buf.numel()))
        self.file._io_chunk = timed_io
        for owner, name in ((nvme, "wait_all"), (nvme_stream, "wait_all"), (store, "wait_writes"),
                            (store.pool, "acquire")):
            setattr(owner, name, self._waited(getattr(owner, name)))

    def _waited(self, fn):
        def wrapper(*args, **kw):
            thread = threading.current_thread()
            if thread is not threading.main_thread() and not thread.name.startswith("zero-cpu-step"):
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                with self._lock:
                    self.waits.append((t0, time.perf_counter()))
        return wrapper

    def mark(self) -> tuple[int, int]:
        with self._lock:
            self.io.clear()
            self.waits.clear()
        return self.file.bytes_read, self.file.bytes_written

    def since(self, mark: tuple[int, int], t0: float, t1: float) -> dict:
        with self._lock:
            io = [x for x in self.io if x[0] >= t0 and x[1] <= t1]
            waits = list(self.waits)
        return {"read_bytes": self.file.bytes_read - mark[0], "written_bytes": self.file.bytes_written - mark[1],
                "disk_busy_s": union_length([(a, b) for a, b, *_ in io]),
                "disk_read_busy_s": union_length([(a, b) for a, b, w, _ in io if not w]),
                "disk_write_busy_s": union_length([(a, b) for a, b, w, _ in io if w]),
                "waiting_s": union_length(waits), "io_requests": len(io)}


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def system_class(name: str) -> type:
    if name in ZERO_PRESETS:
        return Zero
    if name in DEEPSPEED:
        return DeepSpeed
    if name in FSDP:
        return FSDP2
    raise SystemExit(f"unknown system {name!r}: choose from {', '.join(ZERO_PRESETS + tuple(DEEPSPEED) + tuple(FSDP))}")
