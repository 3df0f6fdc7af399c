"""``python -m jmegatron.tools.verify_import``: a saved Hugging Face folder runs in transformers
and jmegatron side by side and gets a card (parts, logit difference, greedy agreement); a
folder the import refuses gets the refused fields and exit status 1."""

import json

import pytest

from jmegatron.tools import verify_import

from test_hf_families import hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # conftest.py


def test_card_of_a_saved_folder_and_of_a_refused_one(tmp_path, capsys):
    folder = tmp_path / "qwen3"
    hf_model("qwen3").save_pretrained(folder)
    card_path = tmp_path / "cards" / "qwen3.json"
    code = verify_import.main(["--hf", str(folder), "--new-tokens", "12", "--card", str(card_path)])
    out = capsys.readouterr().out
    card = json.loads(card_path.read_text())
    print(out)
    assert code == 0 and card["status"] == "verified", out
    assert card["max_logit_diff"] <= 1e-4 < card["max_abs_logit"] and card["greedy_equal"] == 12
    assert card["parts"]["qk_layernorm"] is True and card["parts"]["position_embedding_type"] == "yarn"
    assert card["sizes"]["kv_channels"] == 32 and "fields refused: none" in out

    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(conf, attention_sink=True, layer_types=["linear_attention"] * 2)))
    code = verify_import.main(["--hf", str(folder)])
    out = capsys.readouterr().out
    assert code == 1 and "refused" in out
    assert "attention_sink=True (a field jmegatron's qwen3 import does not read" in out
    assert "layer_types with 'linear_attention'" in out
