// incremental.h: the target a few tokens at a time over a per-sequence cache, for decoding
// (speculative decoding in `dflashd eval`, generation). The full-attention layers keep their
// keys and values; the GatedDeltaNet layers their conv window and recurrent state (fp32, or bf16
// with TargetOptions::decode_state_dtype; the rule always runs in fp32; plain steps on bf16 states
// on a GPU store each head's state every 8th token only: StageCache::unstored). A step appends tokens;
// crop() rolls the cache back to a prefix of the last step (the accepted part of a speculative
// block): keys and values are cut, the conv window re-cut, and the recurrent state recomputed
// from the state before the step over the kept tokens (the step keeps the rule's inputs, a few
// KB per token, rather than a state per token, 3 MB per token and layer at 27B).
//
// Several sequences step together (step_batch, crop_batch: batched decoding of many prompts):
// the token-wise work (embedding, projections, MLP or experts, norms, LM head) runs once over all
// their tokens; the attention and the GatedDeltaNet rule once per group of sequences stepping the
// same number of tokens (each query masked to its own sequence's keys; the rule's heads of the
// group's sequences side by side, which is exact: heads are independent). The caches of a group
// are rows of batch tensors the group shares (DecodeCache): the next step of the same sequences
// reads them as they are, so a step costs no op per sequence and layer; when the set changes (a
// sequence finished, a crop kept different numbers of tokens), rows are sliced or gathered once
// per run of sequences that share a batch.
//
// Math as TargetModel::forward (same weights, same roundings of each layer's pieces); the
// GatedDeltaNet rule runs as libtorch ops (token by token for one-token steps, chunked for
// verify steps and prefills), on any device; where the model's GatedDeltaNet layers run the CUDA
// kernels, every step and crop runs the decode-step kernel (the state read and written once),
// prefills the training forward's chunked kernels from and to the cached states, the conv the
// conv kernel, and on a GPU in bf16 the attention FlashAttention's
// variable-length kernel over the cache rows (no mask).
//
// A target over several devices (a StagedTarget's pipeline stages) decodes as one: each stage
// runs its layers over its part of every cache (StageCache, on its device), the residual stream
// passes from stage to stage as in StagedTarget::forward (so the split changes no rounding: the
// logits and features are bit-identical to one device's), and the logits and features come out
// on the last stage's device. A step runs the stages one after another, so one decoder keeps one
// stage busy at a time; several decoders over one IncrementalTarget, each on its own thread,
// keep several busy (`dflashd generate` runs one per stage).
//
// Thread-safety: const methods; a cache belongs to one thread, and caches that stepped together
// share tensors that no step modifies in place except the attention batch their group shares
// (its new keys and values).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "target/model.h"

