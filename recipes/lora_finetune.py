"""LoRA with ZeRO: PEFT adapters on a sharded model, measured against the full fine-tune.

Why: most fine-tuning of Hugging Face models is LoRA through PEFT. LoRA trains a few
adapter matrices and leaves the base frozen, so the optimizer state and gradients that
ZeRO shards shrink to the adapters' share, while the frozen base is still sharded at
stage 3 (and rests in host memory with ``zero3_offload``). This recipe shows both
sides on 2 CPU processes (or all GPUs), offline::

    python -m torch.distributed.run --nproc-per-node 2 recipes/lora_finetune.py
    python -m torch.distributed.run --nproc-per-node 2 recipes/lora_finetune.py --task causal-lm

``--task classification`` (default): LoRA (rank 8 on the attention query/value
projections; the new classifier head trained in full, PEFT's ``modules_to_save``) on the
packaged MiniLM with the VADER lexicon (recipes/data.py), in a plain PyTorch loop
(``zs.setup`` on the ``PeftModel``). Then, unless ``--no-full``, the full fine-tune with the
same preset, data, steps and schedule (``--full-lr``, default the 1e-4 of finetune.py),
and a table of trainable/total parameters, per-rank model-state memory (measured with
``zs.memory_report`` after an optimizer step, and the formula ``zs.estimate_memory``) and
held-out accuracy. The last line says whether LoRA came within ``--margin`` of the full
fine-tune's accuracy. The adapter is saved with ``PeftModel.save_pretrained`` on every rank and reloaded
with peft alone (``PeftModel.from_pretrained`` on a fresh base model); its logits on the
probe texts are compared with those of the trained, sharded model.

``--task causal-lm``: TRL's ``SFTTrainer`` made ZeRO with ``zero_trainer(SFTTrainer)``,
``peft_config=LoraConfig(...)`` on all attention projections, on a tiny Llama built from a
config (or ``--model DIR``), next-token loss on the lexicon as short texts. The base
model is saved first, so the adapter can be reloaded onto it with peft alone.

Measured (2 CPU processes on the shared 2-core dev machine, zero3_offload, fp32, seed 0,
one epoch = 74 steps of 64 samples, 159 s for both runs): LoRA 74,498 trainable of
22,788,484 parameters, 44.4 MiB model state per rank, held-out accuracy 0.919; the full
fine-tune 22,713,986 trainable, 216.7 MiB, 0.933; the adapter's reload differs by 0.0.
The stated margin (``--margin``) is 0.02. docs/recipes.md, "LoRA recipe", has the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

START = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402

import zero_strategy as zs  # noqa: E402

MiB = 2 ** 20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="classification", choices=data.TASKS)
    p.add_argument("--model", default=None, help="local HF directory (default: the packaged MiniLM for "
                   "classification, a tiny Llama built from a config for causal-lm)")
    p.add_argument("--tokenizer", default=None, help="causal-lm: tokenizer directory (default: --model's, else "
                   "the packaged MiniLM's)")
    p.add_argument("--preset", default="zero3_offload", choices=zs.preset_names())
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--target-modules", default=None,
                   help="comma-separated module names (default: query,value for BERT; q/k/v/o_proj for Llama)")
    p.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate")
    p.add_argument("--full-lr", type=float, default=1e-4, help="the full fine-tune's learning rate")
    p.add_argument("--no-full", action="store_true", help="classification: skip the full fine-tune")
    p.add_argument("--margin", type=float, default=0.02, help="accuracy LoRA must come within of the full run")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch per rank")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup", type=float, default=0.1, help="fraction of steps with linear warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--output-dir", default="recipes/out/lora")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    return p.parse_args(argv)


def counts(model) -> tuple[int, int]:
    """(trainable, total) parameters; ``numel`` is the true size also for stage-3 shards."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def estimate_bytes(model_or_params, world: int, config) -> int:
    """The formula's per-rank model-state bytes (device + host) for this preset."""
    est = zs.estimate_memory(model_or_params, world_size=world, config=config)
    return est.total_device + est.total_host


def mib(report) -> str:
    return ", ".join(f"{k} {v / MiB:.1f}" for k, v in report.by_category.items() if v) + f" (total {report.total / MiB:.1f})"


