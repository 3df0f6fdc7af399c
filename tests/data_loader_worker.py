"""One rank of tests/test_multiprocess.py (not a test module): trains a tiny
GPT with ``jmegatron.training.loop.pretrain`` while recording every train-split sample
index this process reads, and writes ``{out}/rank{process}.json``.

    python tests/data_loader_worker.py OUT --config configs/gpt_tiny.py [--config.<f>=<v> ...]
"""

import json
import os
import sys


class CountingDataset:
    """Wraps a dataset and records the indices of ``__getitem__`` calls."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self.read.append(int(i))
        return self.dataset[i]


def main(out, argv):
    from jmegatron.command_line import config_from_argv
    from jmegatron.distributed import initialize_from_env
    from jmegatron.training import loop

    cfg = config_from_argv(argv)
    initialize_from_env()
    import jax

    build, counted = loop.build_datasets, []

    def counting_build(cfg_, gbs):
        train, valid, test = build(cfg_, gbs)
        counted.append(CountingDataset(train))
        return counted[-1], valid, test

    loop.build_datasets = counting_build
    summary = loop.pretrain(cfg)
    run = summary["run"]
    rows = run.batch_rows()
    with open(os.path.join(out, f"rank{jax.process_index()}.json"), "w") as f:
        json.dump({"process": jax.process_index(), "read": counted[0].read,
                   "rows": None if rows is None else rows.tolist(),
                   "rows_per_microbatch": run.global_batch_size // run.num_microbatches,
                   "losses": summary["losses"]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
