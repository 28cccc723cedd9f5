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
        self.model.train()  # (from_pretrained returns a model in eval mode)
        for step in range(self.args.steps):
            loss = self.forward_loss(_batch(self.args, step, self.rank))
            self.backward_step(loss)

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

    def backward_step(self, loss) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

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
        zero = {"stage": 3, "sub_group_size": int(1e8), "stage3_gather_16bit_weights_on_model_save": True}
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

    def backward_step(self, loss) -> None:
        self.model.backward(loss)
        self.model.step()

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

    def backward_step(self, loss) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

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


def system_class(name: str) -> type:
    if name in ZERO_PRESETS:
        return Zero
    if name in DEEPSPEED:
        return DeepSpeed
    if name in FSDP:
        return FSDP2
    raise SystemExit(f"unknown system {name!r}: choose from {', '.join(ZERO_PRESETS + tuple(DEEPSPEED) + tuple(FSDP))}")
