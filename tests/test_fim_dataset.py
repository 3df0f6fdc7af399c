"""Fill-in-the-middle samples (jmegatron/data/fim_dataset.py) against the definitions of Megatron's
fim_dataset.py: PSM / SPM layouts that reassemble to the original text, the rates over many
samples, fragment splitting, fim_no_prefix, truncation and padding to the sample length, and one
transformation drawn exactly as Megatron's _permute draws it. A character-level tokenizer (a
byte-level BPE without merges) is built here, so a character is a token."""

import numpy as np
import pytest

from jmegatron.config import load_config_file
from jmegatron.data.fim_dataset import GPTFIMDataset
from jmegatron.data.gpt_dataset import GPTDataset
from jmegatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from jmegatron.data.tokenizer import NullTokenizer, load_tokenizer

SPECIALS = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"]
SEQ = 96


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    t.train_from_iterator(["ab"], trainers.BpeTrainer(vocab_size=len(alphabet) + len(SPECIALS), special_tokens=SPECIALS,
                                                      initial_alphabet=alphabet, show_progress=False))
    path = tmp_path_factory.mktemp("fimtok") / "tokenizer.json"
    t.save(str(path))
    return load_tokenizer(path)


def ids(tok, name):
    return tok.tokenizer.token_to_id(name)


def write_docs(tok, path, docs):
    with IndexedDatasetBuilder(f"{path}.bin", dtype=np.uint16) as b:
        for text in docs:
            toks = []
            for k, piece in enumerate(text.split("|")):  # "|" stands for a <file_sep> token
                toks += ([ids(tok, "<file_sep>")] if k else []) + tok.tokenize(piece)
            toks.append(tok.eod)
            b.add_document(toks, [len(toks)])
        b.finalize(f"{path}.idx")
    return IndexedDataset(str(path))


def words(rng, n):
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(list(letters), size=rng.integers(2, 7))) for _ in range(n))


@pytest.fixture(scope="module")
def corpus(tok, tmp_path_factory):
    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("fim")
    docs = [("#! " if i % 7 == 0 else "") + words(rng, int(rng.integers(3, 9))) for i in range(300)]
    files = ["|".join(words(rng, 3) for _ in range(int(rng.integers(1, 4)))) for _ in range(200)]
    return {"docs": docs, "plain": write_docs(tok, d / "plain", docs), "files": write_docs(tok, d / "files", files),
            "specials": write_docs(tok, d / "specials", ["|".join("abcdefgh") * 3])}


def fim(tok, low, num_samples=None, **kw):
    return GPTFIMDataset(low, np.arange(len(low)), num_samples, SEQ, 1234, tok.eod, tokenizer=tok, **kw)


def text(tok, toks):
    return tok.tokenizer.decode([int(t) for t in toks], skip_special_tokens=True)


def parse(tok, seg):
    """('psm' | 'spm' | 'plain', reassembled text, PSM cut points) of one transformed segment.
    'spm' is the layout <pre> <suf> ...; a PSM segment with an empty prefix has it too (Megatron's
    two layouts coincide then), and reassembles the same way."""
    pre, suf, mid = ids(tok, "<fim_prefix>"), ids(tok, "<fim_suffix>"), ids(tok, "<fim_middle>")
    seg = list(seg)
    if not seg or seg[0] != pre:
        return "plain", text(tok, seg), None
    assert seg.count(pre) == seg.count(suf) == seg.count(mid) == 1
    m = seg.index(mid)
    if seg[1] == suf:  # SPM: <pre> <suf> S <mid> P M
        return "spm", text(tok, seg[m + 1:]) + text(tok, seg[2:m]), None
    s = seg.index(suf)  # PSM: <pre> P <suf> S <mid> M
    prefix, suffix, middle = text(tok, seg[1:s]), text(tok, seg[s + 1:m]), text(tok, seg[m + 1:])
    return "psm", prefix + middle + suffix, (len(prefix), len(prefix) + len(middle))


def segments(tok, sample):
    """The segments between end-of-document tokens that lie wholly inside ``sample``."""
    cuts = np.flatnonzero(np.asarray(sample) == tok.eod)
    return [sample[a + 1:b] for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]


