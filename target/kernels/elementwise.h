// elementwise.h: the target forward's element-wise work fused into single passes (no torch in
// this interface; target/fused_ops.h wraps them). Each reproduces the roundings of the
// composite ATen expression it replaces (HF's module code), so outputs differ from it only by
// the order of one fp32 sum.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::target::kernels {

// Rows of n bf16 (n a multiple of 8, rows contiguous). With delta: sum = bf16(x + delta) is
// written to sum_out and normalised; without, x is. normed = rmsnorm(sum) in fp32, then
//   zero_centred: bf16(normed * (w + 1))          (Qwen3.5 / Qwen3-Next)
//   otherwise:    bf16(w * bf16(normed))          (Qwen3 / Llama)
void add_rms_norm(const void* x, const void* delta, const void* weight, void* sum_out, void* normed_out, int rows, int n,
                  float eps, bool zero_centred, cudaStream_t stream);

// add_rms_norm whose normed rows go to an FP8 GEMM (n a multiple of 128): quantised per 1x128
// group as target/kernels/fp8.h's quantize_groups_e4m3 quantises the bf16 rows (q [rows, n]
// contiguous, factor (r, g) at factors[g * factor_stride + r]); no bf16 normed rows are written.
void add_rms_norm_e4m3(const void* x, const void* delta, const void* weight, void* sum_out, int rows, int n, float eps,
                       bool zero_centred, void* q, float* factors, int64_t factor_stride, cudaStream_t stream);

// out = bf16(bf16(silu(gate)) * up) over rows of n bf16 (a multiple of 8): row r of gate and of up
// at r * stride (16-byte aligned; separate tensors or the two halves of one fused projection),
// out contiguous [rows, n].
void silu_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t rows, int64_t n, cudaStream_t stream);
// silu_mul whose rows go to an FP8 GEMM (n a multiple of 128): quantised as add_rms_norm_e4m3's.
void silu_mul_e4m3(const void* gate, const void* up, int64_t stride, int64_t rows, int64_t n, void* q, float* factors,
                   int64_t factor_stride, cudaStream_t stream);

// Attention q and k: out = rope(rms_norm(x)) for rows of d bf16 (d <= 256, a multiple of 8), row
// (token t, head h) read at x + t * token_stride + h * head_stride, written contiguous [t, h, d].
// The norm rounds as add_rms_norm; RoPE over the first `rotary` dims (a multiple of 16) with
// cos/sin bf16 [tokens, rotary]: bf16(bf16(y cos) + bf16(rotate_half(y) sin)), as HF in bf16.
// An attention layer's q and k in one launch: each QkRows is one of them (heads 0: none).
struct QkRows {
  const void* x;
  int64_t token_stride, head_stride;
  int heads;
  const void* weight;
  void* out;
};
void qk_norm_rope(const QkRows& q, const QkRows& k, int tokens, int d, const void* cos, const void* sin, int rotary,
                  float eps, bool zero_centred, cudaStream_t stream);

// out = x as fp32, n bf16 values (a multiple of 8; both 16-byte aligned): a decoding step's
// logits, which ATen's cast copied at half the memory's rate.
void widen_bf16(const void* x, float* out, int64_t n, cudaStream_t stream);

// Gated attention's output gate, in place: out[t, h * d + i] = bf16(out * bf16(sigmoid(gate))) with
// gate (t, h, i) at gate + t * token_stride + h * head_stride + i; d a multiple of 8.
void sigmoid_gate(void* out, const void* gate, int64_t token_stride, int64_t head_stride, int tokens, int heads, int d,
                  cudaStream_t stream);
// sigmoid_gate whose rows go to o_proj's FP8 GEMM (heads * d a multiple of 128): out is only read,
// the gated rows quantised as add_rms_norm_e4m3's.
void sigmoid_gate_e4m3(const void* out, const void* gate, int64_t token_stride, int64_t head_stride, int tokens,
                       int heads, int d, void* q, float* factors, int64_t factor_stride, cudaStream_t stream);

// A GatedDeltaNet layer's gated RMSNorm (its output before out_proj), as the composite in
// target/model.cc rounds it: normed = bf16(o rsqrt(mean(o^2) + eps)), out = bf16(float(bf16(w
// normed)) silu(z)). o fp32 [tokens, heads, d] contiguous, z bf16 (token t, head h) at z + t *
// token_stride + h * head_stride (16-byte aligned rows), w bf16 [d], out bf16 [tokens, heads * d];
// d <= 256, a multiple of 8.
void gated_rms_norm(const float* o, const void* z, int64_t token_stride, int64_t head_stride, const void* weight,
                    void* out, int tokens, int heads, int d, float eps, cudaStream_t stream);

// A GatedDeltaNet layer's gates from its projections a and b (bf16, token t's heads at a + t *
// a_stride, contiguous): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), fp32 [tokens,
// heads] each (A_log, dt_bias fp32 [heads]); softplus as ATen's (x above 20: x).
void gdn_gates(const void* a, int64_t a_stride, const void* b, int64_t b_stride, const float* a_log,
               const float* dt_bias, float* g, float* beta, int tokens, int heads, cudaStream_t stream);

}  // namespace dflash::target::kernels
