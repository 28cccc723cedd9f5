"""``Trainer(strategy=ZeroStrategy(sequence_parallel_size=2))`` on 2 ranks against one process
training the same tiny Llama on the whole sequences.

The LightningModule is written as a Lightning user would: its DataLoader yields whole
samples (dicts with input_ids and labels); the strategy samples them over the data-parallel
ranks and hands ``training_step`` this rank's shard; the step returns
``zero_strategy.sequence_parallel_loss``. Cases (args["cases"]): name, stage, accumulate,
clip. Each reports the per-step losses of both runs and the worst relative weight difference.
"""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from _worker import finish, run_named_cases, start, worst_rel_diff

import zero_strategy as zs
import lightning.pytorch as pl
from torch.utils.data import DataLoader, DistributedSampler

VOCAB = 64


def samples() -> list[dict]:
    out = []
    for i in range(4):
        g = torch.Generator().manual_seed(300 + i)
        ids = torch.randint(1, VOCAB, (40,), generator=g)
        labels = ids.clone()
        labels[:8] = -100
        out.append(dict(input_ids=ids, labels=labels))
    return out


class LitLlama(pl.LightningModule):
    def __init__(self, model: LlamaForCausalLM):
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = self.model.loss_function(logits=out.logits, labels=None, shift_labels=batch["shift_labels"],
                                        vocab_size=VOCAB)
        loss = zs.sequence_parallel_loss(loss, batch["shift_labels"], self)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def run_case(case: dict, world: int) -> dict:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(11)
    base = LlamaForCausalLM(cfg)
    reference = copy.deepcopy(base)
    accumulate, clip = case.get("accumulate", 1), case.get("clip")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    ref_losses = []
    data = samples()
    # Lightning's Trainer shuffles a training loader through a DistributedSampler (seed 0), Fabric
    # keeps the loader's order; under SP it spans the data-parallel ranks only (one here), so both
    # ranks read this order
    fabric = case.get("fabric", False)
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=not fabric, seed=0))
    for i, sample in enumerate(data[j] for j in order):
        loss = reference(input_ids=sample["input_ids"][None], labels=sample["labels"][None]).loss
        (loss / accumulate).backward()
        ref_losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
    if fabric:
        return run_fabric(case, base, data, world) | dict(ref_losses=ref_losses, reference=reference)
    module = LitLlama(base)
    trainer = pl.Trainer(accelerator="cpu", devices=world,
                         strategy=zs.ZeroStrategy(stage=case["stage"], sequence_parallel_size=2),
                         max_epochs=1, accumulate_grad_batches=accumulate, gradient_clip_val=clip, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(data, batch_size=1))
    state = {k: v.detach().float() for k, v in module.model.state_dict().items()}
    trainer.strategy.teardown()
    return dict(losses=module.losses, ref_losses=ref_losses,
                weight_rel_diff=worst_rel_diff(state, reference.state_dict())[0])


def run_fabric(case: dict, model, data, world: int) -> dict:
    """Fabric, as its users write a loop: the loaders from ``setup_dataloaders``, each batch sharded
    with ``zero_strategy.shard_sequence``."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world,
                    strategy=zs.ZeroFabricStrategy(stage=case["stage"], sequence_parallel_size=2))
    fabric.launch()
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    losses = []
    for batch in fabric.setup_dataloaders(DataLoader(data, batch_size=1)):
        shard = zs.shard_sequence(batch, model)
        out = wrapped(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        loss = model.loss_function(logits=out.logits, labels=None, shift_labels=shard["shift_labels"],
                                   vocab_size=VOCAB)
        loss = zs.sequence_parallel_loss(loss, shard["shift_labels"], model)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(losses=losses, state={k: v.float() for k, v in zs.full_state_dict(model).items()})


def main() -> None:
    args, out = start()
    world = torch.distributed.get_world_size()
    finish(out, run_named_cases(args["cases"], lambda case: compared(run_case(case, world))))


def compared(res: dict) -> dict:
    if "state" in res:  # the Fabric case: weights compared here, not sent
        res["weight_rel_diff"] = worst_rel_diff(res.pop("state"), res.pop("reference").state_dict())[0]
    return res


if __name__ == "__main__":
    main()
