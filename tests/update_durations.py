"""Write tests/durations.json (seconds per test file) from a pytest log run with ``--durations=0``.

``python tests/update_durations.py LOG``: the conftest orders test files by these weights,
heaviest first, so that ``pytest -n 2 --dist loadfile --no-loadscope-reorder`` (``make test``)
hands the long files out early and both workers finish together. Only the order depends on
the table: a stale or missing entry costs balance, never a test.
"""

import json
import pathlib
import re
import sys

LINE = re.compile(r"^([0-9.]+)s (?:call|setup|teardown) +(tests/[^:]+\.py)::")


def main(log: str) -> None:
    seconds: dict[str, float] = {}
    for line in open(log):
        m = LINE.match(line)
        if m:
            seconds[m[2]] = seconds.get(m[2], 0.0) + float(m[1])
    out = pathlib.Path(__file__).with_name("durations.json")
    out.write_text(json.dumps({k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
                              indent=1) + "\n")
    print(f"{out}: {len(seconds)} files, {sum(seconds.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
