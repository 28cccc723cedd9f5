"""`zero-strategy estimate` prints the memory table (or JSON) and fails cleanly."""

import json
import sys

import pytest

from zero_strategy.cli import main, parse_count

import _procs
from _zygote import warm_command


def run_cli(*args):
    cmd, env = warm_command([sys.executable, "-m", "zero_strategy.cli", *args], _procs.child_env())
    return _procs.run(cmd, 120, env=env)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_subprocess_prints_the_table_for_every_stage():
    proc = run_cli("estimate", "--params", "7.5e9", "--world-size", "64")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "GiB" in lines[0]
    labels = [line.split("  ")[0].strip() for line in lines[2:]]
    assert labels[:5] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-2 opt:cpu", "ZeRO-3"]
    zero3 = next(line for line in lines if line.startswith("ZeRO-3 "))
    assert float(zero3.split()[4]) == round(16 * 7.5e9 / 64 / 2**30, 2)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_subprocess_json_single_stage():
    proc = run_cli("estimate", "--params", "7B", "-n", "8", "--stage", "3", "--offload-optimizer", "cpu",
                   "--offload-params", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    psi, n = 7e9, 8
    assert (row["stage"], row["offload_optimizer"], row["offload_params"]) == (3, "cpu", "cpu")
    assert row["total_device"] == 2 * psi / n  # bf16 gradient shard only
    assert row["total_host"] == (2 + 12 + 2) * psi / n  # params + master/Adam + the bf16 grad shard's host copy


@pytest.mark.multiprocess
def test_subprocess_error_exit_code_and_message():
    proc = run_cli("estimate", "--params", "1e9", "--optimizer", "adamm")
    assert proc.returncode == 2
    assert "optimizer: unknown optimizer 'adamm'" in proc.stderr and "did you mean" in proc.stderr


def test_main_returns_zero_and_prints(capsys):
    assert main(["estimate", "--params", "1e6", "--stage", "2", "--precision", "fp32", "--optimizer", "sgd",
                 "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["device_params"] == 4e6 and row["device_grads"] == 4e6 and row["device_optimizer"] == 0


def test_frozen_and_config_options(capsys, tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("preset: zero3_offload\nprecision: bf16\n")
    assert main(["estimate", "--params", "1e6", "--frozen", "1e6", "-n", "2", "--config", str(path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["stage"], row["offload_params"], row["frozen_params"]) == (3, "cpu", 1_000_000)
    assert row["host_params"] == 2 * 2e6 / 2


def test_config_preset_with_stage_override(capsys):
    assert main(["estimate", "--params", "1e6", "--config", "zero2_offload", "--stage", "0", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["stage"], row["offload_optimizer"]) == (0, "none")


def test_config_conflicts_with_explicit_options(capsys):
    assert main(["estimate", "--params", "1e6", "--config", "zero3", "--precision", "fp16"]) == 2
    assert "--precision: given together with --config" in capsys.readouterr().err


def test_unknown_config_spec(capsys):
    assert main(["estimate", "--params", "1e6", "--config", "zero9"]) == 2
    assert "neither a preset name nor an existing config file" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("7e9", 7e9), ("7B", 7e9), ("350m", 350e6), ("1,300", 1300), ("2.5k", 2500)])
def test_parse_count(text, value):
    assert parse_count(text) == value


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--params", "lots"])
    assert info.value.code == 2
    assert "'lots' is not a parameter count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["estimate"])  # --params or --model is required
    with pytest.raises(SystemExit):
        main([])  # a subcommand is required


def test_model_needs_transformers(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    assert main(["estimate", "--model", str(tmp_path)]) == 2
    assert "--model: needs the transformers package" in capsys.readouterr().err


def test_model_path_must_exist(capsys, tmp_path):
    pytest.importorskip("transformers")
    assert main(["estimate", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_model_from_hugging_face_config(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    vocab, hidden, inter, layers = 100, 16, 32, 2
    transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                             tie_word_embeddings=True).save_pretrained(tmp_path)
    # Hand count: per layer q,k,v,o (no bias) + gate,up,down + two RMSNorms; embeddings tied to lm_head.
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    expected = vocab * hidden + layers * per_layer + hidden
    assert main(["estimate", "--model", str(tmp_path), "--stage", "3", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["num_params"] == expected == 6800
    assert main(["estimate", "--model", str(tmp_path / "config.json"), "--stage", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["num_params"] == expected


def _tiny_llama_dir(tmp_path, vocab=100, hidden=16, inter=32, layers=2):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                             tie_word_embeddings=True).save_pretrained(tmp_path)
    return tmp_path


def test_per_node_totals_from_nodes_and_gpus_per_node(capsys):
    """As DeepSpeed's estimator: --num-nodes x --gpus-per-node ranks; host and NVMe per node are a
    rank's share times the ranks on the node. The preset is fp32 (ZeroConfig's default precision):
    ZeRO-3 offload with Adam holds 4Ψ/N parameters (which are the master too), 8Ψ/N moments and
    a 4Ψ/N fp32 gradient on the host per rank."""
    psi, nodes, gpn = 7e9, 2, 4
    assert main(["estimate", "--params", "7B", "--num-nodes", str(nodes), "--gpus-per-node", str(gpn),
                 "--config", "zero3_offload", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["world_size"] == nodes * gpn
    assert row["host_per_node"] == pytest.approx(16 * psi / (nodes * gpn) * gpn)
    assert row["nvme_per_node"] == 0


def test_nvme_per_node(capsys):
    """fp32 NVMe offload: master 4 + Adam 8 + parameter shard 4 bytes per parameter, over N, on disk."""
    psi, n = 7e9, 8
    assert main(["estimate", "--params", "7B", "--num-nodes", "1", "--gpus-per-node", "8", "--config",
                 "zero3_offload_nvme", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["nvme_per_node"] == pytest.approx((4 + 8 + 4) * psi / n * 8)


@pytest.mark.parametrize("argv, message", [
    (["--num-nodes", "2"], "--num-nodes: needs --gpus-per-node"),
    (["--num-nodes", "2", "--gpus-per-node", "8", "-n", "8"], "--world-size: 8 disagrees with --num-nodes x"),
    (["--batch-size", "2", "--seq-len", "8"], "--batch-size: activations need the model's shape"),
    (["--batch-size", "2"], None),  # needs --model first, then --seq-len: either error is a usage error
])
def test_node_and_activation_options_are_checked(capsys, argv, message):
    assert main(["estimate", "--params", "1e9", *argv]) == 2
    if message:
        assert message in capsys.readouterr().err


def test_largest_gathered_unit_from_a_model_directory(capsys, tmp_path):
    """Stage 3 keeps the root (embeddings tied to the head, final norm), the unit in use and one
    prefetched unit gathered in bf16: 2(root + 2u) bytes, here the whole model (2 layers); its
    gradient buckets (root + up to 4 units in flight + the unit in backward) hold every gradient."""
    vocab, hidden, inter = 100, 16, 32
    path = _tiny_llama_dir(tmp_path, vocab, hidden, inter)
    unit = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden   # one decoder layer
    root = vocab * hidden + hidden
    assert main(["estimate", "--model", str(path), "--stage", "3", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["largest_unit_params"] == unit
    assert row["working_set_gathered"] == 2 * (root + 2 * unit)
    assert row["working_set_grad_buckets"] == 2 * (root + 2 * unit)


def test_activations_in_the_table_and_json(capsys, tmp_path):
    from zero_strategy.estimate import estimate_activations

    transformers = pytest.importorskip("transformers")
    path = _tiny_llama_dir(tmp_path)
    assert main(["estimate", "--model", str(path), "--stage", "2", "--batch-size", "2", "--seq-len", "16",
                 "--attention", "eager", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    expected = estimate_activations(transformers.AutoConfig.from_pretrained(path), 2, 16, "bf16", "eager")
    assert row["activations"] == expected.to_dict()
    assert main(["estimate", "--model", str(path), "--batch-size", "2", "--seq-len", "16"]) == 0
    assert "without checkpointing" in capsys.readouterr().out


def test_activations_per_sequence_parallel_rank(capsys, tmp_path):
    """``--sp N`` (or a config's sequence_parallel_size) gives one rank's activations of a sequence
    split over N ranks; it must divide the world size."""
    from zero_strategy.estimate import estimate_activations

    transformers = pytest.importorskip("transformers")
    path = _tiny_llama_dir(tmp_path)
    hf = transformers.AutoConfig.from_pretrained(path)
    argv = ["estimate", "--model", str(path), "--stage", "3", "-n", "4", "--batch-size", "1", "--seq-len", "64",
            "--json"]
    assert main(argv + ["--sp", "2", "--tiled-loss", "--activation-offload"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    expected = estimate_activations(hf, 1, 64, "bf16", tiled_loss=True, sequence_parallel_size=2,
                                    activation_offload=True)
    assert row["activations"] == expected.to_dict() and row["activations"]["local_seq_len"] == 32
    config = tmp_path / "zero.json"
    config.write_text(json.dumps({"preset": "zero3", "precision": "bf16", "sequence_parallel_size": 4}))
    assert main(["estimate", "--model", str(path), "-n", "4", "--batch-size", "1", "--seq-len", "64",
                 "--config", str(config)]) == 0
    assert "sequence parallel over 4 ranks: 16 tokens of each sequence per rank" in capsys.readouterr().out
    assert main(argv + ["--sp", "3"]) == 2
    assert "--sp: 3 must divide the world size, 4" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_model_name_is_read_from_the_local_cache_only(tmp_path):
    """A hub name resolves offline from the Hugging Face cache; an uncached one fails, downloading nothing."""
    pytest.importorskip("transformers")
    snapshot = tmp_path / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    _tiny_llama_dir(snapshot)
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    env_cache = {"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = run_cli_env(env_cache, "estimate", "--model", "acme/tiny-llama", "--stage", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[0]["num_params"] == 6800
    proc = run_cli_env(env_cache, "estimate", "--model", "acme/not-downloaded")
    assert proc.returncode == 2
    assert "local Hugging Face cache (nothing is downloaded)" in proc.stderr


def run_cli_env(extra_env, *args):
    """As :func:`run_cli`, with ``extra_env`` set: the warm process re-reads huggingface_hub's settings
    from it (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``) as a fresh interpreter's import would (tests/_launch.py's
    ``_as_if_imported_here``)."""
    cmd, env = warm_command([sys.executable, "-m", "zero_strategy.cli", *args], _procs.child_env(**extra_env))
    return _procs.run(cmd, 120, env=env)


def test_shard_group_size_estimates_the_group_not_the_world(capsys):
    """Hybrid sharding (issue #15): 8 ranks in groups of 2 hold what flat ZeRO on 2 ranks holds;
    the ZeRO paper's stage-3 mixed-precision Adam figure is 16Ψ/k."""
    assert main(["estimate", "--params", "1e6", "-n", "8", "--shard-group-size", "2", "--stage", "3",
                 "--json"]) == 0
    (est,) = json.loads(capsys.readouterr().out)
    assert est["total_device"] == pytest.approx(16 * 1e6 / 2)
    assert main(["estimate", "--params", "1e6", "-n", "8", "--shard-group-size", "3", "--stage", "3"]) != 0
