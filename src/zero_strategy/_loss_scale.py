"""The fp16 loss scale: grows after a run of good steps, backs off after overflows.

Used only with ``precision="fp16"``: the optimizer checks the unscaled gradients for
inf/nan on every rank (one all-reduce) and skips the step on all of them when any
overflowed (See [Note: the order inside ``step()``] in _optim/optimizer.py). The scale backs
off after ``hysteresis`` overflows (DeepSpeed's meaning, see ``LossScaleConfig``).
"""

from __future__ import annotations


class LossScaler:
    """Dynamic (or static) fp16 loss scale with DeepSpeed-style hysteresis."""

    def __init__(self, cfg, enabled: bool):
        self.enabled = enabled
        self.cfg = cfg
        self.scale = float(cfg.initial_scale) if enabled else 1.0
        self._good_steps = 0
        self._hysteresis_left = cfg.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.enabled or self.cfg.static:
            return
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
                self._hysteresis_left = self.cfg.hysteresis
            return
        self._good_steps += 1
        if self._good_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self._good_steps = 0
            self._hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self._good_steps = int(sd["good_steps"])
        self._hysteresis_left = int(sd["hysteresis_left"])
