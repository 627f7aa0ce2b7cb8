// fp8.h: block-scaled FP8 weights and the GEMM that reads them (target.dtype: float8).
//
// A projection W [out, in] is kept as e4m3 with one fp32 factor per 128x128 block (W = data x
// factor), the layout of Qwen's *-FP8 releases (DeepSeek-V3's recipe). A GEMM quantises its
// activations per 1x128 group of each row (factor = max|group| / 448, as FP8 inference of these
// models does: transformers' FineGrainedFP8, SGLang, vLLM), multiplies the e4m3 operands and
// applies both factors per 128-wide slice of the inner dimension in fp32:
// - on Hopper, cuBLASLt's block-scaled FP8 GEMM with 1x128 x 128x128 scales (lt_gemm.h), the
//   activations quantised by one kernel (kernels/fp8.h) or by the kernel that produced them
//   (fused_ops.h);
// - elsewhere (the CPU: tests) the same arithmetic emulated: quantise, dequantise, fp32 matmul.
//   A GPU without the Hopper GEMM refuses FP8 (fp8_gemm_unavailable) unless the slow path is
//   allowed.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace dflash::target {

inline constexpr int64_t kFp8Block = 128;

struct Fp8Weight {
  at::Tensor data;   // e4m3 [out, in] (or a batch [E, out, in]: MoE experts), contiguous
  at::Tensor scale;  // fp32 [ceil(out / 128), in / 128] (or [E, ...]), contiguous: block (i, j)'s factor
  bool defined() const { return data.defined(); }
  int64_t bytes() const;
};

// Why a projection [out, in] cannot run as a block-scaled FP8 GEMM here, or nullopt: the inner
// size must be whole 128-wide groups, four at least per factor row (cuBLASLt reads the weights'
// factors in 16-byte rows: in a multiple of 512; with 256 its results were garbage on the H200),
// and the output a multiple of 16 (cuBLASLt's FP8 layouts).
std::optional<std::string> fp8_shape_unsupported(int64_t out, int64_t in);

// A float weight [out, in] (in a multiple of 128) quantised to 128x128 blocks on its device:
// factor = max|block| / 448 (1 for an all-zero block), data = e4m3(w / factor).
Fp8Weight quantize_blocks(const at::Tensor& w);
// data x factor in `dtype` (2-D or a batch), for blocks of block_rows x block_columns (a
// checkpoint's may differ from the GEMM's 128x128; w.scale then has that grid): one kernel on a
// GPU for 128x128 blocks in bf16, ATen's ops otherwise; the same rounding either way (fp32
// product, one rounding to dtype).
at::Tensor dequantize_blocks(const Fp8Weight& w, at::ScalarType dtype, int64_t block_rows = kFp8Block,
                             int64_t block_columns = kFp8Block);

// One piece of a projection concatenated at load: a checkpoint's own 128x128 FP8 blocks (fp8
// defined) or a float weight.
struct WeightRows {
  at::Tensor weight;
  Fp8Weight fp8;
  int64_t rows() const { return fp8.defined() ? fp8.data.size(0) : weight.size(0); }
};
// The parts stacked by rows as one FP8 weight. A part stored as 128x128 FP8 that starts on a
// block boundary keeps its bytes and factors (exactly the checkpoint's); from the first part
// that is stored in float, or would leave a block straddling two parts, the rest is quantised
// here (e.g. the 48-row b / a projections after a GatedDeltaNet's in_proj_qkv and in_proj_z).
Fp8Weight stack_fp8(const std::vector<WeightRows>& parts);

// A 2-D x [rows, in] quantised per 1x128 group: q e4m3 [padded, in]; factors fp32 [padded, in /
// 128] stored column-major (stride (1, padded)), as the GEMM reads them. rows: x's rows; the
// padded - rows extra ones (if any) are zero with factor 1. dtype: the rows' own (bf16), the
// GEMM's output dtype.
struct Fp8Activations {
  at::Tensor q, factors;
  int64_t rows = 0;
  at::ScalarType dtype = at::kBFloat16;
  bool defined() const { return q.defined(); }
};
Fp8Activations quantize_groups(const at::Tensor& x, int64_t padded_rows = 0);
// How far apart a row's factors of consecutive 128-wide groups lie in a.factors (the column-major
// layout's padded rows), as the kernels that write or read them take it.
int64_t factor_stride(const Fp8Activations& a);
// quantize_groups(x.index_select(0, floor(sources / divisor))), the gather read in place by the
// quantisation kernel on a GPU (sources int64).
Fp8Activations quantize_gathered_groups(const at::Tensor& x, const at::Tensor& sources, int64_t divisor);

