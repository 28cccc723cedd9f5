"""The tiled causal-LM loss gives the untiled loss and its gradients, in one process.

Two references, both independent of the tiling: ``F.cross_entropy`` on the whole logits with
autograd through them (the function itself), and transformers' own ``ForCausalLMLoss`` (its
``labels`` / ``shift_labels`` / ``num_items_in_batch`` / ``ignore_index`` conventions), and for the
Hugging Face idiom the same model not set up, trained by the same loop. Tolerances: fp32 to
rounding (the order of one sum, 1e-6 relative); bf16: the head's gradient is summed over chunks in
fp32 and rounded once, where the untiled matmul rounds once over all tokens: within 2^-7 of the
largest entry. A batch with no valid label gives 0, never NaN (See [Note: the tiled loss] in
src/zero_strategy/_model/tiled_loss.py). Multi-rank stage 3: tests/test_tiled_loss_ranks.py;
memory: tests/test_tiled_loss_memory.py and tests/test_tiled_loss_copies.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero_strategy as zs
from _models import step_beside

transformers = pytest.importorskip("transformers")
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

VOCAB, HIDDEN = 100, 16


def _head_and_hidden(dtype, bias, seed=0, batch=2, seq=37):
    torch.manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias).to(dtype)
    hidden = torch.randn(batch, seq, HIDDEN, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (batch, seq))
    labels[0, :10] = -100  # a masked prompt
    return head, hidden, labels


def _grads(loss, head, hidden):
    wanted = [hidden, head.weight] + ([head.bias] if head.bias is not None else [])
    return torch.autograd.grad(loss, wanted)


@pytest.mark.parametrize("chunk", [1, 7, 64, None], ids=["chunk1", "chunk7", "chunk64", "default"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loss_and_gradients_match_cross_entropy_on_the_whole_logits(dtype, bias, chunk):
    head, hidden, labels = _head_and_hidden(dtype, bias)
    tiled = zs.tiled_causal_lm_loss(head, hidden, labels, chunk_tokens=chunk)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    whole = F.cross_entropy(head(hidden).float().reshape(-1, VOCAB), shift.reshape(-1), ignore_index=-100)
    assert tiled.dtype == torch.float32
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(tiled, head, hidden), _grads(whole, head, hidden)):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.abs().max().item()
        tol = 1e-6 * scale if dtype == torch.float32 else 2 ** -7 * scale
        assert (got.float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_under_autocast_the_head_computes_in_bf16_as_the_untiled_path_does(bias):
    """fp32 head and hidden states under CPU bf16 autocast: the logits are bf16 before the upcast in both
    paths, and the gradients come back in fp32 (backward replays the forward's casts without autocast)."""
    head, hidden, labels = _head_and_hidden(torch.float32, bias)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tiled = zs.tiled_causal_lm_loss(head, hidden, labels, chunk_tokens=7)
        whole = F.cross_entropy(head(hidden).float().reshape(-1, VOCAB), shift.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(tiled, whole, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(tiled, head, hidden), _grads(whole, head, hidden)):
        assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
        assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("form", ["labels", "shift_labels", "num_items_in_batch", "ignore_index"])
def test_follows_transformers_for_causal_lm_loss(form):
    head, hidden, labels = _head_and_hidden(torch.float32, bias=False, seed=1)
    kwargs: dict = {}
    if form == "shift_labels":  # a sequence-parallel shard's labels come shifted already
        kwargs = {"shift_labels": torch.roll(labels, -3, dims=1)}
    elif form == "num_items_in_batch":  # gradient accumulation: the sum over the whole batch's count
        kwargs = {"labels": labels, "num_items_in_batch": torch.tensor(123)}
    elif form == "ignore_index":
        labels = labels.masked_fill(labels == -100, 7)
        kwargs = {"labels": labels, "ignore_index": 7}
    else:
        kwargs = {"labels": labels}
    tiled = zs.tiled_causal_lm_loss(head, hidden, chunk_tokens=5, **kwargs)
    theirs = ForCausalLMLoss(head(hidden), kwargs.pop("labels", None), VOCAB, **kwargs)
    torch.testing.assert_close(tiled, theirs, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(tiled, head, hidden), _grads(theirs, head, hidden)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_batch_without_a_valid_label_gives_zero_and_zero_gradients_not_nan():
    """A sequence-parallel shard that holds only prompt tokens: transformers' mean divides 0 by 0."""
    head, hidden, _ = _head_and_hidden(torch.float32, bias=True)
    masked = torch.full((2, 37), -100)
    assert torch.isnan(ForCausalLMLoss(head(hidden), masked, VOCAB))  # what the tiled loss must not do
    loss = zs.tiled_causal_lm_loss(head, hidden, masked, chunk_tokens=8)
    assert loss.item() == 0.0
    for grad in _grads(loss, head, hidden):
        assert torch.count_nonzero(grad) == 0


def test_labels_of_another_shape_are_refused():
    head, hidden, labels = _head_and_hidden(torch.float32, bias=False)
    with pytest.raises(ValueError, match="37 labels|74 hidden states"):
        zs.tiled_causal_lm_loss(head, hidden, shift_labels=labels[:, :-1])
    with pytest.raises(ValueError, match="exactly one of"):
        zs.tiled_causal_lm_loss(head, hidden)


# --------------------------------------------------------------- a transformers model, the user's loop
def _llama(tied: bool) -> "transformers.LlamaForCausalLM":
    cfg = transformers.LlamaConfig(vocab_size=64 if tied else 512, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(cfg)


def _batches(vocab: int, steps: int = 3):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        labels = ids.clone()
        labels[:, :4] = -100  # the prompt
        yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_hf_loop_trains_like_the_model_itself(tied, stage):
    """``outputs = model(**batch); outputs.loss.backward()``: the same losses and weights as the model
    not set up; the logits are not returned in training."""
    base = _llama(tied)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5),
                          {"stage": stage, "param_persistence_threshold": 0, "tiled_loss": 5})
    for batch in _batches(base.config.vocab_size):
        outputs, want = step_beside(model, opt, ref, ref_opt, batch)
        assert outputs.logits is None
        assert outputs.loss.item() == pytest.approx(want.item(), rel=1e-6)
    trained = zs.full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
    zs.teardown(model)


def test_shift_labels_alone_ask_for_the_loss_as_a_sequence_parallel_shard_does():
    """A sequence-parallel data loader gives each rank ``shift_labels`` (its shard's labels, shifted
    before splitting) and no ``labels``; they win over ``labels`` when both come, as in
    ``ForCausalLMLoss``."""
    base = _llama(tied=False)
    model, _ = zs.setup(copy.deepcopy(base), None, {"stage": 1, "tiled_loss": 3})
    batch = next(_batches(512))
    shift = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    want = ForCausalLMLoss(base(batch["input_ids"]).logits, None, 512, shift_labels=shift)
    got = model(input_ids=batch["input_ids"], shift_labels=shift)
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=1e-6)
    both = model(input_ids=batch["input_ids"], labels=torch.zeros_like(shift), shift_labels=shift)
    torch.testing.assert_close(both.loss, want, rtol=1e-6, atol=1e-6)
    zs.teardown(model)


def test_a_lora_model_gets_the_tiled_loss_of_its_base_and_a_lora_head_is_refused():
    """PEFT's ``PeftModelForCausalLM`` calls the base model's ``forward``, which carries the tiled loss;
    a head under LoRA is no plain ``nn.Linear``: refused."""
    peft = pytest.importorskip("peft")
    base = _llama(tied=False)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), lora)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    model, opt = zs.setup(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
                          {"stage": 3, "param_persistence_threshold": 0, "tiled_loss": 5})
    for batch in _batches(512, steps=2):
        outputs, want = step_beside(model, opt, ref, ref_opt, batch)
        assert outputs.logits is None
        assert outputs.loss.item() == pytest.approx(want.item(), rel=1e-6)
    zs.teardown(model)
    lora_head = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="lm_head"):
        zs.setup(lora_head, None, {"stage": 3, "tiled_loss": True})


