"""Every weight loader compares shapes before it copies, naming the parameter and both shapes
(issue 38, item 2).

Before, ``zero_strategy.transformers.from_pretrained`` and ``zs.load_full_state_dict`` read
each rank's slice of the flattened tensor whatever its shape: a head saved for 3 labels
loaded into a 2-label model as its first rows, tensors of shape ``[24, 48]`` and ``[1152]``
both filled a ``[48, 24]`` weight silently, and a tensor too small failed with a copy error
naming no parameter, on the ranks whose slice fell past its end only. transformers and torch
raise "size mismatch" naming the parameter; so do these loaders now, on every rank, with
nothing copied, and ``ignore_mismatched_sizes=True`` leaves the head newly initialized as
transformers does.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import zero_strategy as zs
from _launch import launch
from _models import TinyLM, param_groups
from _refused_load import differences, snapshot

transformers = pytest.importorskip("transformers")

from zero_strategy.transformers import from_pretrained  # noqa: E402


# ------------------------------------------------------------------ the one-call loader
def _bert():
    return transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64)


def _llama():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


HEADS = {"bert": (_bert, transformers.BertForSequenceClassification, ["classifier.weight", "classifier.bias"]),
         "llama": (_llama, transformers.LlamaForSequenceClassification, ["score.weight"])}


def _saved_with_3_labels(tmp_path, arch):
    config, model_class, _ = HEADS[arch]
    torch.manual_seed(3)
    cfg = config()
    cfg.num_labels = 3
    model_class(cfg).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("arch", list(HEADS))
def test_a_head_for_3_labels_is_refused_for_2_naming_it_and_both_shapes(arch, tmp_path):
    saved = _saved_with_3_labels(tmp_path, arch)
    _, model_class, head = HEADS[arch]
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # transformers' own loader refuses it too
        model_class.from_pretrained(saved, num_labels=2)
    with pytest.raises(zs.CheckpointError) as err:
        from_pretrained(model_class, saved, num_labels=2)
    message = str(err.value)
    assert f"Error(s) in loading state_dict for {model_class.__name__}" in message
    assert (f"size mismatch for {head[0]}: copying a param with shape torch.Size([3, 32]) from checkpoint, the "
            "shape in current model is torch.Size([2, 32]).") in message
    if len(head) > 1:
        assert f"size mismatch for {head[1]}: copying a param with shape torch.Size([3]) from checkpoint" in message
    assert "ignore_mismatched_sizes=True" in message


@pytest.mark.parametrize("arch", list(HEADS))
def test_ignore_mismatched_sizes_initializes_the_head_as_transformers_does(arch, tmp_path, caplog):
    saved = _saved_with_3_labels(tmp_path, arch)
    _, model_class, head = HEADS[arch]
    ref = model_class.from_pretrained(saved, num_labels=2, ignore_mismatched_sizes=True)
    with caplog.at_level(logging.WARNING, logger="zero_strategy.transformers._pretrained"):
        model = from_pretrained(model_class, saved, num_labels=2, ignore_mismatched_sizes=True)
        model, _ = zs.setup(model, None, zs.ZeroConfig(stage=3, param_persistence_threshold=0))
        full = zs.full_state_dict(model)
    assert "newly initialized because the shapes did not match" in caplog.text
    assert (f"- {head[0]}: found shape torch.Size([3, 32]) in the checkpoint and torch.Size([2, 32]) in the model "
            "instantiated") in caplog.text
    for key, want in ref.state_dict().items():
        assert full[key].shape == want.shape, key
        if key not in head:  # the rest is the checkpoint's, bit for bit
            assert torch.equal(full[key], want), key
    # the model's _init_weights, as transformers initializes a mismatched head: normal(0, initializer_range)
    # weights, zero biases, and nothing of the saved 3-label head
    weight = full[head[0]]
    assert abs(weight.std().item() - ref.config.initializer_range) < 0.01
    assert not torch.equal(weight, ref.state_dict()[head[0]])  # a fresh draw, not a copy of anything
    if len(head) > 1:
        assert torch.equal(full[head[1]], torch.zeros(2))


# ------------------------------------------------------------------ load_full_state_dict
def _tiny(stage: int = 2):
    torch.manual_seed(0)
    model = TinyLM(layers=2)
    model.register_buffer("counts", torch.arange(4.0))
    return zs.setup(model, torch.optim.AdamW(param_groups(model)), zs.ZeroConfig(stage=stage))


W = "layers.0.fc1.weight"  # [48, 24]
BAD = {
    "transposed": (lambda t: t.t().contiguous(), r"torch\.Size\(\[24, 48\]\)"),  # same numel: loaded before
    "flat_same_numel": (lambda t: t.reshape(-1), r"torch\.Size\(\[1152\]\)"),      # same numel: loaded before
    "too_small": (lambda t: t.reshape(-1)[:100], r"torch\.Size\(\[100\]\)"),      # a copy error naming nothing
    "too_large": (lambda t: torch.cat([t, t]), r"torch\.Size\(\[96, 24\]\)"),      # first rows: loaded before
}


@pytest.mark.parametrize("case", list(BAD))
def test_load_full_state_dict_refuses_another_shape_and_changes_nothing(case):
    model, opt = _tiny()
    sd = {k: v.clone() for k, v in zs.full_state_dict(model).items()}
    sd = {k: v + 1 for k, v in sd.items()}  # values that would show any copy
    sd[W] = BAD[case][0](sd[W])
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=rf"size mismatch for {W}: copying a param with shape "
                                                 rf"{BAD[case][1]} from checkpoint, the shape in current model is "
                                                 r"torch\.Size\(\[48, 24\]\)"):
        zs.load_full_state_dict(model, sd)
    assert differences(before, snapshot(model, opt)) == []


def test_load_full_state_dict_refuses_a_buffer_of_another_shape():
    """A buffer was copied with broadcasting: a 1-element tensor filled a 4-element buffer."""
    model, opt = _tiny()
    sd = dict(zs.full_state_dict(model))
    sd["counts"] = torch.tensor([7.0])
    before = snapshot(model, opt)
    with pytest.raises(zs.CheckpointError, match=r"size mismatch for counts: copying a param with shape "
                                                 r"torch\.Size\(\[1\]\)"):
        zs.load_full_state_dict(model, sd)
    assert differences(before, snapshot(model, opt)) == []


def test_load_full_state_dict_refuses_integers_for_a_floating_point_parameter():
    model, opt = _tiny()
    sd = dict(zs.full_state_dict(model))
    sd[W] = torch.ones(48, 24, dtype=torch.int64)
    with pytest.raises(zs.CheckpointError, match=rf"dtype mismatch for {W}: copying a param of dtype torch\.int64"):
        zs.load_full_state_dict(model, sd)


def test_load_full_state_dict_still_loads_the_right_shapes():
    """The control: the same state dict with the right shapes loads, and changes the weights."""
    model, opt = _tiny()
    sd = {k: v + 1 for k, v in zs.full_state_dict(model).items()}
    assert zs.load_full_state_dict(model, sd) == []
    full = zs.full_state_dict(model)
    assert all(torch.equal(full[k], v) for k, v in sd.items())


def test_a_plain_function_reader_too_small_names_the_parameter():
    """A reader without ``shape_of`` is checked as it is read: each piece must hold what was asked."""
    model, _ = _tiny()
    sd = dict(zs.full_state_dict(model))
    sd[W] = sd[W].reshape(-1)[:100]

    def read(names, start, end):  # a user's own reader, as docs/front-ends/pytorch.md shows the idea
        name = next((n for n in names if n in sd), None)
        return None if name is None else sd[name].reshape(-1)[start:end]

    with pytest.raises(zs.CheckpointError, match=rf"size mismatch for {W}: the weights give 100 elements where "
                                                 r"its elements \[0, 1152\) are asked for"):
        zs.checkpoint.load_sharded_weights(model, read)


@pytest.fixture(scope="module")
def two_ranks():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return launch("load_shapes.py", 2, {"cases": list(BAD), "weight": W}, timeout=180)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", list(BAD))
def test_two_ranks_refuse_with_the_same_message_naming_the_parameter(case, stage, two_ranks):
    import re

    got = [r["results"][f"z{stage}-{case}"] for r in two_ranks]
    for rank, res in enumerate(got):
        assert re.search(rf"size mismatch for {W}: copying a param with shape {BAD[case][1]}", res["message"]), \
            (rank, res["message"])
        assert res["changed"] == [], f"rank {rank}: the refused load changed {res['changed'][:8]}"
    assert got[0]["message"] == got[1]["message"]