# ============================================================================ classification
def train_classifier(model, config, args, train_ds, held_ds, rank, world, device, lr, say, label) -> dict:
    """``zs.setup`` + the loop of finetune.py; returns held-out metrics, memory and counts."""
    trainable, total = counts(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=args.weight_decay)
    model, zopt = zs.setup(model, optimizer, config)
    sampler = torch.utils.data.DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True,
                                                  seed=args.seed, drop_last=False)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler,
                                         collate_fn=train_ds.collate)
    steps = len(loader) if args.max_steps < 0 else min(args.max_steps, len(loader))
    warmup = int(steps * args.warmup)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        zopt, lambda s: min((s + 1) / max(1, warmup), max(0.0, (steps - s) / max(1, steps - warmup))))
    say(f"[{label}] {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%), "
        f"{steps} steps of {args.batch_size * world} samples, lr {lr}")
    model.train()
    t0 = time.perf_counter()
    for step, batch in enumerate(loader, start=1):
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        zopt.backward(loss)
        zopt.step()
        mem = zs.memory_report(model)  # after the step, before the gradients are freed
        schedule.step()
        zopt.zero_grad()
        if step == 1 or step % args.log_every == 0 or step == steps:
            say(f"[{label}] step {step}/{steps} loss {loss.item():.4f} model-state MiB/rank: {mib(mem)}")
        if step >= steps:
            break
    metrics = data.evaluate(model, held_ds, "classification", rank, world, args.eval_batch_size, device)
    return {"model": model, "trainable": trainable, "total": total, "steps": steps, "memory": mem,
            "estimate_bytes": estimate_bytes(model, world, config),
            "train_s": time.perf_counter() - t0, **metrics}


def save_and_reload_adapter(model, model_path, tokenizer, out: Path, device, main: bool) -> float | None:
    """Save the adapter the way PEFT users do, reload it with peft alone, compare probe logits."""
    from peft import PeftModel

    probe = data.probe_logits(model, tokenizer, device)  # every rank: stage-3 gathers are collective
    # every rank (it reads the sharded adapters), rank 0 writes: the adapter and the classifier head only
    model.save_pretrained(out / "adapter", is_main_process=main)
    if not main:
        return None
    tokenizer.save_pretrained(out / "adapter")
    reloaded = PeftModel.from_pretrained(data.load_model(model_path), out / "adapter").eval()
    with torch.no_grad():
        logits = data.probe_view(reloaded(**data.encode_texts(tokenizer, data.PROBE_TEXTS)).logits)
    diff = float((logits - torch.tensor(probe)).abs().max())
    (out / "probe.json").write_text(json.dumps({"texts": list(data.PROBE_TEXTS), "logits": probe,
                                                "base_model": str(model_path), "reload_max_abs_diff": diff}))
    return diff


def classification(args, rank, world, device, say) -> int:
    from peft import LoraConfig, get_peft_model

    model_path = data.model_path(args.model)
    out = Path(args.output_dir)
    train_ex, held_ex = data.load_splits()
    tokenizer = data.load_tokenizer(model_path)
    train_ds, held_ds = data.TokenizedDataset(train_ex, tokenizer), data.TokenizedDataset(held_ex, tokenizer)
    config = zs.ZeroConfig.preset(args.preset, gradient_clipping=args.clip or None)
    say(f"model {model_path}, {world} rank(s) on {device.type}, preset {args.preset}; data: VADER lexicon, "
        f"{len(train_ex)} train / {len(held_ex)} held-out")

    torch.manual_seed(args.seed)
    targets = args.target_modules.split(",") if args.target_modules else ["query", "value"]
    lora = get_peft_model(data.load_model(model_path).to(device), LoraConfig(
        task_type="SEQ_CLS", r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, target_modules=targets,
        modules_to_save=["classifier"]))
    r_lora = train_classifier(lora, config, args, train_ds, held_ds, rank, world, device, args.lr, say, "LoRA")
    out.mkdir(parents=True, exist_ok=True)
    diff = save_and_reload_adapter(r_lora["model"], model_path, tokenizer, out, device, rank == 0)
    if diff is not None:
        say(f"saved the adapter to {out / 'adapter'}; PeftModel.from_pretrained on a fresh base model gives the "
            f"trained sharded model's probe logits within {diff:.1e}")
    zs.teardown(r_lora["model"], keep_weights=False)

    rows = [("LoRA", r_lora)]
    if not args.no_full:
        torch.manual_seed(args.seed)
        rows.insert(0, ("full", train_classifier(data.load_model(model_path).to(device), config, args, train_ds,
                                                 held_ds, rank, world, device, args.full_lr, say, "full")))
    say(f"\n{'run':<6} {'trainable':>12} {'total':>12} {'model state MiB/rank (measured)':>32} "
        f"{'(formula)':>10} {'held-out acc':>13}")
    for name, r in rows:
        est = f"{r['estimate_bytes'] / MiB:.1f}"
        say(f"{name:<6} {r['trainable']:>12,} {r['total']:>12,} {r['memory'].total / MiB:>32.1f} {est:>10} "
            f"{r['held_out_accuracy']:>13.3f}")
    summary = {name: {k: v for k, v in r.items() if k not in ("model", "memory")} | {
        "model_state_bytes": r["memory"].total,
        "model_state_by_category": {k: int(v) for k, v in r["memory"].by_category.items()}} for name, r in rows}
    if rank == 0:
        (out / "summary.json").write_text(json.dumps({"world_size": world, "preset": args.preset,
                                                      "margin": args.margin, **summary}, indent=1))
    acc = r_lora["held_out_accuracy"]
    if args.no_full:
        say(f"final: LoRA held-out accuracy {acc:.3f}, {r_lora['steps']} steps, {time.perf_counter() - START:.0f} s")
        return 0
    full = rows[0][1]
    within = acc >= full["held_out_accuracy"] - args.margin
    say(f"final: LoRA held-out accuracy {acc:.3f} vs full fine-tune {full['held_out_accuracy']:.3f} "
        f"({'within' if within else 'NOT within'} {args.margin}); model state per rank "
        f"{r_lora['memory'].total / MiB:.1f} vs {full['memory'].total / MiB:.1f} MiB; {r_lora['trainable']:,} vs "
        f"{full['trainable']:,} trainable; {r_lora['steps']} steps, {time.perf_counter() - START:.0f} s")
    return 0


