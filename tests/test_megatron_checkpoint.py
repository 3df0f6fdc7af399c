"""Megatron-LM checkpoints both ways (``import-megatron`` / ``export megatron``), held to
megatron-core itself: its ``GPTModel`` built on the CPU writes the checkpoints that are
imported, loads the ones exported, and computes the reference logits.

megatron-core 0.16 assumes CUDA in three places of a forward pass (RoPE's ``inv_freq``
moved to ``torch.cuda.current_device()``, the dropout RNG tracker's fork, the router's
``te_general_gemm`` name without Transformer Engine); the ``mcore`` fixture (tests/conftest.py) makes them
CPU no-ops for this module. Dropout is 0, so the forward is megatron-core's math.
"""

import argparse
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import megatron.core  # noqa: E402,F401
import torch  # noqa: E402

from jmegatron.config import base_config, from_configdict  # noqa: E402
from jmegatron.conversion import megatron as MC  # noqa: E402
from jmegatron.conversion import tree  # noqa: E402
from jmegatron.export import megatron as M  # noqa: E402
from jmegatron.data.tokenizer import build_tokenizer, gpt2_bpe_tokenizer, train_bpe_tokenizer  # noqa: E402
from jmegatron.export.common import ExportError, load_checkpoint  # noqa: E402
from jmegatron.models.gpt import GPTModel, ModelConfig  # noqa: E402

from conftest import REPO  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300  # padded to 384 at tp 1, 512 at tp 2: the padding rows move
SEQ = 16
KINDS = {
    # GPT-2 style: LayerNorm, GELU, biases, learned positions, tied output
    "gpt": dict(ffn_hidden_size=96),
    # Llama-3 / Qwen3 style: RMSNorm, SwiGLU, GQA, RoPE, QK-norm, untied, no bias; the second
    # layer NoPE (megatron-core's no_rope_freq)
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  num_query_groups=2, untie_embeddings_and_output_weights=True, qk_layernorm=True, ffn_hidden_size=96,
                  no_rope_freq=2),
    # DeepSeek / Qwen-MoE style: a dense then an MoE layer, sigmoid routing with expert bias and
    # scaling, a gated shared expert
    "moe": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                num_query_groups=2, ffn_hidden_size=96, num_moe_experts=4, moe_ffn_hidden_size=48, moe_router_topk=2,
                moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, moe_layer_freq=(0, 1),
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.0),
}


def cfg_of(kind, **kw):
    c = base_config()
    c.mock_data, c.vocab_size, c.num_layers, c.hidden_size, c.num_attention_heads = True, VOCAB, 2, 64, 4
    c.seq_length, c.hidden_dropout, c.attention_dropout = SEQ, 0.0, 0.0
    for k, v in {**KINDS[kind], **kw}.items():
        setattr(c, k, v)
    return from_configdict(c)


