"""The forward-step seam (Megatron's ``pretrain(model_provider, forward_step_func)``): the
loop and the step builder know no loss; a provider plugs the LM loss, distillation or a
research loss into the same step, pipelined or not; no lower layer imports the loop."""

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.distill.losses import ProjectionLayer
from jmegatron.models.gpt import GPTModel
from jmegatron.models.transformer_config import ModelConfig
from jmegatron.parallel.mesh import create_mesh
from jmegatron.checkpoint import checkpointing
from jmegatron.training.forward_step import ForwardStep, gpt_forward_step, lm_pipeline_stages
from jmegatron.training.losses import lm_loss_fn
from jmegatron.training.run import aux_from_meta, aux_spec, build

from test_train_step import random_batches, tiny_cfg

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_loop_imports_no_loss_schedule_or_distillation():
    names = _imports(ROOT / "jmegatron" / "training" / "loop.py")
    banned = ("jmegatron.distill", "jmegatron.parallel.schedules", "jmegatron.training.forward_step",
              "jmegatron.models")
    assert not [n for n in names if n.startswith(banned)], names
    # nor builds a dataset (jmegatron.data.builder does) nor names the LM loss (ForwardStep.loss_key)
    data = {n for n in names if n.startswith("jmegatron.data.")}
    assert data <= {"jmegatron.data.builder", "jmegatron.data.builder.build_datasets", "jmegatron.data.loader",
                    "jmegatron.data.loader.BatchLoader"}, data
    assert "lm_loss" not in (ROOT / "jmegatron" / "training" / "loop.py").read_text()
    # and importing it pulls no distillation module in
    code = ("import sys, jmegatron.training.loop; "
            "print([m for m in sys.modules if m.startswith('jmegatron.distill')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_no_lower_layer_imports_the_loop():
    lower = ["models", "parallel", "distill", "data", "fusions", "inference", "training"]
    offenders = []
    for sub in lower:
        for path in (ROOT / "jmegatron" / sub).rglob("*.py"):
            if path.name == "loop.py" and sub == "training":
                continue
            if any(n.startswith(("jmegatron.training.loop", "jmegatron.pretrain_gpt")) or n == "jmegatron.training.loop"
                   for n in _imports(path)):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def _half_lm_provider(cfg, model, mesh, padded):
    """A research loss: half the LM loss, with its own report entry."""
    lm = lm_loss_fn(model)

    def loss_fn(params, micro, rng, num_tokens, extra, data_sum):
        loss, report = lm(params, micro, rng, num_tokens, extra, data_sum)
        return 0.5 * loss, dict(report, half=0.5 * loss)

    return ForwardStep(loss_fn=loss_fn)


def test_a_custom_provider_plugs_into_the_same_step():
    cfg = tiny_cfg()
    mesh = create_mesh(cfg, jax.devices()[:2])
    plain = build(cfg, mesh)
    half = build(cfg, mesh, forward_step_provider=_half_lm_provider)
    state = plain.init_state()
    b = random_batches(1, plain.global_batch_size, cfg.seq_length, 500)[0]
    b = plain.put_batch({k: v.reshape(plain.num_microbatches, -1, cfg.seq_length) for k, v in b.items()})
    g_plain, r_plain, _ = plain.compute_grads(state, b)
    g_half, r_half, _ = half.compute_grads(state, b)
    np.testing.assert_allclose(float(r_half["half"]), 0.5 * float(r_plain["lm_loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(r_half["lm_loss"]), float(r_plain["lm_loss"]), rtol=1e-6)
    for a, c in zip(jax.tree.leaves(g_half), jax.tree.leaves(g_plain)):
        np.testing.assert_allclose(np.asarray(a), 0.5 * np.asarray(c), rtol=1e-5, atol=1e-9)


def test_a_provider_without_stages_refuses_the_pipeline():
    cfg = tiny_cfg(pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="_half_lm_provider has no pipeline stages"):
        build(cfg, create_mesh(cfg, jax.devices()[:2]), forward_step_provider=_half_lm_provider)
    # the language model's provider has them
    model = GPTModel(ModelConfig.from_config(cfg, 512))
    fwd = gpt_forward_step(cfg, model, None, 512)
    assert fwd.pipeline_stages is lm_pipeline_stages


def test_the_plain_provider_refuses_a_distillation_config():
    cfg = tiny_cfg(kd_teacher_load="/nonexistent/teacher")
    with pytest.raises(ConfigError, match="kd_teacher_load / kd_teacher_logits_path is set.*pretrain_gpt"):
        gpt_forward_step(cfg, None, None, 512)
    from jmegatron.pretrain_gpt import forward_step_provider

    assert forward_step_provider(cfg).__name__ == "distillation_forward_step"
    assert forward_step_provider(cfg.replace(kd_finalize=True, load="/a", save="/b")) is gpt_forward_step


def test_aux_modules_round_trip_through_the_checkpoint_meta():
    module = ProjectionLayer(8, 16)
    spec = aux_spec(module, (1, 1, 8))
    assert spec["module"] == "jmegatron.distill.losses" and spec["input_shape"] == [1, 1, 8]
    (rebuilt, shape), = aux_from_meta({"aux_params": {"kd_projection": spec}}).values()
    assert (rebuilt.student_hidden_size, rebuilt.teacher_hidden_size, shape) == (8, 16, (1, 1, 8))
    x = jnp.ones((1, 1, 8))
    p = module.init(jax.random.PRNGKey(0), x)
    np.testing.assert_array_equal(rebuilt.apply(p, x), module.apply(p, x))
    # the meta written before it named a Python module
    legacy = {"type": "ProjectionLayer", "student_hidden_size": 8, "teacher_hidden_size": 16}
    (old, shape), = aux_from_meta({"aux_params": {"kd_projection": legacy}}).values()
    assert (old.student_hidden_size, old.teacher_hidden_size, shape) == (8, 16, (1, 1, 8))
    for bad in ({"type": "path", "module": "os"}, {"type": "Nope", "module": "jmegatron.distill.losses"}):
        with pytest.raises(checkpointing.CheckpointError, match="unknown auxiliary parameters 'x'"):
            aux_from_meta({"aux_params": {"x": bad}})
