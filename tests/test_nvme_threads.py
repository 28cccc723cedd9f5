"""The NVMe store starts its I/O threads at setup, never on the training path.

CI once hung for 300 s in ``Thread.start()`` called from a stage-3 forward hook: the
swap file's thread pool started a worker lazily, on the first read a gather asked for,
inside the ``torch.compiler.disable`` region around the hook, and the new thread never
began to run. The store now starts every thread it will use when it is built
(_mechanisms/transfers.py). Pinned here: forward, backward, the step, ``state_dict``
and a save start no thread at all; closing the model's store stops them.
"""

from __future__ import annotations

import threading

import pytest
import torch

import zero_strategy as zs
from _habits import train
from _models import TinyLM, param_groups

pytestmark = pytest.mark.timeout(120, method="thread")


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zero-nvme")}


@pytest.mark.parametrize("stage", [2, 3])
def test_training_starts_no_thread(tmp_path, stage):
    torch.manual_seed(0)
    model = TinyLM(layers=2, dim=48, vocab=512)
    nvme = {"device": "nvme", "path": str(tmp_path / "swap"), "buffer_size": 64 * 1024, "io_threads": 3}
    before = _store_threads()
    model, opt = zs.setup(model, torch.optim.AdamW(param_groups(model), lr=1e-3),
                          zs.ZeroConfig(stage=stage, offload_optimizer=nvme,
                                        offload_params=nvme if stage == 3 else None))
    started_at_setup = _store_threads() - before
    assert len([t for t in started_at_setup if t.name.startswith("zero-nvme-io")]) == 3  # io_threads, all now
    every_thread = set(threading.enumerate())
    train(model, opt, range(3))
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 8)))
    model.state_dict()
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert set(threading.enumerate()) - every_thread == set(), "a thread was started while training"
    zs.teardown(model, keep_weights=False)
    for t in started_at_setup:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in started_at_setup), "closing the store left its threads running"
