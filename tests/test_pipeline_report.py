"""The pipeline schedule report (issue 12 item 7): its CLI on a tiny pp=2 model, and its
numbers against the formulas and the compiled program: bubble = Megatron's; the HLO's
collective-permutes x trip count = 2 per tick; 1F1B's compiled temporary memory flat in
the number of micro-batches while GPipe's grows by the stashed activations."""

import json

import pytest

from jmegatron.reporting.collectives import replica_groups
from jmegatron.tools.pipeline_report import main, megatron_live_activations

from conftest import REPO

P, L, H, S, B = 2, 4, 64, 32, 2  # pipeline stages, layers, hidden, sequence, micro-batch
ACT_BYTES = B * S * H * 4  # one float32 stage input [micro_batch_size, seq, hidden]
TINY = [f"--config={REPO / 'configs' / 'gpt_tiny.py'}", f"--config.num_layers={L}", f"--config.hidden_size={H}",
        "--config.ffn_hidden_size=256", f"--config.seq_length={S}", f"--config.max_position_embeddings={S}",
        "--config.vocab_size=500", "--config.hidden_dropout=0.0", "--config.attention_dropout=0.0",
        f"--config.micro_batch_size={B}", f"--config.pipeline_model_parallel_size={P}"]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_report") / "report.json"
    # 2 of the 8 simulated devices: pipeline 2 x data 1
    assert main(["--devices", "2", "--m", "4", "16", "--virtual", "2", "--json", str(out)] + TINY) == 0
    rep = json.loads(out.read_text())
    assert rep["mesh"]["pipeline"] == P and rep["mesh"]["data"] == 1
    return {(r["schedule"], r["m"]): r for r in rep["rows"]}


@pytest.mark.slow
def test_table_has_every_schedule_and_m(rows):
    assert sorted(rows) == sorted((s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (4, 16))


@pytest.mark.slow
def test_bubble_equals_megatron_formula(rows):
    for (name, m), r in rows.items():
        v = 2 if name == "interleaved_1f1b" else 1
        assert r["v"] == v
        assert r["bubble"] == pytest.approx((P - 1) / (v * m + P - 1), abs=1e-12)


@pytest.mark.slow
def test_hlo_ppermutes_equal_two_per_tick(rows):
    for (name, m), r in rows.items():
        v = r["v"]
        # the tick tables' lengths (parallel/schedules.py): m v forward units + p - 1 hops + the offset
        ticks = 2 * (m + P - 1) if name == "gpipe" else m * v + P - 1 + P * v - 1
        assert r["ticks"] == ticks
        # two collective-permutes (activations forward, gradients back) inside one while loop
        # whose known trip count is the number of ticks; all of them over the pipeline axis
        assert (r["ppermute_ops_in_hlo"], r["ppermute_trip_counts"]) == (2, [ticks])
        assert r["ppermutes_not_over_pipeline"] == []
        assert r["ppermutes_hlo"] == r["ppermutes_analytic"] == 2 * ticks
        assert r["bytes_hlo"] == r["bytes_analytic"] == 2 * ticks * ACT_BYTES


@pytest.mark.slow
def test_live_activations(rows):
    for (name, m), r in rows.items():
        if name == "gpipe":
            assert r["peak_live_activations"] == r["megatron_live_activations"] == [m] * P
        elif name == "1f1b":
            assert r["peak_live_activations"] == [2 * (P - s) - 1 for s in range(P)]
            assert r["megatron_live_activations"] == [P - s for s in range(P)]
        else:
            assert r["peak_live_activations"] == r["megatron_live_activations"] == [
                (P - s - 1) * 2 + P + 1 for s in range(P)]


@pytest.mark.slow
def test_one_f_one_b_temp_memory_is_flat_in_m_and_gpipe_grows(rows):
    f4, f16 = rows["1f1b", 4]["temp_size_in_bytes"], rows["1f1b", 16]["temp_size_in_bytes"]
    g4, g16 = rows["gpipe", 4]["temp_size_in_bytes"], rows["gpipe", 16]["temp_size_in_bytes"]
    # 1F1B: the stash has the same 3 slots for any m; what does grow with m is [m]-sized
    # vectors (each micro-batch's token count: 4 bytes each) and buffer alignment, far less
    # than one stashed activation. A stash slot more would exceed the tolerance.
    assert abs(f16 - f4) < ACT_BYTES
    # GPipe stashes every micro-batch's stage input: 12 more slots for m = 16 than m = 4 (XLA:CPU's
    # sequential scheduler, which tests/conftest.py selects, shares part of them: >= 10.6 slots'
    # worth measured; the concurrency-optimized one gives 12)
    assert g16 - g4 >= (16 - 4) * ACT_BYTES * 3 // 4
    i4, i16 = rows["interleaved_1f1b", 4]["temp_size_in_bytes"], rows["interleaved_1f1b", 16]["temp_size_in_bytes"]
    assert abs(i16 - i4) < ACT_BYTES


def test_megatron_live_activation_formulas():
    # Megatron's warm-up (p - s - 1, capped at m) + the one in flight; interleaved p=4 v=2
    assert megatron_live_activations("1f1b", 4, 8, 1) == [4, 3, 2, 1]
    assert megatron_live_activations("1f1b", 4, 2, 1) == [2, 2, 2, 1]
    assert megatron_live_activations("interleaved_1f1b", 4, 8, 2) == [11, 9, 7, 5]
    assert megatron_live_activations("gpipe", 2, 8, 1) == [8, 8]


def test_collective_permute_groups_from_source_target_pairs():
    line = ("%cp = f32[2,32,64]{2,1,0} collective-permute(%x), channel_id=1, "
            "source_target_pairs={{0,4},{4,0},{1,5},{5,1}}, metadata={}")
    assert sorted(replica_groups(line, 8)) == [[0, 4], [1, 5]]


def test_bad_input_exits_2_naming_the_fix(capsys):
    assert main(["--devices", "2", "--m", "4"] + TINY[:-1]) == 2
    assert "pipeline_model_parallel_size=2" in capsys.readouterr().err
    assert main(["--devices", "2", "--schedules", "interleaved_1f1b"] + TINY) == 2
    assert "--virtual 2" in capsys.readouterr().err
    assert main(["--devices", "2", "--virtual", "3"] + TINY) == 2  # 4 layers in 2 x 3 chunks
    assert "num_layers" in capsys.readouterr().err
