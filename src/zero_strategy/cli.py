"""``zero-strategy`` command line.

Subcommands register themselves in :data:`SUBCOMMANDS` as ``name -> (add_parser, run)``:
``add_parser(subparsers)`` adds the argparse subparser and ``run(args) -> int`` executes
it. ``estimate`` prints per-rank model-state memory for each ZeRO stage, and with ``--model``
the working set a step adds and the peak (resting + working set)::

    zero-strategy estimate --params 7e9 --world-size 8
    zero-strategy estimate --model ./llama-config-dir --stage 3 --offload-optimizer cpu --json
    zero-strategy estimate --model ./llama-dir --num-nodes 2 --gpus-per-node 8 --batch-size 8 --seq-len 4096

``consolidate`` streams a sharded checkpoint into one full model::

    zero-strategy consolidate ckpt/step-1000 ./model --dtype bf16 --max-shard-size 5GB --hf-config ./base

It reads a torch.distributed.checkpoint (DCP) directory of an FSDP2 run too. ``export`` writes a
checkpoint of ours as DCP, for an FSDP2 run to resume, or as a DeepSpeed universal checkpoint::

    zero-strategy export ckpt/step-1000 ./step-1000-dcp --format dcp
    zero-strategy export ckpt/step-1000 ./step-1000-ds --format deepspeed-universal
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import ZeroConfig, ZeroConfigError

__all__ = ["main", "build_parser", "SUBCOMMANDS"]

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``"7e9"``, ``"7B"``, ``"350M"``, ``"1,300,000"`` -> a number of parameters."""
    match = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; write e.g. 7e9, 7B or 350M")
    return float(match.group(1).replace(",", "").replace("_", "")) * _SUFFIXES[match.group(2).lower()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


# ------------------------------------------------------------------ estimate


def _add_estimate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate", help="per-rank model-state memory of each ZeRO stage, and its peak with the working set",
        description="Print per-rank model-state memory (parameters, gradients, optimizer state) for DDP and "
                    "the ZeRO stages, by location (device, host, NVMe), using the ZeRO paper's formulas, and "
                    "the working set a step adds (stage-3 gathered units, gradient buckets, staging buffers) "
                    "with the peak (resting + working set; the units need --model). "
                    "Activations are added with --model, --batch-size and --seq-len (per rank with --sp).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=parse_count, metavar="N", help="trainable parameters, e.g. 7e9 or 7B")
    source.add_argument("--model", metavar="PATH",
                        help="Hugging Face model directory or config.json (needs transformers; built on the "
                             "meta device, no weights are read)")
    parser.add_argument("--frozen", type=parse_count, default=0, metavar="N", help="frozen parameters (default 0)")
    parser.add_argument("--world-size", "-n", type=_positive_int, default=None, metavar="N", help="ranks (default 1)")
    parser.add_argument("--shard-group-size", type=_positive_int, default=None, metavar="K",
                        help="hybrid sharding: shard over groups of K ranks (default: all ranks)")
    parser.add_argument("--stage", type=int, choices=(0, 1, 2, 3),
                        help="one stage (0 = DDP); default: a table of all stages and usual offloads")
    parser.add_argument("--precision", default=None, help="compute dtype: bf16 (default), fp16 or fp32")
    parser.add_argument("--reduce-dtype", default=None, help="gradient dtype (default: the precision)")
    parser.add_argument("--optimizer", default="adam",
                        help="adam, adamw, sgd, sgd_momentum, adagrad, rmsprop, ... or state bytes per param")
    parser.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default=None)
    parser.add_argument("--offload-params", choices=("none", "cpu", "nvme"), default=None)
    parser.add_argument("--config", metavar="SPEC",
                        help="take stage/precision/offload from a preset name or a YAML/JSON/DeepSpeed config")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    nodes = parser.add_argument_group("per node (as DeepSpeed's estimate_zero3_model_states_mem_needs_all_live)")
    nodes.add_argument("--num-nodes", type=_positive_int, default=None, metavar="N",
                       help="nodes; with --gpus-per-node sets the world size and adds host/NVMe totals per node")
    nodes.add_argument("--gpus-per-node", type=_positive_int, default=None, metavar="G", help="ranks per node")
    acts = parser.add_argument_group("activations (needs --model: a Llama-style decoder)")
    acts.add_argument("--batch-size", type=_positive_int, default=None, metavar="B",
                      help="sequences per rank per micro-batch")
    acts.add_argument("--seq-len", type=_positive_int, default=None, metavar="S", help="tokens per sequence")
    acts.add_argument("--attention", choices=("eager", "sdpa"), default=None,
                      help="attention kernel (default: the config's, else sdpa as transformers picks)")
    acts.add_argument("--tiled-loss", type=_positive_int, nargs="?", const=0, default=None, metavar="CHUNK",
                      help="with the tiled loss (ZeroConfig tiled_loss), optionally its chunk in tokens")
    acts.add_argument("--tiled-mlp", type=_positive_int, nargs="?", const=0, default=None, metavar="CHUNK",
                      help="with the tiled MLP (ZeroConfig tiled_mlp), optionally its chunk in tokens")
    acts.add_argument("--sp", "--sequence-parallel-size", dest="sp", type=_positive_int, default=None, metavar="N",
                      help="Ulysses sequence parallelism (ZeroConfig sequence_parallel_size): N ranks share each "
                           "sequence of --seq-len tokens; activations are one rank's (default: the config's, else 1)")
    acts.add_argument("--activation-offload", action="store_true", default=None,
                      help="with activation offload (ZeroConfig activation_offload): the checkpointed layers' "
                           "inputs wait on the host")
    here = parser.add_argument_group("this machine: will the run fit its memory and disks?")
    here.add_argument("--this-machine", action="store_true",
                      help="set the ranks on this machine (--gpus-per-node, else --world-size) beside its free "
                           "memory and the free space of the disks below; without a GPU the table counts device "
                           "and host as one memory")
    here.add_argument("--nvme-path", default=None, metavar="DIR",
                      help="where the NVMe swap files go (default: the config's path, $ZERO_STRATEGY_NVME_PATH, "
                           "else the engine's default)")
    here.add_argument("--save-dir", default=".", metavar="DIR",
                      help="where checkpoints and the export go (default: the current directory)")


