"""The Python peers of bench/gdn_bench.cc, same shapes, same GPU, same run (bench/run_h200.sh gdn):
FLA's Triton chunk_gated_delta_rule (fla-core wheel, native GVA, varlen via cu_seqlens) and
transformers' PyTorch fallback (torch_chunk_gated_delta_rule, q/k repeated to the value heads as
the Qwen3.5 layer does; one sequence at a time). Inputs as ours: q, k L2-normalised bf16, g fp32
log decay, beta fp32. Times are CUDA-event means after a warm-up; inputs rotated beyond L2."""
import sys

import torch

HK, HV, D = 16, 48, 128
SHAPES = [[2048], [4096], [8192], [16384], [1024] * 4, [4096] * 4]


def cuda_ms(repeats, fn):
    fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(repeats):
        fn(i)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def make(lengths):
    n = sum(lengths)
    l2 = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    q = l2(torch.randn(1, n, HK, D, device="cuda")).bfloat16()
    k = l2(torch.randn(1, n, HK, D, device="cuda")).bfloat16()
    v = torch.randn(1, n, HV, D, device="cuda").bfloat16()
    g = -(0.05 + 0.95 * torch.rand(1, n, HV, device="cuda"))
    beta = torch.sigmoid(torch.randn(1, n, HV, device="cuda"))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.long)
    return q, k, v, g, beta, cu


def main():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # the table says so instead of failing the run
        chunk_gated_delta_rule = None
        print(f"fla unavailable: {e}", file=sys.stderr)
    fallback = None
    for module in ("qwen3_5", "qwen3_next"):
        try:
            fallback = __import__(f"transformers.models.{module}.modeling_{module}",
                                  fromlist=["torch_chunk_gated_delta_rule"]).torch_chunk_gated_delta_rule
            break
        except Exception:
            continue
    print(f"{'batch':<14} {'tokens':>8} {'FLA':>8} {'HF fallback':>12}   (ms per call; torch {torch.__version__})")
    for lengths in SHAPES:
        n = sum(lengths)
        copies = 2 if n >= 8192 else 4
        sets = [make(lengths) for _ in range(copies)]
        fla = float("nan")
        if chunk_gated_delta_rule is not None:
            def run_fla(i):
                q, k, v, g, beta, cu = sets[i % copies]
                chunk_gated_delta_rule(q, k, v, g, beta, scale=D ** -0.5, cu_seqlens=cu if len(lengths) > 1 else None)
            fla = cuda_ms(20, run_fla)
        hf = float("nan")
        if fallback is not None:
            def run_hf(i):
                q, k, v, g, beta, cu = sets[i % copies]
                for s in range(len(lengths)):
                    a, b = int(cu[s]), int(cu[s + 1])
                    fallback(q[:, a:b].repeat_interleave(HV // HK, 2), k[:, a:b].repeat_interleave(HV // HK, 2),
                             v[:, a:b], g[:, a:b], beta[:, a:b], use_qk_l2norm_in_kernel=False)
            hf = cuda_ms(3, run_hf)
        print(f"{len(lengths)}x{lengths[0]:<12} {n:>8} {fla:>8.3f} {hf:>12.3f}", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