namespace dflash::target {

// One pipeline stage's part of a sequence's decoding state: the caches of the layers that stage
// holds (indexed from its first layer), on its device. A copy shares its tensors with the
// original (keys and values are written in place): step only one of them.
struct StageCache {
  // Full-attention layers: the sequence's keys and values are row `step_slot` of batch tensors
  // [rows, capacity, Hkv, d] it shares with the sequences it last stepped with (positions <
  // DecodeCache::length valid; the step's keys are written in place). step_slot is its row in
  // its last step's group, which also indexes last_gdn's batches; after a step that kept nothing
  // for a crop (GPU, FlashAttention), it may be its row of a batch that sequences have left
  // (their rows unused) or joined (copied into rows no live cache held).
  std::vector<at::Tensor> keys, values;
  int64_t step_slot = 0;
  // GatedDeltaNet layers: the sequence's conv inputs and state are row `slot` of batch tensors it
  // shares with the sequences it last stepped (or was cropped) with: conv [G, K - 1, channels]
  // (the last K - 1 conv inputs), state [G, Hv, dk, dv] (decode_state_dtype). Sharing them costs
  // no op per sequence and layer, and the next step of the same sequences reads the batch as it is.
  std::vector<at::Tensor> conv, state;
  int64_t slot = 0;
  // The state's row in its batch: `slot`, except after plain steps with deferred stores, which
  // leave the states where they lie (below).
  int64_t state_slot = 0;
  // Deferred stores (plain one-token steps on bf16 states where the GatedDeltaNet layers run the
  // CUDA kernels; gdn_cuda.h GdnDeferredRows): each head stores its state every 8th token only,
  // the tokens in between logged. `unstored`: the plain steps since every head of this stage's
  // layers last stored; `log` [layers, kernels::GdnDecodeLog::bytes] this cache's logs (its own, never
  // shared with another sequence). Any other step first stores what is unstored.
  int64_t unstored = 0;
  at::Tensor log;
  // The last step, for crop(), per GatedDeltaNet layer, as batch tensors of the step's group (row
  // step_slot): the state before it, the rule's inputs over it (q, k, v [G, n, heads, d], g, beta
  // [G, n, Hv]) and the conv inputs over it ([G, K - 1 + n, channels]), n the tokens the step ran.
  struct LastGdn {
    at::Tensor state_before, q, k, v, g, beta, window;
  };
  std::vector<LastGdn> last_gdn;  // per layer (empty entries for full-attention layers)
};

// One sequence's decoding state: its length, its last step, and one StageCache per stage of the
// target (one for a target on one device). A copy shares its tensors with the original: step
// only one of them.
struct DecodeCache {
  int64_t length = 0;  // tokens held: positions 0 .. length - 1
  // The last step, for crop(): its first position and token count (the tokens still held of it).
  struct LastStep {
    int64_t begin = 0, count = 0;
  } last;
  std::vector<StageCache> stages;
};

struct DecodeOutput {
  // [tokens, vocab] in the head's dtype (bf16 on a bf16 GPU target): a greedy choice takes the
  // argmax of these (widening to fp32 is exact, so it would choose the same token), sampling
  // widens them (sampling_probs). At 128 sequences and a 248K vocabulary the fp32 copy would be
  // 127 MB written and read again every step; at a verify step's 16 rows each, 2 GB.
  at::Tensor logits;
  at::Tensor features;  // [tokens, K*H], model dtype: the tapped layers' outputs, ascending ids
};

class IncrementalTarget {
 public:
  // Steps of at most this many tokens run the rule token by token; longer ones chunked (64-token
  // chunks, a fixed number of ops): a plain decode step's one token token by token, a 16-token
  // verify step chunked (decode_bench compares the two: bench/RESULTS.md).
  static constexpr int64_t kRecurrentStepTokens = 1;

  // `model` must hold every layer (its last_layer is the model's last) and outlive this.
  // `recurrent_step_tokens`: the threshold above (benchmarks compare the two forms).
  explicit IncrementalTarget(const TargetModel& model, int64_t recurrent_step_tokens = kRecurrentStepTokens);
  // A target over several devices: `stages` (a StagedTarget's, in order) hold layers 0 .. the
  // model's last between them, contiguous, the last with the final norm and LM head; all outlive
  // this. Throws std::invalid_argument otherwise, or when their dtypes or state dtypes differ.
  explicit IncrementalTarget(std::vector<const TargetModel*> stages,
                             int64_t recurrent_step_tokens = kRecurrentStepTokens);