def _no_transformers() -> ZeroConfigError:
    return ZeroConfigError("--model", "needs the transformers package, which is not installed",
                           "pip install transformers, or pass --params.")


def _load_hf_config(path: str):
    """A model directory, its config.json, or a model name already in the Hugging Face cache
    (offline: nothing is downloaded)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise _no_transformers() from None
    target = Path(path)
    if not target.exists() and (target.is_absolute() or path.startswith(".") or path.count("/") > 1):
        raise ZeroConfigError("--model", f"{path} does not exist", "Pass a model directory or its config.json.")
    try:
        if not target.exists():  # a hub name: only from the local cache
            return AutoConfig.from_pretrained(path, local_files_only=True)
        return AutoConfig.from_pretrained(str(target), local_files_only=True) if target.is_dir() else \
            AutoConfig.from_pretrained(str(target.parent), local_files_only=True) if target.name == "config.json" \
            else AutoConfig.from_pretrained(str(target))
    except Exception as err:  # transformers raises OSError/ValueError/KeyError variants
        where = "in the local Hugging Face cache (nothing is downloaded)" if not target.exists() else f"from {path}"
        raise ZeroConfigError("--model", f"cannot read a Hugging Face config {where}: {err}",
                              "Pass a directory holding config.json, or a model name already downloaded.") from None


def _load_hf_model(path: str):
    """``(hf_config, model on the meta device)``: no weights are read or allocated."""
    hf_config = _load_hf_config(path)
    import torch
    try:
        from transformers import AutoModel, AutoModelForCausalLM
    except ImportError:
        raise _no_transformers() from None
    with torch.device("meta"):
        try:
            return hf_config, AutoModelForCausalLM.from_config(hf_config)
        except ValueError:  # not a causal LM (e.g. an encoder): the base model has the same parameters
            return hf_config, AutoModel.from_config(hf_config)


def _run_estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate_memory, format_table

    optimizer: str | int = int(args.optimizer) if args.optimizer.isdigit() else args.optimizer
    kwargs = dict(world_size=args.world_size or 1, stage=args.stage, optimizer=optimizer,
                  frozen_params=args.frozen, shard_group_size=args.shard_group_size)
    names = ("precision", "reduce_dtype", "offload_optimizer", "offload_params")
    if args.config is not None:
        for name in names:
            if getattr(args, name) is not None:
                raise ZeroConfigError(f"--{name.replace('_', '-')}", "given together with --config",
                                      "Use one of them (the config already sets it).")
        config = ZeroConfig.load(args.config)
        args.zero_config = config
        stage = config.stage if args.stage is None else args.stage  # --stage overrides the config
        if args.shard_group_size is None and isinstance(config.shard_group_size, int):
            kwargs["shard_group_size"] = config.shard_group_size
        kwargs.update(stage=stage, precision=config.precision, reduce_dtype=config.reduce_dtype,
                      offload_optimizer=config.offload_optimizer if stage else None,
                      offload_params=config.offload_params if stage == 3 else None)
    else:
        kwargs.update({name: getattr(args, name) for name in names})
    _apply_nodes(args, kwargs)
    hf_config, model = _load_hf_model(args.model) if args.model else (None, args.params)
    if args.this_machine:
        from ._estimate_machine import gpu_free_bytes
        args.gpu_free = gpu_free_bytes()
        if args.gpu_free is None:
            kwargs["device"] = "cpu"  # no GPU here: device and host are one memory
    result = estimate_memory(model, **kwargs)
    estimates = result if isinstance(result, list) else [result]
    extras = _extras(args, hf_config, model, estimates, kwargs)
    if args.this_machine:
        _this_machine(args, estimates, extras, config if args.config is not None else None)
    if args.json:
        print(json.dumps([{**e.to_dict(), **extra} for e, extra in zip(estimates, extras["rows"])], indent=2))
    else:
        print(format_table(estimates))
        for line in extras["lines"]:
            print(line)
    return 0


def _apply_nodes(args: argparse.Namespace, kwargs: dict) -> None:
    """--num-nodes x --gpus-per-node is the world size (and must agree with --world-size if given)."""
    if (args.num_nodes is None) != (args.gpus_per_node is None):
        raise ZeroConfigError("--num-nodes", "needs --gpus-per-node too (and the other way round)",
                              "Pass both, e.g. --num-nodes 2 --gpus-per-node 8.")
    if args.num_nodes is None:
        return
    world = args.num_nodes * args.gpus_per_node
    if args.world_size is not None and args.world_size != world:
        raise ZeroConfigError("--world-size", f"{args.world_size} disagrees with --num-nodes x --gpus-per-node "
                              f"= {world}", "Drop --world-size, or make them agree.")
    kwargs["world_size"] = world


def _extras(args, hf_config, model, estimates, kwargs) -> dict:
    """Per-node host/NVMe totals, the model's units and activations: extra keys per JSON row
    and extra lines under the table."""
    from .estimate import estimate_activations, unit_sizes

    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    rows: list[dict] = [{} for _ in estimates]
    lines: list[str] = []
    if args.gpus_per_node is not None:
        lines.append(f"per node ({args.num_nodes} node(s) x {args.gpus_per_node} ranks):")
        for est, row in zip(estimates, rows):
            row.update(host_per_node=est.total_host * args.gpus_per_node,
                       nvme_per_node=est.nvme_bytes * args.gpus_per_node)
            if est.peak_host is not None:
                row["peak_host_per_node"] = est.peak_host * args.gpus_per_node
            peak = "" if est.peak_host is None else f" (peak {gib(row['peak_host_per_node'])})"
            lines.append(f"  {est.label:<28} host {gib(row['host_per_node'])}{peak}, "
                         f"nvme {gib(row['nvme_per_node'])}")
    if hf_config is not None:
        units = unit_sizes(model)
        lines.append(f"units: {units.count}, largest {units.largest:,} parameters, root (outside units) "
                     f"{units.root:,}; the working set (dev work, and the peaks) counts the root + the unit in "
                     "use + 1 prefetched gathered (stage 3), the gradient buckets in flight, and the staging "
                     "buffers")
        for row in rows:
            row.update(largest_unit_params=units.largest, root_params=units.root, units=units.count)
    elif any(e.peak_device is None and e.stage for e in estimates):
        lines.append("working set: the stage 2-3 gradient buckets and the stage-3 gathered units need the "
                     "model's unit sizes: pass --model DIR (n/a in the table)")
    if (args.batch_size is None) != (args.seq_len is None):
        raise ZeroConfigError("--batch-size", "needs --seq-len too (and the other way round)",
                              "Pass both, e.g. --batch-size 8 --seq-len 4096.")
    if args.batch_size is not None:
        if hf_config is None:
            raise ZeroConfigError("--batch-size", "activations need the model's shape",
                                  "Pass --model DIR (a Hugging Face config) instead of --params.")
        config = getattr(args, "zero_config", None)  # --config's tiling, SP and offload, unless given here
        tiled = _chunk_flag(args.tiled_loss, config.tiled_loss if config is not None else False)
        tiled_mlp = _chunk_flag(args.tiled_mlp, config.tiled_mlp if config is not None else False)
        sp = args.sp or (config.sequence_parallel_size if config is not None else 1)
        offload = bool(args.activation_offload or (config is not None and config.activation_offload))
        world = kwargs["world_size"]
        if sp > 1 and world % sp:
            raise ZeroConfigError("--sp", f"{sp} must divide the world size, {world}",
                                  "Pass a divisor of --world-size (the other factor is data parallel).")
        act = estimate_activations(hf_config, args.batch_size, args.seq_len, estimates[0].precision, args.attention,
                                   tiled_loss=tiled, tiled_mlp=tiled_mlp, sequence_parallel_size=sp,
                                   activation_offload=offload)
        for row in rows:
            row["activations"] = act.to_dict()
        split = (f", sequence parallel over {sp} ranks: {act.local_seq_len} tokens of each sequence per rank"
                 if sp > 1 else "")
        lines.append(f"activations per rank ({act.batch_size} x {act.seq_len} tokens, {act.precision}, "
                     f"{act.attention} attention{split}): {gib(act.without_checkpointing)} without checkpointing, "
                     f"{gib(act.with_checkpointing)} with one checkpoint per layer (peak: every layer's input "
                     "+ one layer recomputed)")
        if offload:
            lines.append(f"  activation offload: {gib(act.host_bytes)} of layer inputs wait in host memory "
                         "(with checkpointing)")
        loss = (f"the tiled loss ({act.tiled_loss} tokens a chunk)" if act.tiled_loss else
                "the model's own loss (--tiled-loss to tile it)")
        lines.append(f"  the loss adds {gib(act.loss_transient)} at the start of backward with {loss}: peak "
                     f"{gib(act.peak_without_checkpointing)} without checkpointing, "
                     f"{gib(act.peak_with_checkpointing)} with")
    return {"rows": rows, "lines": lines}


def _chunk_flag(given: int | None, configured: bool | int) -> bool | int:
    """``--tiled-loss [CHUNK]`` / ``--tiled-mlp [CHUNK]``: absent -> the config's; bare -> True."""
    return configured if given is None else (given or True)


