"""Lightning checkpoints in the sharded format, and a consolidated file for ``load_from_checkpoint``.

[Note: where the Lightning state goes]
A Trainer checkpoint is a directory written by :func:`zero_strategy.save_checkpoint`:
the weights and optimizer state are the sharded files (resumable on any number of
ranks and any stage); everything else Lightning puts in its checkpoint dict (epoch,
global_step, loops, callbacks, LR schedulers, hyper_parameters, datamodule state,
whatever ``on_save_checkpoint`` added) travels in ``extra_state`` as one serialized
blob. The blob is a uint8 tensor so the engine's integrity checks (per-file digests, the
``weights_only`` load of ``extra_state.pt``) cover it, while the blob itself is read
with Lightning's own ``weights_only`` semantics, as a ``.ckpt`` file would be.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from ..api import engine_of, is_set_up
from ..checkpoint import consolidate, save_checkpoint, wait_for_save
from ..checkpoint._load import prepare_load
from ..checkpoint._layout import EXTRA_STATE_FILE
from ..checkpoint._owned import remove_checkpoint

FORMAT = "zero_strategy.lightning/1"
#: keys whose content lives in the sharded files instead of the blob
SHARDED_KEYS = ("state_dict", "optimizer_states")


def pack(checkpoint: dict[str, Any]) -> dict[str, Any]:
    rest = {k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}
    buf = io.BytesIO()
    torch.save(rest, buf)
    return {"format": FORMAT, "lightning": torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)}


def unpack(extra: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's dict from the blob; never a full unpickle unless ``weights_only=False`` is asked for.

    ``None`` means ``True`` here on every torch we support: torch 2.4-2.5 read ``None`` as a
    full pickle (2.6 changed the default), and a checkpoint directory is exactly the kind of
    file that arrives from elsewhere. Lightning's checkpoint dict is plain data (its
    ``hyper_parameters`` are saved as a ``dict``), so it needs no extra safe globals.
    """
    from lightning.fabric.utilities.cloud_io import _load

    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise ValueError("this zero_strategy checkpoint was not written by the Lightning front end "
                         "(no Lightning state in its extra_state); load it with zero_strategy.load_checkpoint")
    blob = extra["lightning"].numpy().tobytes()
    return _load(io.BytesIO(blob), map_location="cpu", weights_only=weights_only is not False)


def save(path, model, zero_optimizers: list, checkpoint: dict[str, Any]) -> None:
    """Every rank: the sharded files, plus Lightning's dict. ``optimizer_states`` absent = weights only."""
    optimizers = list(zero_optimizers) if "optimizer_states" in checkpoint and zero_optimizers else None
    save_checkpoint(path, model, optimizers, extra_state=pack(checkpoint))


def load(path, model, zero_optimizers: list, weights_only: Optional[bool] = None, strict: bool = True) -> dict[str, Any]:
    """Every rank: load weights (and optimizer state when the checkpoint has it) in place; return Lightning's dict.

    The returned dict has no ``state_dict`` (already loaded); it has ``optimizer_states``
    (empty placeholders, already loaded) exactly when the checkpoint holds optimizer
    state, so Lightning's "checkpoint contains only the model" check still works.
    A directory Lightning's ``DeepSpeedStrategy`` saved is read as well (See [Note: a DeepSpeedStrategy
    checkpoint]).
    """
    from ..checkpoint import load_metadata

    if is_deepspeed(path):
        return _load_deepspeed(path, model, zero_optimizers, strict)
    meta = load_metadata(path)
    has_optimizer = bool(meta.get("optimizer") or meta.get("optimizers"))
    optimizers = list(zero_optimizers) if has_optimizer and zero_optimizers else None
    # Lightning's state is unpacked before anything is copied: a refusal of it changes nothing
    with prepare_load(path, model, optimizers, strict=strict,
                      accept_extra=lambda extra: unpack(extra, weights_only)) as load:
        checkpoint = load.commit()
    checkpoint["state_dict"] = {}
    if has_optimizer:
        checkpoint["optimizer_states"] = []
    return checkpoint


# [Note: a DeepSpeedStrategy checkpoint]
# Lightning's DeepSpeedStrategy.save_checkpoint hands its checkpoint dict, less "state_dict" and
# "optimizer_states", to DeepSpeed's ``engine.save_checkpoint(dir, client_state=..., tag="checkpoint")``,
# the engine built over the LightningModule itself (so DeepSpeed names the parameters as the
# LightningModule does). The weights and optimizer state are read by the DeepSpeed reader of
# checkpoint/ (See [Note: DeepSpeed's layout] in checkpoint/_deepspeed.py), at any world size and
# stage; the client_state is Lightning's dict (epoch, global_step, loops, callbacks, lr_schedulers,
# ...), read with that reader's allowlist, and goes back to Lightning as a .ckpt file's would: its
# restore sets the loops and the schedulers. A DeepSpeed directory whose client_state is not
# Lightning's (a DeepSpeed run of its own) is refused before anything is copied, as Lightning's
# restore needs its loops.
_LIGHTNING_KEYS = ("pytorch-lightning_version", "loops", "global_step", "epoch")


