"""Document masking (issue 14 item 3): Megatron's ``reset_attention_mask`` (attention only
within a document of a packed sequence), with ``reset_position_ids`` and ``eod_mask_loss``.

A packed sequence of EOD-separated documents gives, token for token, the logits, loss and
gradients of the documents run one by one; under context parallelism (every
``cp_comm_type``, documents crossing the load-balanced chunks) the loss and every gradient
equal the one-device model's; ``reset_position_ids`` alone under cp equals one device (the
causal order is the sequence's, not the position ids'); and ``python -m jmegatron.train``
trains on packed Shakespeare speeches."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmegatron.data.gpt_dataset import MockGPTDataset, get_ltor_masks_and_position_ids
from jmegatron.data.loader import stack_samples
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.losses import masked_cross_entropy
from jmegatron.training.run import build

from test_expert_parallel import assert_close
from test_train_step import tiny_cfg

EOD = 0
VOCAB = 500
LLAMA = dict(family="llama", num_query_groups=2)
DOCMASK = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True, attention_impl="xla")


def small_cfg(**kw):
    """tests/test_train_step.py's tiny model with one layer (the mask is per layer; compiles
    in half the time)."""
    return tiny_cfg(**dict(dict(num_layers=1), **kw))


def packed_rows(lengths_per_row, seed=0, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True):
    """Host batch rows ``{key: [rows, seq]}`` of EOD-ended documents of the given lengths
    (random tokens 1..VOCAB-1, the last of each document EOD; the last document of a row is cut
    by the row's end), masks from the data pipeline's ``get_ltor_masks_and_position_ids``."""
    rs = np.random.RandomState(seed)
    rows = []
    for lengths in lengths_per_row:
        text = np.concatenate([np.append(rs.randint(1, VOCAB, size=n - 1), EOD) for n in lengths])
        tokens, labels = text[:-1].astype(np.int32), text[1:].astype(np.int32)
        loss_mask, position_ids, segment_ids = get_ltor_masks_and_position_ids(
            tokens, EOD, reset_position_ids, reset_attention_mask, eod_mask_loss)
        row = dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)
        if segment_ids is not None:
            row["segment_ids"] = segment_ids
        rows.append(row)
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def documents(row):
    """The (start, end) slices of a packed row's documents, from its segment ids."""
    seg = row["segment_ids"]
    starts = [0] + [i for i in range(1, len(seg)) if seg[i] != seg[i - 1]]
    return list(zip(starts, starts[1:] + [len(seg)]))


def build_run(cfg, devices=1):
    return build(cfg, create_mesh(cfg, jax.devices()[:devices]))


# ------------------------------------------------------------------ the model alone
@pytest.mark.parametrize("model,impl", [({}, "xla"), (LLAMA, "xla"), (LLAMA, "cpu")],
                         ids=["gpt-xla", "llama-xla", "llama-cpu_kernel"])
def test_packed_documents_equal_documents_run_alone(model, impl):
    """Logits of every document of a packed row equal that document's logits run alone
    (positions from 0); the train step's loss and gradients (and the eval step's loss) on the
    packed batch equal the token sums over the documents run alone, divided by the batch's
    tokens. The documents run alone are one batch, a row each, right-padded (causal attention:
    padding after a document changes none of its logits; its loss mask is 0)."""
    seq = 32
    cfg = small_cfg(**model, **dict(DOCMASK, attention_impl=impl), seq_length=seq, micro_batch_size=2,
                    global_batch_size=2)
    run = build_run(cfg)
    params = run.init_state().params
    host = packed_rows([[11, 7, 15], [5, 20, 8]], seed=1)  # 33 = seq + 1: the last EOD is a label only
    spans = [(r, a, b) for r in range(2) for a, b in documents({k: v[r] for k, v in host.items()})]
    assert len(spans) == 6
    alone = {k: np.zeros((len(spans), seq), host[k].dtype) for k in ("tokens", "labels", "loss_mask")}
    for i, (r, a, b) in enumerate(spans):
        for k in alone:
            alone[k][i, :b - a] = host[k][r, a:b]

    def loss_alone(p):
        logits = run.model.apply({"params": p}, alone["tokens"])  # positions 0.. in every row
        return masked_cross_entropy(logits, alone["labels"], alone["loss_mask"])[0], logits

    (total, logits_alone), grads = jax.jit(jax.value_and_grad(loss_alone, has_aux=True))(params)
    apply = jax.jit(lambda p, seg: run.model.apply({"params": p}, host["tokens"], host["position_ids"],
                                                   segment_ids=seg))
    packed = np.asarray(apply(params, host["segment_ids"]))
    for i, (r, a, b) in enumerate(spans):  # (without the mask, every later document's would differ)
        np.testing.assert_allclose(packed[r, a:b], logits_alone[i, :b - a], rtol=1e-5, atol=1e-5)
    count = float(host["loss_mask"].sum())
    assert float(alone["loss_mask"].sum()) == count
    batch = {k: v[None] for k, v in host.items()}
    g, report, tokens = run.compute_grads(run.init_state(), run.put_batch(batch))
    assert float(tokens) == count
    np.testing.assert_allclose(float(report["lm_loss"]), float(total) / count, rtol=1e-5)
    assert_close(jax.device_get(g), jax.device_get(jax.tree.map(lambda a: a / count, grads)))
    total_eval, count_eval = run.eval_step(params, run.put_batch(batch, train=False))
    np.testing.assert_allclose(float(total_eval) / float(count_eval), float(total) / count, rtol=1e-5)
    with pytest.raises(ValueError, match="reset_attention_mask=True but the batch has no segment_ids"):
        run.put_batch({k: v for k, v in batch.items() if k != "segment_ids"})


def test_dot_product_core_masks_documents_like_xla():
    from jmegatron.kernels.xla.attention import xla_attention
    from jmegatron.models.core_attention import dot_product_attention

    rs = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rs.randn(2, 16, n, 8).astype(np.float32)) for n in (4, 2, 2))
    seg = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 4, axis=1), jnp.int32)
    np.testing.assert_allclose(dot_product_attention(q, k, v, segment_ids=seg), xla_attention(q, k, v, segment_ids=seg),
                               rtol=1e-5, atol=1e-6)


