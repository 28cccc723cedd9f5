"""``with zs.gathered_for_generation(model): model.generate(...)`` on 2 gloo ranks, against a plain model.

Each case sets up a tiny Llama (transformers, built from a config) with AdamW at a given
config and compares what it generates, per rank and on prompts of different lengths per
rank, with an unsharded copy of the same weights generating the same prompts (greedy and
sampled from one seed; and one more call where the ranks ask for different numbers of new
tokens, so they stop at different steps). Reported per case: whether the tokens are equal, the all-gathers
issued by one generate() inside the block and without it, the number of sharded flat
groups, the log lines the block wrote, and the unit states after the block.

Cases (``args["cases"]``, each a dict with ``name`` and ``config``):
* ``kind: "generate"``: the comparisons above; ``budget`` passes ``budget_bytes``;
* ``kind: "training"``: 3 steps of 2 micro-batches, with a gathered generate after the
  first micro-batch of each step (gradients waiting) and after each step, against
  torch DDP training the same batches without generating: losses and final weights;
* ``kind: "refusals"``: an in-place write inside the block, a forward with gradients
  enabled inside it, an exception raised inside it: what each raised, whether the units
  were released, and that a training step afterwards still equals DDP's.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _worker import LogLines, finish, run_named_cases, start, worst_rel_diff
from transformers import LlamaConfig, LlamaForCausalLM

import zero_strategy as zs

VOCAB = 50


def make_model(layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return LlamaForCausalLM(cfg)


def prompts(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randint(3, VOCAB, (2, 3 + 2 * rank), generator=g)  # another length on each rank


def generate(model, ids: torch.Tensor, sample: bool) -> list[list[int]]:
    torch.manual_seed(123)
    kwargs = dict(do_sample=True, top_k=0, temperature=1.0) if sample else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, pad_token_id=0,
                         **kwargs)
    return out.tolist()


def gathers(model) -> int:
    return zs.api._engine_of(model).comm.stats.all_gather.calls


def sharded_groups(model) -> int:
    return sum(len(u.sharded_groups) for u in zs.api._engine_of(model).units)


def sharded_units(model) -> int:
    """Units with sharded groups: one (coalesced) all-gather each, however many groups they have."""
    return sum(1 for u in zs.api._engine_of(model).units if u.sharded_groups)


def unit_states(model) -> list[str]:
    return sorted({u.state.value for u in zs.api._engine_of(model).units if u.sharded_groups})


def config_of(case: dict, nvme_path: str):
    cfg = zs.ZeroConfig.load(case["config"])
    if cfg.stage == 3:
        cfg = cfg.replace(param_persistence_threshold=0)  # every parameter really sharded
    if cfg.offload_params is not None and "nvme" in case["config"]:
        cfg = zs.ZeroConfig.load({**cfg.to_dict(), "offload_optimizer": {"device": "nvme", "path": nvme_path},
                                  "offload_params": {"device": "nvme", "path": nvme_path}})
    return cfg


def setup(case: dict, out) -> tuple:
    plain = make_model()
    model = copy.deepcopy(plain)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = zs.setup(model, opt, config_of(case, str(out / f"nvme{dist.get_rank()}")))
    return plain, model, opt


def run_generate(case: dict, out) -> dict:
    plain, model, _ = setup(case, out)
    ids = prompts(dist.get_rank())
    expected = {s: generate(plain, ids, s) for s in (False, True)}
    lines = LogLines()
    logging.getLogger("zero_strategy").addHandler(lines)
    logging.getLogger("zero_strategy").setLevel(logging.INFO)
    try:
        before = gathers(model)
        with zs.gathered_for_generation(model, budget_bytes=case.get("budget")):
            greedy = generate(model, ids, False)
        in_block = gathers(model) - before
        with zs.gathered_for_generation(model, budget_bytes=case.get("budget")):
            sampled = generate(model, ids, True)
        before = gathers(model)
        per_unit = generate(model, ids, False)
        without_block = gathers(model) - before
        # ranks stopping at different steps: inside the block a forward communicates nothing
        uneven_kwargs = dict(do_sample=False, max_new_tokens=2 + 5 * dist.get_rank(), pad_token_id=0)
        with zs.gathered_for_generation(model, budget_bytes=case.get("budget")):
            uneven = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **uneven_kwargs).tolist()
        uneven_expected = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **uneven_kwargs).tolist()
    finally:
        logging.getLogger("zero_strategy").removeHandler(lines)
    return {"stage": zs.api._engine_of(model).plan.stage, "greedy_equal": greedy == expected[False],
            "sampled_equal": sampled == expected[True], "per_unit_equal": per_unit == expected[False],
            "uneven_equal": uneven == uneven_expected,
            "gathers_in_block": in_block, "gathers_without_block": without_block,
            "sharded_groups": sharded_groups(model), "sharded_units": sharded_units(model),
            "log": [ln for ln in lines.lines if "gathered_for_generation" in ln],
            "states_after": unit_states(model)}


def batches(rank: int, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(3, VOCAB, (2, 8), generator=g) for _ in range(2)]


def train_step(model, opt, step: int, between=None) -> float:
    total = 0.0
    for k, ids in enumerate(batches(dist.get_rank(), step)):
        loss = model(input_ids=ids, labels=ids).loss / 2
        loss.backward()
        total += loss.item()
        if between is not None and k == 0:
            between()  # gradients of the first micro-batch wait in the flat buffers
    opt.step()
    opt.zero_grad()
    return total


def ddp_reference(steps: int) -> tuple[list[float], dict]:
    ref = make_model()
    ddp = DDP(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        total = 0.0
        for k, ids in enumerate(batches(dist.get_rank(), step)):
            ctx = ddp.no_sync() if k == 0 else torch.enable_grad()
            with ctx:
                loss = ddp(input_ids=ids, labels=ids).loss / 2
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def run_training(case: dict, out) -> dict:
    _, model, opt = setup(case, out)
    ids = prompts(dist.get_rank())

    def gathered_generate():
        with zs.gathered_for_generation(model):
            generate(model, ids, False)

    losses = []
    for step in range(3):
        losses.append(train_step(model, opt, step, between=gathered_generate))
        gathered_generate()
    ref_losses, ref_weights = ddp_reference(3)
    worst, name = worst_rel_diff(zs.full_state_dict(model), ref_weights)
    return {"losses": losses, "ref_losses": ref_losses, "weights_rel": worst, "worst": name,
            "states_after": unit_states(model)}


def run_refusals(case: dict, out) -> dict:
    _, model, opt = setup(case, out)
    ids = prompts(dist.get_rank())
    raised = {}
    try:
        with torch.no_grad(), zs.gathered_for_generation(model):
            model.lm_head.weight.mul_(2.0)
    except RuntimeError as e:
        raised["write"] = str(e)
    states = {"write": unit_states(model)}
    try:
        with zs.gathered_for_generation(model):
            model(input_ids=ids)
    except RuntimeError as e:
        raised["grad_forward"] = str(e)
    states["grad_forward"] = unit_states(model)
    try:
        with zs.gathered_for_generation(model):
            generate(model, ids, False)
            raise KeyError("inside")
    except KeyError as e:
        raised["exception"] = str(e)
    states["exception"] = unit_states(model)
    losses = [train_step(model, opt, 0)]
    ref_losses, ref_weights = ddp_reference(1)
    worst, name = worst_rel_diff(zs.full_state_dict(model), ref_weights)
    return {"raised": raised, "states": states, "losses": losses, "ref_losses": ref_losses, "weights_rel": worst}


def main() -> None:
    args, out = start()
    runs = {"generate": run_generate, "training": run_training, "refusals": run_refusals}
    finish(out, run_named_cases(args["cases"], lambda case: runs[case["kind"]](case, out), barrier=True))


if __name__ == "__main__":
    main()
