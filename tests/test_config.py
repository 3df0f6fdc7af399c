"""Config: Megatron names, validation before compilation, CLI overrides."""

import subprocess
import sys

import pytest

from jmegatron.command_line import parse_args
from jmegatron.config import ConfigError, JMegatronConfig, base_config, from_configdict, load_config_file
from jmegatron.models.transformer_config import ModelConfig

from conftest import REPO


def _cfg(**kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 1000
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def test_defaults_are_derived_like_megatron():
    cfg = _cfg(hidden_size=128, num_attention_heads=4)
    assert cfg.ffn_hidden_size == 512
    assert cfg.num_query_groups == 4
    assert cfg.kv_channels == 32
    assert cfg.max_position_embeddings == cfg.seq_length
    assert cfg.lr_decay_iters == cfg.train_iters
    # megatron/training/tokenizer/tokenizer.py: _vocab_size_with_padding
    assert cfg.padded_vocab_size(50257) == 50304
    assert cfg.replace(tensor_model_parallel_size=2).padded_vocab_size(50257) == 50432


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"train_iterz.*train_iters"):
        parse_args(["--config", "configs/gpt_tiny.py", "--config.train_iterz=5"])
    c = base_config()
    with pytest.raises(AttributeError, match="Did you mean \"num_layers\""):
        c.num_layer = 3


@pytest.mark.parametrize("arg, match", [
    ("--config.train_iters=abc", "train_iters='abc' is not a valid int"),
    ("--config.bf16=maybe", "bf16='maybe' is not a boolean"),
    ("--config.lr_decay_style=cosin", 'Did you mean "cosine"'),
    ("--config.num_query_groups=3", "not divisible by config.num_query_groups=3"),
    ("--config.hidden_dropout=1.5", r"hidden_dropout=1.5 must be in \[0, 1\)"),
])
def test_bad_values_fail_with_field_named(arg, match):
    with pytest.raises(ConfigError, match=match):
        path, overrides = parse_args(["--config", str(REPO / "configs" / "gpt_tiny.py"),
                                      "--config.mock_data=True", "--config.vocab_size=100", arg])
        load_config_file(path, overrides)


def test_overrides_are_typed():
    path, ov = parse_args(["--config=configs/gpt_tiny.py", "--config.train_iters", "7",
                           "--config.lr=1e-3", "--config.save=/tmp/x", "--config.bf16=True",
                           "--config.global_batch_size=None"])
    assert path == "configs/gpt_tiny.py"
    assert ov == {"train_iters": 7, "lr": 1e-3, "save": "/tmp/x", "bf16": True, "global_batch_size": None}


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "mixtral_tiny", "gpt3_345m", "llama2_7b"])
def test_shipped_configs_validate(name):
    cfg = load_config_file(str(REPO / "configs" / f"{name}.py"),
                           {"mock_data": True, "vocab_size": 32000} if "tiny" in name else {})
    assert cfg.num_layers > 0


def test_missing_data_path_is_explained():
    with pytest.raises(ConfigError, match="config.data_path is not set"):
        load_config_file(str(REPO / "configs" / "gpt_tiny.py"))