def test_eval_calls_without_labels_and_logits_to_keep_take_the_models_own_path():
    base = _llama(tied=False)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    model, _ = zs.setup(model, None, {"stage": 3, "param_persistence_threshold": 0, "tiled_loss": True})
    batch = next(_batches(512))
    torch.testing.assert_close(model(batch["input_ids"]).logits, ref(batch["input_ids"]).logits)
    kept = model(batch["input_ids"], logits_to_keep=1).logits
    assert kept.shape == (2, 1, 512)
    model.eval()
    ref.eval()
    outputs, want = model(**batch), ref(**batch)
    torch.testing.assert_close(outputs.logits, want.logits)
    torch.testing.assert_close(outputs.loss, want.loss)
    zs.teardown(model)


def test_return_dict_false_gives_the_loss_first():
    base = _llama(tied=True)
    model, _ = zs.setup(copy.deepcopy(base), None, {"stage": 1, "tiled_loss": True})
    batch = next(_batches(64))
    got = model(**batch, return_dict=False)
    assert got[0].item() == pytest.approx(base(**batch).loss.item(), rel=1e-6)
    zs.teardown(model)


def test_teardown_gives_the_model_its_own_forward_back():
    model, _ = zs.setup(_llama(tied=True), None, {"stage": 1, "tiled_loss": True})
    batch = next(_batches(64))
    assert model(**batch).logits is None
    zs.teardown(model)
    assert "forward" not in model.__dict__
    assert model(**batch).logits.shape == (2, 12, 64)