# ============================================================================ causal LM through TRL
def tiny_llama(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))


def causal_lm(args, rank, world, device, say) -> int:
    from datasets import Dataset
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from zero_strategy.transformers import zero_trainer

    out = Path(args.output_dir)
    tokenizer = data.load_tokenizer(args.tokenizer or args.model)  # default: the packaged MiniLM's (offline)
    if tokenizer.eos_token is None:  # a BERT tokenizer: [SEP] ends a text
        tokenizer.eos_token = tokenizer.sep_token
    data.prepare_tokenizer(tokenizer)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    else:
        model = tiny_llama(tokenizer, args.seed)
    base_dir = out / "base"
    if rank == 0:  # the adapter is reloaded onto exactly these weights
        model.save_pretrained(base_dir)
    train_ex, held_ex = data.load_splits()
    train = Dataset.from_dict({"text": data.lm_texts(train_ex)})
    held = Dataset.from_dict({"text": data.lm_texts(held_ex)})
    targets = args.target_modules.split(",") if args.target_modules else ["q_proj", "k_proj", "v_proj", "o_proj"]
    sft_args = SFTConfig(
        output_dir=str(out / "trainer"), per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size, max_steps=args.max_steps if args.max_steps > 0 else -1,
        num_train_epochs=1, learning_rate=args.lr, weight_decay=args.weight_decay,
        max_grad_norm=args.clip or 0.0, logging_steps=args.log_every, save_strategy="no", report_to=[],
        seed=args.seed, bf16=False, fp16=False, max_length=32, disable_tqdm=True, dataloader_num_workers=0)
    trainer = zero_trainer(SFTTrainer)(
        model=model, args=sft_args, train_dataset=train, eval_dataset=held, processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                               target_modules=targets), zero_config=args.preset)
    trainable, total = counts(trainer.model)
    say(f"TRL SFTTrainer + LoRA, {type(trainer).__name__}, preset {args.preset}, {world} rank(s): "
        f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
    trainer.train()
    mem = zs.memory_report(trainer.model)
    cfg = trainer.accelerator.zero_config
    say(f"model state per rank after training: {mib(mem)} MiB; formula: LoRA "
        f"{estimate_bytes(trainer.model, world, cfg) / MiB:.1f} MiB, a full fine-tune at this preset "
        f"{estimate_bytes(total, world, cfg) / MiB:.1f} MiB")
    metrics = trainer.evaluate()
    probe_in = data.encode_texts(tokenizer, data.PROBE_TEXTS)
    trainer.model.eval()
    with torch.no_grad():  # every rank: stage-3 gathers are collective
        probe = data.probe_view(trainer.model(**{k: v.to(device) for k, v in probe_in.items()}).logits)
    trainer.save_model(str(out / "adapter"))  # every rank; the adapter is written by rank 0
    if rank == 0:
        base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
        reloaded = PeftModel.from_pretrained(base, out / "adapter").eval()
        with torch.no_grad():
            diff = float((data.probe_view(reloaded(**probe_in).logits) - probe).abs().max())
        tokenizer.save_pretrained(out / "adapter")
        (out / "probe.json").write_text(json.dumps({"texts": list(data.PROBE_TEXTS), "logits": probe.tolist(),
                                                    "base_model": str(base_dir), "reload_max_abs_diff": diff}))
        say(f"saved the adapter to {out / 'adapter'}; PeftModel.from_pretrained on the saved base gives the "
            f"trained sharded model's probe logits within {diff:.1e}")
    loss = metrics["eval_loss"]
    say(f"final: LoRA SFT held-out loss {loss:.4f} (perplexity {float(torch.tensor(loss).exp()):.2f}), "
        f"{trainer.state.global_step} steps, {time.perf_counter() - START:.0f} s")
    return 0


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    world, rank, device, say = data.launched_rank()
    cuda = device.type == "cuda"
    if args.task == "classification":
        if world > 1:
            if cuda:
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if cuda else "gloo")
        code = classification(args, rank, world, device, say)
    else:
        code = causal_lm(args, rank, world, device, say)  # Accelerate (inside the Trainer) joins the group
    data.finish(code)


if __name__ == "__main__":
    main()
