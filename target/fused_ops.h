// fused_ops.h: the target forward's element-wise work (residual add + RMSNorm, SiLU-mul, the
// attention's q/k norm + RoPE and output gate), as one CUDA kernel each where they can run
// (bf16 on a GPU, 16-byte aligned rows, sizes multiple of 8), as the composite ATen expression
// otherwise (CPU, other dtypes). Same roundings either way (target/kernels/elementwise.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

#include "target/fp8.h"

namespace dflash::target {

// rms_norm(x) (common/tensor_math.h) over the last dimension of a 2-D x.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred);

// {x + delta, rms_norm(x + delta)}: the residual stream and the next sub-layer's input.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps, bool zero_centred);

// add_rms_norm (delta non-null) or rms_norm_rows whose normed rows only an FP8 GEMM reads:
// {the sum (x without delta), the normed rows quantised as quantize_groups quantises the bf16
// rows}. On a GPU one kernel writes the e4m3 rows and factors (no bf16 rows, no second pass);
// elsewhere the bf16 rows are quantised: the same bytes either way.
std::pair<at::Tensor, Fp8Activations> add_rms_norm_fp8(const at::Tensor& x, const at::Tensor* delta,
                                                       const at::Tensor& weight, double eps, bool zero_centred);

// silu(gate) * up, as HF's MLP rounds it. gate and up [rows, n] may be views with a common row
// stride (the two halves of one gate/up projection).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
// silu_mul for down_proj's FP8 GEMM: quantised as add_rms_norm_fp8's rows (one kernel on a GPU).
Fp8Activations silu_mul_fp8(const at::Tensor& gate, const at::Tensor& up);

// Whether kernels can read x's rows with 16-byte vector accesses: last dim contiguous, every
// other stride a multiple of 8 elements, 16-byte aligned data (bf16 rows, any row stride).
bool vector_rows(const at::Tensor& x);
// Strided rows the row kernels can read: bf16 on a GPU (of a CUDA build), vector_rows.
bool rows_apply(const at::Tensor& x);

// x [tokens, heads, d] rotated over its first cos.size(-1) dims; cos/sin [tokens, rotary] in
// x's dtype (the composite expression, HF's apply_rotary_pos_emb with partial rotary).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// apply_rope(rms_norm(x)): an attention layer's q or k after its q_norm / k_norm. x [tokens,
// heads, d] may be a strided view (last dim contiguous); the result is contiguous.
at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps, bool zero_centred);
// Both of a layer's q and k (k [tokens, kv heads, d] with q's tokens and d), in one launch where the
// kernel takes them (a decoding step's attention layer is a few microseconds of work a launch).
std::pair<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& q_weight, const at::Tensor& k,
                                               const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin,
                                               double eps, bool zero_centred);

// x.to(fp32), for bf16 logits: one pass at the memory's rate where the kernel takes x (contiguous
// bf16 on the GPU, rows a multiple of 8), else ATen's cast. The values are the same.
at::Tensor widen_to_float(const at::Tensor& x);

// out * sigmoid(gate) (gated attention): out [tokens, heads * d] contiguous, gate [tokens, heads,
// d] a view with contiguous last dim. May write into out.
at::Tensor sigmoid_gate(const at::Tensor& out, const at::Tensor& gate);
// sigmoid_gate for o_proj's FP8 GEMM: quantised as add_rms_norm_fp8's rows (one kernel on a GPU;
// out is not written).
Fp8Activations sigmoid_gate_fp8(const at::Tensor& out, const at::Tensor& gate);

// A GatedDeltaNet layer's gated RMSNorm before out_proj: bf16(bf16(w bf16(rmsnorm(o))) silu(z)) as
// [tokens, heads * d] in `dtype`; o fp32 [tokens, heads, d], z [tokens, heads, d] (a view of the
// layer's projection), w [d].
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps,
                          at::ScalarType dtype);

// A GatedDeltaNet layer's gates from its projections a, b [tokens, heads] (views): g = -exp(A_log)
// softplus(a + dt_bias) and beta = sigmoid(b), fp32 (gdn_gates_reference's values).
std::pair<at::Tensor, at::Tensor> gdn_gates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                            const at::Tensor& dt_bias);
// Whether gdn_gates runs its kernel for these inputs (bf16 projections with contiguous heads on a
// GPU, fp32 A_log and dt_bias there); then the conv step kernel can form them too (gdn_cuda.h).
bool gdn_gates_kernel_applies(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                              const at::Tensor& dt_bias);

// Nucleus filtering of sampling probabilities [rows, n] (fp32): each row keeps the smallest set of
// its most likely entries whose mass reaches top_p (an entry is kept while the mass of those
// before it, most likely first, is below top_p; equal probabilities in index order) and zeroes
// the rest, unnormalised. On a GPU one kernel per call (a search over the boundary's bits, no
// sort: target/kernels/top_p.h); elsewhere a stable sort and a cumulative sum. The two sum the
// masses in different orders, so a boundary within float rounding of top_p may fall either way.
at::Tensor top_p_keep(const at::Tensor& probs, double top_p);

// One token per row of probs [rows, n] (fp32, contiguous, on a GPU): the first whose cumulative
// probability exceeds u[r] (fp64 [rows] on the same device, in [0, 1)) times the row's total, never
// one of zero probability (kernels::choose_by_uniform, one kernel); int64 [rows]. Undefined where
// the kernel does not apply (not a GPU, not fp32 rows): the caller forms it otherwise.
at::Tensor choose_by_uniform(const at::Tensor& probs, const at::Tensor& u);

}  // namespace dflash::target
