"""Units: which module subtrees are sharded together, their flat groups, the order they gather in, and the gathers.

One concept, "issue the gathers": which units there are (detection, :func:`build_units`), a
:class:`Unit`'s gather and release, the :class:`GatherSchedule` that orders them, and the
coalesced collectives over a unit's flat groups (or the step's groups kept whole) at the end.

[Note: choosing units]
A unit is gathered and reduced together (one all-gather of all its flat groups, one
reduce-scatter of its small ones: usually one group, plus one per member, see below), so it should be one
repeated block of the model. Auto-detection walks the model from the
root, outermost first, and descends into every module until it finds blocks:

* every child holding parameters of an ``nn.ModuleList`` (transformer blocks in
  Hugging Face models: ``model.layers``, ``h``, ``encoder.layer``);
* a child of an ``nn.Sequential`` or ``nn.ModuleDict`` that is a *block*: it holds
  parameters, has submodules of its own (a composite, not one layer such as
  ``Linear`` or ``Conv2d``), is not itself a container, and its class occurs at
  least twice among that container's children. This finds timm's ViT
  (``blocks = nn.Sequential(*blocks)``), torchvision's ResNet (``layer1..4``:
  Sequentials of ``BasicBlock``/``Bottleneck``), ConvNeXt/EfficientNet stages
  (Sequentials inside a Sequential) and Swin stages, and leaves alone an MLP
  ``nn.Sequential(Linear, ReLU, Linear)`` and VGG's Sequential of single layers,
  where one unit per layer would only add collectives.

Only containers are looked into this way: two sibling attributes of one class on an
ordinary module (T5's ``encoder`` and ``decoder`` stacks) are not units, so the
blocks inside them are. Containers themselves (including subclasses such as
torchvision's ``Conv2dNormActivation``) are never units; they are descended into,
as are children not chosen. ``unit_classes`` names module classes instead and
overrides all of this. Units never nest: the outermost match wins. Everything not
inside a unit belongs to the *root* unit (embeddings, final norm, head), which under
stage 3 stays gathered from the start of forward to the end of backward because it
is used at both ends. When stage 3 finds no unit at all, the whole model is that
root unit, gathered at every forward: :func:`warn_if_no_units` says so once per
setup and names repeated classes to put in ``unit_classes``.

A parameter registered in two units (shared across blocks) also goes to the root,
the one unit that is materialized whenever either user runs.

[Note: large modules outside the blocks]
The root is gathered from the start of forward to the end of backward, with its full
gradient held from the head's backward to the embeddings' (the last): for a language
model with its embeddings and head in the root that is, at every moment of a step, two
units' worth of parameters and gradients beyond the prefetch window (on a 748M Llama the
root was 35% of the engine's working set). So auto-detection also makes a unit of each
outermost subtree of the root that holds no unit (as :func:`root_parts` finds them) when
it is large: at least half the parameters of the largest block. Such a module is used
once per pass (the embeddings at the start, the head at the end), so as a unit it is
gathered around its own forward and backward, its gradient reduced as soon as it is in.
Not promoted, so they stay in the root as before: a container (never a unit); a module
registered under two names (T5's ``shared`` embeddings, also ``encoder.embed_tokens``),
whose forward runs in two places; and a module sharing a parameter with anything outside
it (tied input and output embeddings), since a tied parameter must live in the one unit
gathered for both of its users. ``unit_classes`` turns all of this off: the units are
then exactly the classes named.

[Note: members get their own flat groups]
A mixture of experts written as a list of expert modules calls only the experts its
tokens reach, and a vision-language model runs its projector only on batches with
images, so a step can leave such a module with no gradient on any rank. DDP (with
``find_unused_parameters=True``) then leaves its ``.grad`` None and the optimizer
skips it: no weight decay, no momentum, Adam's step count unchanged. A flat group is
stepped as one tensor with one step count, so flat groups follow the modules that
are used or skipped together:

* inside a unit, each *member* of an ``nn.ModuleList``/``nn.ModuleDict`` whose
  children with parameters are all of one class (at least two: experts, parallel
  towers, per-task heads) gets groups of its own; the rest of the unit shares the
  unit's groups;
* the root unit is split into its *parts*: members as above, then each outermost
  subtree that holds no unit (``model.embed_tokens``, ``multi_modal_projector``,
  ``vision_tower.embeddings``, ``lm_head``); a parameter registered on a module that
  holds units (ViT's ``cls_token``) goes with that module's.

A group no rank has a gradient for is then not stepped, as DDP's parameters (See
[Note: no gradient on any rank] in _engine/gradients.py, which also covers what is left
inside a group). The cost would be more, smaller collectives, one per member and part and collective
kind (a list of 64 experts in each of 27 layers: about 1,700 of each kind per step);
instead a unit's groups are gathered as one coalesced all-gather and its small groups
reduced as one coalesced reduce-scatter (a large group has its own: See [Note: coalesced
collectives] in _comm/collectives.py and [Note: reduce order] in _engine/reduce.py), so a
unit costs a collective per large group at most, however many small groups it has. Hugging Face models that fuse their experts into one tensor (Mixtral,
Qwen2-MoE in transformers 5) have no members, and DDP gives every expert a (zero)
gradient there too.

[Note: parameters kept in fp32]
Some models keep a few parameters in fp32 whatever the dtype the rest computes in: a
mixture-of-experts router (DeepSeek-V3's and GLM-4-MoE's ``gate.weight``), whose top-k
choice flips on bf16 rounding. transformers builds them fp32 (its
``_keep_in_fp32_modules_strict``) and its loader keeps them so; a flat group in the
precision's dtype would cast them down. The front end names them (``kept_dtypes``, from
_model/hf.py, the one module that knows the library's flag), and they get flat groups of
their own in that dtype, with gradients reduced in it too: a group apart from the others,
never a group of mixed dtypes.

**Gathers over several flat groups at once**: a stage-3 unit's, and the step's of groups kept whole.

Each :class:`~.flat.FlatGroup` knows how to make room for its ``full`` and where its gather
source is; the functions at the end of this module issue the collectives over a list of them, one
coalesced call where they travel together (See [Note: coalesced collectives] in
_comm/collectives.py): batching groups, not one group's layout or states (flat.py).
"""

