"""The KV-cache generator against the no-cache reference sampler and the full forward
pass: greedy (and seeded sampled) tokens equal, prefill/decode logits equal the forward's,
Megatron's top-k/top-p filtering, EOD and length stopping, one compilation per shape,
and the CLI on a small trained checkpoint."""

import numpy as np
import pytest

import flax.linen as nn
import jax
import jax.numpy as jnp

from jmegatron.config import base_config, from_configdict
from jmegatron.inference import generate as gen
from jmegatron.inference.generate import GenerateError, decode_step, filter_logits, generate, prefill
from jmegatron.inference.sample import sample
from jmegatron.models.gpt import GPTModel, init_kv_cache
from jmegatron.models.transformer_config import ModelConfig

VOCAB, SEQ = 256, 128
PROMPT_LENGTHS = (5, 1, 12)  # ragged batch


def make_model(kind: str, scan: bool = False):
    """A 2-layer gpt_tiny- or llama_tiny-shaped model with random weights large enough
    that the logits are peaked (greedy tokens are not near-ties). The params are drawn
    with numpy on the shapes of ``model.init`` (no init compilation)."""
    c = base_config("gpt2" if kind == "gpt" else "llama")
    c.mock_data, c.vocab_size = True, VOCAB
    c.num_layers, c.hidden_size, c.seq_length, c.max_position_embeddings = 2, 64, SEQ, SEQ
    c.hidden_dropout = c.attention_dropout = 0.0
    c.scan_layers = scan
    if kind == "gpt":
        c.num_attention_heads, c.ffn_hidden_size = 4, 256
    else:
        c.num_attention_heads, c.num_query_groups, c.ffn_hidden_size = 8, 2, 160
    cfg = from_configdict(c)
    model = GPTModel(ModelConfig.from_config(cfg, cfg.padded_vocab_size()))
    shapes = nn.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))["params"]
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = path[-1].key
        if name == "scale":
            return (1.0 + 0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)
        return ((0.1 if name == "bias" else 0.3) * rng.standard_normal(leaf.shape)).astype(np.float32)

    return model, jax.tree_util.tree_map_with_path(draw, shapes)


