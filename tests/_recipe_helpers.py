"""Shared by the framework-recipe smoke tests: tiny HF models in a directory, a subprocess runner (tests/_procs.py)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import _procs
from _procs import ROOT, free_port  # noqa: F401 - the recipe tests import it from here
from _zygote import rank_entry, warm_command


def _char_tokenizer(path: Path):
    from transformers import BertTokenizerFast

    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + ["##" + c for c in chars]
    path.mkdir(parents=True)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # ``vocab=``: transformers 5 takes the vocabulary (a path or a dict) under that name; a
    # ``vocab_file=`` goes into its **kwargs unread, and every token became [UNK]
    tok = BertTokenizerFast(vocab=str(path / "vocab.txt"), do_lower_case=True)
    assert tok.tokenize("hello") == ["h", "##e", "##l", "##l", "##o"], "the character vocabulary was not loaded"
    tok.save_pretrained(path)
    return tok, len(vocab)


def tiny_bert(path: Path) -> Path:
    """A 2-layer, 32-wide BERT classifier (BertModel weights only, as the MiniLM package ships them)."""
    import torch
    from transformers import BertConfig, BertModel

    _, vocab = _char_tokenizer(path)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(path)
    return path


def tiny_llama(path: Path) -> Path:
    """A 2-layer Llama with tied embeddings and a character-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok, vocab = _char_tokenizer(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run(cmd: list[str], timeout: float, cold: bool = False) -> tuple[int, str]:
    """``cmd`` offline, killed with all it started if it outlives ``timeout``; (exit code, combined log).

    Warm unless ``cold`` (tests/_zygote.py, [Note: warm processes behind a launcher]): the command
    and, where a launcher runs a recipe (``torch.distributed.run``, ``accelerate launch``), each of
    its ranks start from the warm zygote instead of importing torch, transformers and Lightning
    afresh. The launcher, its arguments and what it does per rank are those a user types. The README's
    own recipe (tests/test_recipe_smoke.py) runs ``cold``: one launch exactly as on a fresh machine."""
    env = _procs.child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if not cold:
        if cmd[1] == "-m":  # a launcher: the recipe script it runs per rank goes through the shim
            cmd = [a2 for a in cmd for a2 in (rank_entry(a) if _is_recipe(a) else [a])]
        cmd, env = warm_command(cmd, env)
    proc = _procs.run(cmd, timeout, env=env, merge_stderr=True)
    return proc.returncode, proc.stdout


def _is_recipe(arg: str) -> bool:
    path = Path(arg)
    return path.suffix == ".py" and path.parent == ROOT / "recipes"


def require_recipe_deps(framework: str) -> None:
    """Skip the calling test module without transformers, ``framework``, matplotlib or the dataset package."""
    pytest.importorskip("transformers")
    pytest.importorskip(framework)
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "recipes"))
    import data

    if not data.dataset_available():
        pytest.skip(f"recipe dataset not installed: {data.DATASET_INSTALL}", allow_module_level=True)


def recipe_args(task: str, model: Path, out: Path) -> list[str]:
    """The framework recipes' shared arguments: 3 steps of batch 8 with 2-step accumulation, logging every step."""
    return ["--task", task, "--model", str(model), "--max-steps", "3", "--batch-size", "8", "--accum", "2",
            "--lr", "1e-3", "--log-every", "1", "--output-dir", str(out)]


def check_recipe_run(rc: int, log: str, task: str, out_dir: Path, start_model: Path) -> None:
    """A 3-step run of :func:`recipe_args`: its final and step lines, the generate lengths, the saved files."""
    assert re.search(r"^final: held-out .* 3 steps", log, re.M), f"no final line (exit code {rc}):\n{log[-4000:]}"
    assert re.search(r"^step 3/3 loss [0-9.]+ [0-9.]+ samples/s MiB: r0 state dev [0-9.]+ host [0-9.]+, "
                     r"process rss [0-9]+ peak [0-9]+, sent", log, re.M)
    if task == "causal-lm":  # generate with a different length per rank (3 and 5 new tokens) returned on both
        from transformers import AutoTokenizer

        sys.path.insert(0, str(ROOT / "recipes"))
        import data

        prompt = data.encode_texts(AutoTokenizer.from_pretrained(start_model), ["wonderful is"])["input_ids"].shape[1]
        assert f"rank 0: generate(synced_gpus=True) returned {prompt + 3} tokens" in log, log[-3000:]
        assert f"rank 1: generate(synced_gpus=True) returned {prompt + 5} tokens" in log, log[-3000:]
    check_outputs(out_dir, task, start_model, 3, log)


def check_outputs(out_dir: Path, task: str, start_model: Path, steps: int, log: str) -> None:
    """The saved HF directory reloads and gives the probe logits the trained sharded model gave; PNG written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    sys.path.insert(0, str(ROOT / "recipes"))
    import data

    probe = json.loads((out_dir / "probe.json").read_text())
    assert probe["world_size"] == 2 and probe["steps"] == steps, probe
    cls = AutoModelForSequenceClassification if task == "classification" else AutoModelForCausalLM
    model = cls.from_pretrained(out_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    with torch.no_grad():
        logits = data.probe_view(model(**data.encode_texts(tok, probe["texts"])).logits)
    torch.testing.assert_close(logits, torch.tensor(probe["logits"]), rtol=1e-5, atol=1e-5)
    png = out_dir / "loss_memory.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", log[-3000:]
    rows = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == steps
    assert {"loss", "samples_per_s", "rank0/device_mib", "rank1/host_mib", "rank1/sent_mib"} <= set(rows[-1])
    assert rows[-1]["rank1/sent_mib"] > 0
    for r in (0, 1):  # the process beside the engine's accounting: on a CPU run it holds all of it and more
        last = rows[-1]
        assert last[f"rank{r}/rss_mib"] > last[f"rank{r}/device_mib"] + last[f"rank{r}/host_mib"], last
        assert last[f"rank{r}/peak_mib"] >= last[f"rank{r}/rss_mib"], last
    if task == "causal-lm":  # trained: differs from the start (the classifier head is new anyway)
        start = cls.from_pretrained(start_model, local_files_only=True).eval()
        with torch.no_grad():
            assert not torch.allclose(data.probe_view(start(**data.encode_texts(tok, probe["texts"])).logits), logits)