def test_mock_data_and_loader_carry_segments():
    """MockGPTDataset with reset_attention_mask gives segment ids counting its EODs, and the
    loader pads them as a document of its own."""
    ds = MockGPTDataset(16, 32, VOCAB, seed=3, eod_id=EOD, max_document_length=24, reset_attention_mask=True,
                        reset_position_ids=True)
    samples = [ds[i] for i in range(16)]
    for s in samples:
        np.testing.assert_array_equal(s["segment_ids"][1:], np.cumsum(s["tokens"] == EOD)[:-1])
    assert sum(int(s["segment_ids"][-1]) for s in samples) > 0  # the mock documents do end inside samples
    short = dict(samples[0], **{k: v[:20] for k, v in samples[0].items()})
    batch = stack_samples([short, samples[1]], 1)
    np.testing.assert_array_equal(batch["segment_ids"][0, 0, 20:], short["segment_ids"][-1] + 1)


# ------------------------------------------------------------------ context parallelism
_ONE_DEVICE = {}


def grads(cfg, devices, host):
    run = build_run(cfg, devices)
    batch = run.put_batch({k: v.reshape(run.num_microbatches, -1, cfg.seq_length) for k, v in host.items()})
    g, report, tokens = run.compute_grads(run.init_state(), batch)
    return jax.device_get(g), float(report["lm_loss"]), float(tokens)