def prompts_of(lengths=PROMPT_LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


# Shared by the tests so the jitted prefill/decode loop compile once per model: prompts
# of PROMPT_LENGTHS (prefill bucket 16) and max_length 12 + 64.
MAX_LENGTH = max(PROMPT_LENGTHS) + 64
_MODELS = {}


def model_of(kind: str, scan: bool = False):
    if (kind, scan) not in _MODELS:
        _MODELS[kind, scan] = make_model(kind, scan)
    return _MODELS[kind, scan]


@pytest.fixture(params=[("gpt", False), ("llama", False), ("llama", True)], ids=["gpt", "llama", "llama-scan"])
def model_params(request):
    return model_of(*request.param)


# --------------------------------------------------------------------------- equivalence
def test_greedy_equals_no_cache_reference(model_params):
    model, params = model_params
    prompts = prompts_of()
    cached = generate(model, params, prompts, 64, greedy=True)
    reference = sample(model, params, prompts, 64, greedy=True)
    assert [len(c) for c in cached] == [64, 64, 64]
    assert len(set(sum(cached, []))) > 20  # not a degenerate repetition: the check has teeth
    assert cached == reference


@pytest.mark.parametrize("kind,kw", [("gpt", dict(temperature=0.9, top_k=20)),
                                     ("llama", dict(temperature=1.3, top_p=0.8))], ids=["top_k", "top_p"])
def test_sampled_tokens_equal_reference_with_the_same_seed(kind, kw):
    model, params = model_of(kind)
    prompts = prompts_of(seed=1)
    a = generate(model, params, prompts, 24, seed=7, max_length=MAX_LENGTH, **kw)
    assert a == sample(model, params, prompts, 24, seed=7, max_length=MAX_LENGTH, **kw)
    assert a != generate(model, params, prompts, 24, seed=8, max_length=MAX_LENGTH, **kw)


def test_prefill_and_decode_logits_equal_full_forward(model_params):
    model, params = model_params
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
    prompts = prompts_of()
    lengths = np.array([len(p) for p in prompts], np.int32)
    buf = np.zeros((len(prompts), 16), np.int32)
    for i, p in enumerate(prompts):
        buf[i, :len(p)] = p
    full = np.asarray(forward(params, buf))
    rows = np.arange(len(prompts))
    last, cache = prefill(model, params, buf, lengths, max_length=MAX_LENGTH)
    np.testing.assert_allclose(np.asarray(last), full[rows, lengths - 1], rtol=1e-5, atol=1e-5)
    k0 = jax.tree.leaves(cache)[0]
    assert k0.shape[-4:] == (3, MAX_LENGTH, model.cfg.num_query_groups, model.cfg.kv_channels)
    # one decode step per row at its own position, against the forward of the extended rows
    nxt = np.array([7, 100, 255], np.int32)
    buf[rows, lengths] = nxt
    full = np.asarray(forward(params, buf))
    step, cache = decode_step(model, params, cache, nxt, lengths)
    np.testing.assert_allclose(np.asarray(step), full[rows, lengths], rtol=1e-5, atol=1e-5)
    assert np.abs(full[rows, lengths]).max() > 1.0  # the logits are not all ~0


def test_eod_stops_each_sequence():
    model, params = model_of("gpt")
    prompts = prompts_of()
    free = generate(model, params, prompts, 64, greedy=True)
    # an EOD id first produced by row 0 at step k >= 3
    k = next(k for k in range(3, 64) if free[0][k] not in free[0][:k])
    eod = free[0][k]
    stopped = generate(model, params, prompts, 64, greedy=True, eod_id=eod)
    assert stopped[0] == free[0][:k + 1]
    for row, out in zip(free, stopped):
        end = row.index(eod) + 1 if eod in row else len(row)
        assert out == row[:end]


def test_each_row_stops_at_max_length_and_long_prompts_keep_their_tail():
    model, params = model_of("llama")
    prompts = prompts_of()
    free = generate(model, params, prompts, 64, greedy=True)
    out = generate(model, params, prompts, 64, greedy=True, max_length=12)
    assert [len(o) for o in out] == [7, 11, 1]  # 12 - prompt length; the 12-token prompt keeps its last 11
    assert out[:2] == [free[0][:7], free[1][:11]]
    tail = jnp.asarray([prompts[2][-11:]], jnp.int32)
    assert out[2] == [int(jnp.argmax(model.apply({"params": params}, tail)[0, -1]))]


def test_one_decode_compilation_per_batch_and_max_length():
    model, params = model_of("gpt")
    sizes = [gen._decode_loop._cache_size()]
    a = generate(model, params, prompts_of(seed=3), 10, greedy=True, max_length=MAX_LENGTH)
    b = generate(model, params, prompts_of((2, 9, 4), seed=4), 20, greedy=True, max_length=MAX_LENGTH, eod_id=3)
    sizes.append(gen._decode_loop._cache_size())
    c = generate(model, params, prompts_of(seed=5), 5, temperature=0.7, top_k=20, max_length=MAX_LENGTH, seed=1)
    sizes.append(gen._decode_loop._cache_size())
    d = generate(model, params, prompts_of((3, 3, 3), seed=5), 8, temperature=1.2, top_k=20, max_length=MAX_LENGTH)
    sizes.append(gen._decode_loop._cache_size())
    # at most one compilation for greedy and one for top-k sampling (none if an earlier
    # test compiled them); temperature, seed, eod, lengths and max_new_tokens are traced
    assert sizes[1] - sizes[0] <= 1 and sizes[2] - sizes[1] <= 1 and sizes[3] == sizes[2]
    assert len(a[0]) == 10 and len(c[0]) == 5 and len(d[0]) == 8 and all(len(x) <= 20 for x in b)


def test_kv_cache_layout_per_query_group():
    model, _ = model_of("llama")
    cache = init_kv_cache(model.cfg, batch=3, max_length=20)
    assert len(cache) == 2 and all(k.shape == (3, 20, 2, 8) for layer in cache for k in layer)
    scanned, _ = model_of("llama", scan=True)
    k, v = init_kv_cache(scanned.cfg, batch=3, max_length=20)
    assert k.shape == v.shape == (2, 3, 20, 2, 8)


# --------------------------------------------------------------------------- filtering
def test_top_k_and_top_p_filtering_follow_megatron():
    probs = np.array([[0.5, 0.05, 0.3, 0.15]])
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    filt = jax.jit(filter_logits, static_argnames="top_k")  # temperature and top_p traced
    kept = lambda **kw: np.isfinite(np.asarray(filt(logits, **kw)))[0].tolist()
    assert kept(top_k=2) == [True, False, True, False]
    assert kept(top_p=0.4) == [True, False, False, False]   # 0.5 >= 0.4
    assert kept(top_p=0.75) == [True, False, True, False]   # 0.5 + 0.3 >= 0.75
    assert kept(top_p=0.9) == [True, False, True, True]     # 0.95 >= 0.9
    assert kept(top_p=1.0) == [True] * 4
    x = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    np.testing.assert_allclose(filter_logits(x, temperature=2.0), x / 2.0, rtol=1e-6)
    assert np.isfinite(np.asarray(filt(x, top_p=1.0))).all()  # traced top_p = 1 keeps everything
    # against a brute-force "smallest set whose probability reaches p", random rows
    for p in (0.3, 0.6, 0.95):
        got = np.isfinite(np.asarray(filt(x, top_p=p)))
        for row, mask in zip(np.asarray(jax.nn.softmax(x)), got):
            order = np.argsort(-row)
            n = int(np.searchsorted(np.cumsum(row[order]), p) + 1)
            assert set(np.flatnonzero(mask)) == set(order[:n].tolist()), p
    # temperature sharpens before top-p: fewer tokens reach the same mass
    assert got.sum() > np.isfinite(np.asarray(filt(x, temperature=0.5, top_p=0.95))).sum()


def test_bad_input_raises_with_the_argument_named():
    model, params = model_of("gpt")
    cases = [
        (dict(top_k=5, top_p=0.9), "top_k=5 and top_p=0.9"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(top_k=VOCAB + 1), f"top_k={VOCAB + 1}"),
        (dict(max_length=SEQ + 1), "max_position_embeddings"),
    ]
    for kw, msg in cases:
        with pytest.raises(GenerateError, match=msg):
            generate(model, params, [[1, 2]], 4, **kw)
    with pytest.raises(GenerateError, match="prompt 1 is empty"):
        generate(model, params, [[1], []], 4)
    with pytest.raises(GenerateError, match="token id 300"):
        generate(model, params, [[1, 300]], 4)
    with pytest.raises(GenerateError, match="max_new_tokens=-1"):
        generate(model, params, [[1, 2]], -1)
    assert generate(model, params, [[1, 2], [3]], 0) == [[], []]
    out = generate(model, params, [[1, 2], [3], [4]], 3, temperature=0.0, greedy=True, max_length=MAX_LENGTH)
    assert [len(o) for o in out] == [3, 3, 3]


# --------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """A 2-layer GPT trained 3 iterations (one device) on mock data, with a small BPE
    tokenizer."""
    from jmegatron.data.tokenizer import train_bpe_tokenizer
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.loop import pretrain

    tmp = tmp_path_factory.mktemp("gen")
    text = tmp / "text.txt"
    text.write_text("ROMEO: But soft, what light through yonder window breaks?\n"
                    "JULIET: O Romeo, Romeo, wherefore art thou Romeo?\n" * 20)
    tok = train_bpe_tokenizer([text], 300, tmp / "tokenizer.json")
    c = base_config()
    c.mock_data, c.tokenizer_model = True, str(tmp / "tokenizer.json")
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 32, 2, 32
    c.max_position_embeddings = 32
    c.micro_batch_size, c.global_batch_size = 2, 2
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 3, 1, 0, 1  # no evaluation
    c.lr, c.lr_warmup_iters, c.peak_tflops = 1e-3, 1, 1.0
    c.save = str(tmp / "ckpt")
    cfg = from_configdict(c)
    assert pretrain(cfg, create_mesh(cfg, jax.devices()[:1]))["iteration"] == 3
    return tmp / "ckpt", tok


@pytest.mark.slow  # trains a checkpoint (one train-step compilation)
def test_cli_prints_text_from_a_trained_checkpoint(trained_checkpoint, capsys):
    from jmegatron.generate import main
    from jmegatron.inference.generate import generate_text

    ckpt, tok = trained_checkpoint
    assert main(["--load", str(ckpt), "--prompt", "ROMEO:", "--prompt", "JULIET: O",
                 "--max-new-tokens", "12", "--greedy"]) == 0
    out = capsys.readouterr().out
    samples = [s.strip("\n") for s in out.split("=" * 30 + " sample " + "=" * 30)[1:]]
    assert len(samples) == 2 and samples[0].startswith("ROMEO:") and samples[1].startswith("JULIET: O")
    expected = generate_text(str(ckpt), ["ROMEO:", "JULIET: O"], 12, greedy=True)
    assert samples == ["ROMEO:" + expected[0], "JULIET: O" + expected[1]]
    assert all(len(tok.tokenize(e)) > 0 for e in expected)


@pytest.mark.slow
def test_cli_errors_exit_2(tmp_path, trained_checkpoint, capsys):
    from jmegatron.generate import main

    assert main(["--load", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "error: no checkpoint found" in capsys.readouterr().err
    ckpt, _ = trained_checkpoint
    assert main(["--load", str(ckpt), "--prompt", "x", "--top-k", "3", "--top-p", "0.5"]) == 2
    assert "error: top_k=3 and top_p=0.5" in capsys.readouterr().err
