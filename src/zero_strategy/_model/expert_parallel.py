"""Expert parallelism: each rank holds whole experts, and tokens travel to them by all-to-all.

[Note: expert parallelism]
At stage 3 every rank gathers every expert of a layer before the layer runs, although each
token uses only ``top_k`` of them. ``ZeroConfig(expert_parallel_size=N)`` instead gives rank
``r`` experts ``[r*E/N, (r+1)*E/N)`` of every mixture-of-experts layer, whole, for good: the
engine never shards, gathers nor reduces them (they are *rank-local*: See ``rank_local`` in
_engine/units.py), and the layer's experts module is replaced by :class:`ExpertParallelExperts`,
which takes what transformers 5's MoE blocks pass their fused experts (``hidden_states [T, H]``,
``top_k_index [T, K]``, ``top_k_weights [T, K]``) and

1. sorts the ``T*K`` (token, expert) assignments by expert, so each owner's rows are contiguous;
2. exchanges the per-expert row counts (one all-to-all of ``E`` integers), then the rows
   themselves (``[T*K, H]`` out, the rows of this rank's experts from every rank in);
3. runs each local expert on its rows (``act(x @ W_gate^T) * (x @ W_up^T) @ W_down^T``, the
   computation of transformers' own experts forward for the fused, concatenated layout);
4. sends the outputs back by the reverse all-to-all, weights them by ``top_k_weights`` and sums
   them per token, as transformers does.

Both all-to-alls are autograd functions whose backward is the reverse exchange, on a process
group of their own (so they never interleave with the engine's collectives), in the same
order on every rank (every rank runs every layer). Every collective here, and the groups, go
through the engine's ``Collectives`` (counted in ``comm_stats()["all_to_all"]``, waited on with its
bound: See [Note: collectives on other groups] in _comm/collectives.py); teardown destroys the groups.

Groups. ``N`` divides the world ``W``: ranks ``[g*N, (g+1)*N)`` form expert-parallel group ``g``,
which holds every expert; the ``W/N`` groups are data-parallel replicas of each other, and the
ranks at the same place in each group (``i, i+N, ...``) hold the same experts.

Gradients. Each rank's loss is the mean over its own batch, and the engine averages the other
parameters' gradients over the ``W`` ranks, which equals one process on the whole batch (the
mean of the ranks' losses). An expert's rows come from every rank of its group, so autograd
already gives its owner ``sum over the group's ranks s of d loss_s / d expert``: dividing that by
``W`` (a hook on the parameter, before it accumulates) and summing over the replicas (one
all-reduce per expert tensor at the step; none when ``N = W``) is the same mean. Clipping counts
each expert once: the ranks of group 0 add their experts' squares to the norm's all-reduce, the
replicas add nothing (_optim/optimizer.py, ``rank_local``).

Optimizer. The user's optimizer is re-homed onto master shards (See [Note: why re-home instead
of wrap] in _optim/optimizer.py); the rank-local experts are stepped by a second instance of the
same optimizer class over them (:class:`LocalExpertStep`), whose param groups take their
hyperparameters from the user's groups at every step (so LR schedulers reach them), after the
masters step, with the same unscale and clip factor.

Weights. ``model.state_dict()`` of a set-up model holds the full ``[E, ...]`` tensors (a
state-dict hook all-gathers the experts: every rank must call it, as at stage 3), so
``zero_strategy.full_state_dict`` (which gathers them itself, so that ``rank0_only`` works),
``save_pretrained`` and ``teardown`` see the model as one process would, and ``load_state_dict``
with full tensors keeps each rank's rows. The whole tensors are freed once setup succeeded; a
setup that fails after the replacement puts the original modules and the optimizers'
parameters back (:meth:`ExpertParallel.roll_back`).

Lock-step. Every forward is a collective at every stage, so ``generate()`` runs with
``synced_gpus`` (_model/hf.py), and gradient checkpointing's recomputation repeats the
all-to-alls in the same order on every rank.

Checkpoints. ``save_checkpoint`` writes the experts one tensor per expert, by global index, with
their optimizer state, and ``load_checkpoint`` reads back the rows of the experts each rank holds,
at any world size and ``expert_parallel_size`` (See [Note: experts in a checkpoint] in
checkpoint/_experts.py); ``optimizer.state_dict()`` holds the experts' state under
``"expert_parallel"``.

What is not done yet is refused by name: a checkpoint's optimizer state moving between expert
parallelism and none (the weights move), offload and ``offload_states``, fp16, hybrid sharding, sequence
parallelism, experts still on the meta device, experts stored in bf16/fp16 (stepped in place, they would
have no fp32 master: load the model in fp32 and set ``precision='bf16'``),
and expert layouts other than the fused, concatenated, bias-free one (gpt-oss's transposed
experts with biases).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ExpertParallel", "ExpertParallelExperts", "LocalExpertStep", "apply_expert_parallel",
           "refuse_expert_parallel"]


# --------------------------------------------------------------------------- communication
# Every collective goes through the engine's ``Collectives`` (``comm``), on the groups this module
# made with it: counted in comm_stats(), waited on with the engine's bound (See [Note: collectives on
# other groups] in _comm/collectives.py).
def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, comm) -> torch.Tensor:
    """``x`` [sum(send), ...]: rows ``send[r]`` go to rank r; returns [sum(recv), ...] (rank r's first)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    comm.all_to_all_rows(out, x.contiguous(), send, recv, group)
    return out


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` whose backward is the reverse exchange (the transpose)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group, comm) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.comm = send, recv, group, comm
        return _exchange(x, send, recv, group, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.comm), None, None, None, None


# --------------------------------------------------------------------------- the experts module
#: the experts layouts this module computes: transformers' ``use_experts_implementation`` flags
_SUPPORTED_LAYOUT = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True,
                         has_post_expert_norm=False)


class ExpertParallelExperts(nn.Module):
    """A transformers 5 fused experts module with only this rank's experts; See [Note: expert parallelism].

    ``gate_up_proj`` [E/N, 2I, H] and ``down_proj`` [E/N, H, I]: experts ``first .. first + E/N - 1``."""

    def __init__(self, original: nn.Module, group, ranks: list[int], world_size: int, comm):
        """``group``: the expert-parallel group, whose global ``ranks`` hold the experts in rank order;
        ``comm``: the engine's collectives, which issue every exchange."""
        super().__init__()
        self.comm = comm
        size = len(ranks)
        self.num_experts = original.gate_up_proj.shape[0]
        self.num_local = self.num_experts // size
        self.first = ranks.index(dist.get_rank()) * self.num_local
        self.size = size
        self.group, self.ranks = group, ranks
        self.act_fn = original.act_fn
        rows = slice(self.first, self.first + self.num_local)
        for name in ("gate_up_proj", "down_proj"):
            full: nn.Parameter = getattr(original, name)
            local = nn.Parameter(full.detach()[rows].clone(), requires_grad=full.requires_grad)
            setattr(self, name, local)
            if local.requires_grad:
                local.register_hook(lambda g, n=world_size: g / n)  # the data-parallel mean: See [Note: expert parallelism]
        #: while False, ``state_dict()`` keeps the local tensors (zero_strategy.full_state_dict gathers itself)
        self.gather_state = True

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.num_local - 1} of {self.num_experts}, "
                f"gate_up_proj={tuple(self.gate_up_proj.shape)}, down_proj={tuple(self.down_proj.shape)}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [T, H], ``top_k_index``/``top_k_weights`` [T, K] -> [T, H]."""
        with torch.profiler.record_function("zero::expert_parallel"):
            return self._forward(hidden_states, top_k_index, top_k_weights)

    def _forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, local, group = self.size, self.num_local, self.group
        t, k = index.shape
        expert = index.reshape(-1)                                           # [T*K]
        order = torch.argsort(expert, stable=True)                           # by expert: by owner too
        token = torch.arange(t, device=x.device).repeat_interleave(k)[order]  # [T*K]
        per_expert = torch.bincount(expert, minlength=self.num_experts)      # [E]
        got = _exchange(per_expert, [local] * n, [local] * n, group, self.comm).view(n, local)  # [from rank, local expert]
        send = per_expert.view(n, local).sum(1).tolist()
        recv = got.sum(1).tolist()
        rows = _AllToAll.apply(x[token], send, recv, group, self.comm)                  # [sum(recv), H]
        # rows from each rank are sorted by expert; put all rows of one local expert together
        which = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), got.reshape(-1))
        by_expert = torch.argsort(which, stable=True)
        outs = [self._expert(j, part) for j, part in
                enumerate(torch.split(rows[by_expert], got.sum(0).tolist()))]
        out = torch.cat(outs)[torch.argsort(by_expert)]
        back = _AllToAll.apply(out, recv, send, group, self.comm)                       # [T*K, H], in ``order``
        weight = weights.reshape(-1)[order]  # [T*K], the router's dtype: the product in it, as transformers'
        final = torch.zeros_like(x)
        return final.index_add(0, token, (back * weight[:, None]).to(x.dtype))

    def _expert(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``j`` on its rows ``x`` [rows, H] (run also on no rows: its weights get a zero
        gradient, as the full tensor's unused experts do in one process)."""
        gate_up = self.gate_up_proj[j].to(x.dtype)
        gate, up = nn.functional.linear(x, gate_up).chunk(2, dim=-1)
        return nn.functional.linear(self.act_fn(gate) * up, self.down_proj[j].to(x.dtype))

    # ---------------------------------------------------------------- full tensors in state dicts
    def full(self, name: str, to: int | None = None) -> torch.Tensor | None:
        """The whole ``[E, ...]`` tensor of ``name``: an all-gather over the expert-parallel group, or with
        ``to`` a gather to that rank alone (the others send and get None)."""
        local = getattr(self, name).detach().contiguous()
        if to is not None and to not in self.ranks:
            return None  # a replica of experts the group of rank ``to`` holds too
        if to is not None:
            parts = [torch.empty_like(local) for _ in range(self.size)] if dist.get_rank() == to else None
            self.comm.gather_into(parts, local, to, self.group)
            return None if parts is None else torch.cat(parts)
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.comm.all_gather_into(parts, local, self.group)
        return torch.cat(parts)

    def _state_dict_hook(self, state_dict, prefix) -> None:
        if not self.gather_state:
            return
        for name in ("gate_up_proj", "down_proj"):
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.full(name)

    def _load_hook(self, state_dict, prefix, *args) -> None:
        rows = slice(self.first, self.first + self.num_local)
        for name in ("gate_up_proj", "down_proj"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.shape[:1] == (self.num_experts,):
                state_dict[prefix + name] = value[rows]


def _whole_experts_in_state_dict(module: ExpertParallelExperts, state_dict, prefix: str, local_metadata) -> None:
    module._state_dict_hook(state_dict, prefix)


# --------------------------------------------------------------------------- the optimizer of the experts
class LocalExpertStep:
    """A second instance of the user's optimizer class over this rank's experts; See [Note: expert parallelism]."""

    def __init__(self, optimizer: torch.optim.Optimizer, params_of_group: dict[int, list[nn.Parameter]],
                 replicas=None, counts_in_norm: bool = True, comm=None):
        """``replicas``: the group of the ranks holding the same experts (None: this rank alone);
        ``counts_in_norm``: whether this rank's copy is the one the global norm counts; ``comm``: the
        engine's collectives (the replicas' all-reduce)."""
        self.user = optimizer
        self.comm = comm
        self.replicas, self.counts_in_norm = replicas, counts_in_norm
        self._reduced = False
        self.group_index = sorted(params_of_group)
        groups = [{**self._hyper(i), "params": params_of_group[i]} for i in self.group_index]
        try:
            self.inner = type(optimizer)(groups)
        except TypeError:
            self.inner = type(optimizer)(groups, **optimizer.defaults)
        self.params = [p for i in self.group_index for p in params_of_group[i]]

    def _hyper(self, i: int) -> dict:
        return {k: v for k, v in self.user.param_groups[i].items() if k != "params"}

    def _local_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def _reduce(self) -> None:
        """Sum the replicas' gradients (each already divided by the world size), once per step."""
        if self.replicas is not None and not self._reduced:
            for p in self.params:  # every replica ran the same layers: a gradient on each, or on none
                if p.grad is not None:
                    self.comm.all_reduce_in(p.grad, self.replicas)
        self._reduced = True

    def grads(self) -> list[torch.Tensor]:
        """The gradients this rank adds to the global norm: each expert once over the world."""
        self._reduce()
        return self._local_grads() if self.counts_in_norm else []

    @torch.no_grad()
    def clamp_grads(self, bound: float) -> None:
        """Clip by value: clamp the experts' whole gradients (the replicas' sum, as :meth:`step` uses them) to
        ``[-bound, bound]``; ``bound`` is in the gradients' own scale (before ``step``'s factor)."""
        self._reduce()
        for g in self._local_grads():
            g.clamp_(-bound, bound)

    @torch.no_grad()
    def step(self, factor: float | torch.Tensor = 1.0) -> None:
        """Step the experts with the user's current hyperparameters; ``factor``: the unscale and clip factor."""
        self._reduce()
        for pg, i in zip(self.inner.param_groups, self.group_index):
            pg.update(self._hyper(i))  # an LR scheduler changed the user's groups
        if not (isinstance(factor, float) and factor == 1.0):
            for g in self._local_grads():
                g.mul_(factor)
        self.inner.step()
        self._reduced = False

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self._reduced = False


# --------------------------------------------------------------------------- setup
@dataclass
class ExpertParallel:
    """What ``setup`` did to a model for ``expert_parallel_size``: the replaced experts modules and
    the rank-local parameters (the engine's ``expert_parallel``)."""

    size: int
    group: object
    #: the ranks holding the same experts as this one (None: the group is the world)
    replicas: object = None
    #: whether this rank is in the first expert-parallel group (its experts count in the global norm)
    first_group: bool = True
    #: (parent module, attribute name, the original experts module, its replacement)
    replaced: list[tuple[nn.Module, str, nn.Module, ExpertParallelExperts]] = field(default_factory=list)
    #: id(original full parameter) -> its local replacement
    local_of: dict[int, nn.Parameter] = field(default_factory=dict)
    #: id(local parameter) -> the original full parameter it replaces (a failed setup puts it back)
    whole_of: dict[int, nn.Parameter] = field(default_factory=dict)
    #: the engine's collectives, which issue every exchange and made the groups
    comm: object = None
    #: every group made for this model (all ranks make all of them): released on teardown
    made_groups: list = field(default_factory=list)

    @property
    def local_ids(self) -> frozenset[int]:
        return frozenset(id(p) for p in self.local_of.values())

    @contextlib.contextmanager
    def local_state(self):
        """``state_dict()`` keeps the local experts inside (for a caller that gathers them itself)."""
        for *_, new in self.replaced:
            new.gather_state = False
        try:
            yield
        finally:
            for *_, new in self.replaced:
                new.gather_state = True

    def full_values(self, dtype: torch.dtype | None, to: int | None = None) -> dict[int, torch.Tensor]:
        """id(local parameter) -> a host copy of its whole ``[E, ...]`` tensor (every rank must call); with
        ``to``, only that rank receives them (the others send theirs and return ``{}``)."""
        out = {}
        for *_, new in self.replaced:
            for name in ("gate_up_proj", "down_proj"):
                full = new.full(name, to)
                if full is not None:
                    out[id(getattr(new, name))] = full.to("cpu", dtype or full.dtype, copy=True)
        return out

    def stepper(self, optimizer: torch.optim.Optimizer) -> LocalExpertStep | None:
        """The step of the local experts ``optimizer`` held before setup (None: it held none)."""
        by_group: dict[int, list[nn.Parameter]] = {}
        local = self.local_ids
        for i, pg in enumerate(optimizer.param_groups):
            for p in pg["params"]:
                if id(p) in local:
                    by_group.setdefault(i, []).append(p)
        return LocalExpertStep(optimizer, by_group, self.replicas, self.first_group, self.comm) if by_group else None

    def undo(self) -> None:
        """Teardown: the original experts modules back in place (teardown then fills their parameters
        with the full weights, from ``state_dict()``)."""
        for parent, attr, original, _ in self.replaced:
            setattr(parent, attr, original)

    def release_groups(self) -> None:
        """Teardown (after :meth:`undo`), or a failed setup: destroy the groups made for this model."""
        groups, self.made_groups = self.made_groups, []
        if groups:
            self.comm.destroy_subgroups(groups)

    def drop_whole(self) -> None:
        """Free the whole expert tensors this rank no longer needs: once setup has succeeded."""
        for _, _, original, _ in self.replaced:
            for name in ("gate_up_proj", "down_proj"):
                getattr(original, name).data = torch.empty(0, dtype=getattr(original, name).dtype)

    def roll_back(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """A setup that failed after :func:`apply_expert_parallel`: the model and ``optimizers`` as they were."""
        self.undo()
        self.release_groups()
        for opt in optimizers:
            for pg in opt.param_groups:
                pg["params"] = [self.whole_of.get(id(p), p) for p in pg["params"]]


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Module]]:
    """(name, parent, attribute, module) of every fused experts module (3-D ``gate_up_proj`` and ``down_proj``)."""
    found = []
    for name, parent in model.named_modules():
        for attr, m in parent.named_children():
            gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
            if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3:
                found.append((f"{name}.{attr}" if name else attr, parent, attr, m))
    return found


def refuse_expert_parallel(cfg, world_size: int) -> None:
    """Refuse, before anything is changed, the combinations expert parallelism does not support yet."""
    size = cfg.expert_parallel_size
    fix = "drop expert_parallel_size (stage 3 then gathers every expert, as any parameter)"
    if world_size == 1 or world_size % size:
        raise ValueError(
            f"zero_strategy: expert_parallel_size={size} must divide the number of processes ({world_size}), "
            f"which must be more than one: each group of {size} consecutive ranks holds every expert, "
            f"num_experts/{size} per rank, and the groups are data-parallel replicas; use a divisor of "
            f"{world_size} (torchrun --nproc-per-node a multiple of {size}), or {fix}")
    refused = [(cfg.offload_optimizer is not None or cfg.offload_params is not None, "offload_optimizer/offload_params"),
               (cfg.precision == "fp16", "precision='fp16' (its loss scale does not see the experts)"),
               (cfg.overlap_step, "overlap_step"),
               (cfg.shard_group_size is not None, "shard_group_size (hybrid sharding)"),
               (cfg.sequence_parallel_size > 1, "sequence_parallel_size")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"zero_strategy: expert_parallel_size={size} does not combine with {what} yet; "
                             f"drop that setting, or {fix}")


def apply_expert_parallel(model: nn.Module, optimizers: list[torch.optim.Optimizer], size: int,
                          process_group, comm) -> ExpertParallel:
    """Replace every fused experts module of ``model`` by this rank's :class:`ExpertParallelExperts`, and
    its parameters in ``optimizers`` by the local ones. Call after the initial weights are the same on
    every rank (their whole tensors are sliced here). Raises, changing nothing, for a model it cannot serve."""
    if process_group is not None:
        raise ValueError("zero_strategy: expert_parallel_size builds its group from the whole world; pass "
                         "process_group=None (expert parallelism inside a subgroup is not supported)")
    found = _experts_modules(model)
    if not found:
        raise ValueError(
            f"zero_strategy: expert_parallel_size={size}, but {type(model).__name__} has no mixture-of-experts "
            "layer of the form transformers 5 builds (an experts module with 3-D gate_up_proj [E, 2I, H] and "
            "down_proj [E, H, I], e.g. Mixtral, Qwen2/3-MoE, DeepSeek-V3, OLMoE); drop expert_parallel_size")
    for name, _, _, m in found:
        layout = {k: getattr(m, k, None) for k in _SUPPORTED_LAYOUT}
        if layout != _SUPPORTED_LAYOUT or not hasattr(m, "act_fn"):
            raise ValueError(
                f"zero_strategy: expert_parallel_size={size} does not support the experts of {name} "
                f"({type(m).__name__}: {layout}); it computes transformers' fused, concatenated, bias-free "
                "gate_up_proj/down_proj layout (Mixtral, Qwen3-MoE, DeepSeek-V3); drop expert_parallel_size")
        if m.gate_up_proj.is_meta or m.down_proj.is_meta:
            raise ValueError(
                f"zero_strategy: expert_parallel_size={size}: the experts of {name} are on the meta device (a "
                "model built on meta or from zero_strategy.transformers.from_pretrained); load it with "
                "transformers' from_pretrained (or build it on the CPU) before setup, or drop expert_parallel_size")
        low = sorted({str(t.dtype) for t in (m.gate_up_proj, m.down_proj) if t.dtype != torch.float32})
        if low:  # LocalExpertStep steps the experts' own tensors: in half precision there is no fp32 master
            raise ValueError(
                f"zero_strategy: expert_parallel_size={size}: the experts of {name} are stored in {', '.join(low)}, "
                "and each rank steps its experts directly (no fp32 master copy yet), so small updates would be "
                "lost to rounding; load the model in fp32 and set precision='bf16' (the experts then compute in "
                "bf16 and step in fp32), or drop expert_parallel_size")
        experts = m.gate_up_proj.shape[0]
        if experts % size:
            raise ValueError(
                f"zero_strategy: expert_parallel_size={size} must divide the number of experts of {name} "
                f"({experts}); use a divisor of {experts}, or drop expert_parallel_size")
    world, rank = dist.get_world_size(), dist.get_rank()
    # every rank creates every group, in the same order (dist.new_group's rule)
    layouts = [list(range(g * size, (g + 1) * size)) for g in range(world // size)]
    groups = comm.new_subgroups(layouts)
    replicas = comm.new_subgroups([list(range(i, world, size)) for i in range(size)]) if world > size else None
    ranks = layouts[rank // size]
    ep = ExpertParallel(size, groups[rank // size], None if replicas is None else replicas[rank % size],
                        first_group=rank < size, comm=comm, made_groups=groups + (replicas or []))
    for _, parent, attr, m in found:
        new = ExpertParallelExperts(m, ep.group, ranks, world, comm)
        new.register_state_dict_post_hook(_whole_experts_in_state_dict)
        new._register_load_state_dict_pre_hook(new._load_hook)
        for name in ("gate_up_proj", "down_proj"):
            ep.local_of[id(getattr(m, name))] = getattr(new, name)
            ep.whole_of[id(getattr(new, name))] = getattr(m, name)
        setattr(parent, attr, new)
        ep.replaced.append((parent, attr, m, new))
    for opt in optimizers:
        for pg in opt.param_groups:
            pg["params"] = [ep.local_of.get(id(p), p) for p in pg["params"]]
    return ep
