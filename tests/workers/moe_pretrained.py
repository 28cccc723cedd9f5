"""A mixture-of-experts checkpoint as transformers saves it, loaded sharded, trained, saved back.

Each case (``family``, ``stage``, ``dtype``): transformers' own ``from_pretrained`` of the
directory is the reference (every rank holds it whole, and trains it on the whole batch:
one process's training); ``zero_strategy.transformers.from_pretrained`` + ``setup`` loads the
same directory sharded, counting the bytes this rank reads through the safetensors slices.
Both are compared before and after two AdamW steps (each rank trains on its half of the
batch), then the set-up model is saved with ``save_pretrained`` on every rank and rank 0
saves the reference with transformers, for the test to compare the two directories.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from _worker import finish, run_cases, start

import zero_strategy as zs
from zero_strategy.checkpoint import _sharded_weights
from zero_strategy.transformers import from_pretrained


class _CountedSlice:
    """A safetensors slice that adds the bytes each read returns to ``counts[key]``."""

    def __init__(self, sl, key: str, counts: dict):
        self.sl, self.key, self.counts = sl, key, counts

    def get_shape(self):
        return self.sl.get_shape()

    def get_dtype(self):
        return self.sl.get_dtype()

    def __getitem__(self, index):
        values = self.sl[index]
        self.counts[self.key] = self.counts.get(self.key, 0) + values.numel() * values.element_size()
        return values


def _count_reads(counts: dict):
    """Every read of the loader's safetensors reader (the one class it reads files through) counted."""
    original = _sharded_weights._SafetensorsReader._slice

    def _slice(self, candidates):
        sl = original(self, candidates)
        key = next((c for c in candidates if c in self.weight_map), None)
        return None if sl is None else _CountedSlice(sl, key, counts)
    _sharded_weights._SafetensorsReader._slice = _slice
    return lambda: setattr(_sharded_weights._SafetensorsReader, "_slice", original)


def _batch(rank: int, step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole batch, this rank's half): 4 sequences of 12 tokens."""
    whole = torch.randint(0, vocab, (4, 12), generator=torch.Generator().manual_seed(11 + step))
    return whole, whole[2 * rank:2 * rank + 2]


def _own_bytes(model, element_size: int) -> int:
    """The bytes of the checkpoint this rank's shards hold (each element once)."""
    engine = zs.api._engine_of(model)
    return sum((hi - lo) * element_size for g in engine.groups for _, lo, hi, _ in g.slot_ranges_in_shard())


def run(case: dict) -> dict:
    rank = dist.get_rank()
    dtype = getattr(torch, case.get("dtype", "float32"))
    ref = AutoModelForCausalLM.from_pretrained(case["dir"], dtype=dtype).eval()
    counts: dict[str, int] = {}
    restore = _count_reads(counts)
    try:
        model = from_pretrained(AutoModelForCausalLM, case["dir"], dtype=dtype)
        precision = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        model, opt = zs.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                              zs.ZeroConfig(stage=case["stage"], precision=precision, param_persistence_threshold=0))
    finally:
        restore()
    kept = {n: str(p.dtype) for n, p in ref.named_parameters() if p.dtype != dtype}
    seen_dtypes: dict[str, str] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: seen_dtypes.update({n: str(m.weight.dtype)}))
             for n, m in model.named_modules() if any(n + ".weight" == k for k in kept)]
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8]])
    with torch.no_grad():
        logit_diff = (model(ids).logits.float() - ref(ids).logits.float()).abs().max().item()
    for h in hooks:
        h.remove()
    element_size = next(iter(ref.parameters())).element_size()
    report = dict(case=case["case"], logit_diff=logit_diff, kept=kept, kept_in_forward=seen_dtypes,
                  bytes_read=sum(counts.values()), own_bytes=_own_bytes(model, element_size),
                  keys_read=sorted(counts), units=len(zs.api._engine_of(model).units))
    if case.get("train", True):
        model.train()
        ref.train()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        vocab = ref.config.vocab_size
        losses = []
        for step in range(2):
            whole, mine = _batch(rank, step, vocab)
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = ref(input_ids=whole, labels=whole).loss
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            both = torch.tensor([loss.item()])
            dist.all_reduce(both)
            losses.append((both.item() / 2, ref_loss.item()))
        full = zs.full_state_dict(model)
        report["losses"] = losses
        report["weight_diff"] = max((full[k].float() - v.float()).abs().max().item()
                                    for k, v in ref.state_dict().items())
        whole_state_dicts = []
        original = model.state_dict
        model.state_dict = lambda *a, **kw: (whole_state_dicts.append(kw.get("keep_vars", False))
                                             or original(*a, **kw))
        model.save_pretrained(case["saved"], max_shard_size="40KB")
        model.state_dict = original
        report["gathered_whole"] = not all(whole_state_dicts)  # a state_dict() of values: every unit at once
        if rank == 0:
            ref.save_pretrained(case["saved_ref"], max_shard_size="40KB")
            back = AutoModelForCausalLM.from_pretrained(case["saved"], dtype=dtype)
            report["read_back_diff"] = max((back.state_dict()[k].float() - v.float()).abs().max().item()
                                           for k, v in ref.state_dict().items())
        dist.barrier()
    return report


def main() -> None:
    args, out = start()
    finish(out, {"results": run_cases(args["cases"], run)})


if __name__ == "__main__":
    main()
