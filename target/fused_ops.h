// fused_ops.h: the target forward's element-wise work (residual add + RMSNorm, SiLU-mul, the
// attention's q/k norm + RoPE and output gate), as one CUDA kernel each where they can run
// (bf16 on a GPU, 16-byte aligned rows, sizes multiple of 8), as the composite ATen expression
// otherwise (CPU, other dtypes). Same roundings either way (target/kernels/elementwise.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace dflash::target {

// rms_norm(x) (common/tensor_math.h) over the last dimension of a 2-D x.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred);

// {x + delta, rms_norm(x + delta)}: the residual stream and the next sub-layer's input.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps, bool zero_centred);

// silu(gate) * up, as HF's MLP rounds it. gate and up [rows, n] may be views with a common row
// stride (the two halves of one gate/up projection).
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

// Whether kernels can read x's rows with 16-byte vector accesses: last dim contiguous, every
// other stride a multiple of 8 elements, 16-byte aligned data (bf16 rows, any row stride).
bool vector_rows(const at::Tensor& x);

// x [tokens, heads, d] rotated over its first cos.size(-1) dims; cos/sin [tokens, rotary] in
// x's dtype (the composite expression, HF's apply_rotary_pos_emb with partial rotary).
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// apply_rope(rms_norm(x)): an attention layer's q or k after its q_norm / k_norm. x [tokens,
// heads, d] may be a strided view (last dim contiguous); the result is contiguous.
at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps, bool zero_centred);

// out * sigmoid(gate) (gated attention): out [tokens, heads * d] contiguous, gate [tokens, heads,
// d] a view with contiguous last dim. May write into out.
at::Tensor sigmoid_gate(const at::Tensor& out, const at::Tensor& gate);

}  // namespace dflash::target