// The rows the block-scaled GEMM reads for `rows` on `device`: a multiple of 16 on a GPU (with 1
// or 5 rows cuBLASLt's GEMM returned garbage on the H200: tests/fp8_test.cc), rows on the CPU.
int64_t fp8_gemm_rows(int64_t rows, at::Device device);

// Room for rows x in quantised bf16 activations on `device`, padded as fp8_gemm_rows says (the padding
// rows written: zero, factor 1), for the kernels that quantise a GEMM's input as they produce it
// (fused_ops.h: the RMSNorm before a projection, SiLU-mul before down_proj).
Fp8Activations empty_activations(int64_t rows, int64_t in, at::Device device);

// A projection's input: rows in the model dtype, or rows already quantised for an FP8 GEMM by the
// kernel that produced them (then x is undefined).
struct GemmInput {
  at::Tensor x;
  Fp8Activations fp8;
  GemmInput(at::Tensor rows) : x(std::move(rows)) {}  // NOLINT: a tensor is the common input
  GemmInput(Fp8Activations quantised) : fp8(std::move(quantised)) {}  // NOLINT
  int64_t rows() const { return fp8.defined() ? fp8.rows : x.size(0); }
};

// x [..., in] @ W^T (+ bias) with W block-scaled FP8: [..., out] in x's dtype.
at::Tensor fp8_linear(const at::Tensor& x, const Fp8Weight& w, const at::Tensor& bias);
// The same over rows quantised already: [a.rows, out] in a.dtype.
at::Tensor fp8_linear(const Fp8Activations& a, const Fp8Weight& w, const at::Tensor& bias);

// The MoE experts' product over rows sorted by expert: rows [ends[g - 1], ends[g]) of `a` (ends
// int32 [E] on a's device, ends[-1] = 0, rows past ends[E - 1] left unwritten) times W_g^T, W a
// block-scaled batch [E, out, in]: [a.rows, out] in a.dtype. On a Hopper GPU the FP8 grouped GEMM
// (kernels/grouped_fp8.h) where fp8_grouped_gemm_applies; elsewhere the emulation, one product
// per group (the ends read on the host).
at::Tensor fp8_grouped_linear(const Fp8Activations& a, const Fp8Weight& w, const at::Tensor& ends);
// Whether fp8_grouped_linear runs the kernel for weights `w` ([E, out, in]) on `device`: a build
// and GPU for sm_90a, out and in whole 128-wide blocks, at most 1024 groups. Said once at load
// (kernel_paths); the MoE block asks it per call.
bool fp8_grouped_gemm_applies(const Fp8Weight& w, at::Device device);

// Why fp8_linear would not run the block-scaled GEMM on `device` (it needs a Hopper GPU:
// compute capability 9.x, as cuBLASLt's 128x128 block scaling), or nullopt. The CPU always gets
// a reason: there the emulation runs.
std::optional<std::string> fp8_gemm_unavailable(at::Device device);

// fp8_linear on `device` against the CPU emulation for a 64 x 512 -> 256 product: the largest
// difference over the largest value (dflashd doctor's self-test; about 1e-3 when right).
double fp8_gemm_error(at::Device device);

// Why the FP8 grouped GEMM would not run on `device` (FP8 experts then dequantized per layer),
// or nullopt: fp8_gemm_unavailable's reasons, or a build or GPU other than sm_90a.
std::optional<std::string> fp8_grouped_gemm_unavailable(at::Device device);

// fp8_grouped_linear on `device` against the CPU emulation for 4 experts of [256, 512] (one
// without rows) over 5 + 70 + 130 rows: the largest difference over the largest value (dflashd
// doctor's self-test of the MoE experts' kernel). Throws where fp8_grouped_gemm_applies says no.
double fp8_grouped_gemm_error(at::Device device);

// What kernel_paths() says of the projections' GEMMs.
inline constexpr const char* kFp8GemmPath =
    "block-scaled FP8 GEMMs (e4m3 weights in 128x128 blocks, activations in 1x128 groups; cuBLASLt)";
inline constexpr const char* kFp8GroupedPath =
    "FP8 experts on the block-scaled grouped GEMM (TMA + wgmma, factors per 128-wide k-block)";
inline constexpr const char* kFp8EmulatedPath = "block-scaled FP8 emulated (quantise, dequantise, fp32 matmul)";

}  // namespace dflash::target
