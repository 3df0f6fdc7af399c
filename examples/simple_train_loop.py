"""The jmegatron pieces in your own loop, without the CLI (in the spirit of Megatron's
examples/run_simple_mcore_train_loop.py).

    python examples/simple_train_loop.py [--iterations 20]   # 8 simulated CPU devices, data parallel

The mock documents count up (1, 2, 3, ...), so the next token is learnable: the loss
starts near ln(vocab_size) = 6.91 and falls by about a nat in 20 iterations.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jmegatron.config import base_config, from_configdict  # noqa: E402
from jmegatron.data.gpt_dataset import MockGPTDataset  # noqa: E402
from jmegatron.data.loader import BatchLoader  # noqa: E402
from jmegatron.parallel.mesh import create_mesh  # noqa: E402
from jmegatron.training.run import build  # noqa: E402


def main(iterations: int = 20) -> list[float]:
    # 1. A config: Megatron's argument names, validated on construction.
    c = base_config()
    c.num_layers, c.hidden_size, c.num_attention_heads, c.seq_length = 2, 64, 4, 64
    c.vocab_size, c.mock_data = 1000, True
    c.micro_batch_size, c.global_batch_size, c.train_iters = 2, 16, iterations
    c.lr = 3e-3  # linear decay to min_lr 0 over train_iters (Megatron's default style)
    cfg = from_configdict(c)

    # 2. A mesh over every device (data parallel takes what TP/PP/CP/EP leave).
    mesh = create_mesh(cfg)

    # 3. Model, optimizer, shardings and the jitted steps; then the initial state.
    run = build(cfg, mesh)
    state = run.init_state()

    # 4. Data: any map-style dataset of {tokens, labels, loss_mask, position_ids}.
    dataset = MockGPTDataset(num_samples=iterations * run.global_batch_size,
                             seq_length=cfg.seq_length, vocab_size=cfg.vocab_size, seed=cfg.seed)
    loader = BatchLoader(dataset, run.global_batch_size, run.num_microbatches)

    # 5. Your loop: the step is a pure jitted function (state, batch) -> (state, metrics).
    losses = []
    for it in range(1, iterations + 1):
        state, metrics = run.train_step(state, run.put_batch(next(loader)))
        losses.append(float(metrics["lm_loss"]))
        print(f"iteration {it}: lm loss {losses[-1]:.4f}, grad norm {float(metrics['grad_norm']):.3f}")
    print(f"{len(jax.devices())} devices, mesh {dict(mesh.shape)}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="training iterations (default 20)")
    main(parser.parse_args().iterations)
