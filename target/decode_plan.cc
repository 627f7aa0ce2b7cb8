#include "target/decode_plan.h"

#include <algorithm>

#include "target/kernels/gdn_log.h"

namespace dflash::target {

int64_t decoding_sequence_bytes(const ModelConfig& c, int64_t tokens, int64_t step_tokens, int64_t dtype_bytes,
                                int64_t state_bytes) {
  const LayerRange every{0, c.num_layers - 1, true};
  return decoding_sequence_bytes(c, tokens, step_tokens, dtype_bytes, state_bytes, every);
}

int64_t decoding_sequence_bytes(const ModelConfig& c, int64_t tokens, int64_t step_tokens, int64_t dtype_bytes,
                                int64_t state_bytes, const LayerRange& layers) {
  int64_t capacity = 256;
  while (capacity < tokens) capacity *= 2;
  int64_t bytes = 0;
  bool deferred_stores = false;
  for (int64_t i = layers.first; i <= layers.last; ++i) {
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::full_attention) {
      bytes += 2 * capacity * c.num_key_value_heads * c.head_dim * dtype_bytes;
    } else {
      const int64_t channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                               c.linear_num_value_heads * c.linear_value_head_dim;
      bytes += 2 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * state_bytes +
               (c.linear_conv_kernel_dim - 1) * channels * dtype_bytes;
      // bf16 states: plain steps' log of the tokens whose stores they defer (kernels/gdn_log.h).
      if (state_bytes == 2) {
        bytes += kernels::GdnDecodeLog{static_cast<int>(c.linear_num_key_heads),
                                       static_cast<int>(c.linear_num_value_heads)}.bytes();
        deferred_stores = true;
      }
    }
  }
  // One launch's handoff between the deferred step's kernels at a time (the layers reuse it): a
  // store of every head's, the larger.
  if (deferred_stores) {
    bytes += kernels::GdnDeferredHandoff{1, static_cast<int>(c.linear_num_value_heads), true}.floats() * 4;
  }
  return bytes + (layers.head ? step_tokens * c.vocab_size * (4 + dtype_bytes) : 0);
}

int64_t decoding_batch_that_fits(int64_t free_bytes, int64_t per_sequence) {
  if (per_sequence <= 0) return 0;
  return std::max<int64_t>(0, free_bytes - free_bytes / 10) / per_sequence;
}

std::map<int, int64_t> decoding_bytes_by_gpu(const ModelConfig& c, const std::vector<LayerRange>& stages,
                                             const std::vector<int>& gpus, int64_t tokens, int64_t step_tokens,
                                             int64_t dtype_bytes, int64_t state_bytes) {
  std::map<int, int64_t> each;
  for (size_t s = 0; s < stages.size() && s < gpus.size(); ++s) {
    each[gpus[s]] += decoding_sequence_bytes(c, tokens, step_tokens, dtype_bytes, state_bytes, stages[s]);
  }
  return each;
}

DecodingFit decoding_batch_that_fits(const std::map<int, int64_t>& each, const std::map<int, int64_t>& free) {
  DecodingFit fit;
  for (const auto& [gpu, bytes] : each) {
    const auto left = free.find(gpu);
    const int64_t here = decoding_batch_that_fits(left == free.end() ? 0 : left->second, bytes);
    if (fit.gpu < 0 || here < fit.sequences) fit = {here, gpu};
  }
  return fit;
}

}  // namespace dflash::target