def _this_machine(args, estimates, extras: dict, config: ZeroConfig | None) -> None:
    """Each setup's needs on this machine beside its free memory and disks: a ``this_machine``
    key per JSON row and lines under the table (see _estimate_machine.py)."""
    import os

    from ._estimate_machine import fit_on_this_machine
    from ._mechanisms.available_memory import host_available_bytes, human_bytes
    from ._mechanisms.nvme_files import default_base
    from .config import NVMeOffload

    ranks = args.gpus_per_node or args.world_size or 1
    policy = next((p for p in (getattr(config, "offload_optimizer", None), getattr(config, "offload_params", None))
                   if isinstance(p, NVMeOffload) and p.path), None)
    nvme_path = args.nvme_path or (policy.path if policy else None) or os.environ.get("ZERO_STRATEGY_NVME_PATH") \
        or str(default_base())
    activations = next((row["activations"]["with_checkpointing"] for row in extras["rows"] if "activations" in row), 0)
    memory = host_available_bytes()
    fits = [fit_on_this_machine(est, ranks, nvme_path, args.save_dir, activation_bytes=activations,
                                memory_available=memory, gpu_free=args.gpu_free, has_gpu=args.gpu_free is not None)
            for est in estimates]
    first = fits[0]
    gpu = "no GPU (device and host are one memory)" if args.gpu_free is None else \
        f"{human_bytes(args.gpu_free)} free on the fullest GPU"
    disks = (f"{_free_text(first.swap_free)} free on the disk of {nvme_path} (swap files) and {args.save_dir} "
             "(checkpoint, export)" if first.same_disk else
             f"{_free_text(first.swap_free)} free at {nvme_path} (swap files), {_free_text(first.save_free)} at "
             f"{args.save_dir} (checkpoint, export)")
    extras["lines"].append(f"this machine, {ranks} rank(s): {human_bytes(memory)} memory available, {gpu}; {disks}")
    if activations:
        extras["lines"].append("  (memory counts each rank's activations with one checkpoint per layer)")
    for est, fit, row in zip(estimates, fits, extras["rows"]):
        row["this_machine"] = fit.to_dict()
        disk = (f"disk {human_bytes(fit.swap_disk)} swap + {human_bytes(est.checkpoint_bytes)} checkpoint + "
                f"{human_bytes(est.export_bytes)} export")
        verdict = "fits" if fit.fits else "does not fit: " + "; ".join(fit.shortfalls())
        extras["lines"].append(f"  {est.label:<28} memory {human_bytes(fit.memory_needed)}, {disk}: {verdict}")


