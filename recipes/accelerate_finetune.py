"""Fine-tune a Hugging Face model with ZeRO through Hugging Face Accelerate (ZeroAccelerator).

Runs on: CPU (2 processes, gloo) with ``recipes/accelerate/cpu_2proc.yaml``, or GPUs
(nccl, one process per GPU) with ``multi_gpu.yaml`` / ``one_gpu.yaml``. Offline: the
default model (MiniLM, 22.7M parameters) and data (the VADER lexicon) come from
installed PyPI packages (recipes/data.py), nothing is downloaded.

Default (the embedded task: MiniLM sentiment classifier, preset zero3_offload, fp32)::

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/accelerate_finetune.py

Measured on the 2-core CPU dev machine (shared with other jobs): 56 s end to end
(2 processes, 74 optimizer steps of 64 samples at ~100 samples/s); it ends with
``final: held-out accuracy 0.922 (1059/1149; chance 0.54), 74 steps, 54 s`` (the
Lightning recipe, with another data order, reaches 0.933). Each rank holds 43 MiB of
model state on the device and 173 MiB on the host and sends ~107 MiB per step.

Your own causal LM (Llama/GPT-style local Hugging Face directory) on all GPUs (set
``num_processes`` in multi_gpu.yaml, or pass ``--num_processes N``)::

    accelerate launch --config_file recipes/accelerate/multi_gpu.yaml recipes/accelerate_finetune.py \\
        --task causal-lm --model /path/to/hf-model --batch-size 8 --accum 4 --max-steps 500 \\
        --output-dir out/my-model

Precision comes from the launch config's ``mixed_precision`` unless ``--precision`` is
given. Resume: ``--resume OUTPUT_DIR/checkpoint`` continues to ``--max-steps`` in total
(``accelerator.load_state`` re-shards onto any number of processes and any preset).

The model comes from ``zero_strategy.transformers.from_pretrained``: built empty (meta
parameters), then ``prepare`` materializes it one unit at a time and every rank reads only
its slices of the pretrained safetensors, at every preset.

While it runs: a tqdm bar on the main process (in a terminal) with loss and samples/s,
and a line every ``--log-every`` steps with loss, samples/s and, per rank, model-state
MiB on the device and on the host, the process's anonymous resident and peak MiB beside
them (the peak is ``torch.cuda.max_memory_allocated`` on a GPU), and MiB sent in the step. At the end, in
``--output-dir``: the consolidated model + tokenizer (``save_pretrained``, loads with
``from_pretrained``), ``probe.json`` (the trained sharded model's logits on fixed probe
texts), ``metrics.jsonl``, ``summary.json``, ``loss_memory.png`` (needs matplotlib:
``pip install matplotlib``) and ``checkpoint/`` (``save_state``, for ``--resume``). The
causal-LM task also runs ``generate(..., synced_gpus=True)`` with a different length on
each rank.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402

import zero_strategy as zs  # noqa: E402

MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data.add_common_args(p, "recipes/out/accelerate")
    p.set_defaults(precision=None)  # None: the launch config's mixed_precision
    a = p.parse_args(argv)
    data.check_args(p, a)
    return a


class Progress:
    """The optimizer-step count, saved and restored with the accelerator state."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main(argv=None) -> None:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from zero_strategy.accelerate import ZeroAccelerator

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    kwargs = {"mixed_precision": MIXED[args.precision]} if args.precision else {}
    accelerator = ZeroAccelerator(zero_config=args.preset, gradient_accumulation_steps=args.accum, **kwargs)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    main_rank = accelerator.is_main_process
    say = (lambda *a: print(*a, flush=True)) if main_rank else (lambda *a: None)
    torch.manual_seed(args.seed)

    path = data.model_path(args.model)
    config = data.model_config(path, args.task)
    tokenizer = data.prepare_tokenizer(data.load_tokenizer(path))
    train_ds, held_ds = data.datasets(args.task, tokenizer)
    chance = data.majority_rate(data.load_splits()[1])
    model = data.pretrained_model(path, args.task)  # empty: prepare reads each rank's slices

    loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=train_ds.collate)
    micro_per_rank = -(-len(train_ds) // (world * args.batch_size))
    total_steps = args.max_steps if args.max_steps > 0 else max(1, micro_per_rank // args.accum)
    global_batch = args.batch_size * args.accum * world
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warm = max(1, total_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, max(0.0, (total_steps - s) / max(1, total_steps - warm))))
    t = time.perf_counter()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # The scheduler is stepped here once per optimizer step (a prepared one would step per process).
    cfg = accelerator.zero_config
    say(f"model {path} ({args.task}), {world} process(es) on {device.type}, preset {args.preset} (stage {cfg.stage}, "
        f"{cfg.precision}); set up and loaded sharded in {time.perf_counter() - t:.1f} s"
        f"; data: VADER lexicon, {len(train_ds)} train / {len(held_ds)} held-out; {total_steps} optimizer "
        f"steps of {global_batch} samples")
    progress = Progress()
    accelerator.register_for_checkpointing(progress, schedule)
    if args.resume:
        accelerator.load_state(args.resume)
        say(f"resumed from {args.resume} at step {progress.step}")

    out = Path(args.output_dir)
    bar = tqdm(total=total_steps, initial=progress.step, unit="step", disable=not (main_rank and sys.stderr.isatty()))
    rows: list[dict] = []
    model.train()
    loss_sum, t_step, t_train = 0.0, time.perf_counter(), time.perf_counter()
    epoch_loader = accelerator.skip_first_batches(loader, (progress.step * args.accum) % len(loader)) \
        if progress.step else loader
    while progress.step < total_steps:
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.clip:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                if accelerator.sync_gradients:
                    rm = data.rank_metrics(model, device)  # after the step, gradients still held
                optimizer.zero_grad()
            loss_sum += float(loss.detach()) / args.accum
            if not accelerator.sync_gradients:
                continue
            schedule.step()
            progress.step += 1
            per_rank = accelerator.gather(torch.tensor([loss_sum] + rm, device=device))
            per_rank = per_rank.reshape(-1, 1 + len(data.RANK_METRICS)).cpu()
            now = time.perf_counter()
            row = {"step": progress.step, "loss": float(per_rank[:, 0].mean()),
                   "samples_per_s": global_batch / (now - t_step)}
            row.update(data.rank_row(per_rank.tolist()))
            rows.append(row)
            loss_sum, t_step = 0.0, now
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}", sps=f"{row['samples_per_s']:.0f}")
            s = progress.step
            if main_rank and (s == 1 or s % args.log_every == 0 or s == total_steps):
                mem = data.memory_line(row, per_rank.shape[0])
                line = f"step {s}/{total_steps} loss {row['loss']:.4f} {row['samples_per_s']:.1f} samples/s MiB: {mem}"
                (bar.write(line) if not bar.disable else print(line, flush=True))
            if progress.step >= total_steps:
                break
        epoch_loader = loader
    bar.close()
    train_s = time.perf_counter() - t_train

    result = data.evaluate(model, held_ds, args.task, rank, world, args.eval_batch_size, device)
    probe = data.probe_logits(model, tokenizer, device)
    if args.task == "causal-lm":
        model.eval()
        ids = data.encode_texts(tokenizer, ["wonderful is"])["input_ids"].to(device)
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=3 + 2 * rank, do_sample=False, synced_gpus=True,
                                 pad_token_id=tokenizer.pad_token_id)
        print(f"rank {rank}: generate(synced_gpus=True) returned {gen.shape[1]} tokens", flush=True)
        model.train()
    full = zs.full_state_dict(model, rank0_only=True)
    record = {**result, "steps": progress.step, "world_size": world, "preset": args.preset,
              "precision": cfg.precision, "task": args.task, "train_seconds": train_s}
    if main_rank:
        diff = data.save_hf(out, config, args.task, full, tokenizer, probe, record)
        say(f"saved consolidated model + tokenizer to {out} (probe logits match the sharded model within {diff:.1e})")
    accelerator.save_state(str(out / "checkpoint"))
    if main_rank:
        png = data.write_run_files(out, rows, record, plot=not args.no_plot)
        if png:
            say(f"plot: {png}")
        say(data.final_line(args.task, result, chance, progress.step, time.perf_counter() - START))
    data.finish(0)


if __name__ == "__main__":
    main()
