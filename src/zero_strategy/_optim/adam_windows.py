"""The offloaded Adam/AdamW step with low-precision gradients, in windows that stay in cache.

[Note: the bf16 step in cache-sized windows]
With ``precision="bf16"`` (or fp16) an offloaded step reads each group's bf16 gradient, needs it
in fp32 beside the fp32 master, steps, and writes the new master into the bf16 parameters. Done
a step batch at a time that is three passes over memory: the cast writes an fp32 copy of every
gradient (which AdamW then reads back), AdamW's own pass (28 bytes per parameter), and the cast
of every new master (read once more) to bf16: about 12 bytes per parameter more than AdamW, on a
step that is bound by memory bandwidth (0.52-0.59x torch's fused AdamW on fp32 in
benchmarks/hot_path.py). DeepSpeed's CPUAdam reads its gradient and writes the bf16 copy in its
own C++ loop. Without C++ of our own, this file gets the same traffic out of torch's kernels: the
batch is cut into windows of at most :data:`WINDOW_NUMEL` elements; each window's gradients are
cast into a scratch buffer small enough to stay in the CPU's cache, torch's own fused Adam kernel
steps views of the masters and moments for that window, and the window's new masters are cast
out while they are still in cache. What reaches memory is then what one pass with bf16
gradients moves: master, moments, the bf16 gradient read, the bf16 parameters written.

The window is a trade: the smaller it is, the surer the scratch stays in cache, and the more
kernel calls (each a dispatch and, above ~32K elements, a parallel region whose threads meet at
a barrier: on a loaded machine a region waits for a descheduled thread). 2^20 elements (a 4 MiB
scratch, in the L3 of the 2-core test machine, near its 1 MiB L2) measured best; RESULTS.md
"The bf16 step in cache-sized windows" has the figures. Those calls, not memory, bound the step
(it moves fewer bytes than CPUAdam with its copy-out): RESULTS.md "The bf16 step beside CPUAdam".
Threads of our own in place of torch's parallel regions, each window on one, were tried there and
dropped: every call gives the GIL up and takes it back, and on a loaded machine taking it back
waits for the other thread to be scheduled (2-3x slower at load 16-26). The windows cast a window
at a time, so on a CPU-only process the whole step is one batch (``_batch_limit`` in
offloaded_step.py).

Exact: the same kernel on the same elements. Adam is elementwise (See [Note: a step in chunks is
the step] in chunked_step.py); every cut inside a master falls on a multiple of :data:`ALIGN`
elements from its start, so each element takes the kernel's vector path, or its scalar tail at
the end of the tensor, exactly as in one call over the whole master; each group's step count
advances once, before its first window, as torch's ``_fused_adam`` advances it before its call.
tests/test_adam_windows.py compares with the optimizer's own step bit for bit.

Only where it is the user's optimizer's own computation (:func:`window_plan`): torch's ``Adam``
or ``AdamW`` with their own ``step`` (not a subclass's), ``fused=True``, neither ``capturable``
nor ``differentiable``, no GradScaler attributes, every master with its state already (the first
step creates it, through the optimizer's own step), a gradient to cast, and no untouched
parameter (See [Note: no gradient on any rank] in _engine/gradients.py: ``keep_untouched`` puts
those back around the optimizer's own call). Anything else steps as it did.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .._engine.gradients import stepped_whole
from .._mechanisms.cast_scratch import CastScratch

#: the most elements one window steps (the scratch it casts into: 4 MiB of fp32)
WINDOW_NUMEL = 1 << 20
#: a cut inside a master falls on a multiple of this many elements from its start (a cache line
#: of fp32 is 16; a multiple of every vector width the kernel uses)
ALIGN = 64


def _unhooked(step):
    """A step function without torch's hook wrapper (which Optimizer's first instance installs)."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