from __future__ import annotations

import collections
import contextlib
import enum
from collections import OrderedDict

import torch
from torch import nn

from .._comm.collectives import CollectiveDesync, CollectiveError, Collectives, CollectiveTimeout, Handle
from .._config.policies import OffloadPolicy
from .._mechanisms.memory import release_if_large
from .._mechanisms.transfers import Transfers
from .._user_warnings import warn_at_user
from .flat import FlatGroup, ShardState, preserve_version
from .materialize import materialize_unit
from .materialize import unit_modules as unit_scope
from .plan import ShardingPlan


ROOT = "<root>"


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _is_block(m: nn.Module) -> bool:
    """A composite module with parameters that is not a container: a candidate repeated block."""
    return not isinstance(m, _CONTAINERS) and any(True for _ in m.children()) and _has_params(m)


def _auto_units_among(container: nn.Module) -> set[str]:
    """Names of ``container``'s children that auto-detection makes units. See [Note: choosing units]."""
    children = list(container.named_children())
    if isinstance(container, nn.ModuleList):
        return {name for name, child in children if _has_params(child)}
    if not isinstance(container, (nn.Sequential, nn.ModuleDict)):
        return set()
    blocks = [(name, type(child)) for name, child in children if _is_block(child)]
    counts = collections.Counter(cls for _, cls in blocks)
    return {name for name, cls in blocks if counts[cls] >= 2}


