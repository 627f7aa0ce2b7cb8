"""The DFlash block attention of one drafter layer with compiled flex_attention, the peer of
dflashd's fused kernels (bench/drafter_step_bench.cc prints ours in the same run).

Shape: the Qwen3.5-27B drafter (32 query / 8 key-value heads of 128), context 3072, 512 anchors
drawn uniformly without replacement from [64, 3071), blocks of 16, bf16. The mask is the one the
Python trainers build (docs/recipe.md): query row r of block n = r // 16 sees context key j
when j < anchor[n], and the 16 keys of its own block. Keys are [context ; blocks].
Prints the median forward and forward+backward time of 20 runs after warm-up (compile excluded).
"""
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def main():
    S, N, B, HQ, HKV, D = 3072, 512, 16, 32, 8, 128
    dev = "cuda"
    g = torch.Generator().manual_seed(1)
    anchors = torch.randperm(3071 - 64, generator=g)[:N].sort().values + 64
    anchors = anchors.to(dev)
    M = N * B

    def mask(b, h, q, kv):
        block = q // B
        context = (kv < S) & (kv < anchors[block])
        own = (kv >= S) & ((kv - S) // B == block)
        return context | own

    block_mask = create_block_mask(mask, None, None, M, S + M, device=dev)
    attend = torch.compile(flex_attention)
    q = torch.randn(1, HQ, M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, HKV, S + M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, HKV, S + M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, HQ, M, D, device=dev, dtype=torch.bfloat16)

    def timed(f, n=20):
        for _ in range(3):
            f()
        times = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            f()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[n // 2]

    def forward():
        with torch.no_grad():
            attend(q, k, v, block_mask=block_mask, enable_gqa=True)

    def both():
        attend(q, k, v, block_mask=block_mask, enable_gqa=True).backward(dout)

    pairs = float(((anchors + B) * B * HQ).sum())
    flops = 4.0 * D * pairs
    f, fb = timed(forward), timed(both)
    print(f"flex_attention (compiled, torch {torch.__version__}): forward {1e3 * f:.2f} ms ({flops / f / 1e12:.0f} TFLOP/s), "
          f"forward+backward {1e3 * fb:.2f} ms per layer ({3.5 * flops / fb / 1e12:.0f} TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
