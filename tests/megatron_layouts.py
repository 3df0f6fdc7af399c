"""Helper of tests/test_megatron_checkpoint.py: megatron-core writes one model in a
two-process layout, in both of Megatron-LM's formats.

``python tests/megatron_layouts.py OUT KIND:TP:PP:EP [KIND:TP:PP:EP ...]`` starts two gloo
processes on 127.0.0.1; for each layout in turn, each initialises megatron-core's
model-parallel groups (TP x PP x EP over two ranks), builds the ``KIND`` model of
tests/test_megatron_checkpoint.py (``KINDS``) with megatron-core's CPU initialisation,
and saves it twice under ``OUT/KIND-TP-PP-EP``:

* ``legacy``: ``iter_0000005/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``
  holding ``{"args", "checkpoint_version", "iteration", "model": model.state_dict()}``, the
  folder names and contents Megatron-LM's ``save_checkpoint`` writes for ``--ckpt-format
  torch`` (megatron/training/checkpointing.py ``get_checkpoint_name``), and the tracker;
* ``dist``: megatron-core's ``dist_checkpointing.save`` of ``model.sharded_state_dict()``
  (``--ckpt-format torch_dist``).
"""

import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: str, layouts: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import dist_checkpointing, parallel_state as ps

    from jmegatron.export import megatron as M
    from test_megatron_checkpoint import VOCAB, cfg_of

    for layout in layouts:
        kind, tp, pp, ep = layout.split(":")
        tp, pp, ep = int(tp), int(pp), int(ep)
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
        cfg = cfg_of(kind)
        multiple = cfg.make_vocab_size_divisible_by * tp
        padded = -(-VOCAB // multiple) * multiple
        torch.manual_seed(1234)
        model = M.megatron_core_model(cfg, padded, initialize=True)
        with torch.no_grad():  # norms: not all ones, the same on every rank
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.01 * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape))
        args = M.megatron_args(cfg, padded, VOCAB, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, iteration=5)
        t, s, x = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), \
            ps.get_expert_model_parallel_rank()
        name = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (f"_{x:03d}" if ep > 1 else "")
        base = os.path.join(out, layout.replace(":", "-"))
        folder = os.path.join(base, "legacy", "iter_0000005", name)
        os.makedirs(folder, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 5, "model": model.state_dict()},
                   os.path.join(folder, "model_optim_rng.pt"))
        dist = os.path.join(base, "dist", "iter_0000005")
        os.makedirs(dist, exist_ok=True)
        torch.distributed.barrier()
        with M.cpu_megatron_core():
            dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
                                     "iteration": 5}, dist)
        if rank == 0:
            for fmt in ("legacy", "dist"):
                with open(os.path.join(base, fmt, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write("5")
        torch.distributed.barrier()
        ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_worker, args=(port, sys.argv[1], sys.argv[2:]), nprocs=2)