def member_prefixes(unit: nn.Module, inside: tuple[str, ...] = ()) -> list[str]:
    """Name prefixes (relative to ``unit``) of its members, outermost first, skipping the
    subtrees ``inside`` (other units' roots). See [Note: members get their own flat groups]."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            kids = [(n, c) for n, c in module.named_children() if _has_params(c)]
            if len(kids) >= 2 and len({type(c) for _, c in kids}) == 1:
                found.extend(f"{prefix}{n}." for n, _ in kids)
                return
        for name, child in module.named_children():
            if f"{prefix}{name}" not in inside:
                visit(f"{prefix}{name}.", child)

    visit("", unit)
    return found


def _unit_free_branches(model: nn.Module, unit_names: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The outermost subtrees of the root that hold no unit and have parameters, in
    registration order, as (fully qualified name, module)."""
    branches: list[tuple[str, nn.Module]] = []
    units = set(unit_names)
    holders = {u[:i] for u in unit_names for i, c in enumerate(u) if c == "."}  # modules that hold a unit

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = prefix + name
            if fqn in units:
                continue
            if fqn in holders:
                visit(fqn + ".", child)
            elif _has_params(child):
                branches.append((fqn, child))

    visit("", model)
    return branches


def root_parts(model: nn.Module, unit_names: tuple[str, ...]) -> list[str]:
    """Name prefixes of the root unit's parts: members (see :func:`member_prefixes`), then the
    outermost subtrees that hold no unit (embeddings, a projector, the head). See [Note: members
    get their own flat groups]."""
    return member_prefixes(model, unit_names) + [fqn + "." for fqn, _ in _unit_free_branches(model, unit_names)]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def large_root_modules(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The root's large modules that become units of their own beside the auto-detected
    ``blocks``, as (fully qualified name, module). See [Note: large modules outside the blocks]."""
    if not blocks:
        return []
    threshold = max(_numel(m) for _, m in blocks) / 2
    module_names = collections.Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    param_names: dict[int, list[str]] = collections.defaultdict(list)
    for fqn, p in model.named_parameters(remove_duplicate=False):
        param_names[id(p)].append(fqn)
    chosen = []
    for fqn, module in _unit_free_branches(model, tuple(name for name, _ in blocks)):
        if isinstance(module, _CONTAINERS) or module_names[id(module)] > 1 or _numel(module) < threshold:
            continue
        tied = any(not other.startswith(fqn + ".") for p in module.parameters() for other in param_names[id(p)])
        if not tied:
            chosen.append((fqn, module))
    return chosen


def first_prefix(name: str, prefixes: dict[str, int]) -> str | None:
    """The first of ``prefixes`` (name prefix ending in a dot -> its place in the list) that
    ``name`` starts with, or None: ``next(p for p in the list if name.startswith(p))``, found
    through the dots of ``name`` instead of a scan of the list, so that setting up a model
    with thousands of units or members (a mixture of experts) does not take time that grows
    as parameters x units (benchmarks/setup_bench.py)."""
    best = None
    at = name.find(".")
    while at != -1:
        place = prefixes.get(name[:at + 1])
        if place is not None and (best is None or place < best[1]):
            best = (name[:at + 1], place)
        at = name.find(".", at + 1)
    return None if best is None else best[0]


def part_of(name: str, parts: dict[str, int], outside: str) -> str:
    """The part (a name prefix without its dot) a parameter ``name`` belongs to, ``outside``
    if none: in a unit its own groups (""), in the root the groups of the module the
    parameter is registered on (one that holds units, as ViT's ``cls_token``). ``parts``:
    prefix -> its place in the list of parts (the first that matches wins)."""
    found = first_prefix(name, parts)
    return outside if found is None else found[:-1]


def find_unit_modules(root: nn.Module, unit_classes: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """Outermost unit modules in registration order, as (fully qualified name, module)."""
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        if unit_classes:
            chosen = {name for name, child in module.named_children()
                      if type(child).__name__ in unit_classes and _has_params(child)}
        else:
            chosen = _auto_units_among(module)
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if name in chosen:
                found.append((fqn, child))
                continue  # units never nest: the outermost wins
            visit(fqn + ".", child)

    if unit_classes and type(root).__name__ in unit_classes:
        return []  # the root itself: one unit holding everything
    visit("", root)
    if not unit_classes:  # See [Note: large modules outside the blocks]
        large = large_root_modules(root, found)
        if large:  # in registration order among the blocks: the order the schedule gathers in
            order = {name: i for i, (name, _) in enumerate(root.named_modules(remove_duplicate=False))}
            found = sorted(found + large, key=lambda item: order[item[0]])
    if unit_classes and not found:
        present = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"unit_classes={list(unit_classes)} matched no module of {type(root).__name__}; "
            f"module classes present: {present[:30]}"
        )
    return found


def warn_if_no_units(root: nn.Module, unit_modules: list, unit_classes: tuple[str, ...],
                     persistence_threshold: int) -> None:
    """Stage 3 only: warn when auto-detection found no unit, so the whole model is gathered every forward.

    Counts the parameter elements that are really gathered (those at or above the
    persistence threshold); a model whose parameters all stay whole costs nothing
    and gets no warning. ``unit_classes`` naming the root is the user's choice: no warning.
    """
    if unit_modules or unit_classes:
        return
    unique = {id(p): p for p in root.parameters() if p.is_floating_point()}.values()
    gathered = sum(p.numel() for p in unique if p.numel() >= persistence_threshold)
    if gathered == 0:
        return
    warn_at_user(
        f"zero_strategy: stage 3 found no repeated blocks to shard as units in {type(root).__name__}, so "
        f"its {gathered:,} sharded parameter elements form one unit that is gathered whole at every "
        f"forward, so peak parameter memory is that of stage 2. {_unit_class_hint(root)}")


def _unit_class_hint(root: nn.Module) -> str:
    """Repeated classes holding parameters, blocks first, as candidates for ``unit_classes``."""
    stats: dict[str, list] = {}  # class name -> [count, is a block, parameter elements]
    for m in root.modules():
        if m is root or isinstance(m, _CONTAINERS) or not _has_params(m):
            continue
        entry = stats.setdefault(type(m).__name__, [0, _is_block(m), 0])
        entry[0] += 1
        entry[2] += sum(p.numel() for p in m.parameters())
    repeated = sorted((name for name, (n, _, _) in stats.items() if n >= 2),
                      key=lambda name: (not stats[name][1], -stats[name][2]))
    if not repeated:
        return ("No module class holding parameters repeats in it; split the model into blocks, or use "
                "stage 2.")
    shown = ", ".join(f"{name!r} (x{stats[name][0]})" for name in repeated[:5])
    return (f"Name its repeated block class in ZeroConfig(unit_classes=[...]); repeated classes here: "
            f"{shown}.")


def missing_ranks_message(comm: Collectives, what: str, error: CollectiveError,
                          gather: bool = True) -> CollectiveError:
    """The error for a wait on a unit's collective that failed, naming the unit (see [Note: bounded
    waits] in _comm/collectives.py); a timed-out ``gather`` adds what usually causes it."""
    head = f"zero_strategy: rank {comm.rank} gave up on {what}."
    if isinstance(error, CollectiveDesync):
        return CollectiveDesync(f"{head}\n{error}")
    if not isinstance(error, CollectiveTimeout):
        return CollectiveError(f"{head}\n{error}")
    if not gather:
        return CollectiveTimeout(f"{head} If a rank is only slow to get there, raise "
                                 f"ZeroConfig(collective_timeout=...).\n{error}")
    return CollectiveTimeout(
        f"{head} At stage 3 every forward (each generate() step too), "
        "state_dict() / save_pretrained() and gathered_parameters() all-gathers parameters, so "
        "every rank of the group must make the same calls in the same order: run them on all "
        "ranks (save_pretrained writes on one rank when given is_main_process=...), not under "
        "`if rank == 0:`. If a rank is only slow to get there, raise "
        "ZeroConfig(collective_timeout=...). The process group should not be used after this.\n"
        f"{error}")


class Unit:
    """A module subtree sharded together: its flat groups and its gather state."""

    def __init__(self, name: str, module: nn.Module, groups: list[FlatGroup]):
        self.name = name
        self.module = module
        self.groups = groups
        self.sharded_groups = [g for g in groups if g.shard_params]
        #: a gather is in flight: one all-gather of every sharded group (See [Note: coalesced
        #: collectives] in _comm/collectives.py), whose handle is None when all were gathered already
        self._gathering = False
        self._gather_handle: Handle | None = None
        self._comm: Collectives | None = None  # of the gather in flight, for its error message
        #: kept gathered by release() while True: See [Note: gathered for generation] in _model/generation.py
        self.held = False

    def __repr__(self) -> str:
        return f"Unit({self.name}, groups={len(self.groups)}, state={self.state.value})"

    @property
    def state(self) -> ShardState:
        if any(g.state is ShardState.SHARDED for g in self.sharded_groups):
            return ShardState.SHARDED
        return ShardState.GATHERED

    @property
    def gather_in_flight(self) -> bool:
        return self._gathering

    def begin_gather(self, comm: Collectives) -> None:
        """Start the all-gather of this unit's sharded groups (prefetch); no-op if gathered or started."""
        if self._gathering or self.state is ShardState.GATHERED:
            return
        self._comm = comm
        with torch.profiler.record_function(f"zero::gather::{self.name}"):
            label = f"{self.name} ({len(self.sharded_groups)} groups)"
            self._gather_handle = begin_gather_groups(self.sharded_groups, comm, label)
            self._gathering = True

    def wait_gather(self) -> None:
        if not self._gathering:
            return
        handle, self._gather_handle, self._gathering = self._gather_handle, None, False
        if handle is not None:
            try:
                handle.wait()
            except CollectiveError as e:
                raise missing_ranks_message(self._comm, f"the all-gather of unit {self.name!r}", e) from e
        for group in self.sharded_groups:
            group.finish_gather()

    def gather(self, comm: Collectives) -> None:
        self.begin_gather(comm)
        self.wait_gather()

    def release(self) -> None:
        self.wait_gather()  # never free memory an all-gather is still writing
        if self.held:
            return  # See [Note: gathered for generation] in _model/generation.py
        for g in self.sharded_groups:
            g.release()


