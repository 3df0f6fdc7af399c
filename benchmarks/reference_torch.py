"""Float32 PyTorch reference run for ``python -m jmegatron.bench precision``.

    python benchmarks/reference_torch.py --config configs/gpt_tiny.py \
        --config.mock_data=True --config.vocab_size=512 \
        --config.hidden_dropout=0 --config.attention_dropout=0 \
        --train-iters 100 --out runs/bench/reference

Trains the same model as jmegatron would, with nothing of jmegatron's training code:

* model: Hugging Face ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` (chosen by
  ``jmegatron.conversion.hf.hf_architecture``) holding jmegatron's *initial* weights
  (``export.hf_model.to_hf_model`` on the params of ``run.init_state()``, seed ``config.seed``),
  float32, over the padded vocabulary (as jmegatron's logits);
* data: exactly jmegatron's batches (``build_datasets`` + ``BatchLoader``; mock configs use
  ``MockGPTDataset``), micro-batch ``j`` of an iteration holding ``micro_batch_size * dp``
  sequences (``--data-parallel-size`` = the jmegatron run's dp, so micro-batches group the
  same samples);
* loss: per micro-batch, the token mean of the masked cross-entropy; the iteration's
  loss and gradient are the means over micro-batches (jmegatron's / Megatron's);
* optimizer: ``torch.optim.AdamW`` (betas, eps, weight decay from the config) with no
  weight decay on biases and norm weights (Megatron's rule, as jmegatron's
  ``weight_decay_mask``), ``torch.nn.utils.clip_grad_norm_`` at ``clip_grad``, and the
  learning rate of Megatron's ``OptimizerParamScheduler.get_lr`` (jmegatron's
  ``lr_schedule``, itself tested against a transcription of ``get_lr`` in
  tests/test_optimizer.py; iteration ``k`` uses the rate for ``k - 1`` steps taken).

Writes ``--out/metrics.jsonl`` (one ``{"iteration", "lm loss", "lr", "grad_norm"}`` per
iteration) and ``--out/reference.json`` (settings, versions, timing). Dropout cannot be
reproduced (different random streams): a config with dropout > 0 exits 2. ``config.bf16``
is ignored: the reference is float32.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def param_groups(model, weight_decay: float):
    """AdamW groups: decay for matrices and embeddings; none for biases and the weights of
    norm layers (Megatron's no_wd rule: biases and 1-D parameters). Shared (tied)
    parameters appear once."""
    import torch

    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        is_norm = isinstance(module, torch.nn.LayerNorm) or "RMSNorm" in type(module).__name__
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if is_norm or name == "bias" else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--train-iters", type=int, default=None)
    parser.add_argument("--data-parallel-size", type=int, default=1,
                        help="dp of the jmegatron run compared with (micro-batches hold micro_batch_size * dp samples)")
    parser.add_argument("--out", required=True)
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if not a.startswith("--config.")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")

    from jmegatron.command_line import parse_args
    from jmegatron.config import ConfigError, load_config_file

    try:
        path, overrides = parse_args(["--config", args.config, *extra])
        if args.train_iters is not None:
            overrides["train_iters"] = args.train_iters
        cfg = load_config_file(path, overrides)
        if cfg.hidden_dropout or cfg.attention_dropout:
            raise ConfigError("the torch reference cannot reproduce jmegatron's dropout masks; set "
                              "--config.hidden_dropout=0 --config.attention_dropout=0")
        if args.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size={args.data_parallel_size} must be >= 1")
        # One device; the padded vocabulary (hence the initial weights) of the original tp.
        tp = cfg.tensor_model_parallel_size
        cfg1 = cfg.replace(tensor_model_parallel_size=1, sequence_parallel=False, use_distributed_optimizer=False,
                           use_megatron_fsdp=False,
                           make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp, bf16=False)
        dp = args.data_parallel_size
        rows = cfg.micro_batch_size * dp  # sequences per micro-batch
        gbs = cfg.global_batch_size or rows
        if gbs % rows:
            raise ConfigError(f"global_batch_size={gbs} is not divisible by micro_batch_size x dp = {rows}")
        num_micro = gbs // rows
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    import jax
    import numpy as np
    import torch
    import torch.nn.functional as F

    from jmegatron.conversion.hf import hf_architecture
    from jmegatron.data.loader import BatchLoader
    from jmegatron.export.hf_model import to_hf_model
    from jmegatron.parallel.mesh import create_mesh
    from jmegatron.training.run import build
    from jmegatron.data.builder import build_datasets
    from jmegatron.training.optimizer import lr_schedule

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    run = build(cfg1, create_mesh(cfg1, jax.devices()[:1]))
    params = jax.device_get(run.init_state().params)
    model = to_hf_model(params, cfg1).to(torch.float32)
    model.train()  # dropout is 0: train mode changes nothing but is the honest mode
    train_ds, _, _ = build_datasets(cfg1, gbs)
    loader = BatchLoader(train_ds, gbs, num_micro)
    groups = param_groups(model, cfg.weight_decay)
    params_list = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, lr=0.0, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    schedule = lr_schedule(cfg, gbs)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "metrics.jsonl", "w") as log:
        for it in range(1, cfg.train_iters + 1):
            lr = float(schedule(it - 1))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = next(loader)
            opt.zero_grad(set_to_none=True)
            loss_sum = 0.0
            for j in range(num_micro):
                tokens = torch.from_numpy(batch["tokens"][j].astype(np.int64))
                labels = torch.from_numpy(batch["labels"][j].astype(np.int64))
                mask = torch.from_numpy(batch["loss_mask"][j].astype(np.float32))
                positions = torch.from_numpy(batch["position_ids"][j].astype(np.int64))
                logits = model(input_ids=tokens, position_ids=positions).logits.float()
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
                loss = (ce * mask.reshape(-1)).sum() / mask.sum().clamp(min=1.0)
                (loss / num_micro).backward()
                loss_sum += float(loss.detach())
            if cfg.clip_grad > 0:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params_list, cfg.clip_grad))
            else:
                grad_norm = float(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in params_list if p.grad is not None])))
            opt.step()
            record = {"iteration": it, "lm loss": loss_sum / num_micro, "lr": lr, "grad_norm": grad_norm}
            log.write(json.dumps(record) + "\n")
            if it % cfg.log_interval == 0 or it == cfg.train_iters:
                print(f"[reference_torch] iteration {it}/{cfg.train_iters} | lm loss {record['lm loss']:.6f} | "
                      f"lr {lr:.6e} | grad norm {grad_norm:.4f}", flush=True)
    info = {"architecture": hf_architecture(cfg1), "train_iters": cfg.train_iters, "global_batch_size": gbs,
            "num_microbatches": num_micro, "micro_batch_rows": rows, "padded_vocab_size": run.padded_vocab_size,
            "dtype": "float32", "seconds": time.perf_counter() - t0, "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "config": cfg.to_dict(),
            "argv": sys.argv}
    with open(out / "reference.json", "w") as f:
        json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