class _Master:
    """One group of a batch as the windows step it: its master, fp32 state, gradient and settings."""

    __slots__ = ("group", "master", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step", "settings")

    def __init__(self, group, state: dict, settings: dict):
        self.group, self.master = group, group.master
        self.grad = group.master_grad_source()  # [shard] the reduce dtype (waits for its download)
        self.exp_avg, self.exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        self.max_exp_avg_sq = state.get("max_exp_avg_sq")
        self.step = state["step"]
        self.settings = settings


def _kernel_settings(pg: dict, adamw: bool) -> dict | None:
    """The keyword arguments torch's ``_fused_adam`` gives the kernel for param group ``pg``, and
    which kernel (``adamw``: the optimizer is an AdamW, which torch before 2.6 says by its class
    only); None where this step would not be the optimizer's own."""
    if not pg.get("fused") or pg.get("capturable") or pg.get("differentiable"):
        return None
    beta1, beta2 = pg["betas"]
    if torch.is_tensor(beta1) or torch.is_tensor(beta2):
        return None
    lr = pg["lr"]
    if torch.is_tensor(lr) and lr.device.type != "cpu":
        return None
    return {"adamw": bool(pg.get("decoupled_weight_decay", adamw)), "amsgrad": bool(pg.get("amsgrad", False)),
            "lr": lr, "beta1": beta1, "beta2": beta2, "weight_decay": pg["weight_decay"], "eps": pg["eps"],
            "maximize": bool(pg.get("maximize", False))}


def window_plan(optimizer: torch.optim.Optimizer, batch: list) -> list[tuple] | None:
    """``batch``'s groups as the windows step them, (group, state, kernel settings) each; None where
    the batch steps with the optimizer's own call instead (See [Note: the bf16 step in cache-sized
    windows]: when it would not compute what that call computes, or casts nothing)."""
    own = (_unhooked(torch.optim.Adam.step), _unhooked(torch.optim.AdamW.step))
    if _unhooked(type(optimizer).step) not in own or getattr(optimizer, "grad_scale", None) is not None \
            or getattr(optimizer, "found_inf", None) is not None:
        return None
    group_of = {id(p): pg for pg in optimizer.param_groups for p in pg["params"]}
    settings_of: dict[int, dict | None] = {}  # id(param group) -> its kernel settings, one dict per group
    plan = []
    for g in batch:
        if g.owned or g.masters.streams or not g.master_grad_cast_numel or g.grads.untouched:
            return None
        master = g.master
        state, pg = optimizer.state.get(master), group_of.get(id(master))
        settings = None if pg is None else settings_of.setdefault(
            id(pg), _kernel_settings(pg, isinstance(optimizer, torch.optim.AdamW)))
        if settings is None or not state or master.dtype != torch.float32:
            return None
        step = state.get("step")
        moments = [state.get(k) for k in ("exp_avg", "exp_avg_sq")]
        if settings["amsgrad"]:
            moments.append(state.get("max_exp_avg_sq"))
        if not torch.is_tensor(step) or step.device.type != "cpu" or any(
                not torch.is_tensor(t) or t.dtype != master.dtype or t.shape != master.shape for t in moments):
            return None
        plan.append((g, state, settings))
    return plan


def windows(sizes: list[int], window: int, align: int = ALIGN) -> Iterator[list[tuple[int, int, int]]]:
    """Cut tensors of ``sizes`` elements, in order, into windows of at most ``window`` elements:
    each window a list of pieces ``(i, a, b)`` (elements [a, b) of tensor i). A cut inside a tensor
    is a multiple of ``align`` from its start; a tensor's last piece ends where it does."""
    if window < align:
        raise ValueError(f"a window of {window} elements is smaller than one aligned piece ({align})")
    pieces: list[tuple[int, int, int]] = []
    room = window
    for i, n in enumerate(sizes):
        a = 0
        while a < n:
            take = n - a if n - a <= room else room - room % align
            if take == 0:  # the room left is less than one aligned piece: the next window
                yield pieces
                pieces, room = [], window
                continue
            pieces.append((i, a, a + take))
            a += take
            room -= take
        if room < align and pieces:
            yield pieces
            pieces, room = [], window
    if pieces:
        yield pieces


@torch.no_grad()
def step_in_windows(plan: list[tuple], factor: float, scratch: CastScratch) -> list:
    """One Adam/AdamW step of the planned groups (:func:`window_plan`), window by window: the
    gradients cast (and scaled by ``factor``) into a cached scratch, torch's fused kernel on views,
    the new masters written into the parameters. Returns the upload events to ``wait()``.

    See [Note: the bf16 step in cache-sized windows]."""
    masters = [_Master(g, state, settings) for g, state, settings in plan]
    for m in masters:
        m.step.add_(1)  # once per group, before its first window: torch's _fused_adam does it before its call
    buf = scratch.take(min(WINDOW_NUMEL, sum(m.master.numel() for m in masters)), torch.float32)
    uploads = []
    try:
        for pieces in windows([m.master.numel() for m in masters], WINDOW_NUMEL):
            start = 0
            grads = []
            for i, a, b in pieces:
                g32 = buf[start:start + b - a]
                start += b - a
                g32.copy_(masters[i].grad[a:b])
                if factor != 1.0:
                    g32.mul_(factor)
                grads.append(g32)
            _kernel(masters, pieces, grads)
            del grads
            for i, a, b in pieces:
                m = masters[i]
                if not m.group.masters.aliases_params:
                    uploads.append(m.group.params.take_master(m.master[a:b], m.group.transfers, start=a))
    finally:
        scratch.give_back(buf)
    for m in masters:
        stepped_whole(m.group)
    return uploads


def _kernel(masters: list[_Master], pieces: list[tuple[int, int, int]], grads: list[torch.Tensor]) -> None:
    """torch's fused Adam(W) kernel over one window's pieces, one call per set of settings."""
    calls: dict[int, list[int]] = {}
    for k, (i, _, _) in enumerate(pieces):
        calls.setdefault(id(masters[i].settings), []).append(k)
    for ks in calls.values():
        s = masters[pieces[ks[0]][0]].settings
        views = [(masters[pieces[k][0]], pieces[k][1], pieces[k][2]) for k in ks]
        fn = torch._fused_adamw_ if s["adamw"] else torch._fused_adam_
        fn([m.master.data[a:b] for m, a, b in views], [grads[k] for k in ks],
           [m.exp_avg[a:b] for m, a, b in views], [m.exp_avg_sq[a:b] for m, a, b in views],
           [m.max_exp_avg_sq[a:b] for m, a, b in views] if s["amsgrad"] else [],
           [m.step for m, _, _ in views], amsgrad=s["amsgrad"], lr=s["lr"], beta1=s["beta1"],
           beta2=s["beta2"], weight_decay=s["weight_decay"], eps=s["eps"], maximize=s["maximize"],
           grad_scale=None, found_inf=None)