def build_units(
    model: nn.Module,
    *,
    plan: ShardingPlan,
    unit_classes: tuple[str, ...],
    persistence_threshold: int,
    optimizer_group_of: dict[int, tuple[int, int]],
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    comm: Collectives,
    device: torch.device,
    offload_optimizer: OffloadPolicy,
    offload_params: OffloadPolicy,
    transfers: Transfers,
    param_init_fn=None,
    swap=None,
    owned_optimizers: frozenset[int] = frozenset(),
    release_host_memory: bool = False,
    kept_dtypes: dict[int, torch.dtype] | None = None,
    loaded_later: frozenset[int] = frozenset(),
    opaque: frozenset[int] = frozenset(),
    rank_local: frozenset[int] = frozenset(),
) -> list[Unit]:
    """Partition the model's parameters into units and flat groups (root unit first).

    Meta-device parameters are materialized here, unit by unit (see _engine/materialize.py);
    with ``release_host_memory`` what the last unit freed goes back to the OS before the next
    is materialized (See [Note: freed host memory] in _mechanisms/memory.py).
    ``owned_optimizers``: the optimizers whose groups take the ownership layout (See [Note:
    the ownership layout] in _engine/flat.py), balanced over all their groups together.
    ``kept_dtypes``: id(param) -> the dtype it computes in instead of ``compute_dtype`` (See
    [Note: parameters kept in fp32]). ``loaded_later``: ids of meta parameters a pending load
    fills whole, materialized without initialization (_engine/materialize.py). ``opaque``: ids of
    frozen parameters whose values are bit patterns, in groups of their own (See [Note: opaque groups]
    in _engine/flat.py). ``rank_local``: ids of parameters each rank holds whole and alone, which
    no unit takes (See [Note: expert parallelism] in _model/expert_parallel.py).
    """
    owner_load = [0] * comm.world_size
    unit_modules = find_unit_modules(model, unit_classes)
    if plan.shards_parameters:
        warn_if_no_units(model, unit_modules, unit_classes, persistence_threshold)
    prefixes = {fqn + ".": i for i, (fqn, _) in enumerate(unit_modules)}  # units never nest

    owner: dict[int, str] = {}
    first_name: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if (not p.is_floating_point() and id(p) not in opaque) or id(p) in rank_local:  # opaque: packed codes
            continue
        found = first_prefix(fqn, prefixes)
        unit = ROOT if found is None else found[:-1]
        pid = id(p)
        if pid in owner and owner[pid] != unit:
            owner[pid] = ROOT  # shared across units: the root is live whenever any user runs
        else:
            owner.setdefault(pid, unit)
        first_name.setdefault(pid, fqn)
        params[pid] = p

    modules = {ROOT: model, **dict(unit_modules)}
    unit_roots = {id(m) for _, m in unit_modules}
    unit_names = tuple(fqn for fqn, _ in unit_modules)
    owned_by: dict[str, list[int]] = collections.defaultdict(list)  # unit -> its parameters, in model order
    for pid in params:
        owned_by[owner[pid]].append(pid)
    units: list[Unit] = []
    for unit_name in [ROOT] + [fqn for fqn, _ in unit_modules]:
        in_unit = "" if unit_name == ROOT else unit_name + "."
        parts = root_parts(model, unit_names) if unit_name == ROOT else member_prefixes(modules[unit_name])
        parts_at = {pre: i for i, pre in reversed(list(enumerate(parts)))}  # a repeated prefix: its first place
        unit_params = [params[pid] for pid in owned_by[unit_name]]
        if any(p.is_meta for p in unit_params):  # a large unit: what the units before it freed goes first
            release_if_large(release_host_memory, 4 * sum(p.numel() for p in unit_params))
            materialize_unit(unit_scope(model, modules[unit_name], unit_roots),
                             unit_params, device, comm, param_init_fn, first_name, loaded_later)
        buckets: "OrderedDict[tuple, list]" = OrderedDict()
        for pid in owned_by[unit_name]:
            p = params[pid]
            trainable = p.requires_grad and pid in optimizer_group_of
            persistent = plan.shards_parameters and p.numel() < persistence_threshold
            relative = first_name[pid][len(in_unit):]
            if not trainable:
                part = ""  # never stepped: no need to keep its parts apart
            else:
                part = part_of(relative, parts_at, relative.rpartition(".")[0] if unit_name == ROOT else "")
            kept = (kept_dtypes or {}).get(pid)
            key = (trainable, optimizer_group_of.get(pid) if trainable else None,
                   plan.shards_parameters and not persistent, part, kept, pid in opaque)
            buckets.setdefault(key, []).append((first_name[pid], p))
        groups = []
        for (trainable, opt_key, shard_params, part, kept, is_opaque), named in buckets.items():
            opt_index, opt_group = opt_key if opt_key is not None else (None, None)
            label = "" if opt_key is None else (f"{opt_group}" if opt_index == 0 else f"{opt_index}.{opt_group}")
            gname = (f"{unit_name}/{'train' if trainable else 'frozen'}{label}{'' if shard_params else '/whole'}"
                     + (f"/{part}" if part else "") + (f"/{str(kept).removeprefix('torch.')}" if kept else "")
                     + ("/opaque" if is_opaque else ""))
            groups.append(FlatGroup(
                gname, named, trainable=trainable, optimizer_group=opt_group, optimizer_index=opt_index,
                shard_params=shard_params, compute_dtype=kept or compute_dtype,
                grad_dtype=kept if kept is not None and kept.itemsize > grad_dtype.itemsize else grad_dtype,
                rank=comm.rank,
                world_size=comm.world_size, device=device,
                offload_optimizer=offload_optimizer, offload_params=offload_params,
                transfers=transfers, swap=swap,
                owned=trainable and opt_index in owned_optimizers, owner_load=owner_load, opaque=is_opaque,
            ))
        if groups or unit_name == ROOT:
            units.append(Unit(unit_name, modules[unit_name], groups))
    return units