# ----------------------------------------------------------------------------------- refusals
def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0))


def _cohere():
    return transformers.CohereForCausalLM(transformers.CohereConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logit_scale=0.25))


def _granite():
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logits_scaling=4.0))


class _ScaledHead(nn.Linear):
    pass


def _custom_head():
    model = _llama(tied=False)
    model.lm_head = _ScaledHead(32, 512, bias=False)
    return model


def _own_loss():
    model = _llama(tied=True)
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    return model


class _NotHF(nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8)


REFUSED = {
    "gemma2_softcapping": (_gemma2, "final_logit_softcapping"),
    "cohere_logit_scale": (_cohere, "logit_scale"),
    "granite_logits_scaling": (_granite, "logits_scaling"),
    "custom_head": (_custom_head, "_ScaledHead"),
    "own_loss_function": (_own_loss, "loss_function"),
    "not_a_transformers_causal_lm": (_NotHF, "tiled_causal_lm_loss"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_model_whose_loss_tiling_would_change_is_refused_before_it_is_sharded(case):
    make, named = REFUSED[case]
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=named):
        zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), {"stage": 3, "tiled_loss": True})
    assert not zs.is_set_up(model)
    for name, value in model.state_dict().items():  # untouched: nothing was sharded
        assert torch.equal(value, before[name]), name


def test_the_config_takes_true_false_or_a_chunk_in_tokens():
    assert zs.ZeroConfig(tiled_loss=True).tiled_loss is True
    assert zs.ZeroConfig(tiled_loss=2048.0).tiled_loss == 2048
    for bad in (0, -1, "yes", 2.5, float("nan")):
        with pytest.raises(zs.ZeroConfigError, match="tiled_loss"):
            zs.ZeroConfig(tiled_loss=bad)
    for cfg in (zs.ZeroConfig(tiled_loss=512), zs.ZeroConfig(tiled_loss=True), zs.ZeroConfig()):
        assert zs.ZeroConfig.from_dict(cfg.to_dict()) == cfg