def randomize(model) -> None:
    """Every weight of a megatron-core model drawn (norms around 1, the rest around 0) and
    every router's expert bias, so each tensor moves the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.05)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.1)


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))


def mcore_logits(model) -> np.ndarray:
    ids = torch.from_numpy(TOKENS)
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    model.eval()
    with torch.no_grad():
        return model(ids, pos, attention_mask=mask).numpy()[..., :VOCAB]


def jm_logits(cfg, params) -> np.ndarray:
    model = GPTModel(ModelConfig.from_config(cfg, params["word_embeddings"]["embedding"].shape[0]))
    return np.asarray(model.apply({"params": params}, TOKENS))[..., :VOCAB]


@pytest.fixture(scope="module")
def written(mcore, tmp_path_factory):
    """For each kind: a randomly initialised megatron-core model (every weight and the expert
    bias drawn, norms included), its logits, and the model saved in both formats as
    Megatron-LM writes them."""
    from megatron.core import dist_checkpointing

    base = tmp_path_factory.mktemp("megatron")
    (base / "corpus.txt").write_text("the lord of the isle spake to the king of the sea and the sea was still\n" * 50)
    (base / "gpt2").mkdir()
    vocab, merges = train_bpe_tokenizer([base / "corpus.txt"], 280, base / "tokenizer.json").tokenizer.model.save(
        str(base / "gpt2"))
    out = {}
    for i, kind in enumerate(KINDS):
        cfg = cfg_of(kind)
        torch.manual_seed(i)
        model = M.megatron_core_model(cfg, cfg.padded_vocab_size())
        randomize(model)
        args = M.megatron_args(cfg, cfg.padded_vocab_size(), VOCAB, iteration=7)
        if kind == "moe":  # Megatron-LM's GPT-2 tokenizer arguments, as its launch scripts pass them
            args.tokenizer_type, args.vocab_file, args.merge_file = "GPT2BPETokenizer", vocab, merges
        legacy = base / kind / "legacy"
        os.makedirs(legacy / "iter_0000007" / "mp_rank_00")
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": model.state_dict()},
                   legacy / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")
        (legacy / "latest_checkpointed_iteration.txt").write_text("7")
        dist = base / kind / "dist"
        os.makedirs(dist / "iter_0000007")
        with M.cpu_megatron_core():
            dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
                                     "iteration": 7}, str(dist / "iter_0000007"))
        (dist / "latest_checkpointed_iteration.txt").write_text("7")
        out[kind] = dict(cfg=cfg, logits=mcore_logits(model), legacy=str(legacy), dist=str(dist), base=base / kind,
                         state=model.state_dict(), args=args)
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_import_gives_megatron_cores_logits_from_both_formats(written, kind):
    w = written[kind]
    results = {}
    for fmt in ("legacy", "dist"):
        args, sd, it, name = M.read_megatron_checkpoint(w[fmt])
        assert (it, name) == (7, {"legacy": "torch", "dist": "torch_dist"}[fmt])
        fields = MC.config_fields_from_megatron_args(args)
        for k in KINDS[kind]:  # the architecture comes back from the args
            want = KINDS[kind][k]
            assert fields[k] == want, k
        results[fmt] = MC.from_megatron_state_dict(sd, w["cfg"], vocab_size=VOCAB)
    for a, b in zip(*(sorted(tree.plain(r).items()) for r in results.values())):
        np.testing.assert_equal(a, b)  # both formats give the same arrays
    got = jm_logits(w["cfg"], results["legacy"])
    print(f"{kind}: max |jmegatron - megatron-core| logits {np.abs(got - w['logits']).max():.3g}")
    np.testing.assert_allclose(got, w["logits"], atol=1e-5, rtol=1e-5)


def test_import_export_round_trip_loads_into_megatron_core(written, mcore, tmp_path):
    # the whole path for the MoE model: import-megatron -> jmegatron checkpoint ->
    # export megatron in both formats -> megatron-core loads it strictly, same logits
    from megatron.core import dist_checkpointing

    w = written["moe"]
    jm = tmp_path / "jm"
    M.import_megatron(w["legacy"], str(jm))
    src = load_checkpoint(str(jm))
    assert src.iteration == 7 and src.vocab_size == VOCAB
    # the tokenizer came along: Megatron's GPT2BPETokenizer files copied into the checkpoint
    assert src.cfg.tokenizer_type == "GPT2BPETokenizer" and src.cfg.vocab_file == str(jm / "tokenizer" / "vocab.json")
    assert build_tokenizer(src.cfg).tokenize("the king") == gpt2_bpe_tokenizer(*(
        written["moe"]["args"].vocab_file, written["moe"]["args"].merge_file)).tokenize("the king")
    for fmt in ("torch", "torch_dist"):
        out = tmp_path / fmt
        M.export_megatron(str(jm), str(out), fmt)
        assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
        model = M.megatron_core_model(w["cfg"], w["cfg"].padded_vocab_size())
        folder = glob.glob(str(out / "iter_*"))[0]
        if fmt == "torch":
            saved = torch.load(os.path.join(folder, "mp_rank_00", "model_optim_rng.pt"), weights_only=True)
            assert saved["checkpoint_version"] == 3.0 and saved["iteration"] == 7
            assert isinstance(saved["args"], argparse.Namespace) and saved["args"].num_experts == 4
            assert saved["args"].tokenizer_type == "GPT2BPETokenizer"
            assert set(saved["model"]) == set(w["state"])  # megatron-core's own key set, _extra_state included
            model.load_state_dict(saved["model"], strict=True)
        else:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
            model.load_state_dict(loaded["model"], strict=True)
        for k, v in model.state_dict().items():
            if v is None or k.endswith("_extra_state"):
                continue
            if k in ("embedding.word_embeddings.weight", "output_layer.weight"):  # padding rows come back zero
                assert not v[VOCAB:].any()
                v, ref = v[:VOCAB], w["state"][k][:VOCAB]
            else:
                ref = w["state"][k]
            np.testing.assert_array_equal(v.numpy(), ref.numpy(), err_msg=k)
        np.testing.assert_array_equal(mcore_logits(model), w["logits"])


def test_null_tokenizer_vocabulary_keeps_its_end_of_document_row(written, tmp_path):
    # Megatron's --tokenizer-type NullTokenizer --vocab-size N: N + 1 ids, the end of document N
    # (megatron-core's own NullTokenizer); the import keeps row N, and its exports write N back
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer as McoreNullTokenizer

    w = written["gpt"]
    n = VOCAB - 1
    ref = McoreNullTokenizer(n)
    args = M.megatron_args(w["cfg"], 384, VOCAB, iteration=7)
    args.tokenizer_type, args.vocab_size = "NullTokenizer", n
    src_dir = tmp_path / "null"
    os.makedirs(src_dir / "iter_0000007" / "mp_rank_00")
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": w["state"]},
               src_dir / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt")
    (src_dir / "latest_checkpointed_iteration.txt").write_text("7")
    jm = tmp_path / "jm"
    M.import_megatron(str(src_dir), str(jm))
    src = load_checkpoint(str(jm))
    tok = build_tokenizer(src.cfg)
    assert (src.cfg.tokenizer_type, src.cfg.vocab_size) == ("NullTokenizer", n)
    assert (src.vocab_size, tok.vocab_size, tok.eod) == (ref.vocab_size, ref.vocab_size, ref.eod) == (VOCAB, VOCAB, n)
    got = jm_logits(src.cfg, src.params)  # the whole vocabulary, the end of document included
    np.testing.assert_allclose(got[..., ref.eod], w["logits"][..., ref.eod], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, w["logits"], atol=1e-5, rtol=1e-5)
    out = tmp_path / "torch"
    M.export_megatron(str(jm), str(out), "torch")
    saved = torch.load(out / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt", weights_only=True)
    assert (saved["args"].tokenizer_type, saved["args"].vocab_size) == ("NullTokenizer", n)
    model = M.megatron_core_model(w["cfg"], 384)
    model.load_state_dict(saved["model"], strict=True)
    np.testing.assert_array_equal(mcore_logits(model), w["logits"])


LAYOUTS = [("llama", 2, 1, 1), ("llama", 1, 2, 1), ("moe", 2, 1, 1), ("moe", 1, 1, 2)]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """megatron-core in two gloo processes writes one model per (kind, tp, pp, ep) of
    LAYOUTS, in both formats (tests/megatron_layouts.py; one start for all layouts)."""
    out = tmp_path_factory.mktemp("layouts")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "megatron_layouts.py"), str(out),
                           *(":".join(map(str, x)) for x in LAYOUTS)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("kind,tp,pp,ep", LAYOUTS)
def test_two_process_layouts_read_and_write_as_megatron_core_shards_them(layouts, kind, tp, pp, ep):
    # the legacy rank files' merge must equal torch_dist's global tensors (megatron-core's own
    # resharding), and sharding them again must reproduce megatron-core's rank files exactly
    base = layouts / f"{kind}-{tp}-{pp}-{ep}"
    _, legacy, _, _ = M.read_megatron_checkpoint(str(base / "legacy"))
    _, dist, _, _ = M.read_megatron_checkpoint(str(base / "dist"))
    assert set(legacy) == set(dist)
    for k in legacy:
        np.testing.assert_array_equal(legacy[k], dist[k], err_msg=k)
    shards = MC.shard_state_dict(legacy, cfg_of(kind), tp, pp, ep)
    files = sorted(glob.glob(str(base / "legacy" / "iter_0000005" / "mp_rank_*")))
    assert sorted(shards) == [os.path.basename(f) for f in files]
    for f in files:
        theirs = torch.load(os.path.join(f, "model_optim_rng.pt"), weights_only=True)["model"]
        ours = shards[os.path.basename(f)]
        assert set(ours) == set(theirs), os.path.basename(f)
        for k, v in theirs.items():
            if v is not None:
                np.testing.assert_array_equal(ours[k], v.numpy(), err_msg=f"{os.path.basename(f)}: {k}")


def test_refusals_name_the_argument(written, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jmegatron.export", "import-megatron", "--load", str(tmp_path),
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "latest_checkpointed_iteration.txt" in proc.stderr, proc.stderr[-2000:]
    with pytest.raises(ExportError, match="latest_checkpointed_iteration.txt"):
        M.read_megatron_checkpoint(str(tmp_path))
    with pytest.raises(ExportError, match="exists and is not empty"):
        M.import_megatron(written["gpt"]["legacy"], written["gpt"]["base"])
    bad = tmp_path / "mla"
    os.makedirs(bad / "release" / "mp_rank_00")
    args = M.megatron_args(written["gpt"]["cfg"], 384, VOCAB)
    args.multi_latent_attention, args.rotary_percent = True, 0.5
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": {}},
               bad / "release" / "mp_rank_00" / "model_optim_rng.pt")
    (bad / "latest_checkpointed_iteration.txt").write_text("release")
    with pytest.raises(ExportError, match=r"multi_latent_attention=True.*rotary_percent=0.5"):
        M.read_megatron_checkpoint(str(bad))
    os.makedirs(tmp_path / "dcp" / "iter_0000001")
    (tmp_path / "dcp" / "iter_0000001" / ".metadata").write_bytes(b"")
    with pytest.raises(ExportError, match="torch_dcp"):
        M.read_megatron_checkpoint(str(tmp_path / "dcp" / "iter_0000001"))
    with pytest.raises(ValueError, match=r"blocks \(Gemma, DeepSeek-V3, gpt-oss"):
        M.megatron_args(cfg_of("llama", sandwich_norms=True, normalization="RMSNorm"), 384, VOCAB)
