"""Layer placement on pipeline stages (Megatron's get_transformer_layer_offset /
get_num_layers_to_build): even, interleaved and uneven (decoder_first/last_pipeline_num_layers)."""

import numpy as np
import pytest

from jmegatron.config import ConfigError
from jmegatron.parallel.pipeline_layout import PAD, PipelineLayout, gather_index, stage_layer_order

from test_train_step import tiny_cfg


def megatron_offset(L, p, v, first, last, rank, vp_stage):
    """Megatron-Core's offset rule, written out for the test (transformer_layer.py)."""
    middle_stages = p - (first is not None) - (last is not None)
    f, l = first or 0, last or 0
    middle = L - f - l
    if first is None and last is None:
        per_rank = L // p
        return vp_stage * (L // v) + rank * (per_rank // v)
    fv, lv, mv = f // v, l // v, middle // v
    total = fv + mv + lv
    if rank == 0 and first is not None:
        return vp_stage * total
    middle_rank = rank - (first is not None)
    return vp_stage * total + fv + middle_rank * (mv // middle_stages if middle_stages else 0)


@pytest.mark.parametrize("L,p,v,first,last", [
    (8, 2, 1, None, None), (8, 2, 2, None, None), (8, 4, 2, None, None),
    (8, 2, 1, 3, None), (8, 2, 1, None, 2), (8, 2, 2, 2, 6), (10, 4, 1, 1, 3), (12, 4, 2, 2, 2), (9, 3, 1, 1, None),
])
def test_layers_follow_megatrons_offsets(L, p, v, first, last):
    lay = PipelineLayout(L, p, v, first, last)
    counts, starts = lay.chunk_layers(), lay.chunk_first_layer()
    for s in range(p):
        for c in range(v):
            assert starts[s, c] == megatron_offset(L, p, v, first, last, s, c), (s, c)
    assert counts.sum() == L
    order = lay.order()
    assert len(order) == lay.num_slots == p * v * lay.slots_per_chunk
    assert sorted(order[order != PAD]) == list(range(L))  # every layer stored once
    if not lay.uneven:
        assert len(order) == L and np.array_equal(order, stage_layer_order(L, p, v))
    # gather to the model's order and back
    canon = PipelineLayout(L)
    assert np.array_equal(order[gather_index(lay, canon)], np.arange(L))
    back = gather_index(canon, lay)
    assert np.array_equal(np.where(back == PAD, PAD, back), order)


def test_uneven_config_errors_name_the_field():
    ok = tiny_cfg(num_layers=6, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
                  decoder_last_pipeline_num_layers=1)
    assert list(ok.pipeline_layout().stage_layers()) == [1, 2, 2, 1]
    bad = [
        (dict(num_layers=6, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1),
         "leave 5 layers, which must split evenly over the 3 middle stages"),
        (dict(num_layers=8, pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=3,
              decoder_last_pipeline_num_layers=3), "must equal num_layers=8"),
        (dict(num_layers=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
              decoder_first_pipeline_num_layers=3), "decoder_first_pipeline_num_layers=3 must be in .* multiple"),
        (dict(num_layers=8, decoder_last_pipeline_num_layers=2), "need pipeline_model_parallel_size > 1"),
        (dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2,
              decoder_first_pipeline_num_layers=2), "give virtual_pipeline_model_parallel_size"),
    ]
    for kw, match in bad:
        with pytest.raises(ConfigError, match=match):
            tiny_cfg(**kw)
