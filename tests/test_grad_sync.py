"""parallel/grad_sync.py on its own (no model): the shard_map's manual axes, the one
sample_offset formula under data x expert, the ZeRO-1 group read back from the shardings
distributed_optimizer built, and a dense / expert / ZeRO-1 gradient reduction against the
sums it must equal."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jmegatron.parallel.distributed_optimizer import zero1_axes, zero1_shardings
from jmegatron.parallel.grad_sync import GradSync, StepLayout
from jmegatron.parallel.mesh import MESH_AXES


def mesh_of(**sizes):
    shape = [sizes.get(a, 1) for a in MESH_AXES]
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))], dtype=object).reshape(shape), MESH_AXES)


@pytest.mark.parametrize("sizes, pipeline, manual", [
    (dict(data=8), False, ("data",)),
    (dict(data=4, expert=2), False, ("data", "expert")),
    (dict(data=2, context=2, tensor=2), True, ("data", "context", "pipeline")),
])
def test_manual_axes(sizes, pipeline, manual):
    assert GradSync.manual_axes(mesh_of(**sizes), pipeline) == manual


def test_sample_offset_is_the_global_row_of_each_rank():
    # data 2 x expert 2: the batch splits data-major over 4 ranks (rules.batch_axes)
    mesh = mesh_of(data=2, expert=2, tensor=2)
    sh = NamedSharding(mesh, P())
    sync = GradSync(StepLayout(mesh, {"w": sh}, {"w": sh}))
    rows, micro = 3, 5

    def offsets(_):
        return sync.sample_offset(jnp.int32(micro), rows)[None, None]

    got = jax.shard_map(offsets, mesh=mesh, in_specs=P(), out_specs=P("data", "expert"),
                        axis_names={"data", "expert"})(jnp.zeros(()))
    dp = 4
    want = np.array([[(micro * dp + d * 2 + e) * rows for e in range(2)] for d in range(2)])
    np.testing.assert_array_equal(np.asarray(got), want)


def test_zero1_axes_read_back_the_group_the_state_was_sharded_over():
    mesh = mesh_of(data=2, expert=2, context=2)
    dense = NamedSharding(mesh, P(None, "tensor"))
    expert = NamedSharding(mesh, P("expert", None))
    abstract = {"dense": jax.ShapeDtypeStruct((8, 8), jnp.float32), "expert": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    grads = zero1_shardings({"dense": dense, "expert": expert}, abstract)
    assert zero1_axes(grads["dense"], expert_leaf=False) == ("data", "expert", "context")
    assert zero1_axes(grads["expert"], expert_leaf=True) == ("data", "context")
    assert zero1_axes(dense, expert_leaf=False) == ()  # not split over data: all-reduced


def test_reduce_sums_dense_over_data_and_expert_and_experts_over_data():
    mesh = mesh_of(data=2, expert=2, tensor=2)
    dense, expert = NamedSharding(mesh, P()), NamedSharding(mesh, P("expert"))
    zero = zero1_shardings({"z": dense}, {"z": jax.ShapeDtypeStruct((4,), jnp.float32)})["z"]
    ps = {"dense": dense, "expert": expert, "z": dense}
    sync = GradSync(StepLayout(mesh, ps, {"dense": dense, "expert": expert, "z": zero}))
    # each of the 4 ranks' partial gradient: 1 + its data-major rank
    rank_value = np.arange(1.0, 5.0).reshape(2, 2)

    def body(params, batch, rng, extra, loss_scale):
        r = batch["tokens"][0, 0, 0]
        grads = jax.tree.map(lambda p: jnp.broadcast_to(r, p.shape).astype(jnp.float32), sync.varying(params))
        grads, report = sync.reduce(grads, {"loss": jnp.float32(0.0)}, 1)
        return grads, report, jnp.float32(0.0)

    params = {"dense": jnp.zeros((2,)), "expert": jnp.zeros((2,)), "z": jnp.zeros((4,))}
    batch = {"tokens": jnp.asarray(rank_value.reshape(1, 4, 1), jnp.float32)}
    grads, _, _ = sync.shard_map(body)(params, batch, jnp.zeros(()), None, jnp.zeros(()))
    grads = sync.reduce_scatter(grads)
    np.testing.assert_allclose(np.asarray(grads["dense"]), 10.0)  # every rank
    # expert e's weight: summed over the data ranks only (its expert-data-parallel group)
    np.testing.assert_allclose(np.asarray(grads["expert"]), [1 + 3, 2 + 4])
    np.testing.assert_allclose(np.asarray(grads["z"]), 10.0)  # ZeRO-1: reduce-scattered, the same sum
    assert grads["z"].sharding.spec == zero.spec


def test_the_step_imports_no_loss_and_parallel_no_model():
    """make_train_step takes the forward step: step.py imports neither forward_step nor the
    losses; the parallel modules the step composes import neither models nor training."""
    root = pathlib.Path(__file__).resolve().parents[1] / "jmegatron"

    def imports(path):
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
        return out

    step = imports(root / "training" / "step.py")
    assert not [n for n in step if n.startswith(("jmegatron.training.forward_step", "jmegatron.training.losses"))]
    for name in ("grad_sync", "schedules", "rules", "distributed_optimizer"):
        names = imports(root / "parallel" / f"{name}.py")
        assert not [n for n in names if n.startswith(("jmegatron.models", "jmegatron.training"))], name
