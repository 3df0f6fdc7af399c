"""Every shipped config resolves to the fields of its snapshot (AXLearn's golden configs).

``tests/golden_configs.json`` holds, for each ``configs/**/*.py``, the fields its
``get_config()`` sets (all of them, before derivation) and the validated
``JMegatronConfig.to_dict()`` (what checkpoints store as config.json), taken with the
few overrides a config needs to validate without data. A change to a config file or to
a family preset that moves any field fails here and names the field. A deliberate change
regenerates the snapshot::

    .venv/bin/python tests/test_golden_configs.py --update
"""

import glob
import json
import os
import sys

import pytest

from jmegatron.config import get_config_of, load_config_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden_configs.json")


def shipped_configs() -> list[str]:
    """Paths of the shipped Python configs, relative to the repository root."""
    paths = glob.glob(os.path.join(ROOT, "configs", "*.py")) + glob.glob(os.path.join(ROOT, "configs", "*", "*.py"))
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _portable(value):
    """Paths under the repository become "<repo>/..."; tuples become lists (JSON's form)."""
    if isinstance(value, str) and value.startswith(ROOT + os.sep):
        return "<repo>" + value[len(ROOT):]
    if isinstance(value, (list, tuple)):
        return [_portable(v) for v in value]
    return value


def _overrides(fields: dict) -> dict:
    """The overrides a shipped config needs to validate on a machine without its data."""
    over = {}
    if not fields["mock_data"] and fields["data_path"] is None and (fields["sft"] or fields["fim_data"]):
        # SFT and FIM samples come from preprocessed prefixes only: placeholders for them and their tokenizer
        over["data_path"] = "DATA_PREFIX"
        if fields["tokenizer_model"] is None and fields["tokenizer_type"] is None:
            over["tokenizer_model"] = "TOKENIZER"
    elif not fields["mock_data"] and fields["data_path"] is None:
        over["mock_data"] = True
        if fields["vocab_size"] is None:
            over["vocab_size"] = 512
    if fields["kd_cfg"] is not None and fields["kd_teacher_load"] is None:
        over["kd_teacher_load"] = "teacher"
    return over


def snapshot(rel_path: str) -> dict:
    """``{"fields", "overrides", "resolved"}`` of one config file, JSON-ready."""
    path = os.path.join(ROOT, rel_path)
    fields = get_config_of(path).to_dict()
    over = _overrides(fields)
    resolved = load_config_file(path, over).to_dict()
    return {"fields": {k: _portable(v) for k, v in fields.items()},
            "overrides": over,
            "resolved": {k: _portable(v) for k, v in resolved.items()}}


def _golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


def test_every_shipped_config_has_a_snapshot():
    assert sorted(_golden()) == shipped_configs(), (
        "configs/ and tests/golden_configs.json list different files; after adding or removing a config "
        "run `.venv/bin/python tests/test_golden_configs.py --update` and review the diff")


@pytest.mark.parametrize("rel_path", shipped_configs())
def test_config_matches_snapshot(rel_path):
    golden = _golden()
    if rel_path not in golden:
        pytest.fail(f"{rel_path} has no snapshot in tests/golden_configs.json")
    now = json.loads(json.dumps(snapshot(rel_path)))
    want = golden[rel_path]
    for part in ("fields", "overrides", "resolved"):
        moved = {k: (want[part].get(k), now[part].get(k))
                 for k in sorted(set(want[part]) | set(now[part])) if want[part].get(k) != now[part].get(k)}
        assert not moved, f"{rel_path}: {part} moved (snapshot, now): {moved}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_golden_configs.py --update   (rewrites tests/golden_configs.json)")
    sys.path.insert(0, ROOT)
    snapshots = {p: snapshot(p) for p in shipped_configs()}  # every config resolves before the file is touched
    with open(GOLDEN, "w") as f:
        json.dump(snapshots, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {GOLDEN}: {len(shipped_configs())} configs")
