"""One run of a SLURM job with auto-requeue: each rank is a task srun started, Lightning's
SLURMEnvironment finds it, and SIGUSR1 (SLURM's warning before the time limit) makes Lightning
save ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir`` and call ``scontrol requeue`` (a fake one on
PATH here, which records its arguments). A requeued run is the same script again: Lightning
resumes from the ``hpc_ckpt_`` with the highest number it reads from the folder's names.

args: root (default_root_dir), max_steps, signal_at (the global step after which every rank
sends itself SIGUSR1), kill_save (rank 0 is SIGKILLed in the middle of that save: the shards
written, the metadata not yet).

Rank 1 sends its signal once rank 0 is about to, and then once something new has appeared in
``root`` (rank 0's save has begun writing) or 5 s have passed: a rank that reads the folder
while rank 0's save writes could pick another name than rank 0 (issue 38).

Each rank writes ``rank<r>.json``: the global step training started from (the resumed
checkpoint's) and ended at, or the error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

# what srun sets for each task (the launch helper's RANK / WORLD_SIZE / LOCAL_RANK, translated)
_rank, _world = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
os.environ.update(SLURM_PROCID=_rank, SLURM_LOCALID=os.environ.pop("LOCAL_RANK"), SLURM_NTASKS=_world,
                  SLURM_NTASKS_PER_NODE=_world, SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NAME="zs_requeue",
                  SLURM_JOB_ID="4242", SLURM_NODELIST="127.0.0.1")

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import zero_strategy  # noqa: E402,F401 - registers the presets
import lightning.pytorch as pl  # noqa: E402

from _models import SEQ, VOCAB, TinyLM, loss_fn  # noqa: E402


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM(layers=2)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return loss_fn(self.model(tokens), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _wait_for(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


class Requeue(pl.Callback):
    def __init__(self, args: dict, out: Path, rank: int, report: dict):
        self.args, self.out, self.rank, self.report = args, out, rank, report
        self.root = Path(args["root"])
        self.before = set(os.listdir(self.root))  # nobody writes there before the first save

    def on_train_start(self, trainer, pl_module):
        self.report["start_step"] = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.args.get("signal_at") or self.report.get("signalled"):
            return
        self.report["signalled"] = True
        saving = self.out / "rank0_saving"
        if self.rank == 1:
            _wait_for(saving.exists, 60)
            _wait_for(lambda: set(os.listdir(self.root)) - self.before, 5)  # a save that writes at once shows here
        if self.rank == 0:
            if self.args.get("kill_save"):
                from zero_strategy.checkpoint import _save

                _save._write_metadata = lambda tmp, meta: os.kill(os.getpid(), signal.SIGKILL)
            saving.touch()
        os.kill(os.getpid(), signal.SIGUSR1)  # Lightning's handler runs here: the hpc save, the requeue


def main() -> None:
    out = Path(sys.argv[1])
    args = json.loads((out / "args.json").read_text())
    rank = int(_rank)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    data = DataLoader(TensorDataset(tokens, torch.roll(tokens, -1, dims=1)), batch_size=4)
    report: dict = {}
    callback = Requeue(args, out, rank, report)
    trainer = pl.Trainer(accelerator="cpu", devices=int(_world), strategy="zero3", max_steps=args["max_steps"],
                         default_root_dir=args["root"], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback])
    report["environment"] = type(trainer.strategy.cluster_environment).__name__
    try:
        trainer.fit(LM(), data)
        report["end_step"] = trainer.global_step
    except BaseException as e:  # noqa: BLE001 - reported to the test
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
