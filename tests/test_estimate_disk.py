"""The estimate's disk figures are the bytes a run writes: ``checkpoint_bytes`` against the tensors
of a real ``save_checkpoint`` on 2 ranks (stages 1-3, fp32 and bf16, Adam and SGD with momentum,
a frozen layer), ``export_bytes`` against transformers' own ``save_pretrained``."""

from __future__ import annotations

import functools
import json
import struct
import tempfile
from pathlib import Path

import pytest
import torch

from _launch import launch_cases
from zero_strategy.estimate import estimate_memory

pytestmark = pytest.mark.multiprocess

CASES = [
    {"name": "zero1_fp32_adamw", "preset": "zero1", "precision": "fp32", "optimizer": "adamw", "stage": 1},
    {"name": "zero2_bf16_adamw", "preset": "zero2", "precision": "bf16", "optimizer": "adamw", "stage": 2},
    {"name": "zero3_bf16_sgd", "preset": "zero3", "precision": "bf16", "optimizer": "sgd_momentum", "stage": 3},
    {"name": "zero3_offload_fp32_adamw", "preset": "zero3_offload", "precision": "fp32", "optimizer": "adamw",
     "stage": 3},
]


@functools.lru_cache(maxsize=1)
def saved():
    with tempfile.TemporaryDirectory(prefix="zs_ckpt_sizes_") as root:
        return launch_cases("checkpoint_sizes.py", 2, [dict(c, root=root) for c in CASES], key=lambda r: r["name"])


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_checkpoint_bytes_are_the_saved_tensors(case):
    rank0 = saved().of(case["name"])[0]
    assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= set(rank0["files"])
    est = estimate_memory(rank0["trainable"], frozen_params=rank0["frozen"], world_size=2, stage=case["stage"],
                          precision=case["precision"], optimizer=case["optimizer"])
    # beyond the estimate: each group's step count and the shards' padding to equal sizes (< 1%)
    assert est.checkpoint_bytes <= rank0["tensor_bytes"] <= est.checkpoint_bytes * 1.01, rank0


def _payload(path: Path) -> int:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")


@pytest.mark.parametrize("dtype, tied", [(torch.bfloat16, True), (torch.float32, False)])
def test_export_bytes_are_what_save_pretrained_writes(tmp_path, dtype, tied):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(tmp_path)
    written = sum(_payload(p) for p in tmp_path.glob("*.safetensors"))
    est = estimate_memory(model, world_size=2, stage=3, precision="bf16" if dtype == torch.bfloat16 else "fp32")
    assert est.export_bytes == written