def one_device(model, flags, host_key, host):
    key = (tuple(sorted(model.items())), tuple(sorted(flags.items())), host_key)
    if key not in _ONE_DEVICE:
        _ONE_DEVICE[key] = grads(small_cfg(**model, **flags, micro_batch_size=4, global_batch_size=4), 1, host)
    return _ONE_DEVICE[key]


# seq 32: cp2 chunks of 8, cp4 chunks of 4; documents cross them (and one spans four)
LENGTHS = [[5, 13, 3, 12], [19, 6, 8], [2, 2, 17, 12], [33]]
# Every cp_comm_type at cp 2, the ring at cp 4 (three hops), each model family; the attentions
# alone are checked for every kind with GQA below. cp 1 x pp 2: the pipeline's stages.
CP_CASES = [  # (cp, devices, model, other fields)
    (2, 2, {}, dict(cp_comm_type="all_gather")),
    (4, 4, {}, dict(cp_comm_type="p2p")),
    (2, 2, LLAMA, dict(cp_comm_type="p2p")),
    (2, 2, LLAMA, dict(cp_comm_type="a2a")),
    (2, 4, LLAMA, dict(use_distributed_optimizer=True)),  # cp2 x dp2 + ZeRO-1
    (1, 2, dict(num_layers=2, scan_layers=True), dict(pipeline_model_parallel_size=2)),  # pipelines scan
]


@pytest.mark.parametrize("cp,devices,model,extra", [
    pytest.param(c, n, m, x, id=f"cp{c}-dev{n}-{m.get('family', 'gpt')}-"
                 + "_".join(f"{k}={v}" for k, v in x.items()),
                 marks=pytest.mark.slow if "pipeline_model_parallel_size" in x else ())
    for c, n, m, x in CP_CASES])
def test_document_mask_under_context_parallelism_equals_one_device(cp, devices, model, extra):
    host = packed_rows(LENGTHS, seed=2)
    dp = devices // cp // extra.get("pipeline_model_parallel_size", 1)
    g, loss, tokens = grads(small_cfg(**model, **DOCMASK, **extra, context_parallel_size=cp, micro_batch_size=4 // dp,
                                      global_batch_size=4), devices, host)
    g1, loss1, tokens1 = one_device(model, DOCMASK, "docmask", host)
    assert tokens == tokens1
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    assert_close(g, g1)


def test_reset_position_ids_alone_under_cp_equals_one_device():
    """Position ids restart at each EOD but attention still spans documents: the causal order
    under cp must be each slot's sequence position, not its position id (RoPE keeps those)."""
    flags = dict(reset_position_ids=True, attention_impl="xla")
    host = packed_rows(LENGTHS, seed=4, reset_attention_mask=False, eod_mask_loss=False)
    assert "segment_ids" not in host
    g, loss, tokens = grads(small_cfg(**LLAMA, **flags, context_parallel_size=2, micro_batch_size=4,
                                     global_batch_size=4), 2, host)
    g1, loss1, _ = one_device(LLAMA, flags, "reset_position_ids", host)
    np.testing.assert_allclose(loss, loss1, rtol=1e-5)
    assert_close(g, g1)