def is_deepspeed(path) -> bool:
    """A DeepSpeed checkpoint directory (not ours): Lightning's and Fabric's DeepSpeedStrategy write them."""
    from ..checkpoint._deepspeed import find_deepspeed_checkpoint
    from ..checkpoint._layout import METADATA_FILE

    path = Path(path)
    return path.is_dir() and not (path / METADATA_FILE).exists() and find_deepspeed_checkpoint(path) is not None


def _lightning_client_state(client_state: Any) -> dict[str, Any]:
    missing = [k for k in _LIGHTNING_KEYS if not (isinstance(client_state, dict) and k in client_state)]
    if missing:
        raise ValueError(f"this DeepSpeed checkpoint was not saved by Lightning's DeepSpeedStrategy (its client_state "
                         f"lacks {missing}): resume it with zero_strategy.load_checkpoint, or load its weights "
                         "only (zero_strategy.load_checkpoint(dir, model) in LightningModule.on_fit_start)")
    return dict(client_state)


def _load_deepspeed(path, model, zero_optimizers: list, strict: bool) -> dict[str, Any]:
    """See [Note: a DeepSpeedStrategy checkpoint]."""
    optimizers = list(zero_optimizers) or None
    with prepare_load(path, model, optimizers, strict=strict, accept_extra=_lightning_client_state) as load:
        checkpoint = load.commit()
    checkpoint["state_dict"] = {}
    checkpoint["optimizer_states"] = []  # DeepSpeed's ZeRO files always hold it: loaded when fitting
    return checkpoint


def read_lightning_state(ckpt_dir, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Lightning's dict of a checkpoint directory, without any model or process group."""
    from ..checkpoint import load_metadata
    from ..checkpoint._load import resolve_checkpoint_dir

    meta = load_metadata(ckpt_dir)
    extra = meta.get("extra_state")
    if extra is None:
        raise ValueError(f"{ckpt_dir} holds no Lightning state (it was not saved by a Lightning trainer)")
    if extra["kind"] == "json":
        value = extra["value"]
    else:
        value = torch.load(resolve_checkpoint_dir(ckpt_dir) / EXTRA_STATE_FILE, map_location="cpu",
                           weights_only=True)
    return unpack(value, weights_only)


def convert_to_lightning_checkpoint(ckpt_dir: str | os.PathLike, out_file: str | os.PathLike,
                                    dtype=None, weights_only: Optional[bool] = None) -> Path:
    """Write one ``.ckpt`` file that ``LightningModule.load_from_checkpoint`` (and ``Trainer(ckpt_path=...)``
    with any strategy) accepts, from a sharded Trainer checkpoint directory.

    Runs in one process, no ``torch.distributed``. ``state_dict`` holds the full fp32
    weights (or ``dtype``) keyed like ``model.state_dict()``; the other entries (epoch,
    global_step, hyper_parameters, loops, callbacks, LR schedulers) are Lightning's own.
    Optimizer state is not included (it is sharded; resume from the directory for it).
    Needs memory for the whole model once.
    """
    import safetensors.torch

    out_file = Path(out_file)
    if out_file.exists():
        raise FileExistsError(f"{out_file} exists; refusing to overwrite it")
    checkpoint = read_lightning_state(ckpt_dir, weights_only)
    with tempfile.TemporaryDirectory(dir=out_file.parent if out_file.parent.exists() else None) as tmp:
        folder = consolidate(ckpt_dir, Path(tmp) / "full", dtype=dtype)
        state_dict: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            state_dict.update(safetensors.torch.load_file(f))
    checkpoint["state_dict"] = state_dict
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp_file = out_file.with_name(out_file.name + ".tmp")
    torch.save(checkpoint, tmp_file)
    os.replace(tmp_file, out_file)
    return out_file


def remove(path, module=None) -> None:
    """Delete a checkpoint (ModelCheckpoint's pruning) and the leftovers of killed saves of it: the
    same helper as a save's, so only directories of this user, never by a pattern over user names
    and never through a link (See [Note: what a save may delete] in checkpoint/_owned.py).

    While an asynchronous save of ``module`` is writing (the checkpoint that replaces this one as
    the best), the removal waits for it on its thread and happens only if it succeeds: a failed
    save never costs the checkpoint it was to replace."""
    if module is not None and is_set_up(module) and engine_of(module).after_save_succeeds(
            lambda: remove_checkpoint(path)):
        return
    remove_checkpoint(path)


def wait(module) -> None:
    """Wait for the asynchronous save of ``module`` still writing, if any; raise its failure."""
    if module is not None and is_set_up(module):
        wait_for_save(module)
