"""The batch loader at scale (jmegatron/data/loader.py, data/prefetch.py): process-local
rows from the batch shardings, variable-length padding agreed without reading tokens,
Megatron's end of the data (single / cyclic), and the prefetch thread (order, errors at
the batch they concern, exact positions, clean close). Two real processes:
tests/test_multiprocess.py."""

import threading
import time

import numpy as np
import pytest

from jmegatron.config import base_config, from_configdict
from jmegatron.data.gpt_dataset import MockGPTDataset
from jmegatron.data.gpt_variable_dataset import GPTVariableDataset
from jmegatron.data.loader import BatchLoader, DataExhaustedError
from jmegatron.data.prefetch import Prefetcher
from jmegatron.parallel.mesh import create_mesh
from jmegatron import num_microbatches_calculator as nmc
from jmegatron.parallel import rules as rules_lib
from jmegatron.training.run import build, process_rows


class IndexDataset:
    """Sample i is the constant sequence i; counts reads; ``fail_at`` raises on that index."""

    def __init__(self, n=1000, seq=4, fail_at=None, delay=0.0):
        self.n, self.seq, self.fail_at, self.delay, self.read = n, seq, fail_at, delay, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is unreadable")
        if self.delay:
            time.sleep(self.delay)
        self.read.append(int(i))
        z = np.full(self.seq, i)
        return {"tokens": z, "labels": z, "loss_mask": np.ones(self.seq), "position_ids": np.arange(self.seq)}


def _cfg(**kw):
    c = base_config()
    c.mock_data, c.vocab_size = True, 64
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 1, 16, 2, 8
    c.max_position_embeddings = 8
    c.micro_batch_size, c.global_batch_size = 1, 16
    c.train_iters, c.lr_warmup_iters, c.eval_interval = 4, 1, 0
    for k, v in kw.items():
        setattr(c, k, v)
    return from_configdict(c)


# --- (a) process-local rows ---

@pytest.mark.parametrize("tp,processes,expected", [
    (1, 2, [range(0, 4), range(4, 8)]),  # dp 8, 4 devices a process: 4 data ranks each
    (2, 2, [range(0, 2), range(2, 4)]),  # tp innermost: a process = 2 tensor groups = 2 data ranks
    (2, 4, [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),  # one tensor group each
])
def test_rows_a_process_holds_follow_the_batch_shardings(tp, processes, expected):
    cfg = _cfg(tensor_model_parallel_size=tp)
    mesh = create_mesh(cfg)
    sharding = rules_lib.batch_shardings(mesh)["tokens"]
    rows = 8 // tp  # micro_batch_size 1 x dp
    per = 8 // processes
    got = [process_rows(sharding, rows, p, process_of=lambda d: d.id // per).tolist() for p in range(processes)]
    assert got == [list(r) for r in expected]


def test_context_parallel_rows_are_still_a_row_subset():
    cfg = _cfg(context_parallel_size=2, seq_length=8)
    mesh = create_mesh(cfg)
    sharding = rules_lib.batch_shardings(mesh)["tokens"]  # dp 4 x cp 2: rows over data only
    # the two devices of a context group hold the same rows: a process of one group reads 1 row
    assert [process_rows(sharding, 4, p, process_of=lambda d: d.id // 2).tolist() for p in range(4)] == \
        [[0], [1], [2], [3]]


def test_loader_reads_only_its_rows_and_the_processes_together_read_the_global_batch():
    whole = BatchLoader(IndexDataset(), 16, 2, 8)  # 8 rows per micro-batch
    parts = [IndexDataset() for _ in range(2)]
    loaders = [BatchLoader(parts[p], 16, 2, 8, rows=range(4 * p, 4 * p + 4)) for p in range(2)]
    for _ in range(3):
        ref = next(whole)
        got = [next(loader) for loader in loaders]
        for key in ref:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got], axis=1), ref[key])
    # 3 batches x 2 micro-batches x 4 rows, all of its rows and only those
    for p in range(2):
        assert len(parts[p].read) == 24 and all(i % 8 in range(4 * p, 4 * p + 4) for i in parts[p].read)
    assert loaders[0].consumed_samples == whole.consumed_samples == 8 + 3 * 16
    with pytest.raises(ValueError, match=r"rows=\[8\] must be distinct rows of \[0, 8\)"):
        BatchLoader(IndexDataset(), 16, 2, rows=[8])


def test_variable_length_padding_is_the_global_batchs_longest_in_every_process():
    base = MockGPTDataset(num_samples=64, seq_length=32, vocab_size=50, seed=3)
    data = GPTVariableDataset(base, 32, 3, seed=5, eod_id=0)
    whole = BatchLoader(data, 8, 2)
    local = [BatchLoader(data, 8, 2, rows=[p]) for p in range(4)]
    seen = set()
    for consumed in range(0, 64, 8):
        ref = whole.batch_at(consumed)
        got = [loader.batch_at(consumed) for loader in local]
        seen.add(ref["tokens"].shape[-1])
        for key in ref:  # same padded length everywhere, and the rows of the global batch
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got], axis=1), ref[key])
    assert len(seen) > 1  # the test covers batches of different padded lengths


