"""TRL's GRPOTrainer through ``zero_trainer(GRPOTrainer)`` against the stock GRPOTrainer (DDP), counting gathers.

Run under ``accelerate launch`` with 2 CPU processes. Written the way TRL's docs write a GRPO
script: a ``GRPOConfig``, a rule-based reward function, a prompt dataset, ``trainer.train()``;
here the model is a tiny Llama built from a ``LlamaConfig`` (given by path, as the docs give
a hub id) with a word-level tokenizer made in memory, ``num_generations=2``, 3 steps,
``use_vllm=False``. Each case trains once; the report holds, per case, the completion
token ids the reward function received, the logged losses, rewards and KL (where logged), the final
weights' worst relative difference from the stock run with the same ``beta``, and for each
``generate()`` call how many all-gathers the policy model's engine issued during it.

Cases (``args["cases"]``): ``ref`` / ``ref_beta`` (stock GRPOTrainer, beta 0 / 0.04),
``zero2``, ``zero3``, ``zero3_beta`` (the reference model sharded too), ``zero3_tiny_budget``
(``zs.gather_once_in_generate(trainer.model, budget_bytes=1024)``: per-unit gathers),
``zero3_per_unit`` (``GRPOConfig(ds3_gather_for_generation=False)``, TRL's own switch).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

import torch

from _worker import LogLines, finish, worst_rel_diff
from zero_strategy.transformers import zero_trainer  # before any TrainingArguments (see its module note)

import datasets  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import zero_strategy as zs  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]
METRICS = ("loss", "reward", "kl")  # what the report keeps of the trainer's log, where it is logged
STAGE3 = {"stage": 3, "param_persistence_threshold": 0}  # every parameter really sharded
CASES = {
    "ref": (None, {}), "ref_beta": (None, {"beta": 0.04}),
    "zero2": ({"stage": 2}, {}), "zero3": (STAGE3, {}), "zero3_beta": (STAGE3, {"beta": 0.04}),
    "zero3_tiny_budget": (STAGE3, {}), "zero3_per_unit": (STAGE3, {"ds3_gather_for_generation": False}),
}


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def model_path(out: Path) -> str:
    """The tiny Llama saved once, by rank 0, given by path as TRL's docs give a hub id (GRPO loads
    its reference model from the same path when ``beta > 0``).

    Every rank enters the barrier on its first call, whatever the file system shows: when each
    rank asked ``path.exists()``, a rank that looked while rank 0 was writing skipped the barrier,
    read a half-written model and met rank 0's barrier with DDP's first collective ("Connection
    closed by peer" on a loaded machine)."""
    path = out / "tiny-llama"
    if not SAVED:
        if torch.distributed.get_rank() == 0:  # the process group exists: GRPOConfig made it
            make_model().save_pretrained(path)
        torch.distributed.barrier()
        SAVED.append(path)
    return str(path)


SAVED: list[Path] = []  # the model's directory once rank 0 has written it and every rank has waited


def prompts() -> datasets.Dataset:
    g = torch.Generator().manual_seed(3)
    rows = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(n),), generator=g))
            for n in torch.randint(2, 6, (16,), generator=g)]
    return datasets.Dataset.from_dict({"prompt": rows})


def run(case: str, out: Path) -> dict:
    zero_config, extra_args = CASES[case]
    seen: list[list[int]] = []

    def reward_even_words(completions, completion_ids, **kwargs):
        """Rule-based: the share of words with an even index (w0, w2, ...)."""
        seen.extend(list(map(int, ids)) for ids in completion_ids)
        return [sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit()) / max(1, len(c.split()))
                for c in completions]

    args = GRPOConfig(output_dir=str(out / case), num_generations=2, max_completion_length=8,
                      per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                      save_strategy="no", report_to=[], seed=0, data_seed=0, disable_tqdm=True, bf16=False,
                      use_vllm=False, dataloader_num_workers=0, **extra_args)
    cls = GRPOTrainer if zero_config is None else zero_trainer(GRPOTrainer)
    kwargs = {} if zero_config is None else {"zero_config": zero_config}
    trainer = cls(model=model_path(out), reward_funcs=reward_even_words, args=args, train_dataset=prompts(),
                  processing_class=tokenizer(), **kwargs)
    gathers: list[int] = []
    if zero_config is not None:  # the policy model is set up when train() prepares it
        trainer.add_callback(Instrument(gathers, budget_bytes=1024 if case == "zero3_tiny_budget" else None))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = zs.full_state_dict(trainer.model) if zs.is_set_up(trainer.model) else trainer.model.state_dict()
    report = {"trainer": type(trainer).__name__, "wrapped": type(trainer.model_wrapped).__name__,
              "completion_ids": seen, "logged": logged_metrics(logs), "gathers_per_generate": gathers,
              "weights": {k: v.detach().float().clone() for k, v in weights.items()}}
    if zero_config is not None:
        engine = zs.api._engine_of(trainer.model)
        report["stage"] = engine.plan.stage
        report["sharded_groups"] = sum(len(u.sharded_groups) for u in engine.units)
        report["sharded_units"] = sum(1 for u in engine.units if u.sharded_groups)  # one coalesced gather each
        report["ref_sharded"] = getattr(trainer, "ref_model", None) is not None and zs.is_set_up(trainer.ref_model)
    return report


def logged_metrics(logs: list[dict]) -> dict[str, list[float]]:
    """Each of :data:`METRICS` the trainer logged, as its values per logging step; a metric it does
    not log (GRPO logs no ``kl`` with ``beta=0``) is left out, not recorded as ``None``, so the test
    compares what both runs logged and that they logged the same metrics. A metric logged at some
    steps only fails the case here (``KeyError``), loudly."""
    return {key: [h[key] for h in logs] for key in METRICS if any(key in h for h in logs)}


class Instrument(TrainerCallback):
    """At the start of training (the policy model set up): count the all-gathers of the policy's engine
    during each generate() (test instrumentation over the model's generate, which TRL calls inside
    unwrap_model_for_generation); ``budget_bytes``: set the generation budget as a user would."""

    def __init__(self, counts: list[int], budget_bytes: int | None):
        self.counts, self.budget_bytes = counts, budget_bytes

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.budget_bytes is not None:
            zs.gather_once_in_generate(model, budget_bytes=self.budget_bytes)
        stats = zs.api._engine_of(model).comm.stats
        inner = model.generate

        def generate(*a, **k):
            before = stats.all_gather.calls
            try:
                return inner(*a, **k)
            finally:
                self.counts.append(stats.all_gather.calls - before)

        model.__dict__["generate"] = generate


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    lines = LogLines()
    logging.getLogger("zero_strategy").addHandler(lines)
    logging.getLogger("zero_strategy").setLevel(logging.INFO)
    runs, report = {}, {}
    for case in args["cases"]:
        try:
            lines.lines.clear()
            runs[case] = run(case, out)
            runs[case]["log"] = [ln for ln in lines.lines if "gathered_for_generation" in ln]
        except Exception:  # noqa: BLE001 - reported to the test; the ranks stop together
            report[case] = {"error": traceback.format_exc()}
            print(report[case]["error"], file=sys.stderr)
            break
    weights = {case: r.pop("weights") for case, r in runs.items()}
    for case, r in runs.items():
        ref = "ref_beta" if "beta" in case else "ref"
        if not case.startswith("ref") and ref in weights:
            r["weights_rel"], r["worst"] = worst_rel_diff(weights[case], weights[ref])
        report[case] = r
    finish(out, report)


if __name__ == "__main__":
    main()