def refuse_replaced_units(model: nn.Module, units: list[Unit]) -> None:
    """Refuse a unit module replaced in the model after setup (``model.layers[i] =
    torch.compile(block)``): the engine's hooks stay on the old module object and the
    parameters' names change under the engine, so checkpoints and state dicts would
    disagree with the names recorded at setup. See [Note: torch.compile and the hooks]
    in _engine/engine.py."""
    for unit in units:
        try:
            found = model.get_submodule(unit.name)
        except AttributeError:
            found = None
        if found is not unit.module:
            raise RuntimeError(
                f"zero_strategy: unit {unit.name!r} was replaced in the model after setup (now "
                f"{type(found).__name__}), e.g. by model.layers[i] = torch.compile(block). The engine "
                "shards the module it found at setup and its parameter names. Compile in place "
                "instead (block.compile(), torchtitan-style, or torch.compile(model)), or replace "
                "blocks before zero_strategy.setup / Trainer / accelerator.prepare.")


# ------------------------------------------------------------- the gather schedule
class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class GatherSchedule:
    """The order of the stage-3 unit gathers in each pass, and how far this rank got in the current one.

    [Note: gather schedule]
    At stage 3 a unit is all-gathered when it is about to run, and every rank of the
    group must take part in that all-gather. When ranks run different units (an expert
    only one rank's samples reach, an image tower only batches with images need, blocks
    after an early exit), the gathers of one rank have no partner on the other, and the
    k-th all-gathers of the ranks pair up wrongly: silently when the units have one size,
    as a hang otherwise. So gathers follow a *schedule*, the same on every rank:

    * the forward pass visits the units in registration order (``model.named_modules``
      order: the order a model of repeated blocks runs them in), the backward pass visits
      the units holding trainable parameters in the reverse order;
    * before a unit is gathered, every unit before it in the pass that this rank has not
      gathered in this pass yet is *passed*: gathered and released at once, taking part
      in the gathers the ranks that run it make. At the end of the pass (the end of the
      outermost forward, the end of backward) every unit not reached is passed too;
    * prefetch gathers the next ``prefetch`` units of the pass, in pass order.

    So every rank issues one gather per unit per pass, in pass order, whatever it runs:
    a unit some rank skips costs the ranks that skip it one all-gather (and a moment of
    its memory), and a model whose ranks run every unit in order issues exactly the
    gathers it issued without a schedule. A unit run again in the same pass (a block
    called twice, a module called out of registration order) is gathered again on its
    own, outside the schedule, as before: exact when every rank does the same, and caught
    by the collective signature (see [Note: the collective signature] in _comm/collectives.py)
    when ranks differ. Frozen units are left out of the backward pass: a unit without
    trainable parameters needs backward only to pass gradients through, which every
    rank of a model does alike (an image tower that is frozen never needs it at all).
    """

    def __init__(self, units: list[Unit], prefetch: int):
        """``units``: the non-root units with sharded groups, in registration order."""
        self.prefetch = prefetch
        self._orders = {Pass.FORWARD: list(units),
                        Pass.BACKWARD: [u for u in reversed(units) if any(g.trainable for g in u.groups)]}
        self._positions = {p: {id(u): i for i, u in enumerate(order)} for p, order in self._orders.items()}
        self.current: Pass | None = None
        self._cursor = 0  # positions before it were used or passed in this pass
        self._issued = 0  # positions before it have their gather begun in this pass

    def begin(self, which: Pass) -> None:
        """A pass starts: nothing of it gathered yet."""
        self.current, self._cursor, self._issued = which, 0, 0

    def position(self, unit: Unit) -> int | None:
        """``unit``'s place in the current pass, None when it is not in it (or no pass runs)."""
        return None if self.current is None else self._positions[self.current].get(id(unit))

    def remaining(self) -> int:
        """Units of the current pass not used or passed yet."""
        return 0 if self.current is None else len(self._order()) - self._cursor

    def use(self, unit: Unit, comm: Collectives) -> None:
        """``unit`` is about to run: gather it in schedule order (passing what this rank skipped) and
        prefetch the next ones. The caller waits for ``unit``'s gather."""
        position = self.position(unit)
        if position is None or position < self._cursor:  # out of the pass: on its own, as before
            unit.begin_gather(comm)
            return
        self._pass_until(position, comm)
        self._issue_through(position, comm)
        self._cursor = position + 1
        self._issue_through(min(position + self.prefetch, len(self._order()) - 1), comm)

    def finish(self, comm: Collectives) -> None:
        """The pass ends: pass every unit it did not reach, so every rank has gathered each once."""
        if self.current is not None:
            self._pass_until(len(self._order()), comm)
        self.current = None

    def abandon(self) -> None:
        """An iteration an exception abandoned: no pass runs (gathers in flight are the caller's to wait)."""
        self.current = None

    # ----------------------------------------------------------------- helpers
    def _order(self) -> list[Unit]:
        return self._orders[self.current]

    def _issue_through(self, position: int, comm: Collectives) -> None:
        order = self._order()
        while self._issued <= position:
            order[self._issued].begin_gather(comm)
            self._issued += 1

    def _pass_until(self, position: int, comm: Collectives) -> None:
        """Gather and release at once the units from the cursor up to (not including) ``position``."""
        order = self._order()
        for k in range(self._cursor, position):
            self._issue_through(k, comm)
            skipped = order[k]
            skipped.wait_gather()
            skipped.release()
        self._cursor = max(self._cursor, position)


