"""Graph breaks that torch.compile meets in a set-up model: none inside a unit, and with
the whole model compiled, exactly the engine's gather/release hooks.

[Note: why each remaining break exists]
* A unit's forward pre-hook (gather: all-gather into the flat buffer, ``param.data``
  swaps, prefetch bookkeeping, autograd wrapping of the inputs) and its post-hook
  (release, registration of the pre-backward hook) run eagerly, outside any graph:
  traced, Dynamo lowers ``param.data = view`` to ``set_`` on a graph input and AOT
  autograd then fails the first backward (see [Note: torch.compile and the hooks] in
  _engine/engine.py). So a whole-model compile at stage 3 stops at the first unit's pre-hook;
  inside a ``for`` loop over the layers Dynamo cannot resume mid-loop, so the loop's
  frame runs eagerly and every frame it calls is compiled on its own. Measured on the
  tiny Llama: one graph per decoder layer (its whole forward, 59 ops), plus the
  embedding, the rotary embedding, the final norm and the head with the loss; the
  mask construction between them runs eagerly. Removing them needs the gather
  inside the graph (SimpleFSDP's approach: parameters as traced collectives), a
  different engine. Per-unit compile (``block.compile()``) has none, and stages 1-2
  have no unit hooks.
* The root unit's submodules (embeddings, final norm, tied head) carry an on-demand
  gather hook for direct calls; inside the root's forward it is a traced integer test,
  not a break.

Counted with ``torch._dynamo.utils.counters`` over two training steps of a tiny Hugging
Face Llama (2 decoder layers) on one process, backend ``aot_eager``.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

from _models import tiny_llama_config

import zero_strategy as zs

pytest.importorskip("transformers")
# a dynamo compile per case, about 12 s together: the full tier (docs/testing.md#tiers)
pytestmark = pytest.mark.slow


def _train_compiled(stage: int, how: str) -> list[str]:
    """Two steps of a set-up tiny Llama compiled ``how``; returns the graph-break reasons."""
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config())
    opt = torch.optim.AdamW(model.parameters())
    model, zopt = zs.setup(model, opt, zs.ZeroConfig.preset(f"zero{stage}", param_persistence_threshold=0))
    run = model
    if how == "model":
        run = torch.compile(model, backend="aot_eager")
    else:
        for block in model.model.layers:
            block.compile(backend="aot_eager", fullgraph=True)
    try:
        for step in range(2):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            zopt.backward(run(input_ids=tokens, labels=tokens).loss)
            zopt.step()
            zopt.zero_grad()
        assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
        return [reason for reason, n in counters["graph_break"].items() for _ in range(n)]
    finally:
        zs.teardown(model)
        torch._dynamo.reset()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_per_unit_compile_has_no_graph_break(stage):
    assert _train_compiled(stage, "blocks") == []


@pytest.mark.parametrize("stage", [1, 2])
def test_whole_model_compile_has_no_graph_break_without_unit_hooks(stage):
    assert _train_compiled(stage, "model") == []


def test_whole_model_compile_breaks_only_at_the_unit_hooks_at_stage_3():
    """Dynamo stops at the first unit's gather hook inside the decoder's layer loop (it
    retries the frame, so the counter shows that one site several times); any other
    break (an on-demand root gather, a hook of ours traced by mistake) fails this."""
    reasons = _train_compiled(3, "model")
    assert reasons, "expected Dynamo to stop at the unit hooks at stage 3"
    sites = {re.search(r"function `<function (\S+) at", r).group(1) for r in reasons}
    assert sites == {"ZeroEngine._make_unit_pre_forward.<locals>.hook"}, reasons
    assert all("zero_strategy gather/release hook" in r for r in reasons), reasons
