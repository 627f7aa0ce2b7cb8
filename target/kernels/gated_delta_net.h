// gated_delta_net.h: the GatedDeltaNet CUDA kernels (no torch in this interface; the torch-facing
// wrapper is target/gdn_cuda.h).
//
// Head size 128 (keys and values), chunk 64, bf16 operands, fp32 state and accumulation,
// tensor cores through mma.sync (sm_80 and newer; the solve's merges in TF32). The math is the chunked WY form of
// docs/targets.md, as in target/gated_delta_net.h (the reference these kernels are tested against):
//   1. conv1d_silu_l2norm: causal depthwise conv + SiLU over all channels of the packed
//      [tokens, q|k|v] projection, with the L2 normalisation of every q and k head fused in.
//   2. prepare (grid chunks x key heads; each CTA takes the key head's value heads in turn, at most 8,
//      K K^T and Q K^T computed once for them): the gates (or precomputed g, beta); gamma =
//      in-chunk cumsum of g; A = strict_lower(diag(beta) K K^T o exp(gamma_i - gamma_j)); T =
//      (I + A)^-1 by blocked substitution (diagonal blocks in fp32, merges in TF32 on the tensor
//      cores); W = T diag(beta e^gamma) K, U = T diag(beta) V; P = causal(scale Q K^T o
//      exp(gamma_i - gamma_j)) (all bf16).
//   3. state (grid sequences x value heads x value-column blocks): the one sequential pass. The
//      fp32 state stays in registers for the whole sequence, transposed (S^T, value columns x
//      key dims, 16 value columns per pair of warps) so that no product needs it in shared memory; per
//      chunk it stores S^T (bf16, for the output kernel), V'^T = (U - W S)^T (both in mma fragment
//      order), and updates S =
//      e^gamma_last S + K^T (V' e^(gamma_last - gamma)). Loads of chunk c+1 overlap the math of
//      chunk c (cp.async double buffering).
//   4. output (grid chunks x value heads): O = (scale e^gamma Q) S + P V', with the gated
//      RMSNorm of the layer fused in (w * rmsnorm(O) * silu(z)).
//   On Hopper (built for sm_90a, compute capability 9.0) 3 and 4 are one kernel on the
//   warpgroup tensor-core products (wgmma): a 2-CTA cluster per (sequence, value head), 64 value
//   columns per CTA; in each CTA one warpgroup carries the state (in registers) from chunk to
//   chunk and hands each chunk's S^T and V'^T through shared memory to one of two output
//   warpgroups, which compute the output and the gated norm (the two CTAs' per-token sums of
//   squares exchanged through distributed shared memory), so neither the per-chunk states nor
//   V' go through global memory (force_mma_sync in common/kernel_variants.h forces the mma.sync kernels above).
// Variable-length batches: the chunk table never lets a chunk cross a sequence boundary.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "target/kernels/gdn_log.h"