def test_unequal_lengths_without_sample_length_are_refused_for_local_reads():
    class Ragged(IndexDataset):
        def __getitem__(self, i):
            s = super().__getitem__(i)
            return {k: v[: 2 + i % 3] for k, v in s.items()}

    BatchLoader(Ragged(), 4, 1).batch_at(0)  # whole batches: padded to the longest, as before
    with pytest.raises(ValueError, match="no sample_length"):
        BatchLoader(Ragged(), 4, 1, rows=[0, 1]).batch_at(0)


def test_put_batch_assembles_the_global_array_from_process_rows():
    run = build(_cfg())  # dp 8, 2 micro-batches of 8 rows
    assert run.batch_rows() is None  # one process holds every row
    data = IndexDataset(seq=8)
    ref = run.put_batch(BatchLoader(data, 16, 2).batch_at(0))
    order = np.array([5, 1, 7, 0, 3, 6, 2, 4])  # any order of rows: placed by their global row
    local = {k: v[:, order] for k, v in BatchLoader(data, 16, 2).batch_at(0).items()}
    got = run.put_batch(local, rows=order)
    for key in ref:
        assert got[key].sharding == ref[key].sharding
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(ref[key]))
    with pytest.raises(ValueError, match="read only rows"):
        run.put_batch({k: v[:, :4] for k, v in local.items()}, rows=order[:4])


# --- (c) the end of the data ---

def test_single_stops_with_an_error_naming_the_run_length_and_cyclic_starts_again():
    data = IndexDataset(n=40)
    loader = BatchLoader(data, 16, 2, 16)
    next(loader)  # samples [16, 32)
    with pytest.raises(DataExhaustedError, match=r"\[32, 48\) reads past the 40 samples of the train split.*"
                                                 r"config.train_iters x global_batch_size"):
        next(loader)
    assert loader.consumed_samples == 32  # the failed batch was not handed out
    exact = BatchLoader(IndexDataset(n=32), 16, 2, 16)
    assert next(exact)["tokens"][-1, -1, 0] == 31  # a batch ending exactly at the end is fine
    with pytest.raises(DataExhaustedError, match="valid split.*eval_iters"):
        BatchLoader(data, 16, 2, split="valid").batch_at(32)
    cyclic = BatchLoader(data, 16, 2, 32, dataloader_type="cyclic")
    np.testing.assert_array_equal(next(cyclic)["tokens"][..., 0].reshape(-1), np.arange(32, 48) % 40)
    with pytest.raises(ValueError, match="dataloader_type='random' must be one of"):
        BatchLoader(data, 16, 2, dataloader_type="random")


