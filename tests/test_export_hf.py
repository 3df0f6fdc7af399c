"""``python -m jmegatron.export hf`` / ``import-hf``: checkpoints of any parallel layout export to
folders transformers loads with jmegatron's logits (<= 1e-4), and JAX -> HF -> JAX gives
identical arrays."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import torch  # noqa: E402
import transformers  # noqa: E402

from jmegatron.export.common import load_checkpoint  # noqa: E402
from jmegatron.export.convert import export_hf  # noqa: E402
from jmegatron.export.imports import import_hf  # noqa: E402
from jmegatron.presets import FAMILIES  # noqa: E402
from jmegatron.training.loop import pretrain  # noqa: E402
from jmegatron.training.run import restore_run  # noqa: E402

from conftest import REPO  # noqa: E402
from test_checkpoint_resume import cfg_for  # noqa: E402

TOL = 1e-4


def llama_changes(**kw):
    return dict(FAMILIES["llama"], num_attention_heads=4, num_query_groups=2, **kw)


@pytest.fixture(scope="module")
def gpt_tp2_ckpt(tmp_path_factory):
    # tensor parallel 2 with sequence parallelism and the distributed optimizer on 8 devices;
    # vocab 512 is already a multiple of 128 * tp: no padding rows, so round trips are exact
    d = tmp_path_factory.mktemp("gpt_tp2")
    pretrain(cfg_for(d, vocab_size=512, train_iters=4, lr_warmup_iters=1, eval_interval=0, hidden_dropout=0.0, attention_dropout=0.0,
                     tensor_model_parallel_size=2, sequence_parallel=True, use_distributed_optimizer=True))
    return str(d)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    # GQA, scanned layers, a vocabulary with Megatron padding (300 -> 384)
    d = tmp_path_factory.mktemp("llama")
    pretrain(cfg_for(d, train_iters=4, lr_warmup_iters=1, eval_interval=0, scan_layers=True, **llama_changes()))
    return str(d)


def jmegatron_logits(load, tokens):
    run, state, _ = restore_run(load)
    return np.asarray(run.model.apply({"params": state.params}, tokens))


def hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy(), model


@pytest.mark.parametrize("which", ["gpt_tp2_ckpt", "llama_ckpt"])
def test_exported_model_has_jmegatron_logits(which, request, tmp_path):
    load = request.getfixturevalue(which)
    out = tmp_path / "hf"
    summary = export_hf(load, str(out))
    tokens = np.random.default_rng(0).integers(0, summary["vocab_size"], (2, 32)).astype(np.int32)
    ref = jmegatron_logits(load, tokens)[..., :summary["vocab_size"]]
    got, model = hf_logits(str(out), tokens)
    assert type(model).__name__ == summary["architecture"]
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= TOL
    assert json.loads((out / "jmegatron_export.json").read_text())["iteration"] == 4


def test_round_trip_gives_identical_arrays(gpt_tp2_ckpt, tmp_path):
    export_hf(gpt_tp2_ckpt, str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    a, b = load_checkpoint(gpt_tp2_ckpt), load_checkpoint(str(tmp_path / "back"))
    leaves_a = jax.tree_util.tree_leaves_with_path(a.params)
    leaves_b = dict(jax.tree_util.tree_leaves_with_path(b.params))
    assert len(leaves_a) == len(leaves_b)
    for path, x in leaves_a:
        assert np.array_equal(x, leaves_b[path]), jax.tree_util.keystr(path)
    # the imported checkpoint trains like any other: 2 more iterations from it
    cfg = restore_run(str(tmp_path / "back"))[0].cfg
    out = pretrain(cfg.replace(load=str(tmp_path / "back"), save=str(tmp_path / "more"), train_iters=2, lr_warmup_iters=1,
                               micro_batch_size=1, global_batch_size=8, eval_interval=0))
    assert out["iteration"] == 2 and all(np.isfinite(v) for v in out["losses"].values())


def test_hugging_face_folder_as_the_teacher(llama_ckpt, tmp_path):
    # config.kd_teacher_load = an HF folder: the teacher is the checkpoint it was exported from,
    # read with no import step, in the student's layout
    from jmegatron.distill.teacher import load_teacher
    from jmegatron.parallel.mesh import create_mesh

    export_hf(llama_ckpt, str(tmp_path / "hf"))
    student = cfg_for(tmp_path / "s", scan_layers=True, **llama_changes())
    mesh = create_mesh(student, jax.devices())
    from_hf, from_ckpt = (load_teacher(d, student, 384, mesh) for d in (str(tmp_path / "hf"), llama_ckpt))
    assert from_hf.cfg.num_query_groups == 2 and from_hf.iteration == 0
    flat_hf = dict(jax.tree_util.tree_leaves_with_path(from_hf.params))
    for path, x in jax.tree_util.tree_leaves_with_path(from_ckpt.params):
        name = jax.tree_util.keystr(path)
        assert flat_hf[path].sharding == x.sharding, name
        got, want = np.asarray(flat_hf[path]), np.asarray(x)
        if "output_layer" in name:  # the HF folder holds the 300 true columns, the padding comes back zero
            got, want = got[:, :300], want[:, :300]
        elif "word_embeddings" in name:
            got, want = got[:300], want[:300]
        np.testing.assert_array_equal(got, want, err_msg=name)
    # a tensor-parallel student: the HF teacher is padded by the student's rule (300 -> 512)
    tp2 = cfg_for(tmp_path / "t", tensor_model_parallel_size=2, **llama_changes())
    t = load_teacher(str(tmp_path / "hf"), tp2, 512, create_mesh(tp2, jax.devices()))
    emb = np.asarray(t.params["word_embeddings"]["embedding"])
    assert emb.shape[0] == 512 and not emb[300:].any()
    np.testing.assert_array_equal(emb[:300], np.asarray(from_ckpt.params["word_embeddings"]["embedding"])[:300])


def test_padded_vocabulary_round_trip(llama_ckpt, tmp_path):
    # 300 true rows are exported; importing pads back to 384 with zero rows
    export_hf(llama_ckpt, str(tmp_path / "hf"), dtype="bfloat16")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["vocab_size"] == 300 and conf["num_key_value_heads"] == 2 and conf["dtype"] == "bfloat16"
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    a, b = load_checkpoint(llama_ckpt), load_checkpoint(str(tmp_path / "back"))
    assert b.padded_vocab_size == a.padded_vocab_size == 384
    emb_a, emb_b = a.params["word_embeddings"]["embedding"], b.params["word_embeddings"]["embedding"]
    bf16 = lambda x: torch.from_numpy(np.array(x)).to(torch.bfloat16).float().numpy()  # noqa: E731
    assert np.array_equal(emb_b[:300], bf16(emb_a[:300])) and not emb_b[300:].any()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jmegatron.export", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_cli_errors_before_any_work(tmp_path, gpt_tp2_ckpt, capsys):
    """Bad input exits 2 with the reason and writes nothing: one case as a process (the
    exit status), the others through the same ``main`` in this process."""
    from jmegatron.export.__main__ import main

    def cli(*args):
        capsys.readouterr()
        code = main(list(args))
        return code, capsys.readouterr().err

    r = run_cli("hf", "--load", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no checkpoint found" in r.stderr and not (tmp_path / "o").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    code, err = cli("hf", "--load", gpt_tp2_ckpt, "--out", str(tmp_path / "full"))
    assert code == 2 and "not empty" in err and os.listdir(tmp_path / "full") == ["keep.txt"]
    # a GPT with RMSNorm has no Hugging Face target: the field is named, nothing written
    bad = tmp_path / "rms"
    pretrain(cfg_for(bad, train_iters=1, lr_warmup_iters=0, eval_interval=0, normalization="RMSNorm"))
    code, err = cli("hf", "--load", str(bad), "--out", str(tmp_path / "o2"))
    assert code == 2 and "config.normalization='RMSNorm'" in err and not (tmp_path / "o2").exists()
    code, err = cli("import-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "o3"))
    assert code == 2 and "no config.json" in err


def test_import_refuses_what_jmegatron_cannot_represent(tmp_path):
    from jmegatron.conversion.hf import config_fields_from_hf

    with pytest.raises(ValueError, match="activation_function='relu'"):
        config_fields_from_hf({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 1,
                               "n_positions": 32, "vocab_size": 100, "activation_function": "relu"})
    with pytest.raises(ValueError, match="attention_bias=True with mlp_bias=False"):
        config_fields_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                               "num_hidden_layers": 1, "intermediate_size": 128, "max_position_embeddings": 32,
                               "vocab_size": 100, "attention_bias": True})
    with pytest.raises(ValueError, match="model_type='bloom' has no jmegatron import"):
        config_fields_from_hf({"model_type": "bloom"})


def test_export_help_lists_the_readme_architectures(capsys):
    """`python -m jmegatron.export --help` names the Hugging Face classes `export hf` writes, the
    same list, in the same order, as the README's export section."""
    import re

    from jmegatron.export.__main__ import main

    readme = open(os.path.join(REPO, "README.md")).read()
    listed = readme[readme.index("# Hugging Face folder ("):readme.index("+ tokenizer)")]
    names = re.compile(r"\b\w+(?:ForCausalLM|LMHeadModel)\b")
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    hf_line = help_text[help_text.index("write a Hugging Face folder"):help_text.index("import-hf")]
    assert names.findall(hf_line) == names.findall(listed) and len(names.findall(listed)) == 19
