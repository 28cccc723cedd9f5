"""``{"preset": "zero_auto", "seq_len": L}``: setup counts a step's activations when it chooses.

Oracle: ``estimate_memory``'s per-rank peaks of the candidate presets and ``estimate_activations``'
bytes for the sequence, each computed here on its own; the memory given to setup (through the
measurement seam) holds zero2_offload's device peak plus the sequence's activations with every
activation tool, and less than zero2's peak plus the same. Without ``seq_len`` setup cannot see the
activations and keeps zero2; with it, it must take zero2_offload, and turn the tiled loss and the
tiled MLP on (no activation tool lets zero2 fit).
"""

from __future__ import annotations

import copy

import pytest
import torch

import zero_strategy as zs
from zero_strategy import AvailableMemory, ZeroConfig, ZeroConfigError, estimate_memory
from zero_strategy.estimate import estimate_activations

transformers = pytest.importorskip("transformers")

GIB = 2**30
SEQ = 4096


def _llama():
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return config, transformers.LlamaForCausalLM(config)


def _chosen(model, spec, monkeypatch, available: AvailableMemory) -> ZeroConfig:
    from zero_strategy import _zero_auto as _auto

    monkeypatch.setattr(_auto, "measure_available", lambda comm, device, config: available)
    model = copy.deepcopy(model)
    model, _ = zs.setup(model, torch.optim.AdamW(model.parameters()), spec)
    try:
        return zs.engine_of(model).config
    finally:
        zs.teardown(model)


def test_setup_counts_the_sequence_given_in_the_config(monkeypatch):
    hf, model = _llama()
    tools = estimate_activations(hf, 1, SEQ, "fp32", "sdpa", tiled_loss=True, tiled_mlp=True)
    acts = tools.peak_without_checkpointing  # the model does not checkpoint
    peaks = {name: estimate_memory(model, world_size=1, config=ZeroConfig.preset(name)).peak_device
             for name in ("zero2", "zero2_offload")}
    device = int((peaks["zero2_offload"] + acts) / 0.75) + 1
    assert peaks["zero2"] + acts > 0.75 * device  # zero2 does not fit the sequence, even tiled
    assert peaks["zero2"] <= 0.75 * device  # but its model states alone do
    available = AvailableMemory(device=device, host=64 * GIB, nvme=None)

    blind = _chosen(model, {"preset": "zero_auto"}, monkeypatch, available)
    assert (blind.stage, blind.offload_optimizer, blind.tiled_loss) == (2, None, False)

    seeing = _chosen(model, {"preset": "zero_auto", "seq_len": SEQ}, monkeypatch, available)
    assert (seeing.stage, seeing.offload_optimizer is not None, seeing.offload_params) == (2, True, None)
    assert (seeing.tiled_loss, seeing.tiled_mlp) == (True, True)
    assert seeing.seq_len is None and not seeing.auto  # the chosen preset's config, ready to run

    # choose_preset reads the same key, and agrees with its own seq_len= argument
    cfg = ZeroConfig.load({"preset": "zero_auto", "seq_len": SEQ})
    assert zs.choose_preset(model, cfg, world_size=1, available=available) == seeing
    assert zs.choose_preset(model, "zero_auto", world_size=1, available=available, seq_len=SEQ) == seeing


def test_a_short_sequence_changes_nothing(monkeypatch):
    """Where the activations fit beside zero2's model states, the key leaves the choice as it was."""
    hf, model = _llama()
    acts = estimate_activations(hf, 1, 16, "fp32", "sdpa").peak_without_checkpointing
    zero2 = estimate_memory(model, world_size=1, config=ZeroConfig.preset("zero2")).peak_device
    device = int((zero2 + acts) / 0.75) + 1
    available = AvailableMemory(device=device, host=64 * GIB, nvme=None)
    chosen = _chosen(model, {"preset": "zero_auto", "seq_len": 16}, monkeypatch, available)
    assert (chosen.stage, chosen.offload_optimizer, chosen.tiled_loss, chosen.tiled_mlp) == (2, None, False, False)


@pytest.mark.parametrize("spec, key, says", [
    ({"preset": "zero3", "seq_len": 4096}, "seq_len", "read by zero_auto only"),
    ({"stage": 2, "seq_len": 4096}, "seq_len", "read by zero_auto only"),
    ({"preset": "zero_auto", "seq_len": 0}, "seq_len", ""),
    ({"preset": "zero_auto", "seq_len": "32k"}, "seq_len", ""),
    ({"preset": "zero_auto", "batch_size": 4}, "batch_size", "needs seq_len"),
    ({"preset": "zero_auto", "seq_len": 4096, "batch_size": 0}, "batch_size", ""),
])
def test_the_shape_is_refused_where_it_cannot_be_used(spec, key, says):
    with pytest.raises(ZeroConfigError, match=rf"^{key}: .*{says}"):
        ZeroConfig.load(spec)


def test_the_shape_round_trips_and_needs_a_transformers_model(monkeypatch):
    cfg = ZeroConfig.load({"preset": "zero_auto", "seq_len": 8192, "batch_size": 2})
    assert ZeroConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ZeroConfigError, match="needs a Hugging Face transformers model"):
        _chosen(torch.nn.Linear(4, 4), {"preset": "zero_auto", "seq_len": 128}, monkeypatch,
                AvailableMemory(device=GIB, host=GIB, nvme=None))
