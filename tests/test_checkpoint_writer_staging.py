"""``memory_report`` counts the staging buffer of each checkpoint file being written (issue 42).

Each file writer stages its bytes in an aligned buffer for ``O_DIRECT`` writes (See [Note: direct
writes] in _mechanisms/safetensors_writer.py). The report's "staging" counted an asynchronous
save's host copies but not that buffer, in a synchronous save or in an asynchronous one's writer
thread: 16 MiB per open file, unreported. The oracle here is the writer's own buffer, seen from
inside the save.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import zero_strategy as zs
from zero_strategy.checkpoint import _save
from zero_strategy._mechanisms import safetensors_writer

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="the staging buffer is O_DIRECT's")


def _model(**config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model, opt = zs.setup(model, torch.optim.AdamW(model.parameters()), zs.ZeroConfig(stage=2, **config))
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    return model, opt


def _staging(model) -> int:
    return zs.memory_report(model).by_category["staging"]


def _nbytes(buffer: torch.Tensor) -> int:
    """The writer's staging buffer's own size: its storage's."""
    return buffer.untyped_storage().nbytes()


def test_a_synchronous_save_counts_its_writers_staging_buffer(tmp_path, monkeypatch):
    model, opt = _model()
    before = _staging(model)
    seen = []
    write = safetensors_writer.StreamWriter.write

    def observed(self, name, piece):
        if not seen:  # the first file's first piece: its writer is open
            seen.append((_nbytes(self._stage), _staging(model)))
        return write(self, name, piece)

    monkeypatch.setattr(safetensors_writer.StreamWriter, "write", observed)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    (buffer_bytes, during), = seen
    assert buffer_bytes >= safetensors_writer.STAGING_BYTES
    assert during - before == buffer_bytes
    assert _staging(model) == before  # released when the file is closed


def test_an_asynchronous_save_counts_its_writers_staging_buffer_while_it_writes(tmp_path, monkeypatch):
    model, opt = _model(async_save=True)
    before = _staging(model)
    buffers, started, release = [], threading.Event(), threading.Event()
    init = safetensors_writer.StreamWriter.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        buffers.append(_nbytes(self._stage))

    def hold(item):  # the writer thread, before a piece of the open file: wait for the test
        if item[0] == "piece" and not started.is_set():
            started.set()
            release.wait(60)

    monkeypatch.setattr(safetensors_writer.StreamWriter, "__init__", kept)
    monkeypatch.setattr(_save, "_before_background_write", hold)
    zs.save_checkpoint(tmp_path / "ckpt", model, opt)
    assert started.wait(60)
    staged_copies = sum(t.untyped_storage().nbytes() for t in zs.api._engine_of(model).background_save._staged)
    during = _staging(model)
    release.set()
    zs.checkpoint.wait_for_save(model, release_buffers=True)
    assert len(buffers) >= 1 and buffers[0] >= safetensors_writer.STAGING_BYTES
    assert during - before == staged_copies + buffers[0]  # the copies staged, and the open file's buffer
    assert _staging(model) == before
