"""GPTDataset / BlendedDataset index building against megatron-core's own: its GPTDataset
(gpt_dataset.py) over the same files, and the compiled helpers.cpp (build_sample_idx,
build_blending_indices)."""

import math
import types

import numpy as np
import pytest
from megatron.core.datasets import helpers as mcore_helpers
from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexedDataset
from megatron.core.datasets.utils import Split

from jmegatron.data.blended_dataset import (
    BlendedDataset,
    build_blending_indices,
    build_train_valid_test_datasets,
    convert_split_vector_to_split_matrix,
    get_blend_from_list,
    parse_and_normalize_split,
)
from jmegatron.data.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    build_sample_index,
    get_ltor_masks_and_position_ids,
)
from jmegatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

EOD = 0


# ----------------------------------------------------------------- megatron-core's own
def megatron_blending_indices(weights, size):
    """megatron-core's helpers.cpp build_blending_indices (compiled C++), as BlendedDataset calls it."""
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    mcore_helpers.build_blending_indices(dataset_index, dataset_sample_index, np.asarray(weights, np.float64),
                                         len(weights), size, False)
    return dataset_index, dataset_sample_index


def megatron_indices(prefix, documents, num_samples, L, seed):
    """megatron-core's GPTDataset over the same .bin/.idx files (its own IndexedDataset
    reader): its document, sample and shuffle indices and its number of epochs."""
    tokenizer = types.SimpleNamespace(vocab_size=None, eod=EOD, unique_identifiers={"eod": EOD})
    config = GPTDatasetConfig(random_seed=seed, sequence_length=L, blend=None, blend_per_split=None, split="1",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=None)
    ds = MegatronGPTDataset(MegatronIndexedDataset(prefix), prefix, documents, num_samples, Split.train, config)
    epochs = ds._get_num_epochs(ds._get_num_tokens_per_epoch())
    return ds.document_index, ds.sample_index, ds.shuffle_index, epochs