def _free_text(nbytes: int | None) -> str:
    from ._mechanisms.available_memory import human_bytes
    return "unknown" if nbytes is None else human_bytes(nbytes)


# ------------------------------------------------------------------ consolidate


def _add_consolidate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "consolidate", help="write a sharded checkpoint as one full model (safetensors or torch)",
        description="Stream a zero_strategy checkpoint directory (or a torch.distributed.checkpoint directory of "
                    "an FSDP2/torchtitan run: its model) into a full state dict in one process "
                    "(no torch.distributed): peak memory stays near one read chunk, not the model. "
                    "OUT is a new directory with model.safetensors (or sharded files plus "
                    "model.safetensors.index.json, or pytorch_model.bin).")
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR",
                        help="checkpoint directory written by save_checkpoint, or a DCP directory")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="dtype of floating tensors (default: as stored; trained weights are fp32 masters)")
    parser.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                        help="safetensors (streamed; default) or torch (pytorch_model.bin, needs the model in memory)")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="split safetensors output into files of at most SIZE (e.g. 5GB) with an index")
    parser.add_argument("--optimizer", action="store_true",
                        help="also write optimizer.safetensors (per-parameter optimizer state)")
    parser.add_argument("--hf-config", default=None, metavar="DIR",
                        help="Hugging Face model dir: copy its config.json and tokenizer files into OUT")


