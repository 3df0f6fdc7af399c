"""ByteMLPerf's variable-length data: samples against a transcription of its
GPTVariableDataset.__getitem__, padding as its batch_pad, one compilation per length (each
announced), the memory line per length and its reserved pool across seeds (ByteMLPerf's
variable-memory workload)."""

import collections
import re

import jax
import numpy as np
import pytest

from jmegatron.bench.__main__ import main as bench_main
from jmegatron.bench.megatron_log import read_log
from jmegatron.config import ConfigError, JMegatronConfig, base_config, from_configdict
from jmegatron.data.builder import build_datasets
from jmegatron.data.gpt_dataset import MockGPTDataset, get_ltor_masks_and_position_ids
from jmegatron.data.gpt_variable_dataset import GPTVariableDataset
from jmegatron.data.loader import BatchLoader, stack_samples
from jmegatron.parallel.mesh import create_mesh
from jmegatron.training.loop import pretrain
from jmegatron.training.run import build

EOD = 0


def bytemlperf_variable_sample(base, idx, seq_length, eod_mask_loss):
    """ByteMLPerf byte_train_perf/Megatron-LM/megatron/core/datasets/gpt_dataset.py,
    GPTVariableDataset.__getitem__ with the drawn length given (add_extra_token_to_sequence)."""
    text, _ = base.get_raw_sample(idx)
    text = np.concatenate((text[:seq_length], [EOD]))
    tokens, labels = text[:-1].copy(), text[1:].copy()
    loss_mask, position_ids, _ = get_ltor_masks_and_position_ids(tokens, EOD, False, False, eod_mask_loss)
    loss_mask[labels == -1] = 0.0
    tokens[tokens == -1] = 0
    labels[labels == -1] = 0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


@pytest.mark.parametrize("eod_mask_loss", [False, True])
def test_samples_match_bytemlperf(eod_mask_loss):
    base = MockGPTDataset(200, 64, vocab_size=50, seed=3, eod_id=EOD, eod_mask_loss=eod_mask_loss,
                          max_document_length=40)
    var = GPTVariableDataset(base, 64, 6, seed=3, eod_id=EOD, eod_mask_loss=eod_mask_loss)
    assert var.lengths == tuple(64 - 6 * k for k in range(1, 10))
    seen_eod_last = 0
    for i in range(len(var)):
        got = var[i]
        n = var.sample_length(i)
        want = bytemlperf_variable_sample(base, i, n, eod_mask_loss)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"sample {i} {key}")
        seen_eod_last += int(got["tokens"][-1] == EOD)
    assert seen_eod_last > 0  # the eod_mask_loss case of the last token was exercised


def test_lengths_are_deterministic_and_cover_every_step():
    base = MockGPTDataset(2000, 32, vocab_size=50, seed=1)
    a, b = GPTVariableDataset(base, 32, 3, seed=7, eod_id=EOD), GPTVariableDataset(base, 32, 3, seed=7, eod_id=EOD)
    other = GPTVariableDataset(base, 32, 3, seed=8, eod_id=EOD)
    lengths = [a.sample_length(i) for i in range(2000)]
    assert lengths == [b.sample_length(i) for i in range(2000)]
    assert lengths != [other.sample_length(i) for i in range(2000)]
    counts = collections.Counter(lengths)
    assert sorted(counts) == sorted(a.lengths)
    assert min(counts.values()) > 2000 / 9 * 0.7  # k uniform on 1..9, as numpy.random.randint(1, 10)


def bytemlperf_rand_var_seq_length(seq_length, seq_length_min, seq_length_step, draws):
    """ByteMLPerf's GPTVariableDataset._get_rand_var_seq_length, ``draws`` times (its dataset
    keeps ``seq_length_min`` and draws without it)."""
    return [seq_length - np.random.randint(1, 10) * seq_length_step for _ in range(draws)]


def test_seq_length_min_bounds_the_lengths_bytemlperf_draws():
    assert JMegatronConfig.seq_length_min == 128  # ByteMLPerf's --seq-length-min default
    base = MockGPTDataset(2000, 64, vocab_size=50, seed=1)
    np.random.seed(0)
    want = collections.Counter(bytemlperf_rand_var_seq_length(64, 10, 6, 2000))
    for seq_length_min in (1, 10):  # the shortest, 64 - 9 x 6, reaches either: the same lengths
        var = GPTVariableDataset(base, 64, 6, seed=7, eod_id=EOD, seq_length_min=seq_length_min)
        got = collections.Counter(var.sample_length(i) for i in range(2000))
        assert sorted(got) == sorted(want) == sorted(var.lengths) and min(var.lengths) == 10
        assert all(abs(got[n] - want[n]) < 0.3 * 2000 / 9 for n in want)  # both uniform on k in 1..9
    with pytest.raises(ValueError, match=r"seq_length_min=11 exceeds the shortest length seq_length - 9 x "
                                         r"seq_length_step = 10"):
        GPTVariableDataset(base, 64, 6, seed=7, eod_id=EOD, seq_length_min=11)
    # the config: the field checked by name, and the datasets built with it
    with pytest.raises(ConfigError, match=r"config\.seq_length_min=5 exceeds the shortest variable_data sample, "
                                          r"seq_length - 9 x seq_length_step = 4"):
        _cfg(seq_length_min=5)
    with pytest.raises(ConfigError, match=r"config\.seq_length_min=128 exceeds"):
        _cfg(seq_length_min=128)  # ByteMLPerf's default refuses 40 - 9 x 4
    cfg = _cfg(seq_length_min=4)
    assert all(ds.seq_length_min == 4 for ds in build_datasets(cfg, 2))


