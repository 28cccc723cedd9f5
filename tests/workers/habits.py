"""Users' own training-loop habits, run on a ZeRO model and on a plain reference model.

The reference is one plain torch model trained on the *global* batch (every rank's
micro-batch; loss = mean over ranks), which is what data parallelism must equal. The
ZeRO side runs the same user code on this rank's micro-batch. Each scenario is the
loop a user writes (``model.zero_grad()``, a try/except retry around an OOM, ...);
the code under test is the scenario function, applied to both models unchanged.

args["cases"]: list of {scenario, stage, offload (None|"cpu"|"nvme"), overlap, steps, nvme_path}.
Reports per case: losses of both and the largest relative weight difference.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from _worker import finish, run_cases, start, worst_rel_diff
from _models import TinyLM, batch, loss_fn, param_groups

import zero_strategy as zs


class Side:
    """One model + optimizer and how it computes the loss of (step, micro)."""

    def __init__(self, model, optimizer, ranks: list[int]):
        self.model, self.optimizer, self.ranks = model, optimizer, ranks
        self.fail_forward_at: set = set()   # (step, micro, attempt) where block 1 raises in forward
        self.fail_backward_at: set = set()  # ... where block 1's output gradient raises in backward
        self.where = None
        self.depth = None  # blocks the forward runs (None: all)
        self.skip_commits = False  # a skipped batch is stepped first (what overlap_step's refusal does)
        self.committed: list[int] = []  # steps where zero_grad raised OverlapStepCommitted
        block = model.layers[1]
        block.register_forward_hook(self._inject)

    def _inject(self, module, args, output):
        if self.where in self.fail_forward_at:
            raise torch.OutOfMemoryError("injected: out of memory in forward")
        if self.where in self.fail_backward_at and output.requires_grad:
            def boom(grad):
                raise torch.OutOfMemoryError("injected: out of memory in backward")
            output.register_hook(boom)
        return None

    def loss(self, step: int, micro: int, attempt: int = 0) -> torch.Tensor:
        self.where = (step, micro, attempt)
        losses = [loss_fn(self.model(tokens, self.depth), targets)
                  for tokens, targets in (batch(r, step, micro) for r in self.ranks)]
        return sum(losses) / len(losses)


# ---------------------------------------------------------------- the users' loops
def model_zero_grad(side: Side, steps: int) -> list[float]:
    """Accelerate's and many users' loop: zero through the model at the top of each step."""
    out = []
    for step in range(steps):
        side.model.zero_grad()
        loss = side.loss(step, 0)
        loss.backward()
        side.optimizer.step()
        out.append(loss.item())
    return out


def model_zero_grad_keep_tensors(side: Side, steps: int) -> list[float]:
    """``zero_grad(set_to_none=False)``: gradients zeroed in place instead of dropped."""
    out = []
    for step in range(steps):
        loss = side.loss(step, 0)
        loss.backward()
        side.optimizer.step()
        side.model.zero_grad(set_to_none=False)
        out.append(loss.item())
    return out


def _clear_between_micro_batches(side: Side, steps: int, clear) -> list[float]:
    """Two micro-batches accumulate; ``clear`` runs between them, then step and zero the model."""
    out = []
    for step in range(steps):
        first = side.loss(step, 0)
        first.backward()
        clear(side.model)
        second = side.loss(step, 1)
        second.backward()
        side.optimizer.step()
        side.model.zero_grad()
        out.append(first.item() + second.item())
    return out


def submodule_zero_grad(side: Side, steps: int) -> list[float]:
    """Block 0's gradients of the first micro-batch are cleared: whole flat groups."""
    return _clear_between_micro_batches(side, steps, lambda model: model.layers[0].zero_grad())


def part_of_a_block_zero_grad(side: Side, steps: int) -> list[float]:
    """Only one layer inside block 0 is cleared: part of a flat group."""
    return _clear_between_micro_batches(side, steps, lambda model: model.layers[0].fc1.zero_grad())


def grad_set_to_none_by_hand(side: Side, steps: int) -> list[float]:
    """``for p in model.parameters(): p.grad = None`` after each step."""
    out = []
    for step in range(steps):
        loss = side.loss(step, 0)
        loss.backward()
        side.optimizer.step()
        for p in side.model.parameters():
            p.grad = None
        out.append(loss.item())
    return out


def _clear_between_backward_and_step(side: Side, steps: int, clear) -> list[float]:
    """At step 1 ``clear`` runs after backward and before ``optimizer.step()``."""
    out = []
    for step in range(steps):
        loss = side.loss(step, 0)
        loss.backward()
        if step == 1:
            clear(side.model)
        side.optimizer.step()
        side.optimizer.zero_grad()
        out.append(loss.item())
    return out


def zero_grad_between_backward_and_step(side: Side, steps: int) -> list[float]:
    """A step after ``model.zero_grad()`` has no gradients: torch skips every parameter."""
    return _clear_between_backward_and_step(side, steps, lambda model: model.zero_grad())


def zeroed_in_place_between_backward_and_step(side: Side, steps: int) -> list[float]:
    """``zero_grad(set_to_none=False)`` before step: torch steps with zero gradients (AdamW's
    moments and weight decay still move the weights)."""
    return _clear_between_backward_and_step(side, steps, lambda model: model.zero_grad(set_to_none=False))


