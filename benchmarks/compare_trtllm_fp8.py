"""Compare two TensorRT-LLM FP8 checkpoints of the same weights (tp 1): jmegatron's export
with the training's own scales (``export trtllm --load CKPT --scales from-checkpoint``)
against ModelOpt's FP8 PTQ (``export quantize --quant-cfg fp8`` then ``export trtllm
--quantized``).

    python benchmarks/compare_trtllm_fp8.py OURS_DIR MODELOPT_DIR

Prints: whether names, shapes and dtypes agree (AssertionError naming the tensor if not);
the range of ``weights_scaling_factor`` ratios; the smallest fraction of equal FP8 weight
codes over the quantized linears; and per linear the two ``activation_scaling_factor``
values (float32 dequantization multipliers, amax / 448) and their ratio.
"""

import sys

import numpy as np
import torch
from safetensors.torch import load_file


def main(ours: str, theirs: str) -> None:
    a, b = (load_file(f"{d}/rank0.safetensors") for d in (ours, theirs))
    assert sorted(a) == sorted(b), f"tensor names differ: {sorted(set(a) ^ set(b))}"
    weight_ratio, act, codes = [], [], []
    for k in sorted(a):
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        if k.endswith("weights_scaling_factor"):
            weight_ratio.append(float(a[k] / b[k]))
        elif k.endswith("activation_scaling_factor"):
            act.append((k[len("transformer."):-len(".activation_scaling_factor")], float(a[k]), float(b[k])))
        elif a[k].dtype == torch.float8_e4m3fn:
            codes.append(float((a[k].view(torch.uint8) == b[k].view(torch.uint8)).float().mean()))
    print(f"{len(a)} tensors, same names, shapes and dtypes; weights_scaling_factor ours / ModelOpt: "
          f"min {min(weight_ratio):.4f} max {max(weight_ratio):.4f}; FP8 weight codes equal: at least "
          f"{min(codes):.2%} of each tensor's elements")
    ratios = [x / y for _, x, y in act]
    print(f"activation_scaling_factor ours / ModelOpt over {len(ratios)} linears: min {min(ratios):.3f} "
          f"median {np.median(ratios):.3f} max {max(ratios):.3f}")
    for name, x, y in act:
        print(f"  {name:28s} ours {x:.5f}  ModelOpt {y:.5f}  ratio {x / y:.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