# ------------------------------------------------ gathers over several flat groups
class _DeferredHandle:
    """A gather whose collective is issued at ``wait()`` (its disk read is already running)."""

    __slots__ = ("_start",)

    def __init__(self, start):
        self._start = start

    def wait(self) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            start().wait()


def begin_gather_groups(groups: list[FlatGroup], comm: Collectives, label: str):
    """Start one all-gather of the ``groups`` not gathered yet (several: coalesced, See [Note:
    coalesced collectives] in _comm/collectives.py); None when all are gathered. Where a shard
    rests on NVMe, the reads start now and the collective is issued at ``wait()``, in the
    same order on every rank (``_DeferredHandle``)."""
    opened = [g for g in groups if g.open_for_gather()]
    if not opened:
        return None
    name = opened[0].name if len(opened) == 1 else label

    def start():
        with contextlib.ExitStack() as stack:
            for g in opened:
                stack.enter_context(preserve_version(g.full))
            sources = [g.gather_source() for g in opened]
            return comm.all_gather_coalesced([g.full for g in opened], sources, label=name)
    if any(g.params.needs_deferred_gather for g in opened):
        return _DeferredHandle(start)
    return start()


#: the step's all-gathers of groups kept whole are coalesced up to this many elements per call (4 MiB
#: in fp32): small groups (stage 3's persistent ones, biases and norms) cost a collective's fixed
#: cost each, while above it one group's own bytes outweigh it and the copies in and out would only
#: add to them. See [Note: coalesced collectives] in _comm/collectives.py.
COALESCE_STEP_ELEMENTS = 1 << 20