def test_cli_exits_2_with_message_before_compiling():
    r = subprocess.run([sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py",
                        "--config.num_layer=2"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "num_layers" in r.stderr and "num_layer " in r.stderr
    r = subprocess.run([sys.executable, "-m", "jmegatron.train", "--config", "configs/nope.py"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cli_reports_errors_found_at_start_up(tmp_path):
    # sizes that do not fit the devices and a missing data prefix: message, exit 2, no traceback
    base = [sys.executable, "-m", "jmegatron.train", "--config", "configs/gpt_tiny.py"]
    r = subprocess.run(base + ["--config.mock_data=True", "--config.vocab_size=100",
                               "--config.tensor_model_parallel_size=3"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "not divisible by tensor(3)" in r.stderr and "Traceback" not in r.stderr
    import os

    from jmegatron.data.tokenizer import train_bpe_tokenizer

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = subprocess.run(base + [f"--config.data_path={tmp_path}/missing", f"--config.tokenizer_model={tmp_path}/no.json",
                               f"--config.save={tmp_path}/s"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "no.json" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    (tmp_path / "t.txt").write_text("to be or not to be, that is the question " * 50)
    train_bpe_tokenizer([str(tmp_path / "t.txt")], 300, str(tmp_path / "tok.json"))
    r = subprocess.run(base + [f"--config.data_path={tmp_path}/missing", f"--config.tokenizer_model={tmp_path}/tok.json",
                               f"--config.save={tmp_path}/s"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "missing" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_distillation_configs_extend_gpt_tiny():
    data = {"data_path": "p", "tokenizer_model": "t.json"}
    teacher = load_config_file(str(REPO / "configs" / "gpt_teacher.py"), data)
    student = load_config_file(str(REPO / "configs" / "distill_gpt_tiny.py"), dict(data, kd_teacher_load="T"))
    assert (teacher.num_layers, teacher.hidden_size) == (6, 384)
    assert student.num_layers == 4 and student.kd_cfg.endswith("configs/distill.yaml")
    assert teacher.seq_length == student.seq_length
    with pytest.raises(ConfigError, match="kd_teacher_load is not"):
        load_config_file(str(REPO / "configs" / "distill_gpt_tiny.py"), data)


@pytest.mark.parametrize("kw, match", [
    (dict(kd_finalize=True, save="/tmp/a"), "kd_finalize=True writes a plain student to a new directory"),
])
def test_unsupported_or_inconsistent_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)



@pytest.mark.parametrize("family", ["gpt2", "llama", "llama3", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_family_preset_sets_only_config_fields_and_validates(family):
    import dataclasses

    from jmegatron.config import JMegatronConfig
    from jmegatron.presets import FAMILIES

    c = base_config(family)
    c.mock_data, c.vocab_size = True, 1000
    cfg = from_configdict(c)  # a preset with the default sizes is a valid config
    for name, value in FAMILIES[family].items():
        assert getattr(cfg, name) == value, name
    if family == "gpt2":  # Megatron's defaults are GPT's: the preset only restates them
        defaults = {f.name: f.default for f in dataclasses.fields(JMegatronConfig)}
        assert {k: defaults[k] for k in FAMILIES["gpt2"]} == FAMILIES["gpt2"]
    else:
        assert cfg.normalization == "RMSNorm" and cfg.swiglu and not cfg.add_bias_linear
        assert cfg.untie_embeddings_and_output_weights and cfg.position_embedding_type == "rope"
        assert (cfg.num_moe_experts is not None) == (family in ("mixtral", "qwen3_moe"))


def test_set_family_changes_only_the_family_fields():
    from jmegatron.config import get_config_of, set_family
    from jmegatron.presets import FAMILIES

    before = get_config_of(f"{REPO}/configs/gpt_tiny.py").to_dict()
    after = set_family(get_config_of(f"{REPO}/configs/gpt_tiny.py"), "llama").to_dict()
    changed = {k for k in before if before[k] != after[k]}
    assert changed and changed <= set(FAMILIES["llama"])
    assert "swiglu" in changed and after["num_layers"] == before["num_layers"] and after["lr"] == before["lr"]
    with pytest.raises(ConfigError, match=r"model family 'lama'.*Did you mean \['llama'"):
        base_config("lama")


def test_each_field_is_declared_once():
    """Every field lives in one group: no two classes among the run's config, the model's
    config and the groups they compose declare the same name."""
    owners: dict = {}
    for klass in {*JMegatronConfig.__mro__, *ModelConfig.__mro__}:
        for name in klass.__dict__.get("__annotations__", {}):
            owners.setdefault(name, []).append(klass.__name__)
    assert {name: sorted(o) for name, o in owners.items() if len(o) > 1} == {}
    assert "moe" not in owners and {"dtype", "backend", "rope"} <= set(ModelConfig.__annotations__)