def test_batches_are_padded_to_their_longest_like_batch_pad():
    base = MockGPTDataset(50, 32, vocab_size=50, seed=1)
    var = GPTVariableDataset(base, 32, 3, seed=2, eod_id=EOD)
    samples = [var[i] for i in range(4)]
    lens = [len(s["tokens"]) for s in samples]
    batch = stack_samples(samples, 2)
    longest = max(lens)
    assert batch["tokens"].shape == (2, 2, longest)
    flat = {k: v.reshape(4, longest) for k, v in batch.items()}
    for i, (s, n) in enumerate(zip(samples, lens)):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            np.testing.assert_array_equal(flat[key][i, :n], s[key])
        assert not flat["tokens"][i, n:].any() and not flat["labels"][i, n:].any()
        assert not flat["loss_mask"][i, n:].any()  # padding never counts in the loss
        np.testing.assert_array_equal(flat["position_ids"][i], np.arange(longest))


def _cfg(**kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 256
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 1, 32, 2, 40
    c.micro_batch_size, c.global_batch_size = 2, 2
    c.variable_data, c.seq_length_step, c.seq_length_min = True, 4, 4
    c.train_iters, c.log_interval, c.eval_interval, c.eval_iters = 12, 4, 0, 1
    c.hidden_dropout, c.attention_dropout, c.peak_tflops = 0.0, 0.0, 1.0
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


def test_padding_does_not_change_the_loss():
    cfg = _cfg()
    run = build(cfg, create_mesh(cfg, jax.devices()[:1]))
    params = run.init_state().params
    train, _, _ = build_datasets(cfg, run.global_batch_size)
    assert isinstance(train, GPTVariableDataset)
    batch = BatchLoader(train, 2, 1).batch_at(0)
    seq = batch["tokens"].shape[-1]
    assert seq in train.lengths
    wider = {k: np.concatenate([v, np.zeros(v.shape[:-1] + (40 - seq,), v.dtype)], -1) for k, v in batch.items()}
    wider["position_ids"][..., seq:] = np.arange(seq, 40)
    total, count = jax.device_get(run.eval_step(params, run.put_batch(batch)))
    total_w, count_w = jax.device_get(run.eval_step(params, run.put_batch(wider)))
    assert count == count_w == batch["loss_mask"].sum()
    np.testing.assert_allclose(total, total_w, rtol=1e-5)


@pytest.mark.slow
def test_training_compiles_once_per_padded_length_and_measures_memory_per_length(tmp_path, capsys):
    # ByteMLPerf's variable-memory run: a memory line per iteration; padded lengths 20, 24, 24, 36
    cfg = _cfg(test_memory=True, log_interval=1, train_iters=4)
    mesh = create_mesh(cfg, jax.devices()[:1])
    train, _, _ = build_datasets(cfg, 2)
    batch_length = [max(train.sample_length(2 * i), train.sample_length(2 * i + 1)) for i in range(cfg.train_iters)]
    lengths, longest = set(batch_length), max(train.lengths)
    assert batch_length == [20, 24, 24, 36] and longest == 36
    out = pretrain(cfg, mesh)
    log = capsys.readouterr().out
    assert out["iteration"] == 4 and all(np.isfinite(v) for v in out["losses"].values())
    # one program per length, each compilation announced; the longest's compiled at the first memory
    # line (its pool) and run at iteration 4 without a second compilation
    assert out["run"].train_step._cache_size() == len(lengths)
    assert log.index("compiled the train step for tokens [1, 2, 36]") < log.index("(after 1 iterations) memory")
    announced = re.findall(r"^\[jmegatron\] compiling the train step for tokens \[1, 2, (\d+)\] \.\.\.\n"
                           r"\[jmegatron\] compiled the train step for tokens \[1, 2, \1\] in [0-9.]+ s$", log, re.M)
    assert sorted(map(int, announced)) == sorted(lengths)
    # the memory line is each length's: the same length gives the same figures, another length others
    (tmp_path / "a.log").write_text(log)
    memory = read_log(str(tmp_path / "a.log")).memory[0]
    assert [m.iteration for m in memory] == list(range(1, 5))
    peak = {}
    for m, n in zip(memory, batch_length):
        assert peak.setdefault(n, (m.allocated, m.max_allocated)) == (m.allocated, m.max_allocated)
    assert len(set(peak.values())) == len(lengths)
    assert [n for n, _ in sorted(peak.items(), key=lambda kv: kv[1][1])] == sorted(lengths)  # longer: more memory
    # reserved: the pool that runs every length, the same at every iteration and in a run of another seed
    assert {(m.reserved, m.max_reserved) for m in memory} == {(peak[36][1], peak[36][1])}
    other = _cfg(test_memory=True, log_interval=1, train_iters=3, seed=1)  # lengths 28, 20, 20
    pretrain(other, mesh)
    (tmp_path / "b.log").write_text(capsys.readouterr().out)
    assert bench_main(["memory_chart", "-b", str(tmp_path / "a.log"), "-i", str(tmp_path / "b.log"),
                       "-o", str(tmp_path / "chart"), "--reserved"]) == 0
