"""The step's shape given ``zero_auto`` through each front end's own config reaches its choice.

tests/test_zero_auto_seq_len.py checks that ``zero_strategy.setup`` counts ``seq_len`` /
``batch_size``; this checks that the front ends pass them on, written as their users write a
config: Accelerate's ``zero_config`` (a mapping, a YAML file, ``ZERO_STRATEGY_CONFIG`` naming a
JSON file), the Hugging Face Trainer's ``zero_config``, Lightning's ``ZeroStrategy`` arguments and
``config=<YAML file>``, Fabric's ``ZeroFabricStrategy`` arguments (one rank,
tests/workers/zero_auto_seq_len_front_ends.py).

Oracle: ``zs.choose_preset(model, "zero_auto", available=..., seq_len=..., batch_size=...)``
computed here, with the memory injected into the worker's setup (through the measurement seam):
device memory holds zero2_offload's peak plus a 4096-token sequence's activations with the tiled
loss and MLP, and less than zero2's peak plus the same. Each shape's oracle differs from the choice
without it, and a shape with ``batch_size`` from the choice with ``seq_len`` alone, so a front end
that dropped either key would set up another config than the oracle.
"""

from __future__ import annotations

import functools

import pytest

import zero_strategy as zs
from zero_strategy import AvailableMemory, ZeroConfig, estimate_memory
from zero_strategy.estimate import estimate_activations

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from _launch import launch  # noqa: E402

GIB = 2**30
SEQ = 4096
LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)
LONG = {"seq_len": SEQ}
BATCHED = {"seq_len": SEQ // 4, "batch_size": 4}  # a quarter of the sequence, four times per step

#: (route, shape): see the worker's docstring for what each route does
CASES = [
    ("accelerate_argument", LONG),
    ("accelerate_file", BATCHED),
    ("accelerate_env", LONG),
    ("hf_trainer", LONG),
    ("lightning_arguments", LONG),
    ("lightning_file", BATCHED),
    ("fabric_arguments", BATCHED),
]


def _llama():
    config = transformers.LlamaConfig(**LLAMA)
    return config, transformers.LlamaForCausalLM(config)


@functools.lru_cache(maxsize=None)
def _available() -> AvailableMemory:
    hf, model = _llama()
    acts = estimate_activations(hf, 1, SEQ, "fp32", "sdpa", tiled_loss=True, tiled_mlp=True).peak_without_checkpointing
    peaks = {name: estimate_memory(model, world_size=1, config=ZeroConfig.preset(name)).peak_device
             for name in ("zero2", "zero2_offload")}
    device = int((peaks["zero2_offload"] + acts) / 0.75) + 1
    assert peaks["zero2"] + acts > 0.75 * device  # zero2 does not fit the sequence, even tiled
    return AvailableMemory(device=device, host=64 * GIB, nvme=None)


def choice(cfg: ZeroConfig) -> tuple:
    """What zero_auto decides; the rest of a front end's config (its clipping, ...) is its own."""
    return (cfg.stage, cfg.offload_optimizer, cfg.offload_params, cfg.tiled_loss, cfg.tiled_mlp,
            cfg.activation_offload)


def oracle(**shape) -> tuple:
    _, model = _llama()
    return choice(zs.choose_preset(model, "zero_auto", world_size=1, available=_available(), **shape))


@functools.lru_cache(maxsize=None)
def reports() -> dict:
    available = _available()
    cases = [dict(name=route, route=route, shape=shape) for route, shape in CASES]
    args = {"llama": LLAMA, "cases": cases,
            "available": {"device": available.device, "host": available.host, "nvme": available.nvme}}
    return launch("zero_auto_seq_len_front_ends.py", 1, args, timeout=300)[0]


def test_each_shape_changes_the_choice():
    """The oracle's premise: without the shape (or without its batch_size) zero_auto chooses otherwise."""
    blind = oracle()
    assert blind == (2, None, None, False, False, False)
    assert oracle(**LONG) != blind and oracle(**BATCHED) != blind
    assert oracle(**BATCHED) != oracle(seq_len=BATCHED["seq_len"])


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("route, shape", CASES, ids=[route for route, _ in CASES])
def test_the_front_end_passes_the_shape_to_the_choice(route, shape):
    got = reports()[route]
    assert "error" not in got, got.get("trace")
    chosen = ZeroConfig.from_dict(got["chosen"])
    assert choice(chosen) == oracle(**shape)
    assert chosen.offload_optimizer is not None and chosen.tiled_loss and chosen.tiled_mlp  # not zero2, tiled
    assert not chosen.auto and chosen.seq_len is None  # the chosen preset's config, ready to run
