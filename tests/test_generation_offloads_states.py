"""``ZeroConfig(offload_states_during_generation=...)``: every ``generate()`` of a set-up model runs
with that training state off the compute device (DeepSpeed users call ``offload_states()`` /
``reload_states()`` around the rollout by hand), and nothing else changes.

Oracle: the same model set up without the knob, from the same weights, generating the same
prompts and training the same steps; the tokens and, after the steps, the weights and every
optimizer state tensor must be equal bit for bit. Inside ``generate()`` a logits processor reads
``memory_report``: the moved bytes are counted there, and nothing afterwards. One process (the
move is local to each rank), a tiny ``LlamaForCausalLM`` from its config, stages 1-3.
"""

from __future__ import annotations

import pytest
import torch

import zero_strategy as zs
from _rollout import optimizer_state

transformers = pytest.importorskip("transformers")


class RecordOffloaded(transformers.LogitsProcessor):
    """Reads the engine's accounting at every generated token."""

    def __init__(self, model):
        self.model, self.seen = model, []

    def __call__(self, input_ids, scores):
        self.seen.append(zs.memory_report(self.model).offloaded_bytes)
        return scores


def run(stage: int, knob) -> dict:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    model, zopt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                           zs.ZeroConfig(stage=stage, param_persistence_threshold=0,
                                         offload_states_during_generation=knob))
    prompts = torch.randint(0, 63, (2, 5), generator=torch.Generator().manual_seed(1))  # 63: padding
    record, tokens = RecordOffloaded(model), []
    for step in range(3):  # a rollout, then a training step on it, as GRPO does
        out = model.generate(prompts, max_new_tokens=4, do_sample=False, logits_processor=[record],
                             pad_token_id=63)
        tokens.append(out.tolist())
        model(out, labels=out).loss.backward()
        zopt.step()
        zopt.zero_grad()
    return dict(tokens=tokens, seen=record.seen, after=zs.memory_report(model).offloaded_bytes,
                weights=zs.full_state_dict(model), state=optimizer_state(zopt))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_generate_runs_with_the_training_state_off_the_device_and_changes_nothing(stage):
    plain, offloaded = run(stage, ()), run(stage, True)
    assert offloaded["tokens"] == plain["tokens"]
    assert plain["seen"] and all(b == 0 for b in plain["seen"])
    # the first rollout comes before any optimizer state exists; from the second on, at every token,
    # the Adam moments are off the device, and back once generate() returns
    later = offloaded["seen"][4:]
    assert len(later) == 8 and all(b > 0 for b in later) and offloaded["after"] == 0, offloaded["seen"]
    assert all(torch.equal(offloaded["weights"][k], v) for k, v in plain["weights"].items())
    assert len(offloaded["state"]) == len(plain["state"])
    for a, b in zip(offloaded["state"], plain["state"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
