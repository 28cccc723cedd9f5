"""The optimizer ``ZeroAccelerator.prepare`` returns: Accelerate's wrapper over a ZeroOptimizer.

It is an ``accelerate.optimizer.AcceleratedOptimizer`` (code that checks for one, such
as Accelerate's schedulers, ``optimizer_step_was_skipped`` and the HF Trainer, keeps
working) whose inner ``optimizer`` is the :class:`~zero_strategy.ZeroOptimizer`:

* ``step()`` / ``zero_grad()`` act only at accumulation boundaries
  (``sync_gradients``), as Accelerate's wrapper does;
* no ``GradScaler`` and no device placement of the state: the ZeroOptimizer owns fp16
  loss scaling (its overflow check spans all ranks) and its shards already live
  where the config puts them; ``step_was_skipped`` reports a skipped fp16 step;
* ``state_dict()`` is this rank's shard only: use ``accelerator.save_state`` (every
  rank's shard, resumable on any number of processes).
"""

from __future__ import annotations

from accelerate.optimizer import AcceleratedOptimizer

from .._optim.optimizer import ZeroOptimizer


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    def __init__(self, zero_optimizer: ZeroOptimizer, param_ids: frozenset[int]):
        """``param_ids``: ids of the model parameters this optimizer was built over (before setup)."""
        super().__init__(zero_optimizer, device_placement=False, scaler=None)
        self.param_ids = param_ids

    @property
    def zero_optimizer(self) -> ZeroOptimizer:
        return self.optimizer

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return
        before = self.optimizer.skipped_steps
        self.optimizer.step(closure)
        self._is_overflow = self.optimizer.skipped_steps > before

    def __repr__(self) -> str:
        return f"ZeroAcceleratedOptimizer({self.optimizer!r})"