namespace dflash::target::kernels {

constexpr int kGdnChunk = 64;
constexpr int kGdnMaxGroup = 8;  // value heads per key head (the prepare kernel's shared arrays)

// Chunks of a packed batch, device int32 arrays: chunk c covers tokens [start[c], start[c] +
// length[c]) of one sequence; sequence s owns chunks [seq_chunks[s], seq_chunks[s + 1]).
struct GdnChunks {
  const int32_t* start = nullptr;
  const int32_t* length = nullptr;
  const int32_t* seq_chunks = nullptr;
  int num_chunks = 0;
  int num_seqs = 0;
};

// x: bf16 [tokens, channels] with row stride x_stride (a multiple of 8, 16-byte aligned rows);
// y: bf16 [tokens, channels] contiguous; weight: bf16 [channels, kernel]; positions: int64
// [tokens], each token's index in its own sequence. Channels [0, qk_channels) are
// L2-normalised per 128-channel head after the SiLU. kernel <= 4.
void conv1d_silu_l2norm(const void* x, int64_t x_stride, const void* weight, int kernel, const int64_t* positions,
                        void* y, int tokens, int channels, int qk_channels, cudaStream_t stream);

// A decoding step's conv for `sequences` sequences of `tokens` new rows each (conv_step): per
// sequence its kernel - 1 cached inputs (tails, bf16, row i of sequence j at tails + j *
// tails_sequence_stride + i * tails_row_stride, oldest first) and its rows of x (bf16, row j *
// tokens + t at x + row * x_stride). Writes y bf16 [sequences * tokens, channels] = SiLU(conv) (no
// L2 norm) and new_tails bf16 [sequences, kernel - 1, channels], each sequence's last kernel - 1
// inputs. kernel 2..4; channels and strides multiples of 8; 16-byte aligned rows.
// With g set, the same launch also forms the step's GatedDeltaNet gates as gdn_gates does
// (elementwise.h): g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), fp32 [sequences *
// tokens, heads], from the projections a and b (bf16, row r at r * a_stride, r * b_stride).
struct ConvStep {
  const void* tails = nullptr;
  int64_t tails_sequence_stride = 0, tails_row_stride = 0;
  const void* x = nullptr;
  int64_t x_stride = 0;
  const void* weight = nullptr;  // [channels, kernel]
  int kernel = 0, sequences = 0, tokens = 0, channels = 0;
  void* y = nullptr;
  void* new_tails = nullptr;
  const void* gate_a = nullptr;
  const void* gate_b = nullptr;
  int64_t a_stride = 0, b_stride = 0;
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  float* g = nullptr;
  float* beta = nullptr;
  int heads = 0;
  // The tails and the weight were written by kernels that had finished before the launch two
  // back began (a cache's rows from an earlier step, not a copy made for this launch): the kernel
  // reads them before its grid wait (a programmatic dependent of the projection, launch.h),
  // overlapping the projection. (Only then: the launch before it may start before its own
  // prerequisite has finished, as the stream-K GEMM does.)
  bool inputs_settled = false;
};
void conv_step(const ConvStep& step, cudaStream_t stream);

struct GdnForward {
  // qkv: bf16 [tokens, row stride qkv_stride]; q heads at column 0, k heads at key_heads*128,
  // v heads at 2*key_heads*128; q and k already L2-normalised.
  const void* qkv = nullptr;
  int64_t qkv_stride = 0;
  int tokens = 0, key_heads = 0, value_heads = 0;
  // The gates, either precomputed: g (log decay, <= 0) and beta, fp32 [tokens, value_heads];
  const float* g = nullptr;
  const float* beta = nullptr;
  // or formed in the prepare kernel from the layer's projections a and b (bf16 [tokens,
  // value_heads], row strides a_stride, b_stride) and A_log, dt_bias (fp32 [value_heads]):
  // g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), in fp32.
  const void* gate_a = nullptr;
  const void* gate_b = nullptr;
  int64_t a_stride = 0, b_stride = 0;
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  float scale = 0;              // q scale (head_dim^-0.5)
  GdnChunks chunks;
  // Scratch, bf16 unless noted: w, u [num_chunks, value_heads, 64 tokens, 128]; gamma fp32
  // [num_chunks, value_heads, 64]; states (S^T at each chunk's start, 128 value columns x 128
  // key dims) and v_new (V'^T, 128 value columns x 64 tokens) per (chunk, value head) in
  // fragment order: 16x16 blocks (value-column block major), each as 32 lanes x 16 bytes, lane
  // 4g + t holding the element pairs {(g, 2t), (g, 2t + 8), (g + 8, 2t), (g + 8, 2t + 8)} of the
  // block: the mma.m16n8k16 B fragments (b0, b1) of its two 8-column halves, adjacent registers
  // for the output kernel's products.
  void* w = nullptr;
  void* u = nullptr;
  void* v_new = nullptr;
  void* states = nullptr;
  float* gamma = nullptr;
  // P = causal(scale Q K^T o exp(gamma_i - gamma_j)), bf16 64 x 64 per (chunk, value head) as
  // mma.m16n8k16 A fragments {(g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8)}, 32 lanes x 16
  // bytes per 16x16 block: 16-row block r major, then the 16-token step k.
  void* qk = nullptr;
  // Output, one of:
  float* out_raw = nullptr;   // fp32 [tokens, value_heads, 128]: o itself (tests)
  void* out_plain = nullptr;  // bf16 [tokens, value_heads * 128]: o itself, as FLA's kernels return it
  // or the gated RMSNorm: out bf16 [tokens, value_heads * 128] = w * rmsnorm(o) * silu(z),
  // z bf16 with row stride z_stride, norm_weight bf16 [128].
  void* out = nullptr;
  const void* z = nullptr;
  int64_t z_stride = 0;
  const void* norm_weight = nullptr;
  float eps = 1e-6f;
  // Optional (decoding's prefills): sequence s's state before its tokens, state_before [num_seqs,
  // value_heads, 128 key dims, 128 value dims] (zero when null), and its state after them, written
  // to state_after (the same layout; distinct buffers); fp32, or bf16 with carried_bf16 (widened on
  // load, rounded once on store).
  const void* state_before = nullptr;
  void* state_after = nullptr;
  bool carried_bf16 = false;
  // Value columns per CTA of the state pass (32, 64 or 128; 16 per pair of warps): smaller gives
  // more CTAs, larger reads W and K fewer times.
  int state_columns = 64;
  // Optional: four events recorded before prepare, state, output and after output (profiling).
  cudaEvent_t* stage_events = nullptr;
};

// Whether gated_delta_rule_forward runs the fused state + output kernel on the current device
// (Hopper, 64 state columns): then GdnForward::states and v_new are not used (may be null).
bool gated_delta_rule_fuses_output(int state_columns);

// Launches prepare, state and output on `stream`. Throws std::runtime_error (naming the kernel
// and the CUDA error) when a launch fails.
void gated_delta_rule_forward(const GdnForward& args, cudaStream_t stream);

// A few tokens of the rule per sequence (decoding; gdn/decode_step.cuh), `tokens` each for
// `sequences` sequences, token t of sequence s at row s * tokens + t: q, k bf16 [rows, key_heads,
// 128] and v bf16 [rows, value_heads, 128], rows `*_stride` elements apart (q and k as the conv
// returns them, not yet normalised); g, beta fp32 [rows, value_heads]; state_in, state_out fp32,
// or bf16 with state_bf16 (the rule still runs in fp32: the new state is rounded once), [sequences,
// value_heads, 128 key dims, 128 value dims] (distinct buffers: the states before and after the
// tokens); out fp32 [rows, value_heads, 128]. With state_rows (device, [sequences]), sequence s's
// state [value_heads, 128, 128] is read at state_rows[s] instead of row s of state_in (the rows
// of the batch tensors the sequences' caches hold, read where they lie: no gather first).
// With `normed` set, the call's result is the layer's gated RMSNorm of o: normed bf16 [rows,
// value_heads * 128] = gated_rms_norm(o, z, weight, eps) (elementwise.h), z bf16 (row r, head h) at
// z + r * z_stride + h * z_head_stride (16-byte aligned), weight bf16 [128]. One token on bf16
// states (v 4-byte aligned) forms it in the step's kernel and never writes `out`; otherwise the
// step writes `out` and gated_rms_norm's kernel follows. The same bits either way.
struct GdnDecodeNorm {
  const void* z = nullptr;
  int64_t z_stride = 0, z_head_stride = 0;
  const void* weight = nullptr;
  float eps = 0;
  void* normed = nullptr;
};
// A test and benchmark hook (the daemon never sets it): plain steps store every state every step
// instead (IncrementalTarget), to compare the two in one process.
inline std::atomic<bool> deferred_stores_off{false};
// Deferred stores (gdn_log.h): pending[s] the tokens sequence s stepped since all its heads last
// stored (n), logs[s] its log of this layer (GdnDecodeLog::bytes). `store_all`: no token runs;
// every head stores its unstored tokens (the states are then complete). `handoff`: the launch's
// scratch between its two kernels, GdnDeferredHandoff::floats() fp32 (gdn_log.h), 16-byte aligned.
struct GdnDeferredStores {
  const int64_t* pending = nullptr;
  void* const* logs = nullptr;
  bool store_all = false;
  float* handoff = nullptr;
};
struct GdnDecodeStep {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  const void* state_in = nullptr;
  const void* const* state_rows = nullptr;
  void* state_out = nullptr;
  bool state_bf16 = false;
  float* out = nullptr;
  int sequences = 0, tokens = 0, key_heads = 0, value_heads = 0;
  float scale = 0;  // q scale (head_dim^-0.5)
  GdnDecodeNorm norm;
  // With deferred.logs set (one token, bf16 states, state_rows): the stores deferred, the states
  // updated in place where state_rows point; state_out is not used.
  GdnDeferredStores deferred;
};
void gated_delta_rule_decode_step(const GdnDecodeStep& args, cudaStream_t stream);

// Empty when the kernels have an image for the current device; otherwise the CUDA error.
const char* kernels_unavailable_on_current_device();

}  // namespace dflash::target::kernels