# ----------------------------------------------------------------- fixtures
def _write(prefix, docs, dtype=np.int32):
    b = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(np.asarray(d), [len(d)])
    b.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def _docs(n, seed, lo=1, hi=40):
    """Documents whose tokens identify (document, position) and end with EOD."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        k = int(rng.integers(lo, hi))
        out.append(list(1000 * (i + 1) + np.arange(k - 1)) + [EOD])
    return out


@pytest.fixture(scope="module")
def small_ds(tmp_path_factory):
    return _write(str(tmp_path_factory.mktemp("gpt") / "small"), _docs(30, 0))


# ----------------------------------------------------------------- sample index
@pytest.mark.parametrize("extra", [1, 0])
@pytest.mark.parametrize("drop", [True, False])
def test_sample_index_matches_helpers_cpp(extra, drop):
    rng = np.random.default_rng(1)
    for trial in range(25):
        n_seq = int(rng.integers(1, 12))
        sizes = rng.integers(0 if trial % 3 else 1, 20, size=n_seq).astype(np.int32)
        if sizes.sum() < 3:
            sizes[0] += 3
        docs = np.arange(n_seq, dtype=np.int32)
        epochs = int(rng.integers(1, 4))
        doc_idx = np.tile(docs, epochs)
        rng.shuffle(doc_idx)
        if extra == 1 and sizes[doc_idx[-1]] == 0:
            continue  # helpers.cpp would write a negative offset here; never reached in practice
        L = int(rng.integers(2, 9))
        tpe = int(sizes.sum())
        want = mcore_helpers.build_sample_idx(sizes, doc_idx.astype(np.int32), L, epochs, tpe, drop, bool(extra))
        got = build_sample_index(sizes, doc_idx, L, epochs, tpe, drop, bool(extra))
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("num_samples,L,seed", [(5, 8, 1), (40, 16, 3), (300, 7, 5),
                                                (101, 32, 9), (None, 8, 2)])
def test_indices_match_megatron_cores_gpt_dataset(small_ds, num_samples, L, seed):
    documents = np.arange(3, 27, dtype=np.int32)
    ds = GPTDataset(small_ds, documents, num_samples, L, seed, EOD)
    d, s, sh, epochs = megatron_indices(small_ds.path_prefix, documents, num_samples, L, seed)
    np.testing.assert_array_equal(ds.document_index, d)
    np.testing.assert_array_equal(ds.sample_index, s)
    np.testing.assert_array_equal(ds.shuffle_index, sh)
    assert ds.shuffle_index.dtype == np.uint32 and ds.document_index.dtype == np.int32
    assert ds.num_epochs == epochs
    if num_samples is not None:
        assert len(ds) >= num_samples


def test_samples_are_contiguous_windows_and_cover_epochs(small_ds):
    documents = np.arange(0, 30, dtype=np.int32)
    L, num_samples = 12, 250
    ds = GPTDataset(small_ds, documents, num_samples, L, 7, EOD)
    # every document appears once per epoch
    counts = np.bincount(ds.document_index, minlength=30)
    assert ds.num_epochs > 1 and np.all(counts == ds.num_epochs)
    stream = np.concatenate([small_ds[int(d)] for d in ds.document_index]).astype(np.int64)
    assert len(ds) == (len(stream) - 1) // L
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        raw, _ = ds.get_raw_sample(i)
        assert raw.shape == (L + 1,)
        np.testing.assert_array_equal(raw, stream[j * L: j * L + L + 1])
        item = ds[i]
        np.testing.assert_array_equal(item["tokens"], raw[:-1])
        np.testing.assert_array_equal(item["labels"], raw[1:])


def test_separate_final_epoch():
    # 10 documents x 10 tokens: 99 // 10 = 9 samples per epoch; ask for 1 epoch + 2 samples
    sizes = np.full(10, 10, dtype=np.int32)

    class Fake:
        sequence_lengths = sizes

        @staticmethod
        def get(idx, offset=0, length=None):
            return np.arange(10)[offset:None if length is None else offset + length]

    ds = GPTDataset(Fake(), np.arange(10), 11, 10, 0, EOD)
    assert ds.num_epochs == 2 and ds.separate_final_epoch
    assert sorted(ds.document_index[:10]) == list(range(10))
    assert sorted(ds.document_index[10:]) == list(range(10))
    sans = (10 * 10 - 1) // 10
    assert sorted(ds.shuffle_index[:sans]) == list(range(sans))
    assert sorted(ds.shuffle_index[sans:]) == list(range(sans, len(ds)))


def test_determinism_and_seed(small_ds):
    docs = np.arange(30)
    a = GPTDataset(small_ds, docs, 60, 10, 11, EOD)
    b = GPTDataset(small_ds, docs, 60, 10, 11, EOD)
    c = GPTDataset(small_ds, docs, 60, 10, 12, EOD)
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    np.testing.assert_array_equal(a.document_index, b.document_index)
    for i in (0, 17, 59):
        for k in a[i]:
            np.testing.assert_array_equal(a[i][k], b[i][k])
    assert not np.array_equal(a.document_index, c.document_index)
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)


def test_item_dtypes_masks_and_positions(small_ds):
    L = 50
    ds = GPTDataset(small_ds, np.arange(30), 10, L, 1, EOD, reset_position_ids=True,
                    reset_attention_mask=True, eod_mask_loss=True)
    item = ds[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids", "segment_ids"}
    for k in ("tokens", "labels", "position_ids", "segment_ids"):
        assert item[k].dtype == np.int32 and item[k].shape == (L,)
    assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].shape == (L,)
    tokens = item["tokens"]
    eods = np.flatnonzero(tokens == EOD)
    assert eods.size > 0
    np.testing.assert_array_equal(item["loss_mask"], (tokens != EOD).astype(np.float32))
    pos = item["position_ids"]
    start = 0
    for e in list(eods) + [L - 1]:
        np.testing.assert_array_equal(pos[start:e + 1], np.arange(e + 1 - start))
        start = e + 1
    np.testing.assert_array_equal(item["segment_ids"], np.concatenate(
        [[0], np.cumsum(tokens[:-1] == EOD)]))
    plain = GPTDataset(small_ds, np.arange(30), 10, L, 1, EOD)[0]
    assert set(plain) == {"tokens", "labels", "loss_mask", "position_ids"}
    np.testing.assert_array_equal(plain["position_ids"], np.arange(L))
    assert plain["loss_mask"].sum() == L


def test_ltor_matches_megatron_loop():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=40)
    _, pos, _ = get_ltor_masks_and_position_ids(tokens, 0, True, False, False)
    want = np.arange(40)
    prev = 0
    for i in np.flatnonzero(tokens == 0):
        want[i + 1:] -= i + 1 - prev
        prev = i + 1
    np.testing.assert_array_equal(pos, want)


def test_no_extra_token_and_partial_padding(small_ds):
    L = 16
    ds = GPTDataset(small_ds, np.arange(30), None, L, 4, EOD, add_extra_token_to_sequence=False,
                    drop_last_partial_sequence=False)
    for i in range(len(ds)):
        item = ds[i]
        np.testing.assert_array_equal(item["labels"][:-1], item["tokens"][1:])
        assert item["loss_mask"][-1] == 0
    # the padded last sample (pad id -1) is masked and mapped to token 0
    last = int(np.flatnonzero(ds.shuffle_index == len(ds) - 1)[0])
    raw, _ = ds.get_raw_sample(last)
    if (raw == -1).any():
        assert ds[last]["loss_mask"][raw[:L] == -1].sum() == 0
        assert (ds[last]["tokens"] >= 0).all()


def test_mock_dataset():
    a = MockGPTDataset(64, 32, vocab_size=100, seed=3)
    b = MockGPTDataset(64, 32, vocab_size=100, seed=3)
    c = MockGPTDataset(64, 32, vocab_size=100, seed=4)
    assert len(a) >= 64
    x, y, z = a[5], b[5], c[5]
    assert x["tokens"].shape == (32,) and x["tokens"].dtype == np.int32
    assert x["tokens"].min() >= 0 and x["tokens"].max() < 100
    np.testing.assert_array_equal(x["tokens"], y["tokens"])
    assert not np.array_equal(a.shuffle_index, c.shuffle_index)
    np.testing.assert_array_equal(x["labels"][:-1], x["tokens"][1:])


def test_bad_arguments(small_ds):
    with pytest.raises(ValueError, match="document_ids"):
        GPTDataset(small_ds, np.array([], dtype=np.int32), 5, 8, 0, EOD)
    with pytest.raises(ValueError, match="document_ids"):
        GPTDataset(small_ds, np.array([99]), 5, 8, 0, EOD)
    with pytest.raises(ValueError, match="seq_length"):
        GPTDataset(small_ds, np.arange(3), 5, 0, 0, EOD)
    with pytest.raises(IndexError):
        GPTDataset(small_ds, np.arange(3), 2, 8, 0, EOD)[10 ** 6]


# ----------------------------------------------------------------- blending
def test_blending_indices_match_helpers_cpp():
    rng = np.random.default_rng(0)
    cases = [[0.3, 0.7], [1 / 3, 2 / 3], [0.25] * 4, [1.0]] + [
        list(rng.random(int(rng.integers(2, 6)))) for _ in range(6)]
    for w in cases:
        w = list(np.asarray(w) / np.sum(w))
        size = int(rng.integers(1, 3000))
        di, dsi = build_blending_indices(w, size)
        wdi, wdsi = megatron_blending_indices(w, size)
        assert di.dtype == np.int16 and dsi.dtype == np.int64
        np.testing.assert_array_equal(di, wdi)
        np.testing.assert_array_equal(dsi, wdsi)
        counts = np.bincount(di, minlength=len(w))
        assert np.all(np.abs(counts - np.asarray(w) * size) <= 1.0)


def test_split_parsing():
    assert np.allclose(parse_and_normalize_split("949,50,1"), [0.949, 0.05, 0.001])
    assert np.allclose(parse_and_normalize_split("90/10"), [0.9, 0.1, 0.0])
    assert np.allclose(parse_and_normalize_split("1"), [1.0, 0.0, 0.0])
    m = convert_split_vector_to_split_matrix(parse_and_normalize_split("98,2,0"))
    assert m[0] == (0, 0.98) and m[1][0] == 0.98 and math.isclose(m[1][1], 1.0) and m[2] is None
    for bad in ["", "a,b", "1,2,3,4", "-1,2", "0,0,0", "1e3,1"]:
        with pytest.raises(ValueError, match="split"):
            parse_and_normalize_split(bad)


def test_blend_list_parsing():
    assert get_blend_from_list(["p"]) == (["p"], None)
    assert get_blend_from_list(["a", "b"]) == (["a", "b"], None)
    assert get_blend_from_list(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert get_blend_from_list("30 a 70 b") == (["a", "b"], [30.0, 70.0])
    for bad in [[], ["0.3", "a", "b", "c"], ["-1", "a", "2", "b"], ["0", "a", "1", "b"]]:
        with pytest.raises(ValueError, match="data_path"):
            get_blend_from_list(bad)


@pytest.fixture(scope="module")
def two_prefixes(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    _write(str(d / "a"), _docs(200, 1, 5, 30))
    # tokens of "b" are >= 10**6, those of "a" below
    _write(str(d / "b"), [[t + 10 ** 6 for t in doc[:-1]] + [EOD] for doc in _docs(150, 2, 5, 30)])
    return str(d / "a"), str(d / "b")


def test_weighted_blend_sizes_and_ratio(two_prefixes):
    a, b = two_prefixes
    sizes = (1000, 100, 10)
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", a, "0.7", b], "90,8,2", sizes, seq_length=16, seed=5, eod_id=EOD)
    for ds, n in zip((train, valid, test), sizes):
        assert isinstance(ds, BlendedDataset)
        # Megatron: target ceil(n*w) per dataset, blend size the sum, mid-level datasets built
        # with ceil(ceil(n*w) * 1.005) samples
        assert len(ds) == math.ceil(n * 0.3) + math.ceil(n * 0.7)
        assert ds.datasets[0].num_samples == math.ceil(math.ceil(n * 0.3) * 1.005)
        assert ds.datasets[1].num_samples == math.ceil(math.ceil(n * 0.7) * 1.005)
    frac_b = np.mean(train.dataset_index == 1)
    assert abs(frac_b - 0.7) < 0.002
    for i in range(0, 1000, 7):  # each sample comes from the dataset dataset_index names
        t = train[i]["tokens"]
        from_b = bool(((t >= 10 ** 6) | (t == EOD)).all())
        assert from_b == bool(train.dataset_index[i] == 1)
    # splits use disjoint document ranges: a has 200 documents -> train [0, 180)
    np.testing.assert_array_equal(train.datasets[0].indices, np.arange(0, 180))
    np.testing.assert_array_equal(valid.datasets[0].indices, np.arange(180, 196))
    np.testing.assert_array_equal(test.datasets[0].indices, np.arange(196, 200))


def test_single_prefix_and_empty_split(two_prefixes):
    a, _ = two_prefixes
    train, valid, test = build_train_valid_test_datasets([a], "1,0,0", (40, 0, 0), 16, 5, EOD)
    assert isinstance(train, GPTDataset) and valid is None and test is None
    assert len(train) >= 40 and train.num_samples == 40
    t2, _, _ = build_train_valid_test_datasets([a], "1,0,0", (40, 0, 0), 16, 5, EOD)
    np.testing.assert_array_equal(train.shuffle_index, t2.shuffle_index)


def test_unweighted_multi_prefix(two_prefixes):
    a, b = two_prefixes
    train, _, _ = build_train_valid_test_datasets([a, b], "1,0,0", (100, 0, 0), 16, 5, EOD)
    assert isinstance(train, BlendedDataset) and len(train) == 100
    lengths = np.array([len(d) for d in train.datasets], dtype=np.float64)
    assert np.allclose(train.weights, lengths / lengths.sum())


def test_builder_errors(two_prefixes, tmp_path):
    a, _ = two_prefixes
    with pytest.raises(ValueError, match="data_path.*not found"):
        build_train_valid_test_datasets([str(tmp_path / "nope")], "1", (1, 0, 0), 8, 0, EOD)
    with pytest.raises(ValueError, match="drop the suffix"):
        build_train_valid_test_datasets([a + ".bin"], "1", (1, 0, 0), 8, 0, EOD)
    with pytest.raises(ValueError, match="split"):
        build_train_valid_test_datasets([a], "90,x,1", (1, 0, 0), 8, 0, EOD)
    with pytest.raises(ValueError, match="train_valid_test_num_samples"):
        build_train_valid_test_datasets([a], "1", (1, 0), 8, 0, EOD)
    with pytest.raises(ValueError, match="data_path"):
        build_train_valid_test_datasets(["0.5", a, "x", a], "1", (1, 0, 0), 8, 0, EOD)


def test_mock_builder():
    train, valid, test = build_train_valid_test_datasets(None, "949,50,1", (20, 5, 5), 16, 0,
                                                         None, mock=True, vocab_size=64)
    assert len(train) >= 20 and len(valid) >= 5 and len(test) >= 5
    assert train[0]["tokens"].max() < 64
    with pytest.raises(ValueError, match="vocab_size"):
        build_train_valid_test_datasets(None, "1", (1, 1, 1), 8, 0, None, mock=True)