def test_layouts_rates_and_lengths(tok, corpus):
    low = corpus["plain"]
    ds = fim(tok, low, 400, fim_rate=0.5, fim_spm_rate=0.3)
    raw = GPTDataset(low, np.arange(len(low)), 400, SEQ, 1234, tok.eod)
    kinds, cuts, lengths = [], [], []
    for i in range(len(ds)):
        sample, ref = ds.get_raw_sample(i)[0], raw.get_raw_sample(i)[0]
        assert sample.shape == (SEQ + 1,)
        ref_segments = segments(tok, ref)
        got = segments(tok, sample)
        # the end-of-document tokens stay between the segments; the sentinels push the last ones out
        assert len(ref_segments) - 3 <= len(got) <= len(ref_segments)
        for seg, orig in zip(got, ref_segments):
            if len(orig) == 0:  # two end-of-document tokens in a row: kept, nothing to transform
                assert len(seg) == 0
                continue
            kind, reassembled, cut = parse(tok, seg)
            assert reassembled == text(tok, orig), (i, kind)
            if not text(tok, orig).startswith("#!"):
                kinds.append(kind)
                lengths.append(len(reassembled))
            if cut is not None:
                cuts.append(np.asarray(cut) / max(len(reassembled), 1))
        # the part after the last end of document is cut at the sample's length
        s = ds[i]
        assert all(v.shape == (SEQ,) for v in s.values())
    kinds, lengths = np.asarray(kinds), np.asarray(lengths, np.float64)
    n, fimmed = len(kinds), kinds != "plain"
    fim_share = np.mean(fimmed)
    # the SPM layout: SPM, or PSM whose first cut fell at 0 (probability 1 - (L / (L + 1))^2)
    spm_layout = np.mean(kinds[fimmed] == "spm")
    expected = np.mean(0.3 + 0.7 * (1 - (lengths[fimmed] / (lengths[fimmed] + 1)) ** 2))
    print(f"{n} segments: FIM {fim_share:.3f} (0.5), SPM layout among FIM {spm_layout:.3f} ({expected:.3f})")
    assert n > 1000
    assert abs(fim_share - 0.5) < 4 * np.sqrt(0.25 / n)
    assert abs(spm_layout - expected) < 4 * np.sqrt(expected * (1 - expected) / np.sum(fimmed))
    # two cut points uniform on [0, len], sorted: at 1/3 and 2/3 of the text on average
    np.testing.assert_allclose(np.mean(cuts, axis=0), [1 / 3, 2 / 3], atol=0.05)
    # the same index gives the same sample (a generator per sample, not per reader)
    np.testing.assert_array_equal(fim(tok, low, 400, fim_rate=0.5, fim_spm_rate=0.3)[17]["tokens"], ds[17]["tokens"])


def test_psm_spm_everywhere_and_no_prefix(tok, corpus):
    low = corpus["plain"]
    for spm, want in ((0.0, "psm"), (1.0, "spm")):
        ds = fim(tok, low, fim_rate=1.0, fim_spm_rate=spm, fim_no_prefix="#!")
        kinds = []
        for i in range(0, len(ds), 5):
            for seg in segments(tok, ds.get_raw_sample(i)[0]):
                if len(seg) == 0:
                    continue
                kind, reassembled, cut = parse(tok, seg)
                if reassembled.startswith("#!"):
                    assert kind == "plain"
                    continue
                kinds.append(kind)
                assert kind == want or (want == "psm" and kind == "spm")  # an empty prefix (parse's doc)
        assert np.mean(np.asarray(kinds) == want) > (0.85 if want == "psm" else 0.999)


def test_fragments(tok, corpus):
    low, sep = corpus["files"], ids(tok, "<file_sep>")
    raw = GPTDataset(low, np.arange(len(low)), None, SEQ, 1234, tok.eod)
    every = fim(tok, low, fim_rate=1.0, fim_spm_rate=0.0, fim_split_sample="<file_sep>", fim_fragment_rate=1.0)
    whole_only = fim(tok, low, fim_rate=1.0, fim_spm_rate=0.0, fim_split_sample="<file_sep>", fim_fragment_rate=0.0)
    split_seen = 0
    for i in range(len(every)):
        ref = raw.get_raw_sample(i)[0]
        # a segment with split tokens: fim_rate picks it, then no fragment is transformed at rate 0;
        # a segment without one is transformed at fim_rate
        for seg, orig in zip(segments(tok, whole_only.get_raw_sample(i)[0]), segments(tok, ref)):
            if len(orig) == 0:
                continue
            if sep in orig:
                np.testing.assert_array_equal(seg, orig)
            else:
                kind, reassembled, _ = parse(tok, seg)
                assert kind != "plain" and reassembled == text(tok, orig)
        for seg, orig in zip(segments(tok, every.get_raw_sample(i)[0]), segments(tok, ref)):
            parts, orig_parts = np.split(seg, np.flatnonzero(seg == sep)), np.split(orig, np.flatnonzero(orig == sep))
            assert len(parts) == len(orig_parts)  # the split tokens stay in place
            split_seen += len(parts) > 1
            for k, (part, o) in enumerate(zip(parts, orig_parts)):
                part, o = part[1:] if k else part, o[1:] if k else o
                if len(o) == 0:  # split tokens in a row: kept, nothing to transform
                    assert len(part) == 0
                    continue
                kind, reassembled, _ = parse(tok, part)
                assert kind != "plain" and reassembled == text(tok, o)  # each fragment on its own
    assert split_seen > 20


