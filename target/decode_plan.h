// decode_plan.h: what decoding a sequence holds on the device, without torch: the incremental
// target's cache (target/incremental.h) at the length a sequence reaches, so that `dflashd
// generate` and `dflashd eval` refuse a batch that cannot fit before they start, naming the
// largest that does, instead of running out of memory mid-run.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "target/model_config.h"
#include "target/stage_plan.h"

namespace dflash::target {

// Device bytes one sequence of up to `tokens` positions holds while it decodes in steps of
// `step_tokens` tokens: per GatedDeltaNet layer its state twice (a step reads the states before
// it and writes new ones), its conv inputs and, for bf16 states, the log of the tokens whose
// stores plain steps defer (kernels/gdn_log.h), with the deferred step's handoff once; per
// attention layer its keys and values at the capacity they grow to (a power of two, at least 256
// positions); a step's logits in the model's dtype and their fp32 widening (made only for a
// sampled choice; counted for greedy too).
// dtype_bytes: the model's dtype (2 for bf16); state_bytes: the states' (4 for fp32, 2 for bf16:
// TargetOptions::decode_state_dtype).
// `layers`: a pipeline stage's part (its layers; the logits only with its head); every layer
// and the logits by default.
int64_t decoding_sequence_bytes(const ModelConfig& c, int64_t tokens, int64_t step_tokens, int64_t dtype_bytes,
                                int64_t state_bytes);
int64_t decoding_sequence_bytes(const ModelConfig& c, int64_t tokens, int64_t step_tokens, int64_t dtype_bytes,
                                int64_t state_bytes, const LayerRange& layers);

// The most sequences of decoding_sequence_bytes `per_sequence` that fit in `free_bytes`, keeping
// a tenth for the prefill's activations, the allocator's fragmentation and the GEMMs' workspaces.
int64_t decoding_batch_that_fits(int64_t free_bytes, int64_t per_sequence);

// A target in pipeline stages (stage s holds `stages[s]`'s layers on GPU gpus[s]): the bytes one
// sequence's caches take on each GPU (stages on one GPU add up; the logits on the head's).
std::map<int, int64_t> decoding_bytes_by_gpu(const ModelConfig& c, const std::vector<LayerRange>& stages,
                                             const std::vector<int>& gpus, int64_t tokens, int64_t step_tokens,
                                             int64_t dtype_bytes, int64_t state_bytes);

// The most sequences whose caches fit on every GPU of `each` (bytes per sequence by GPU) in
// `free` (bytes left by GPU; none for a GPU it lacks), and the GPU that limits them.
struct DecodingFit {
  int64_t sequences = 0;
  int gpu = -1;
};
DecodingFit decoding_batch_that_fits(const std::map<int, int64_t>& each, const std::map<int, int64_t>& free);

}  // namespace dflash::target
