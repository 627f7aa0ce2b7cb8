// decode_attention.h: a decoding step's attention when every sequence brings one token
// (a plain step of `dflashd generate` or of the acceptance evaluation), over the keys and values
// in the attention caches where they lie. No torch here.
//
// Why not FlashAttention's variable-length kernel: for one query per sequence it copies q into
// its grouped-query layout and the output back (three copies a layer) and tiles 64 query rows of
// which a step has hq / hkv; here one CTA takes one sequence's kv head and a range of its keys
// (the G = hq / hkv query heads sharing that kv head as the rows of one m16 product), the ranges
// of a sequence are merged by a second kernel, and q and the output stay in the layer's layout.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

namespace dflash::target::kernels {

// A test and benchmark hook (the daemon never sets it): one-token steps take FlashAttention's
// kernel instead, to compare the two in one process.
inline std::atomic<bool> decode_attention_off{false};

// Query heads one kv head may serve (the rows of the m16 product) and the head sizes built.
inline constexpr int kDecodeAttentionMaxGroup = 16;
inline bool decode_attention_head_dim(int d) { return d == 128 || d == 256; }

struct DecodeAttention {
  // q: bf16, sequence b's query head j at q + b * q_stride + j * d (heads contiguous).
  const void* q = nullptr;
  int64_t q_stride = 0;
  // Keys and values: bf16 rows of kv_heads * d elements (kv head h at h * d in a row); sequence b's
  // keys are rows first_row(b) .. first_row(b) + lengths[b] - 1, first_row(b) = (rows ? rows[b] :
  // b) * capacity.
  void* k = nullptr;
  void* v = nullptr;
  const int* rows = nullptr;
  int64_t capacity = 0;
  const int* lengths = nullptr;  // int32 [sequences] on the device, each >= 1
  // The step's own keys and values (both or neither): sequence b's kv head h at new_k + b *
  // new_k_stride + h * d (the same for new_v), written into the caches at its last position
  // (lengths[b] - 1) by the CTA whose range holds that key, before it reads it.
  const void* new_k = nullptr;
  const void* new_v = nullptr;
  int64_t new_k_stride = 0, new_v_stride = 0;
  // out: bf16, sequence b's head j at out + b * out_stride + j * d. With a gate (gated
  // attention), out = bf16(bf16(o) * bf16(sigmoid(gate))) as kernels::sigmoid_gate computes it,
  // gate (b, j, i) at gate + b * gate_stride + j * gate_head_stride + i.
  void* out = nullptr;
  int64_t out_stride = 0;
  const void* gate = nullptr;
  int64_t gate_stride = 0, gate_head_stride = 0;
  int sequences = 0, heads = 0, kv_heads = 0, d = 0;
  int longest = 0;  // the largest of lengths (sizes the key ranges; a host-side bound is enough)
  float scale = 1.f;
  // Per-range partial results when a sequence's keys are split (decode_attention_workspace bytes).
  void* workspace = nullptr;
};

// The key ranges per sequence for `a` on a GPU of `sms` SMs, and the workspace they need.
int decode_attention_splits(const DecodeAttention& a, int sms);
size_t decode_attention_workspace(const DecodeAttention& a, int sms);

// Runs on `stream` as a programmatic dependent of its previous kernel. Needs sm_80 or newer.
void decode_attention(const DecodeAttention& a, int sms, cudaStream_t stream);

}  // namespace dflash::target::kernels