def _retry_loop(side: Side, steps: int, clear) -> list[float]:
    """The OOM-retry loop of Lightning's batch-size finder / HF auto_find_batch_size / users' own."""
    out = []
    for step in range(steps):
        for attempt in range(2):
            try:
                loss = side.loss(step, 0, attempt)
                loss.backward()
                break
            except torch.OutOfMemoryError:
                clear(side)
        else:
            raise AssertionError("the retry failed too")
        side.optimizer.step()
        side.optimizer.zero_grad()
        out.append(loss.item())
    return out


def retry_after_forward_error(side: Side, steps: int) -> list[float]:
    side.fail_forward_at = {(1, 0, 0)}
    return _retry_loop(side, steps, lambda s: s.optimizer.zero_grad())


def retry_after_backward_error(side: Side, steps: int) -> list[float]:
    side.fail_backward_at = {(1, 0, 0), (2, 0, 0)}
    return _retry_loop(side, steps, lambda s: s.optimizer.zero_grad())


def retry_after_backward_error_model_zero_grad(side: Side, steps: int) -> list[float]:
    side.fail_backward_at = {(1, 0, 0)}
    return _retry_loop(side, steps, lambda s: s.model.zero_grad())


def skip_a_batch_after_backward(side: Side, steps: int) -> list[float]:
    """At step 1 the batch is judged bad after its backward: ``zero_grad()`` and no step."""
    out = []
    for step in range(steps):
        loss = side.loss(step, 0)
        loss.backward()
        out.append(loss.item())
        if step == 1:
            if side.skip_commits:
                side.optimizer.step()
            try:
                side.optimizer.zero_grad()
            except zs.OverlapStepCommitted:
                side.committed.append(step)
            continue
        side.optimizer.step()
        side.optimizer.zero_grad()
    return out


def a_block_no_rank_uses(side: Side, steps: int) -> list[float]:
    """The last block is in no rank's forward: its parameters get no gradient anywhere."""
    side.depth = len(side.model.layers) - 1
    out = []
    for step in range(steps):
        loss = side.loss(step, 0)
        loss.backward()
        side.optimizer.step()
        side.optimizer.zero_grad()
        out.append(loss.item())
    return out


SCENARIOS = {f.__name__: f for f in (
    model_zero_grad, model_zero_grad_keep_tensors, submodule_zero_grad, part_of_a_block_zero_grad,
    grad_set_to_none_by_hand, zero_grad_between_backward_and_step, zeroed_in_place_between_backward_and_step, retry_after_forward_error, retry_after_backward_error,
    retry_after_backward_error_model_zero_grad, skip_a_batch_after_backward, a_block_no_rank_uses,
)}


def _offload(case: dict):
    """``"nvme"``: NVMe offload under the case's ``nvme_path``; its read-ahead defers work past backward."""
    if case.get("offload") == "nvme":
        return zs.NVMeOffload(case["nvme_path"], buffer_size=4096 * 4)
    return case.get("offload")


def same_on_every_rank(model) -> bool:
    """Every parameter this rank holds whole equals rank 0's (stages 1-2: replicated parameters)."""
    local = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    first = local.clone()
    dist.broadcast(first, 0)
    return bool(torch.equal(local, first))


def run_case(case: dict, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    base = TinyLM(layers=3)
    ref_model = copy.deepcopy(base)
    ref = Side(ref_model, torch.optim.AdamW(param_groups(ref_model)), list(range(world)))
    ref.skip_commits = bool(case.get("overlap"))  # See [Note: a step overlap_step began is not undone]
    config = zs.ZeroConfig(stage=case["stage"], param_persistence_threshold=0,
                           offload_optimizer=_offload(case),
                           offload_params=_offload(case) if case["stage"] == 3 else None,
                           overlap_step=bool(case.get("overlap")))
    model = copy.deepcopy(base)
    model, zopt = zs.setup(model, torch.optim.AdamW(param_groups(model)), config)
    zero = Side(model, zopt, [rank])
    scenario = SCENARIOS[case["scenario"]]
    steps = case.get("steps", 4)
    losses_ref = scenario(ref, steps)
    losses_zero = scenario(zero, steps)
    # this rank's loss is its own micro-batch's: compare the mean over ranks with the reference's
    mean = torch.tensor(losses_zero, dtype=torch.float64)
    dist.all_reduce(mean)
    engine = zs.api._engine_of(model)
    return dict(case=case, losses_ref=losses_ref, losses_zero=(mean / world).tolist(),
                weight_rel_diff=worst_rel_diff(zs.full_state_dict(model), ref_model.state_dict())[0],
                training_state=engine.training_state.value, committed=zero.committed,
                same_on_every_rank=same_on_every_rank(model) if case["stage"] < 3 else None,
                units_gathered=[u.name for u in engine.units[1:] if u.sharded_groups and u.state.value == "gathered"])


def main() -> None:
    args, out = start()
    rank, world = dist.get_rank(), dist.get_world_size()
    finish(out, {"results": run_cases(args["cases"], lambda case: run_case(case, rank, world))})


if __name__ == "__main__":
    main()