def publish_masters(groups: list[FlatGroup], comm: Collectives) -> list:
    """:meth:`FlatGroup.publish_master` for each of ``groups``, with the all-gathers of neighbours that
    fit :data:`COALESCE_STEP_ELEMENTS` together issued as one. Returns the handles to wait for."""
    return _coalesced_gathers([(g, g.publish_local()) for g in groups], comm)


def gather_replicated_groups(groups: list[FlatGroup], comm: Collectives) -> list:
    """Stages 1-2 and persistent stage-3 groups (the offloaded step): all-gather each ``full`` from its
    own slice, coalesced as :func:`publish_masters`."""
    return _coalesced_gathers([(g, None if g.shard_params else g.own(g.full)) for g in groups], comm)


def _coalesced_gathers(sources: list, comm: Collectives) -> list:
    """All-gather each group's ``full`` from its own slice (pairs ``(group, own)``; own None: nothing to
    gather), neighbours together up to :data:`COALESCE_STEP_ELEMENTS` per collective."""
    handles, batch, size = [], [], 0

    def issue() -> None:
        if batch:
            label = batch[0][0].name if len(batch) == 1 else f"{batch[0][0].name} +{len(batch) - 1} groups"
            with torch.no_grad(), contextlib.ExitStack() as stack:
                for g, _ in batch:
                    stack.enter_context(preserve_version(g.full))
                handles.append(comm.all_gather_coalesced([g.full for g, _ in batch], [o for _, o in batch],
                                                         label=label))
            batch.clear()

    for g, own in sources:
        if own is None:
            continue
        if size + g.padded_numel > COALESCE_STEP_ELEMENTS:
            issue()
            size = 0
        batch.append((g, own))
        size += g.padded_numel
    issue()
    return handles