def test_evaluation_past_the_validation_split_names_it():
    from jmegatron.training.loop import evaluate

    run = build(_cfg())
    params = run.init_state().params
    data = IndexDataset(n=40, seq=8)
    evaluate(run, params, data, 2, 0)  # samples [0, 32)
    with pytest.raises(DataExhaustedError, match="valid split"):
        evaluate(run, params, data, 2, 16)
    assert np.isfinite(evaluate(run, params, data, 2, 16, dataloader_type="cyclic"))


# --- (b) prefetch ---

def test_prefetch_gives_identical_batches_and_exact_positions_under_rampup():
    def loader(workers, data):
        calc = nmc.build_num_microbatches_calculator(24, 2, 2, (4, 4, 50))
        return BatchLoader(data, 24, 6, 8, calc, rows=[1, 2], num_workers=workers)

    plain, data = loader(0, IndexDataset()), IndexDataset()
    with loader(2, data) as ahead:
        for _ in range(8):
            a, b = next(plain), next(ahead)
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
            assert ahead.consumed_samples == plain.consumed_samples  # batches handed out, not read
            assert ahead.last_global_batch_size == plain.last_global_batch_size
            assert ahead.calculator.get() == plain.calculator.get()
        deadline = time.time() + 10
        while len(data.read) < len(plain.dataset.read) + 2 and time.time() < deadline:
            time.sleep(0.01)
        assert len(data.read) > len(plain.dataset.read)  # it did read ahead


def test_a_reader_error_is_raised_at_the_batch_it_concerns():
    loader = BatchLoader(IndexDataset(fail_at=37), 8, 1, num_workers=2)  # sample 37: the 5th batch
    for i in range(4):
        assert next(loader)["tokens"][0, 0, 0] == 8 * i
    with pytest.raises(KeyError, match="sample 37 is unreadable"):
        next(loader)
    assert loader.consumed_samples == 32
    assert not any(t.name.startswith("jmegatron-train-data") for t in threading.enumerate())
    loader.close()


def test_end_of_data_in_the_thread_is_raised_only_when_that_batch_is_asked_for():
    loader = BatchLoader(IndexDataset(n=24), 8, 1, num_workers=4)
    for _ in range(3):
        next(loader)  # the thread already failed on the 4th batch; nothing surfaces yet
    with pytest.raises(DataExhaustedError):
        next(loader)


def test_close_joins_the_thread_even_when_it_waits_on_a_full_queue():
    before = threading.active_count()
    loader = BatchLoader(IndexDataset(), 8, 1, num_workers=1)
    next(loader)
    time.sleep(0.2)  # the thread fills the queue and blocks on put
    thread = loader._prefetcher._thread
    assert thread.is_alive() and thread.daemon
    t0 = time.time()
    loader.close()
    assert not thread.is_alive() and time.time() - t0 < 2
    assert threading.active_count() == before
    loader.close()  # idempotent
    # a new next() continues from the batches handed out
    assert next(loader)["tokens"][0, 0, 0] == 8
    loader.close()


def test_prefetcher_contract():
    items = iter(range(5))
    with Prefetcher(lambda: next(items), depth=2) as p:
        assert [p.get() for _ in range(5)] == list(range(5))
        with pytest.raises(StopIteration):  # the producer's own exception, in order
            p.get()
        assert not p.alive
    with pytest.raises(ValueError, match="depth=0 must be >= 1"):
        Prefetcher(lambda: 0, depth=0)
    p = Prefetcher(lambda: 1)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.get()


def test_close_never_raises_on_a_hung_read():
    release = threading.Event()
    p = Prefetcher(lambda: release.wait(30), depth=1)
    time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match="did not stop within 0.2 s"):
        assert p.close(timeout=0.2) is False
    release.set()  # the read returns; the thread sees the stop flag and ends
    assert p.close() is True and not p.alive


@pytest.mark.parametrize("field,value,message", [
    ("num_workers", -1, "config.num_workers=-1 must be >= 0"),
    ("dataloader_type", "random", "config.dataloader_type='random' must be 'single'"),
])
def test_config_fields_are_checked(field, value, message):
    from jmegatron.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _cfg(**{field: value})