def _run_consolidate(args: argparse.Namespace) -> int:
    from .checkpoint import consolidate

    return _checkpoint_tool("consolidate", lambda: consolidate(
        args.ckpt_dir, args.out, dtype=args.dtype, format=args.format, max_shard_size=args.max_shard_size,
        include_optimizer=args.optimizer, hf_config=args.hf_config))


def _checkpoint_tool(command: str, write: Callable[[], Path]) -> int:
    """Run ``write()``; one line on stderr and status 2 for any failure: the checkpoint's or the disk's,
    never a traceback.

    SIGTERM (a scheduler's kill) becomes SystemExit, so the temporary output directory is
    removed on the way out as for any other failure (SIGKILL: by the next run to that OUT).
    """
    import signal

    from .checkpoint import CheckpointError

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        out = write()
    except CheckpointError as err:
        print(f"zero-strategy {command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"zero-strategy {command}: error: {err.strerror or err}"
              f"{f' ({err.filename})' if err.filename else ''}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - a checkpoint check we lack: still one line, named
        print(f"zero-strategy {command}: error: {type(err).__name__}: {err} (the checkpoint is not one this "
              "zero_strategy can read; please report it)", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------ export


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="write a checkpoint of ours as another system's checkpoint (DCP, DeepSpeed), to resume there",
        description="Write a zero_strategy checkpoint directory as another system's checkpoint of model and "
                    "optimizer state, in one process (no torch.distributed). --format dcp: a "
                    "torch.distributed.checkpoint directory, one chunk in memory at a time; an FSDP2 run at any "
                    "world size resumes it with get_state_dict, dcp.load({'model': ..., 'optim': ...}) and "
                    "set_state_dict. --format deepspeed-universal: a DeepSpeed universal checkpoint, one "
                    "parameter in memory at a time; DeepSpeed resumes it with engine.load_checkpoint(OUT) and "
                    "\"checkpoint\": {\"load_universal\": true} in its config. OUT is a new directory.")
    parser.add_argument("ckpt_dir", metavar="CKPT_DIR", help="checkpoint directory written by save_checkpoint")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist)")
    parser.add_argument("--format", choices=("dcp", "deepspeed-universal"), required=True,
                        help="dcp: torch.distributed.checkpoint, as FSDP2 and torchtitan read it; "
                             "deepspeed-universal: DeepSpeed's universal checkpoint, which DeepSpeed resumes at "
                             "any world size and stage with \"checkpoint\": {\"load_universal\": true}")


def _run_export(args: argparse.Namespace) -> int:
    from .checkpoint import export_checkpoint

    return _checkpoint_tool("export", lambda: export_checkpoint(args.ckpt_dir, args.out, format=args.format))


# ------------------------------------------------------------------ plumbing

SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {
    "estimate": (_add_estimate, _run_estimate),
    "consolidate": (_add_consolidate, _run_consolidate),
    "export": (_add_export, _run_export),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero-strategy",
                                     description="ZeRO sharded data parallel for PyTorch: tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_parser, _ in SUBCOMMANDS.values():
        add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zero-strategy``; returns the exit status (2 on a usage/config error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command][1](args)
    except ZeroConfigError as err:
        print(f"zero-strategy {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