def test_padding_is_fim_pad_and_out_of_the_loss(tok, corpus):
    # decoding drops the <file_sep> special tokens, so the transformed sample is shorter: padded
    ds = GPTFIMDataset(corpus["specials"], np.arange(1), None, 16, 0, tok.eod, tokenizer=tok, fim_rate=1.0)
    pad = ids(tok, "<fim_pad>")
    s = ds[0]
    n_pad = int(np.sum(s["tokens"] == pad))
    assert s["tokens"].shape == (16,) and n_pad > 0 and np.all(s["tokens"][-n_pad:] == pad)
    np.testing.assert_array_equal(s["loss_mask"], (s["labels"] != pad).astype(np.float32))


def megatron_permute(tok, sample, fim_rate, fim_spm_rate, rng, no_fim_prefix=None):
    """Megatron's GPTFIMDataset._permute with truncate_or_pad=False, transcribed."""
    pre, mid, suf = ids(tok, "<fim_prefix>"), ids(tok, "<fim_middle>"), ids(tok, "<fim_suffix>")
    if rng.binomial(1, fim_rate):
        contents = tok.tokenizer.decode(list(map(int, sample)), skip_special_tokens=True)
        if no_fim_prefix is not None and contents.startswith(no_fim_prefix):
            return sample
        boundaries = list(rng.randint(low=0, high=len(contents) + 1, size=2))
        boundaries.sort()
        prefix = np.array([*tok.tokenize(contents[:boundaries[0]])], dtype=np.int64)
        middle = np.array([*tok.tokenize(contents[boundaries[0]:boundaries[1]])], dtype=np.int64)
        suffix = np.array([*tok.tokenize(contents[boundaries[1]:])], dtype=np.int64)
        if rng.binomial(1, fim_spm_rate):
            return np.concatenate([[pre, suf], suffix, [mid], prefix, middle])
        return np.concatenate([[pre], prefix, [suf], suffix, [mid], middle])
    return sample


def test_one_transformation_draws_as_megatron(tok, corpus):
    ds = fim(tok, corpus["plain"], fim_rate=0.7, fim_spm_rate=0.5)
    for seed in range(30):
        seq = np.asarray(tok.tokenize(corpus["docs"][seed + 1]), dtype=np.int64)
        ours = ds._permute(seq, 0.7, np.random.RandomState(seed))
        np.testing.assert_array_equal(ours, megatron_permute(tok, seq, 0.7, 0.5, np.random.RandomState(seed)))


def test_bad_settings_and_the_config_route(tok, corpus, tmp_path):
    low = corpus["plain"]
    with pytest.raises(ValueError, match="fim_prefix_token"):
        fim(tok, low, fim_extra_tokens={"prefix": "<nope>"})
    with pytest.raises(ValueError, match="fim_rate"):
        fim(tok, low, fim_rate=1.5)
    with pytest.raises(ValueError, match="fim_fragment_rate"):
        fim(tok, low, fim_split_sample="<file_sep>")
    with pytest.raises(ValueError, match="one token"):
        fim(tok, low, fim_split_sample="two words", fim_fragment_rate=0.5)
    with pytest.raises(ValueError, match="HuggingFaceTokenizer"):
        fim(NullTokenizer(300), low)
    from jmegatron.data.builder import build_datasets
    cfg = load_config_file("configs/gpt_tiny.py", dict(data_path=low.path_prefix, tokenizer_model=tok.path, fim_data=True,
                                      fim_rate=1.0, split="1,0,0", seq_length=SEQ, max_position_embeddings=SEQ,
                                      micro_batch_size=1, global_batch_size=8, train_iters=2, lr_warmup_iters=1))
    train, valid, _ = build_datasets(cfg, 8)
    assert isinstance(train, GPTFIMDataset) and valid is None
    assert ids(tok, "<fim_prefix>") in train[0]["tokens"]
