// The GatedDeltaNet CUDA kernels: the launches and the choice between them. The kernels, one
// stage per file (gated_delta_net.h has the math and the data layout):
//   gdn/conv.cuh              1. causal conv1d + SiLU + L2 norm of q and k
//   gdn/prepare.cuh           2. per chunk: gates, (I + A)^-1, W, U, P
//   gdn/state.cuh             3. the sequential state pass (mma.sync)
//   gdn/output.cuh            4. the output and the gated norm (mma.sync)
//   gdn/state_output_sm90.cuh 3 + 4 fused on Hopper: the state chain (mainloop) and the output
//                             groups (epilogue), warp-specialised (wgmma)
//   gdn/decode_step.cuh       5. decoding: a few tokens per sequence, the state read and written once
//   gdn/decode_deferred.cuh   5b. plain decoding steps whose states are stored every kGdnDeferTokens-th token
#include "target/kernels/gated_delta_net.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "target/kernels/elementwise.h"
#include "target/kernels/gdn/common.cuh"
#include "target/kernels/gdn/conv.cuh"
#include "target/kernels/gdn/decode_step.cuh"
#include "target/kernels/gdn/decode_deferred.cuh"
#include "target/kernels/gdn/output.cuh"
#include "target/kernels/gdn/prepare.cuh"
#include "target/kernels/gdn/state.cuh"
#include "target/kernels/gdn/state_output_sm90.cuh"