def test_context_parallel_attentions_with_segments_equal_xla_attention():
    """The cp attentions alone (values and q/k/v gradients, cp 4, GQA), with XLA's and the CPU
    kernel's block forms, against xla_attention with the same segments, in the original order."""
    from jax.sharding import Mesh, PartitionSpec as P

    from jmegatron.kernels.xla.attention import xla_attention
    from jmegatron.parallel import context_parallel as cpl

    cp, b, s, nq, nkv, d = 4, 2, 32, 8, 4, 8  # GQA; a2a splits 8 and 4 heads over 4 ranks
    rs = np.random.RandomState(7)
    q, k, v = (jnp.asarray(rs.randn(b, s, n, d).astype(np.float32)) for n in (nq, nkv, nkv))
    w = jnp.asarray(rs.randn(b, s, nq, d).astype(np.float32))
    seg = jnp.asarray(packed_rows([[3, 14, 7, 9], [30, 3]], seed=3)["segment_ids"])
    index = cpl.load_balance_index(s, cp)
    inverse = np.argsort(index)
    mesh = Mesh(np.array(jax.devices()[:cp]), ("context",))
    pos = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b, s))
    spec = P(None, "context")
    ref = jax.value_and_grad(lambda q, k, v: jnp.sum(xla_attention(q, k, v, segment_ids=seg) * w), argnums=(0, 1, 2))
    want, want_g = ref(q, k, v)
    for (kind, fn), block in itertools.product(cpl.CP_ATTENTIONS.items(), ("xla", "cpu")):
        sharded = jax.shard_map(lambda q, k, v, p, sg, fn=fn, block=block: fn(q, k, v, p, "context", cp, sg, block),
                                mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)

        def loss(q, k, v):
            out = sharded(q[:, index], k[:, index], v[:, index], pos, seg[:, index])[:, inverse]
            return jnp.sum(out * w)

        got, got_g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{kind} {block}")
        for a, e in zip(got_g, want_g):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5, err_msg=f"{kind} {block}")


# ------------------------------------------------------------------ the CLI
@pytest.mark.slow
def test_cli_trains_packed_shakespeare_with_document_masking(tmp_path, shakespeare_dir):
    """python -m jmegatron.train with reset_attention_mask, reset_position_ids and eod_mask_loss
    at cp 2 on packed Shakespeare speeches (a document per blank-line block, EOD-ended, so
    most 64-token samples hold several): a few steps, finite and decreasing loss."""
    from test_pipeline_e2e import cli, metrics

    blocks = [blk.strip() for play in sorted(shakespeare_dir.glob("*_gut.txt"))[:2]
              for blk in play.read_text(errors="ignore").split("\n\n") if blk.strip()]
    corpus = tmp_path / "speeches.jsonl"
    corpus.write_text("".join(json.dumps({"text": blk}) + "\n" for blk in blocks[:3000]))
    from jmegatron.tools import preprocess_data, train_tokenizer

    # the tokenizer and the data through the tools' own entry points, in this process (their
    # command lines: tests/test_shakespeare_integration.py)
    tok = tmp_path / "tokenizer.json"
    train_tokenizer.main(["--input", str(corpus), "--vocab-size", "320", "--output", str(tok)])
    (prefix,) = preprocess_data.preprocess([str(corpus)], str(tmp_path / "shk"), str(tok), append_eod=True, log=None)
    from jmegatron.data.blended_dataset import build_train_valid_test_datasets
    from jmegatron.data.tokenizer import load_tokenizer

    train, _, _ = build_train_valid_test_datasets([prefix], "969,30,1", [16, 0, 0], 64, 1234,
                                                  load_tokenizer(str(tok)).eod, reset_attention_mask=True)
    counts = [int(train[i]["segment_ids"][-1]) for i in range(16)]
    assert sum(c > 0 for c in counts) >= 8  # most samples pack documents (11 of 16 here)
    fields = dict(data_path=prefix, tokenizer_model=str(tok), num_layers=2, hidden_size=64, num_attention_heads=4,
                  seq_length=64, max_position_embeddings=64, micro_batch_size=2, global_batch_size=4, train_iters=4,
                  lr_warmup_iters=1, eval_interval=4, eval_iters=1, log_interval=1, context_parallel_size=2,
                  attention_dropout=0.0, save=str(tmp_path / "ckpt"), save_interval=100, **DOCMASK)
    out = cli(["jmegatron.train", "--config", "configs/gpt_tiny.py", *(f"--config.{k}={v}" for k, v in fields.items())],
              devices=2)
    assert "'context': 2" in out
    losses, vals = metrics(tmp_path / "ckpt")
    assert sorted(losses) == [1, 2, 3, 4] and all(np.isfinite(list(losses.values())))
    assert np.isfinite(vals[4]) and losses[4] < losses[1]