  DecodeCache new_cache() const;
  // Runs `ids` (int64 [n], n >= 1) at positions cache.length .. + n - 1; the cache grows by n.
  // `tap`: decoder layers whose outputs make DecodeOutput::features (may be empty).
  DecodeOutput step(DecodeCache& cache, const at::Tensor& ids, const std::vector<int64_t>& tap) const;
  // One step of several sequences: caches[s] runs ids[s] (n_s >= 1 tokens each, any mix of n);
  // outputs per sequence as step() gives them (equal up to the rounding of the batched GEMMs).
  // The caches must be distinct. `croppable` false: the step keeps nothing for crop() (plain
  // decoding never rolls back; the state before the step, 150 MB per sequence at 27B shapes,
  // is not held) and the caches can only be "cropped" to their full length. The ids may lie on
  // the host or the model's device (e.g. the tokens the step before chose, still being computed:
  // no id is read on the host), and nothing here waits for the device: a GPU step is queued while
  // the one before runs.
  std::vector<DecodeOutput> step_batch(const std::vector<DecodeCache*>& caches, const std::vector<at::Tensor>& ids,
                                       const std::vector<int64_t>& tap, bool croppable = true) const;
  // A prompt in steps of at most `chunk` tokens (bounded attention scores and activations for
  // long prompts): the features of every token, the logits of the last one ([1, vocab]). Keeps
  // nothing for crop() (a prompt is never rolled back; its rule inputs are 1.2 GB per 512 tokens
  // at 27B shapes).
  DecodeOutput prefill(DecodeCache& cache, const at::Tensor& ids, const std::vector<int64_t>& tap,
                       int64_t chunk = kPrefillChunkTokens) const;
  static constexpr int64_t kPrefillChunkTokens = 2048;
  // Several prompts' prefills in one forward (caches[s] runs ids[s]): what prefill() gives per
  // sequence (logits of the last token only, [1, vocab]; equal up to the rounding of the batched
  // GEMMs). The prompts together hold at most kPrefillBatchTokens tokens; throws
  // std::invalid_argument otherwise.
  std::vector<DecodeOutput> prefill_batch(const std::vector<DecodeCache*>& caches, const std::vector<at::Tensor>& ids,
                                          const std::vector<int64_t>& tap) const;
  static constexpr int64_t kPrefillBatchTokens = 4096;

  // Keeps the first `length` tokens; length must lie within the last step, [last.begin,
  // last.begin + last.count]. Throws std::invalid_argument.
  void crop(DecodeCache& cache, int64_t length) const;
  // crop() of several caches (lengths[s] for caches[s]), the recurrent states recomputed together
  // for the caches that keep the same number of tokens of their last step.
  void crop_batch(const std::vector<DecodeCache*>& caches, const std::vector<int64_t>& lengths) const;

  const ModelConfig& config() const { return stages_.front()->config(); }
  // The first stage's options (every stage's dtype and decode_state_dtype are the same).
  const TargetOptions& options() const { return stages_.front()->options(); }
  // Where the logits and features come out: the last stage's device.
  at::Device device() const { return stages_.back()->options().device; }
  const at::Tensor& embed_tokens() const { return stages_.front()->embed_tokens(); }  // on the first stage
  const at::Tensor& lm_head() const { return stages_.back()->lm_head(); }             // on the last stage
  size_t stage_count() const { return stages_.size(); }
  // The stages' devices for logs: "cuda:0", or "cuda:0 + cuda:1" for a target over two.
  std::string places() const;
  const TargetModel& stage(size_t i) const { return *stages_[i]; }

 private:
  // step_batch's forward; with last_logits_only, each sequence's logits are its last token's.
  std::vector<DecodeOutput> run_step(const std::vector<DecodeCache*>& caches, const std::vector<at::Tensor>& ids,
                                     const std::vector<int64_t>& tap, bool croppable, bool last_logits_only) const;

  // A step's tokens (incremental.cc), and the checks of a step's caches, ids and taps.
  struct StepTokens;
  StepTokens step_tokens(const std::vector<DecodeCache*>& caches, const std::vector<at::Tensor>& input_ids,
                         const std::vector<int64_t>& tap) const;
  // One stage's layers of a step over its part of the caches, from `stream` (the previous stage's;
  // none on the first stage, which embeds the ids): the stream after them; the outputs of the
  // tapped layers it holds appended to *tapped.
  StreamState run_stage(size_t stage, const std::vector<DecodeCache*>& caches, const StepTokens& tokens,
                        const StreamState& stream, const std::vector<int64_t>& tap, bool croppable,
                        std::vector<at::Tensor>* tapped) const;
  // crop_batch's GatedDeltaNet states of one stage, for the members keeping `keep` tokens.
  void crop_stage(size_t stage, const std::vector<DecodeCache*>& caches, const std::vector<size_t>& members,
                  int64_t keep) const;

  std::vector<const TargetModel*> stages_;
  int64_t recurrent_step_tokens_;
};

}  // namespace dflash::target