namespace dflash::target::kernels {

using namespace gdn;

void conv1d_silu_l2norm(const void* x, int64_t x_stride, const void* weight, int kernel, const int64_t* positions,
                        void* y, int tokens, int channels, int qk_channels, cudaStream_t stream) {
  if (tokens == 0) return;
  if (kernel < 1 || kernel > 4 || channels % 128 != 0 || qk_channels % 128 != 0 || x_stride % 8 != 0) {
    throw std::invalid_argument(
        "conv1d_silu_l2norm: needs kernel 1..4, channel counts that are multiples of 128, a row stride multiple of 8");
  }
  const dim3 grid((tokens + kConvTokens - 1) / kConvTokens, (channels / 8 + kConvThreads - 1) / kConvThreads);
  conv1d_silu_l2norm_kernel<<<grid, kConvThreads, 0, stream>>>(static_cast<const bf16*>(x), x_stride, static_cast<const bf16*>(weight),
                                                      kernel, positions, static_cast<bf16*>(y), tokens, channels,
                                                      qk_channels);
  check_cuda_launch("GatedDeltaNet kernel conv1d_silu_l2norm");
}

void conv_step(const ConvStep& a, cudaStream_t stream) {
  if (a.kernel < 2 || a.kernel > 4 || a.channels % 8 != 0 || a.x_stride % 8 != 0 || a.tails_row_stride % 8 != 0 ||
      a.tails_sequence_stride % 8 != 0) {
    throw std::invalid_argument("conv_step: needs kernel 2..4, channels and strides that are multiples of 8");
  }
  if (a.g != nullptr && (a.heads < 1 || a.gate_a == nullptr || a.gate_b == nullptr || a.a_log == nullptr ||
                         a.dt_bias == nullptr || a.beta == nullptr)) {
    throw std::invalid_argument("conv_step: gates need a, b, A_log, dt_bias, beta and at least one head");
  }
  if (a.sequences == 0 || a.channels == 0 || a.tokens == 0) return;
  const dim3 grid(static_cast<unsigned>(a.sequences),
                  static_cast<unsigned>((a.channels / 8 + kConvStepThreads - 1) / kConvStepThreads));
  check_cuda(launch_dependent(conv_step_kernel, grid, kConvStepThreads, 0, stream, a),
             "GatedDeltaNet kernel conv_step");
}

// The fused wgmma state + output kernel on compute capability 9.0 when built for sm_90a (64 value
// columns per CTA), the mma.sync kernels elsewhere (and where a test forces them:
// kernel_variants.h).
bool warpgroup_kernels() {
#ifdef DFLASHD_CUDA_SM90A
  return warpgroup_mma_on_current_device(MmaKernels::gated_delta_net);
#else
  return false;
#endif
}

template <int kPairs>
void launch_state(const GdnForward& args, cudaStream_t stream) {
  const size_t bytes = sizeof(StateShared<kPairs>);
  allow_shared_memory(state_kernel<kPairs>, bytes, "GatedDeltaNet kernel state");
  state_kernel<kPairs><<<dim3(args.chunks.num_seqs, args.value_heads, D / (16 * kPairs)), 64 * kPairs, bytes, stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel state");
}

template <OutputFormat kFormat>
void launch_state_output(const GdnForward& args, cudaStream_t stream) {
  const size_t bytes = sizeof(FusedShared) + mma_tile::kSharedAlignment;
  allow_shared_memory(state_output_kernel<kFormat>, bytes, "GatedDeltaNet kernel state+output (wgmma)");
  check_cuda(launch_dependent(state_output_kernel<kFormat>, dim3(args.chunks.num_seqs, args.value_heads, D / FusedShared::BV),
                              kFusedThreads, bytes, stream, args),
             "GatedDeltaNet kernel state+output (wgmma)");
}

bool gated_delta_rule_fuses_output(int state_columns) {
  return state_columns == 64 && warpgroup_kernels();
}

void gated_delta_rule_forward(const GdnForward& args, cudaStream_t stream) {
  if (args.chunks.num_chunks == 0) return;
  if (args.key_heads <= 0 || args.value_heads % args.key_heads != 0) {
    throw std::invalid_argument("gated_delta_rule_forward: value heads must be a multiple of key heads");
  }
  if (args.value_heads / args.key_heads > kMaxGroup) {
    throw std::invalid_argument("gated_delta_rule_forward: at most " + std::to_string(kMaxGroup) +
                                " value heads per key head (got " + std::to_string(args.value_heads / args.key_heads) + ")");
  }
  if ((args.out_raw != nullptr) + (args.out_plain != nullptr) + (args.out != nullptr) != 1) {
    throw std::invalid_argument("gated_delta_rule_forward: exactly one of out_raw, out_plain and out");
  }
  const dim3 per_chunk(args.chunks.num_chunks, args.value_heads);
  auto mark = [&](int i) {
    if (args.stage_events != nullptr) cudaEventRecord(args.stage_events[i], stream);
  };
  mark(0);
  const size_t prepare_bytes = sizeof(PrepareShared) + mma_tile::kSharedAlignment;
  auto* prepare = warpgroup_kernels() ? prepare_kernel<true> : prepare_kernel<false>;
  allow_shared_memory(prepare, prepare_bytes, "GatedDeltaNet kernel prepare");
  prepare<<<dim3(args.chunks.num_chunks, args.key_heads), kPrepareThreads, prepare_bytes, stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel prepare");
  mark(1);
  if (gated_delta_rule_fuses_output(args.state_columns)) {
    if (args.out != nullptr) {
      launch_state_output<OutputFormat::gated_norm>(args, stream);
    } else if (args.out_plain != nullptr) {
      launch_state_output<OutputFormat::bf16>(args, stream);
    } else {
      launch_state_output<OutputFormat::fp32>(args, stream);
    }
    mark(2);
    mark(3);
    return;
  }
  switch (args.state_columns) {
    case 32: launch_state<2>(args, stream); break;
    case 64: launch_state<4>(args, stream); break;
    case 128: launch_state<8>(args, stream); break;
    default: throw std::invalid_argument("gated_delta_rule_forward: state_columns must be 32, 64 or 128");
  }
  mark(2);
  allow_shared_memory(output_kernel, sizeof(OutputShared), "GatedDeltaNet kernel output");
  output_kernel<<<per_chunk, kOutputThreads, sizeof(OutputShared), stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel output");
  mark(3);
}

const char* kernels_unavailable_on_current_device() {
  return kernel_image_missing(output_kernel);
}

void gated_delta_rule_decode_step(const GdnDecodeStep& args, cudaStream_t stream) {
  if (args.key_heads < 1 || args.value_heads % args.key_heads != 0) {
    throw std::invalid_argument("gated_delta_rule_decode_step: value heads must be a multiple of key heads");
  }
  // One token on bf16 states (plain decoding steps): column pairs, v read as bf16 pairs.
  const bool v_pairs = reinterpret_cast<uintptr_t>(args.v) % 4 == 0 && args.v_stride % 2 == 0;
  if (args.deferred.logs != nullptr) {
    if (!args.state_bf16 || args.state_rows == nullptr || args.deferred.pending == nullptr ||
        args.deferred.handoff == nullptr || reinterpret_cast<uintptr_t>(args.deferred.handoff) % 16 != 0 ||
        (!args.deferred.store_all && (args.tokens != 1 || !v_pairs))) {
      throw std::invalid_argument(
          "gated_delta_rule_decode_step: deferred stores take one token a sequence (v in 4-byte pairs), bf16 "
          "states by address, the pending counts and a 16-byte aligned handoff");
    }
    if (args.sequences == 0) return;
    // The chains launched plainly (they read what the conv step wrote), the state pass as their
    // programmatic dependent: its first CTAs load their states while the chains run.
    const Handoff handoff{args.sequences, args.value_heads, args.deferred.store_all};
    const size_t chain_bytes =
        GroupTokens::bytes(GroupTokens::key_span(args.value_heads / args.key_heads, args.key_heads));
    if (chain_bytes > 48 * 1024) {  // past the default limit only where a key head has few value heads
      check_cuda(cudaFuncSetAttribute(deferred_chains_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(chain_bytes)),
                 "GatedDeltaNet kernel deferred_chains: shared memory");
    }
    deferred_chains_kernel<<<dim3(handoff.groups(), args.sequences), kChainThreads, chain_bytes, stream>>>(args);
    check_cuda(cudaGetLastError(), "GatedDeltaNet kernel deferred_chains");
    check_cuda(launch_dependent(deferred_state_kernel, dim3(args.sequences * args.value_heads), kTokenThreads, 0,
                                stream, args),
               "GatedDeltaNet kernel deferred_state");
    return;
  }
  if (args.sequences == 0 || args.tokens == 0) return;
  const int ctas = args.sequences * args.value_heads * kDecodeCtasPerHead;
  const bool one_token = args.state_bf16 && args.tokens == 1 && v_pairs;
  cudaError_t launched;
  if (one_token) {
    // A plain launch, not a programmatic dependent: in a step of 128 it ran 115 us a layer launched
    // early against 101 us launched plainly (bench/RESULTS.md, session 26), probably because the
    // early first wave (3 CTAs per SM of 6,144) leaves the grid wait at one instant and the waves
    // after keep that lockstep (all loading, then all storing). Its own dependents still launch early.
    decode_token_bf16_kernel<<<dim3(args.sequences * args.value_heads), kTokenThreads, 0, stream>>>(args);
    launched = cudaGetLastError();
  } else if (args.state_bf16) {
    launched = launch_dependent(decode_step_kernel<bf16>, dim3(ctas), kDecodeThreads, 0, stream, args);
  } else {
    launched = launch_dependent(decode_step_kernel<float>, dim3(ctas), kDecodeThreads, 0, stream, args);
  }
  check_cuda(launched, "GatedDeltaNet kernel decode_step");
  const GdnDecodeNorm& n = args.norm;
  if (n.normed != nullptr && !one_token) {  // the step kernels above wrote o: the norm's own kernel
    gated_rms_norm(args.out, n.z, n.z_stride, n.z_head_stride, n.weight, n.normed, args.sequences * args.tokens,
                   args.value_heads, kGdnHeadDim, n.eps, stream);
  }
}

}  // namespace dflash::target::kernels
