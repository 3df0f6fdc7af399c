"""Raw text corpora: the input files ``preprocess_data`` and ``train_tokenizer`` read
(``--input``: files, directories of ``.txt`` / ``.jsonl`` files, glob patterns)."""

from __future__ import annotations

import glob
import os
from typing import List, Sequence

__all__ = ["resolve_inputs"]

# a directory contributes these (not *.json, so a tokenizer.json beside the data is not
# mistaken for a corpus); .json files given explicitly are read as JSON lines.
_INPUT_SUFFIXES = (".txt", ".jsonl")


def resolve_inputs(inputs: Sequence[str]) -> List[str]:
    """Expand ``--input`` values into an ordered list of files.

    A directory gives its ``.txt``/``.jsonl`` files sorted by name; a string with glob
    characters that is not an existing file gives its sorted matches; a file gives itself.

    Raises:
        FileNotFoundError: an input does not exist / a glob or directory matches nothing.
    """
    files: List[str] = []
    for item in inputs:
        item = os.fspath(item)
        if os.path.isdir(item):
            found = sorted(
                os.path.join(item, n) for n in os.listdir(item)
                if n.endswith(_INPUT_SUFFIXES) and os.path.isfile(os.path.join(item, n))
            )
            if not found:
                raise FileNotFoundError(
                    f"--input directory {item} has no {'/'.join(_INPUT_SUFFIXES)} files"
                )
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        elif glob.has_magic(item):
            found = sorted(f for f in glob.glob(item) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"--input pattern {item!r} matches no files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"--input {item!r}: no such file or directory")
    return files
