// model.h: the DFlash drafter (docs/recipe.md) and its batch.
//
// Parameters (trainable): fc [H, K*H], hidden_norm [H], per layer the Qwen3 decoder layer
// (input/post-attention norms, q/k/v/o projections, q_norm/k_norm over head_dim, SwiGLU MLP),
// and the final norm. The embedding and LM head are the target's, frozen, passed in.
// Per layer, K and V come from [context ; block] through that layer's own k_proj / v_proj
// (k_norm on both), Q from the block only; attention is block_attention.h's.
//
// A Drafter is owned by one worker thread; replicas in different threads share nothing.
// Parameter names are the export names (docs/recipe.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

#include "drafter/block_attention.h"
#include "drafter/drafter_config.h"

namespace dflash::drafter {

// One micro-batch, packed over sequences (no padding anywhere).
struct DrafterBatch {
  at::Tensor features;               // [tokens, K*H]: tapped target states, ascending layer ids
  at::Tensor input_ids;              // [tokens] int64, same device
  at::Tensor loss_mask;              // [tokens] uint8/bool/int, CPU
  std::vector<int64_t> cu_seqlens;   // sequence boundaries in tokens
  std::vector<at::Tensor> anchors;   // per sequence: int64 CPU, ascending, positions within the sequence
};

// Decoding (speculative decoding): per layer the keys and values of the context, the tokens
// whose target features are known, extended as tokens are accepted (rows < length valid).
struct DrafterContextCache {
  int64_t length = 0;
  std::vector<at::Tensor> keys, values;  // per layer [capacity, Hkv, d]
};

class Drafter {
 public:
  Drafter(DrafterShape shape, at::TensorOptions options);

  const DrafterShape& shape() const { return shape_; }
  // The block attention's implementation (default automatic: block_attention.h decides per call).
  // Decoding (block_hiddens) keeps the padded, masked SDPA under `math`, the portable reference.
  void set_attention_path(BlockAttentionPath path) { attention_path_ = path; }
  // Activation checkpointing (train.activation_checkpointing): with gradients on, each layer of
  // forward() keeps only its input for backward, which runs the layer again. Same gradients;
  // about a third more drafter compute; the activations of one layer instead of all of them.
  void set_activation_checkpointing(bool on) { checkpoint_layers_ = on; }
  // Seeded initialisation like the HF init (normal 0.02 for matrices, ones for norms).
  void init_random(uint64_t seed);
  // Copies values into the parameters by name; throws naming the missing or misshapen one.
  void load_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& source);
  // Loads an exported drafter directory (config.json shape must equal ours).
  void load_export(const std::string& dir);
  // Writes DIR/config.json and DIR/model.safetensors (bf16) atomically; creates DIR if needed.
  void save_export(const std::string& dir) const;

  // Name -> parameter (leaf tensors with requires_grad), in a fixed order.
  const std::vector<std::pair<std::string, at::Tensor>>& parameters() const { return parameters_; }

  // Hidden states after the final norm for every block row of the batch: [sum_n N_n * B, H].
  // `embed` is the target's embedding table [vocab, H] (frozen).
  at::Tensor forward(const DrafterBatch& batch, const at::Tensor& embed, int64_t group_blocks = 64) const;

  // Decoding, no gradients. Appends the context of positions cache.length .. + n - 1 from their
  // target features ([n, K*H]): each layer's keys and values of hidden_norm(fc(features)).
  void extend_context(DrafterContextCache& cache, const at::Tensor& features) const;
  // The hidden states after the final norm [B, H] of one block at positions cache.length ..
  // cache.length + B - 1 whose token ids are `block_ids` (int64 [B]: the last accepted token,
  // then mask tokens): every row sees the whole cached context and the whole block, as a training
  // block sees the context before its anchor (forward() of an anchor at cache.length).
  at::Tensor block_hidden(const DrafterContextCache& cache, const at::Tensor& block_ids, const at::Tensor& embed) const;
  // The same for several sequences (batched decoding): the projections, norms and MLPs once over
  // every block row; the attention on a bf16 / fp16 GPU once per layer on FlashAttention's
  // variable-length kernel (contexts and blocks packed), else (and under the math path) once per
  // group of blocks of one length (contexts padded and masked). extend_context of several caches:
  // one fc and one k / v projection per layer, the rows copied into every cache at once.
  // Results per sequence, equal to the one-sequence calls up to the rounding of batched GEMMs.
  void extend_contexts(const std::vector<DrafterContextCache*>& caches, const std::vector<at::Tensor>& features) const;
  std::vector<at::Tensor> block_hiddens(const std::vector<const DrafterContextCache*>& caches,
                                        const std::vector<at::Tensor>& block_ids, const at::Tensor& embed) const;

 private:
  friend class CheckpointedLayer;  // model.cc: forward()'s layers under activation checkpointing
  // What every layer of one forward() shares: rotary tables, the packing of the batch, the
  // attention shape (its window set per layer). Defined in model.cc.
  struct LayerInputs;
  // Layer i of forward(): x [rows, H] -> x after the layer, over the fused context [tokens, H].
  at::Tensor layer_forward(int64_t i, const at::Tensor& x, const at::Tensor& context, const LayerInputs& in) const;

  // The parameters by role (handles to the same tensors as parameters_, typed as the target's
  // layers are): built once at construction.
  struct Layer {
    at::Tensor input_norm, post_attention_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, gate_proj, up_proj,
        down_proj;
  };
  at::Tensor fc_, hidden_norm_, norm_;
  std::vector<Layer> layers_;
  DrafterShape shape_;
  at::TensorOptions options_;
  BlockAttentionPath attention_path_ = BlockAttentionPath::automatic;
  bool checkpoint_layers_ = false;
  std::vector<std::pair<std::string, at::Tensor>> parameters_;
};

// Writes DIR/config.json and DIR/model.safetensors (bf16) of a drafter of `shape` whose weights
// are `weights` (export names, any dtype or device), atomically; creates DIR if needed.
void write_export(const std::string& dir, const DrafterShape& shape,
                  const std::vector<std::pair<std::string, at::Tensor>>& weights);

// Block token ids for one sequence: per anchor [input_ids[a], mask, ..., mask] (docs/recipe.md).
at::Tensor block_token_ids(const at::Tensor& sequence_ids, const at::Tensor& anchors, int64_t block_size,
                           int64_t mask_token_id);
// Absolute positions of block rows: anchor .. anchor + B - 1 per block (docs/recipe.md).
at::Tensor block_positions(const at::Tensor& anchors, int64_t block_size);

}  // namespace dflash::drafter
