"""Expert parallelism on 2 ranks against one process on the whole batch (tests/test_expert_parallel.py).

Each training case: a tiny transformers 5 MoE model built from its config with the same seed on
every rank; a deep copy before setup is the reference, trained in this process on the whole
batch (one process's training). The set-up model, with ``expert_parallel_size=2``, trains on
this rank's half of the batch, so the routing differs by rank (what each rank's tokens choose is
reported). Reported: both losses per step, the largest difference of the final full weights,
the bytes of expert weights this rank holds against the whole experts, and whether the engine
holds any expert weight. Each refusal case reports the message it raised.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import transformers
from torch import nn

from _worker import finish, run_cases, start

import zero_strategy as zs
from zero_strategy._model.expert_parallel import ExpertParallelExperts


def _config(family: str, experts: int = 4):
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    if family == "mixtral":
        return transformers.MixtralConfig(**small, intermediate_size=48, num_key_value_heads=2,
                                          num_local_experts=experts, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**small, intermediate_size=48, moe_intermediate_size=24,
                                           num_key_value_heads=2, num_experts=experts, num_experts_per_tok=2,
                                           head_dim=8)
    if family == "gpt_oss":  # experts with biases, transposed and interleaved: a layout not served yet
        return transformers.GptOssConfig(**small, intermediate_size=48, num_key_value_heads=2, head_dim=8,
                                         num_local_experts=experts, num_experts_per_tok=2)
    return transformers.LlamaConfig(**small, intermediate_size=48, num_key_value_heads=2)


def _model(family: str, experts: int = 4) -> nn.Module:
    torch.manual_seed(5)
    return transformers.AutoModelForCausalLM.from_config(_config(family, experts))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole batch, this rank's share): 4 sequences of 12 tokens."""
    whole = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(31 + step))
    per = 4 // dist.get_world_size()
    return whole, whole[per * rank:per * (rank + 1)]


