"""Fine-tune a Hugging Face model with ZeRO through the PyTorch Lightning Trainer.

Runs on: CPU (2 processes, gloo, started by Lightning itself) when there is no GPU, or
all GPUs of the machine (nccl, one process per GPU); ``--devices N`` to choose. Offline:
the default model (MiniLM, 22.7M parameters) and data (the VADER lexicon) come from
installed PyPI packages (recipes/data.py), nothing is downloaded.

Default (the embedded task: MiniLM sentiment classifier, preset zero3_offload, fp32)::

    python recipes/lightning_finetune.py

Measured on the 2-core CPU dev machine (shared with other jobs): 60 s end to end
(2 processes, 74 optimizer steps of 64 samples at ~100 samples/s); the loss falls from
0.69 to ~0.1-0.3 and it ends with ``final: held-out accuracy 0.933 (1072/1149; chance
0.54), 74 steps, 60 s``. Each rank holds 43 MiB of model state on the device (its
parameter shards) and 173 MiB on the host (fp32 masters, gradients, Adam state) and
sends ~107 MiB per step. This is the main job: ``bash recipes/run_main.sh``.

Your own causal LM (Llama/GPT-style local Hugging Face directory) on all GPUs::

    python recipes/lightning_finetune.py --task causal-lm --model /path/to/hf-model \\
        --precision bf16 --batch-size 8 --accum 4 --max-steps 500 --output-dir out/my-model

(the data is the same shipped lexicon as short texts, "wonderful is positive"; put your
own texts in ``data.datasets``). Resume: ``--resume OUTPUT_DIR/checkpoint`` continues to
``--max-steps`` in total, on any number of devices and any preset.

``configure_model`` builds the model with ``zero_strategy.transformers.from_pretrained``
(empty: meta parameters); the strategy's setup materializes it one unit at a time and
reads each rank's slices of the pretrained safetensors, so no rank loads the whole model.

While it runs: Lightning's progress bar (in a terminal) with loss and samples/s, and
``self.log`` metrics per optimizer step (CSV in OUTPUT_DIR/lightning_logs): ``loss``,
``samples_per_s``, ``rank{r}/device_mib``, ``rank{r}/host_mib`` (model-state bytes of
each rank by placement), ``rank{r}/sent_mib`` (bytes each rank sent in the step), and
beside them what each rank's process holds: ``rank{r}/rss_mib`` (anonymous resident
memory) and ``rank{r}/peak_mib`` (on a GPU ``torch.cuda.max_memory_allocated``, else the
resident high-water mark).
At the end, in ``--output-dir``: the consolidated model + tokenizer (``save_pretrained``,
loads with ``from_pretrained``), ``probe.json`` (the trained sharded model's logits on
fixed probe texts), ``metrics.jsonl``, ``summary.json``, ``loss_memory.png`` (loss,
per-rank model-state and process memory over steps; needs matplotlib: ``pip install matplotlib``), and
``checkpoint/`` (sharded, for ``--resume``). The causal-LM task also runs a short
``generate(..., synced_gpus=True)`` with a different length on each rank.
"""

from __future__ import annotations

import time

START = time.perf_counter()

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402

import zero_strategy as zs  # noqa: E402

PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    data.add_common_args(p, "recipes/out/lightning")
    p.add_argument("--devices", type=int, default=None,
                   help="processes on this machine (default: all GPUs, else 2 CPU processes)")
    a = p.parse_args(argv)
    data.check_args(p, a)
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from transformers.utils import logging as hf_logging
    from zero_strategy.lightning import call_through_hooks

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    pl.seed_everything(args.seed, verbose=False)
    cuda = torch.cuda.is_available()
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or args.devices or (torch.cuda.device_count() if cuda else 2)
    path = data.model_path(args.model)
    config = data.model_config(path, args.task)
    tokenizer = data.prepare_tokenizer(data.load_tokenizer(path))
    train_ds, held_ds = data.datasets(args.task, tokenizer)
    chance = data.majority_rate(data.load_splits()[1])
    micro_per_rank = math.ceil(len(train_ds) / devices / args.batch_size)
    total_steps = max(1, micro_per_rank // args.accum)
    if args.max_steps > 0:
        total_steps = args.max_steps
    global_batch = args.batch_size * args.accum * devices
    out = Path(args.output_dir)

    class FineTune(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = None
            self.rows: list[dict] = []
            self.result: dict = {}
            self._loss_sum, self._micro, self._t = 0.0, 0, None

        # -- model: empty (meta parameters); the strategy's setup reads each rank's slices
        def configure_model(self):
            if self.model is None:
                # train mode: from_pretrained returns eval mode (as transformers' does), and Lightning
                # keeps each module's mode, so dropout would stay off for the whole fit
                self.model = data.pretrained_model(path, args.task).train()

        def forward(self, **batch):
            return self.model(**batch)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
            warm = max(1, total_steps // 10)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min((s + 1) / warm, max(0.0, (total_steps - s) / max(1, total_steps - warm))))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_fit_start(self):
            if self.trainer.is_global_zero:
                print(f"loaded {path} sharded (each rank read its own slices at setup)", flush=True)
            self._t = time.perf_counter()

        # -- training
        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self._loss_sum += float(loss.detach())
            self._micro += 1
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self._micro % args.accum:
                return  # not an optimizer step yet
            step = self.trainer.global_step
            vals = torch.tensor([self._loss_sum / args.accum] + data.rank_metrics(self, self.device),
                                device=self.device)
            per_rank = self.all_gather(vals).reshape(-1, 1 + len(data.RANK_METRICS)).cpu()
            now = time.perf_counter()
            row = {"step": step, "loss": float(per_rank[:, 0].mean()), "samples_per_s": global_batch / (now - self._t)}
            row.update(data.rank_row(per_rank.tolist()))
            self._loss_sum, self._t = 0.0, now
            self.rows.append(row)
            self.log("loss", row["loss"], prog_bar=True, rank_zero_only=True)
            self.log("samples_per_s", row["samples_per_s"], prog_bar=True, rank_zero_only=True)
            self.log_dict({k: v for k, v in row.items() if k.startswith("rank")}, rank_zero_only=True)
            if self.trainer.is_global_zero and (step == 1 or step % args.log_every == 0 or step == total_steps):
                mem = data.memory_line(row, per_rank.shape[0])
                print(f"step {step}/{total_steps} loss {row['loss']:.4f} {row['samples_per_s']:.1f} samples/s "
                      f"MiB: {mem}", flush=True)

        # -- the end, still sharded: evaluate, probe, generate, consolidate, checkpoint
        def on_train_end(self):
            rank, world = self.trainer.global_rank, self.trainer.world_size
            self.result = data.evaluate(self, held_ds, args.task, rank, world, args.eval_batch_size, self.device)
            probe = call_through_hooks(self, "_probe")
            if args.task == "causal-lm":
                gen = call_through_hooks(self, "_generate", rank)
                print(f"rank {rank}: generate(synced_gpus=True) returned {gen.shape[1]} tokens", flush=True)
            full = zs.full_state_dict(self, rank0_only=True)
            if self.trainer.is_global_zero:
                state = {k[len("model."):]: v for k, v in full.items()}
                diff = data.save_hf(out, config, args.task, state, tokenizer, probe,
                                    {**self.result, "steps": self.trainer.global_step, "world_size": world,
                                     "preset": args.preset, "precision": args.precision})
                print(f"saved consolidated model + tokenizer to {out} (probe logits match the sharded model "
                      f"within {diff:.1e})", flush=True)
            self.trainer.save_checkpoint(out / "checkpoint")

        def _probe(self):
            return data.probe_logits(self.model, tokenizer, self.device)

        @torch.no_grad()
        def _generate(self, rank):
            ids = data.encode_texts(tokenizer, ["wonderful is"])["input_ids"].to(self.device)
            self.model.eval()
            return self.model.generate(ids, max_new_tokens=3 + 2 * rank, do_sample=False, synced_gpus=True,
                                       pad_token_id=tokenizer.pad_token_id)

    module = FineTune()
    strategy = zs.ZeroStrategy(config=args.preset)
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=devices, strategy=strategy,
                         precision=PRECISION[args.precision], max_steps=total_steps, max_epochs=-1,
                         accumulate_grad_batches=args.accum, gradient_clip_val=args.clip or None,
                         logger=CSVLogger(str(out), name="lightning_logs"), enable_checkpointing=False,
                         enable_progress_bar=sys.stderr.isatty(), enable_model_summary=False,
                         log_every_n_steps=1, num_sanity_val_steps=0)
    if trainer.is_global_zero:
        print(f"model {path} ({args.task}), {devices} process(es) on {'gpu' if cuda else 'cpu'}, preset "
              f"{args.preset}, {args.precision}; data: VADER lexicon, {len(train_ds)} train / {len(held_ds)} "
              f"held-out; {total_steps} optimizer steps of {global_batch} samples", flush=True)
    loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                                         collate_fn=train_ds.collate)
    t_train = time.perf_counter()
    trainer.fit(module, loader, ckpt_path=args.resume)
    if trainer.is_global_zero:
        summary = {**module.result, "steps": trainer.global_step, "world_size": devices, "preset": args.preset,
                   "precision": args.precision, "task": args.task, "train_seconds": time.perf_counter() - t_train}
        png = data.write_run_files(out, module.rows, summary, plot=not args.no_plot)
        if png:
            print(f"plot: {png}", flush=True)
        print(data.final_line(args.task, module.result, chance, trainer.global_step, time.perf_counter() - START),
              flush=True)
    data.finish(0)


if __name__ == "__main__":
    main()
