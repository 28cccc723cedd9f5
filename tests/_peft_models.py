"""The tiny Llama and the LoRA the PEFT tests train, shared by workers and the tests that reload."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64


def tiny_llama(vocab: int = VOCAB) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    return LlamaForCausalLM(cfg)


def lora(model: LlamaForCausalLM):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights=False))


def batch(step: int, rank: int, vocab: int = VOCAB, rows: int = 2) -> torch.Tensor:
    """Rank ``rank``'s micro-batch of step ``step`` (every rank can make every rank's)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, vocab, (rows, 12), generator=g)


def reference(steps: int, world: int, lr: float = 1e-2):
    """A plain PEFT model trained on each step's whole global batch (what DDP averages over)."""
    ref = lora(tiny_llama())
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr)
    for step in range(steps):
        every = torch.cat([batch(step, r) for r in range(world)])
        ref(input_ids=every, labels=every).loss.backward()
        opt.step()
        opt.zero_grad()
    return ref


PROBE = torch.arange(10).view(1, 10) % VOCAB


def after_training(model, ref, out, name: str, rank: int, save, merge: bool = True) -> dict:
    """The PEFT calls users make after training, on the set-up ``model`` and on ``ref``.

    ``save(peft_model, directory)``: how the front end's users save (every rank calls
    it; one writes). Reports the directories for the test to reload, the largest
    differences from ``ref``, and generate() tokens with a different length per rank.
    """
    from peft import get_peft_model_state_dict

    got, want = get_peft_model_state_dict(model), get_peft_model_state_dict(ref)
    untrained = get_peft_model_state_dict(lora(tiny_llama()))
    res = dict(adapter_state_diff=max((got[k] - want[k]).abs().max().item() for k in want),
               adapter_state_keys=sorted(got) == sorted(want),
               trained_distance=max((untrained[k] - want[k]).abs().max().item() for k in want))
    adapter_dir, ref_dir = out / f"adapter-{name}", out / f"ref-adapter-{name}"
    save(model, adapter_dir)
    if rank == 0:
        ref.save_pretrained(ref_dir)
    prompt = torch.tensor([[1, 5, 9, 3 + rank]])
    new_tokens = 3 + 5 * rank  # ranks stop at different steps: stage 3 must keep them in step
    with torch.no_grad():
        res["generated"] = model.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=False).tolist()
        res["generated_ref"] = ref.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=False).tolist()
        # early EOS on rank 0: its own second new token ends its sequence; rank 1 runs on to 8 tokens
        free = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
        eos = dict(eos_token_id=int(free[0, prompt.shape[1] + 1])) if rank == 0 else {}
        res["generated_eos"] = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, **eos).tolist()
        res["generated_eos_ref"] = ref.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, **eos).tolist()
    res.update(adapter_dir=str(adapter_dir), ref_adapter_dir=str(ref_dir))
    if not merge:
        return res
    merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
    merged_dir, ref_merged_dir = out / f"merged-{name}", out / f"ref-merged-{name}"
    save(merged, merged_dir)
    if rank == 0:
        ref_merged.save_pretrained(ref_merged_dir)
    res.update(merged_dir=str(merged_dir), ref_merged_dir=str(ref_merged_dir))
    return res


def saved_tensors(directory) -> dict:
    """Every tensor in the safetensors files of a ``save_pretrained`` directory."""
    from pathlib import Path

    from safetensors.torch import load_file

    found = sorted(Path(directory).glob("*.safetensors"))
    assert found, f"no safetensors file in {directory}"
    out = {}
    for f in found:
        out.update(load_file(f))
    return out


def assert_same_files(got_dir, want_dir, tol: float = 1e-5) -> None:
    """The two directories hold the same tensors: names, shapes (none empty) and values."""
    got, want = saved_tensors(got_dir), saved_tensors(want_dir)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k].shape == want[k].shape and got[k].numel() > 0, (k, got[k].shape, want[k].shape)
        assert torch.allclose(got[k].float(), want[k].float(), atol=tol, rtol=0), k


class Rows(torch.utils.data.Dataset):
    """The rows of ``steps`` steps of :func:`batch` on 2 ranks, as a Trainer's dataset: each row its
    own input and label, in the order a 2-rank run's sampler hands them out unshuffled."""

    def __init__(self, steps: int):
        self.ids = torch.cat([batch(step, r) for step in range(steps) for r in range(2)])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