def _steps(model, opt, steps) -> list[float]:
    """Train ``steps`` (their indices pick the batches); the mean loss over the ranks of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        _, mine = _batch(rank, step)
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        both = torch.tensor([loss.item()])
        dist.all_reduce(both)
        losses.append(both.item() / world)
    return losses


def _expert_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}


def _first_owner_only(model: nn.Module) -> None:
    """Every token routed to experts 0-1 (rank 0's): rank 1's experts get no row from any rank."""
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(lambda m, args, out: (out[0], out[1], out[2] % 2))


def train(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(case["family"])
    if case.get("first_owner_only"):
        _first_owner_only(model)
    if case.get("checkpointing"):  # each layer's forward, all-to-alls included, runs again in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    whole_expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                             if n in _expert_names(model))
    config = zs.ZeroConfig(stage=case["stage"], param_persistence_threshold=0,
                           expert_parallel_size=case.get("ep", world),
                           gradient_clipping=case.get("clip"))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    engine = zs.api._engine_of(model)
    local = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    held_bytes = sum(p.numel() * p.element_size() for m in local for p in m.parameters())
    managed_names = {n for n, p in model.named_parameters() if engine.group_of(p) is not None}
    routed: list[list[int]] = []  # per call of layer 0's experts: rows for each expert
    hook = local[0].register_forward_pre_hook(
        lambda m, args: routed.append(torch.bincount(args[1].reshape(-1), minlength=m.num_experts).tolist()))
    losses, norms, all_to_alls = [], [], []
    for step in range(3):
        whole, mine = _batch(rank, step)
        if case.get("accumulate"):  # two micro-batches of one sequence, the first inside no_sync
            with zs.no_sync(model):
                first = model(input_ids=mine[:1], labels=mine[:1]).loss / 2
                first.backward()
            loss = model(input_ids=mine[1:], labels=mine[1:]).loss / 2
            loss.backward()
            loss = loss + first.detach()
        else:
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
        if case.get("clip_value"):  # elementwise: the experts' gradients clamped too
            opt.clip_grad_value_(case["clip_value"])
        opt.step()
        opt.zero_grad()
        all_to_alls.append(zs.comm_stats(model)["all_to_all"]["calls"])
        ref_loss = ref(input_ids=whole, labels=whole).loss
        ref_loss.backward()
        if case.get("clip_value"):
            nn.utils.clip_grad_value_(ref.parameters(), case["clip_value"])
        if case.get("clip"):  # the global norms themselves compared: Adam hides a wrong clip coefficient
            norms.append((float(opt.last_grad_norm), float(nn.utils.clip_grad_norm_(ref.parameters(), case["clip"]))))
        ref_opt.step()
        ref_opt.zero_grad()
        both = torch.tensor([loss.item()])
        dist.all_reduce(both)
        losses.append((both.item() / world, ref_loss.item()))
    hook.remove()
    full = zs.full_state_dict(model)
    only = zs.full_state_dict(model, rank0_only=True)  # the other ranks send, keep nothing
    rank0_only = (sorted(only) == sorted(full) and all(torch.equal(only[k], full[k]) for k in full)) if rank == 0 \
        else only == {}
    ref_state = ref.state_dict()
    report = dict(case=case["case"], losses=losses, norms=norms, keys_equal=sorted(full) == sorted(ref_state), rank0_only=rank0_only,
                  weight_diff=max((full[k].float() - v.float()).abs().max().item() for k, v in ref_state.items()),
                  expert_weight_diff=max((full[k] - ref_state[k]).abs().max().item() for k in _expert_names(ref)),
                  held_expert_bytes=held_bytes, whole_expert_bytes=whole_expert_bytes,
                  engine_holds_experts=bool(managed_names & _expert_names(model)),
                  local_experts=[[m.first, m.num_local] for m in local[:1]], routed=routed,
                  all_to_alls=all_to_alls)
    if case.get("generate"):  # greedy, rank r asks for 3 + 2r tokens: a rank that is done keeps the all-to-alls going
        model.eval()
        ref.eval()
        prompt = _batch(rank, 9)[1][:, :5]
        new = 3 + 2 * rank
        with torch.no_grad():
            got = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            want = ref.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        report["generated_equal"] = torch.equal(got, want)
        report["generated"] = got.shape[1] - prompt.shape[1]
    if case.get("saved"):  # transformers' own directory, one tensor per expert, read back by transformers
        model.save_pretrained(case["saved"])
        if rank == 0:
            back = transformers.AutoModelForCausalLM.from_pretrained(case["saved"]).state_dict()
            report["read_back_diff"] = max((back[k] - v).abs().max().item() for k, v in ref_state.items())
        dist.barrier()
    if case.get("teardown"):  # a plain module again, with the whole experts
        zs.teardown(model)
        state = model.state_dict()
        report["teardown_diff"] = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    if case.get("release"):  # teardown(keep_weights=False): the experts stay empty, and it says which
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            groups = list(engine.expert_parallel.made_groups)
            zs.teardown(model, keep_weights=False)
        report["groups_left"] = sum(g in dist.distributed_c10d._world.pg_map for g in groups)
        report["groups_made"] = len(groups)
        report["release_warnings"] = [str(w.message) for w in caught]
        report["empty_experts"] = sorted(n for n, p in model.named_parameters()
                                         if n in _expert_names(model) and p.numel() == 0)
    return report


def bf16_beside_gather(case: dict) -> dict:
    """bf16 compute: expert parallelism beside the stage-3 gather path on the same data (one process has no
    bf16 ZeRO reference: both keep fp32 masters and compute in bf16)."""
    world = dist.get_world_size()
    runs = {}
    for name, extra in (("gather", {}), ("ep", {"expert_parallel_size": world})):
        model = _model("mixtral")
        config = zs.ZeroConfig(stage=3, precision="bf16", param_persistence_threshold=0, **extra)
        # SGD: a weight's difference follows its gradient's (Adam's normalisation would blow bf16 rounding
        # of near-zero gradients up to a whole step)
        model, opt = zs.setup(model, torch.optim.SGD(model.parameters(), lr=0.5), config)
        runs[name] = (_steps(model, opt, range(3)), zs.full_state_dict(model))
        zs.teardown(model, keep_weights=False)
    (gather_losses, gather_w), (ep_losses, ep_w) = runs["gather"], runs["ep"]
    return dict(case=case["case"], losses=list(zip(ep_losses, gather_losses)),
                weight_diff=max((ep_w[k] - v).abs().max().item() for k, v in gather_w.items()),
                weight_scale=max(v.abs().max().item() for v in gather_w.values()))


def refusal(case: dict) -> dict:
    """The message of what ``case["what"]`` raises."""
    world = dist.get_world_size()
    what = case["what"]
    cfg = dict(stage=3, expert_parallel_size=world)
    family, experts = "mixtral", 4
    if what == "dense":
        family = "llama"
    elif what == "indivisible":
        experts = 3
    elif what == "size":
        cfg["expert_parallel_size"] = 2 * world
    elif what == "offload":
        cfg = dict(cfg, offload_optimizer="cpu")
    elif what == "fp16":
        cfg = dict(cfg, precision="fp16")
    elif what == "sequence_parallel":
        cfg = dict(cfg, sequence_parallel_size=world)
    elif what == "layout":
        family = "gpt_oss"
    elif what == "offload_states":
        cfg = dict(cfg, stage=2)
    if what == "meta":  # built on the meta device: nothing to slice yet
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(family, experts))
    else:
        model = _model(family, experts)
    if what == "bf16_stored":  # no fp32 master for the experts: refused (load in fp32, precision='bf16')
        model = model.to(torch.bfloat16)
    params = list(model.parameters())
    if what == "rollback":  # fails after the experts were replaced: everything is put back
        params.append(nn.Parameter(torch.zeros(3)))
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    try:
        model, opt = zs.setup(model, optimizer, zs.ZeroConfig(**cfg))
        if what == "offload_states":  # the experts are not among the states it moves: refused
            refused = None
            try:
                zs.offload_states(model)
            except NotImplementedError as err:
                refused = err
            zs.teardown(model, keep_weights=False)  # outside the except block: not the error path
            if refused is not None:
                raise refused
    except (ValueError, NotImplementedError) as err:
        untouched = not any(isinstance(m, ExpertParallelExperts) for m in model.modules())
        in_model = {id(p) for p in model.parameters()}
        return dict(case=case["case"], message=f"{type(err).__name__}: {err}", untouched=untouched,
                    optimizer_holds_model_params=sum(id(p) in in_model for p in optimizer.param_groups[0]["params"]),
                    model_params=len(in_model), whole_experts=all(
                        p.shape[0] == experts for n, p in model.named_parameters() if n in _expert_names(model)))
    return dict(case=case["case"], message=None)


def run(case: dict) -> dict:
    if "what" in case:
        return refusal(case)
    return bf16_beside_gather(case) if case.get("bf16") else train(case)


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
