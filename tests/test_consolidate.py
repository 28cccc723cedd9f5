"""Consolidation: the full state dict of a sharded checkpoint, exactly, in every output form."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import zero_strategy as zs
from _launch import launch
from _models import TinyLM, param_groups
from zero_strategy.cli import main as cli_main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-rank zero3 bf16 checkpoint (every parameter split over both rank files) and its
    full_state_dict(dtype=None): fp32 trained weights (from the masters), bf16 frozen ones."""
    d = tmp_path_factory.mktemp("consolidate")
    case = dict(name="c", stage=3, precision="bf16", start=0, end=2, save={"2": str(d / "ckpt")},
                sd_at_save=str(d / "sd"))
    reports = launch("checkpoint.py", 2, {"cases": [case]}, timeout=120)
    assert all("error" not in r["results"][0] for r in reports), reports
    return d / "ckpt", torch.load(d / "sd-2.pt")


def _assert_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.multiprocess
def test_equals_full_state_dict(saved, tmp_path):
    ckpt, want = saved
    out = zs.checkpoint.consolidate(ckpt, tmp_path / "out")
    got = load_file(out / "model.safetensors")
    _assert_equal(got, want)
    assert "head.weight" in got and "embed.weight" in got  # tied: both names, like model.state_dict()
    assert got["frozen_mix"].dtype == torch.bfloat16 and got["embed.weight"].dtype == torch.float32


@pytest.mark.multiprocess
def test_loads_with_load_state_dict(saved, tmp_path):
    ckpt, want = saved
    out = zs.checkpoint.consolidate(ckpt, tmp_path / "out", dtype="fp32")
    model = TinyLM(layers=2)
    model.load_state_dict(load_file(out / "model.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k].float()), k


@pytest.mark.multiprocess
def test_sharded_output_with_index(saved, tmp_path):
    ckpt, want = saved
    out = zs.checkpoint.consolidate(ckpt, tmp_path / "out", max_shard_size="4KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    got = {}
    for f in files:
        got.update(load_file(out / f))
    assert set(index["weight_map"]) == set(want)
    _assert_equal({k: got[k] for k in want}, want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.multiprocess
def test_torch_format(saved, tmp_path):
    ckpt, want = saved
    out = zs.checkpoint.consolidate(ckpt, tmp_path / "out", format="torch")
    got = torch.load(out / "pytorch_model.bin")
    _assert_equal(got, want)
    assert got["head.weight"] is got["embed.weight"]


@pytest.mark.multiprocess
def test_cli(saved, tmp_path, capsys):
    ckpt, want = saved
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    got = load_file(tmp_path / "out" / "model.safetensors")
    _assert_equal(got, {k: v.to(torch.bfloat16) for k, v in want.items()})
    assert cli_main(["consolidate", str(ckpt), str(tmp_path / "out")]) == 2
    assert "exists" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_existing_output_refused(saved, tmp_path):
    ckpt, _ = saved
    (tmp_path / "out").mkdir()
    with pytest.raises(zs.CheckpointError, match="out exists"):
        zs.checkpoint.consolidate(ckpt, tmp_path / "out")


def test_optimizer_state(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=2))
    model(torch.randint(0, 37, (2, 8))).float().mean().backward()
    opt.step()
    zs.save_checkpoint(tmp_path / "c", model, opt)
    out = zs.checkpoint.consolidate(tmp_path / "c", tmp_path / "out", include_optimizer=True)
    got = load_file(out / "optimizer.safetensors")
    engine = zs.api._engine_of(model)
    for g in engine.trainable_groups:
        state = opt.optimizer.state[g.master]
        for s in g.slots:
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got[f"{s.fqn}.{key}"], state[key][s.offset:s.offset + s.numel].view(s.shape))
            assert got[f"{s.fqn}.step"].item() == state["step"].item() == 1


def test_hf_llama_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    model.config.save_pretrained(tmp_path / "base")
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zs.ZeroConfig(stage=2))
    tokens = torch.randint(0, 64, (2, 12))
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    out = zs.checkpoint.consolidate(tmp_path / "ckpt", tmp_path / "hf", hf_config=tmp_path / "base")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
