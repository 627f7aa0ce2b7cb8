#include "drafter/block_attention.h"

#include <ATen/ATen.h>
#include <ATen/ops/_efficient_attention_backward.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <stdexcept>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "drafter/kernels/block_attention.h"
#endif

namespace dflash::drafter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Batched product with an fp32 result. fp32 operands: at::matmul. bf16/fp16 operands (GPU):
// cuBLAS with fp32 accumulation and fp32 output (tensor cores), as flash attention keeps its
// scores in fp32 while P and dS enter the next product in the input precision.
at::Tensor product(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble) return at::matmul(a, b);
  const auto batch = at::infer_size(a.sizes().slice(0, a.dim() - 2), b.sizes().slice(0, b.dim() - 2));
  auto shape_of = [&](const at::Tensor& t) {
    std::vector<int64_t> s(batch.begin(), batch.end());
    s.push_back(t.size(-2));
    s.push_back(t.size(-1));
    return s;
  };
  const at::Tensor a3 = a.expand(shape_of(a)).reshape({-1, a.size(-2), a.size(-1)});
  const at::Tensor b3 = b.expand(shape_of(b)).reshape({-1, b.size(-2), b.size(-1)});
  std::vector<int64_t> out(batch.begin(), batch.end());
  out.push_back(a.size(-2));
  out.push_back(b.size(-1));
  return at::bmm(a3, b3, at::kFloat).view(out);
}

// Operand precision: bf16/fp16 stay as they are on a GPU; everything else computes in fp32.
at::ScalarType operand_type(const at::Tensor& q) {
  const bool reduced = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  return reduced && q.is_cuda() ? q.scalar_type() : at::kFloat;
}

// A group of blocks and the context keys [begin, begin + context) its part A reads: up to the
// largest anchor, from the smallest key any of its rows sees (0 for a full layer; with a window
// W, the first block's anchor - W + 1: anchors ascend).
struct Group {
  int64_t first_row, rows, blocks, begin, context;
};

std::vector<Group> make_groups(const at::Tensor& anchors, int64_t block_size, int64_t group_blocks, int64_t window) {
  const int64_t blocks = anchors.size(0);
  const int64_t* a = anchors.data_ptr<int64_t>();
  std::vector<Group> groups;
  for (int64_t first = 0; first < blocks; first += group_blocks) {
    const int64_t count = std::min(group_blocks, blocks - first);
    const int64_t end = a[first + count - 1];  // sorted: the last is the largest
    const int64_t begin = window > 0 ? std::min(end, std::max<int64_t>(0, a[first] - window + 1)) : 0;
    groups.push_back({first * block_size, count * block_size, count, begin, end - begin});
  }
  return groups;
}

// Row r of the group (block r / B, offset r % B) may see context key j iff j < its anchor, and
// with a window W iff also j > anchor + offset - W: [rows, context] over keys begin.. .
at::Tensor staircase_mask(const at::Tensor& anchors, const Group& g, int64_t block_size, int64_t window,
                          const at::Device& device) {
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(device);
  const at::Tensor block_anchor = anchors.narrow(0, g.first_row / block_size, g.blocks).to(device);
  const at::Tensor row_anchor = block_anchor.repeat_interleave(block_size);  // [rows]
  const at::Tensor columns = at::arange(g.begin, g.begin + g.context, long_options).unsqueeze(0);
  at::Tensor visible = columns < row_anchor.unsqueeze(1);
  if (window > 0) {
    const at::Tensor row_offset = at::arange(g.rows, long_options).remainder(block_size);
    visible = visible & (columns > (row_anchor + row_offset - window).unsqueeze(1));
  }
  return visible;
}

// A sliding layer's own-block mask [B, B]: row r sees block keys 0..r.
at::Tensor causal_block_mask(int64_t block_size, const at::Device& device) {
  return at::ones({block_size, block_size}, at::TensorOptions().dtype(at::kBool).device(device)).tril();
}

// Per-group views, heads first, fp32. q: [Hkv, rep*rows, d] (query heads of one key-value
// head side by side, so a matmul against [Hkv, keys, d] is GQA without repeating keys).
struct GroupTensors {
  at::Tensor q_rows;       // [Hkv, rep*rows, d]
  at::Tensor q_blocks;     // [Hkv, rep, blocks, B, d]
  at::Tensor k_ctx, v_ctx; // [Hkv, context, d]
  at::Tensor k_blk, v_blk; // [Hkv, 1, blocks, B, d]
  at::Tensor mask;         // [1, rep*rows, context] (true = attend)
};

GroupTensors group_tensors(const at::Tensor& qh, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& kb,
                           const at::Tensor& vb, const at::Tensor& anchors, const Group& g, int64_t block_size,
                           int64_t window) {
  const int64_t hkv = kc.size(0), rep = qh.size(0) / hkv, d = qh.size(2);
  GroupTensors t;
  const at::Tensor q = qh.narrow(1, g.first_row, g.rows).view({hkv, rep, g.rows, d});
  t.q_rows = q.reshape({hkv, rep * g.rows, d});
  t.q_blocks = q.view({hkv, rep, g.blocks, block_size, d});
  t.k_blk = kb.narrow(1, g.first_row, g.rows).view({hkv, 1, g.blocks, block_size, d});
  t.v_blk = vb.narrow(1, g.first_row, g.rows).view({hkv, 1, g.blocks, block_size, d});
  if (g.context > 0) {
    t.k_ctx = kc.narrow(1, g.begin, g.context);
    t.v_ctx = vc.narrow(1, g.begin, g.context);
    t.mask = staircase_mask(anchors, g, block_size, window, qh.device())
                 .unsqueeze(0)
                 .expand({rep, g.rows, g.context})
                 .reshape({1, rep * g.rows, g.context});
  }
  return t;
}

struct BlockAttentionFunction : public torch::autograd::Function<BlockAttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_context,
                            const at::Tensor& v_context, const at::Tensor& k_block, const at::Tensor& v_block,
                            const at::Tensor& anchors, int64_t block_size, int64_t group_blocks, double scale,
                            int64_t window) {
    const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_context.size(1), rep = hq / hkv;
    // Heads first. Operands stay bf16/fp16 on a GPU (tensor cores, fp32 accumulation and
    // scores); everything else computes in fp32. Output and log-sum-exp are kept in fp32.
    const at::ScalarType op = operand_type(q);
    const at::Tensor qh = q.permute({1, 0, 2}).to(op).contiguous();
    const at::Tensor kc = k_context.permute({1, 0, 2}).to(op).contiguous();
    const at::Tensor vc = v_context.permute({1, 0, 2}).to(op).contiguous();
    const at::Tensor kb = k_block.permute({1, 0, 2}).to(op).contiguous();
    const at::Tensor vb = v_block.permute({1, 0, 2}).to(op).contiguous();
    const auto fp32 = qh.options().dtype(at::kFloat);
    at::Tensor out = at::empty({hkv, rep, rows, d}, fp32);
    at::Tensor lse = at::empty({hkv, rep, rows}, fp32);
    const at::Tensor own = window > 0 ? causal_block_mask(block_size, qh.device()) : at::Tensor();
    for (const Group& g : make_groups(anchors, block_size, group_blocks, window)) {
      const GroupTensors t = group_tensors(qh, kc, vc, kb, vb, anchors, g, block_size, window);
      // Part B: own block, unmasked (causal in a sliding layer).
      at::Tensor scores_b = product(t.q_blocks, t.k_blk.transpose(-1, -2)) * scale;  // [Hkv,rep,G,B,B]
      if (own.defined()) scores_b = scores_b.masked_fill(own.logical_not(), -INFINITY);
      const at::Tensor lse_b = at::logsumexp(scores_b, -1).reshape({hkv, rep * g.rows});
      at::Tensor lse_g = lse_b;
      at::Tensor scores_a;
      if (g.context > 0) {
        scores_a = (product(t.q_rows, t.k_ctx.transpose(-1, -2)) * scale).masked_fill(t.mask.logical_not(), -INFINITY);
        lse_g = at::logaddexp(at::logsumexp(scores_a, -1), lse_b);  // rows with anchor 0: lse_a = -inf
      }
      // Each part's probabilities against the merged log-sum-exp sum to one over all keys.
      at::Tensor o = product(at::exp(scores_b - lse_g.view({hkv, rep, g.blocks, block_size, 1})).to(op), t.v_blk)
                         .reshape({hkv, rep * g.rows, d});
      if (g.context > 0) o = o + product(at::exp(scores_a - lse_g.unsqueeze(-1)).to(op), t.v_ctx);
      out.narrow(2, g.first_row, g.rows).copy_(o.view({hkv, rep, g.rows, d}));
      lse.narrow(2, g.first_row, g.rows).copy_(lse_g.view({hkv, rep, g.rows}));
    }
    ctx->save_for_backward({qh, kc, vc, kb, vb, out, lse, anchors});
    ctx->saved_data["block_size"] = block_size;
    ctx->saved_data["group_blocks"] = group_blocks;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    return out.view({hq, rows, d}).permute({1, 0, 2}).to(q.scalar_type()).contiguous();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qh = saved[0], &kc = saved[1], &vc = saved[2], &kb = saved[3], &vb = saved[4];
    const at::Tensor &out = saved[5], &lse = saved[6], &anchors = saved[7];
    const int64_t block_size = ctx->saved_data["block_size"].toInt();
    const int64_t group_blocks = ctx->saved_data["group_blocks"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t window = ctx->saved_data["window"].toInt();
    const int64_t hq = qh.size(0), rows = qh.size(1), d = qh.size(2), hkv = kc.size(0), rep = hq / hkv;
    const at::ScalarType input_type = grad_outputs[0].scalar_type();
    const at::ScalarType op = qh.scalar_type();
    const at::Tensor d_out_f = grad_outputs[0].permute({1, 0, 2}).to(at::kFloat).reshape({hkv, rep, rows, d});
    const at::Tensor d_out = d_out_f.to(op);
    const auto fp32 = qh.options().dtype(at::kFloat);
    at::Tensor dq = at::zeros({hkv, rep, rows, d}, fp32);
    at::Tensor dkc = at::zeros(kc.sizes(), fp32), dvc = at::zeros(vc.sizes(), fp32);
    at::Tensor dkb = at::zeros(kb.sizes(), fp32), dvb = at::zeros(vb.sizes(), fp32);
    const at::Tensor own = window > 0 ? causal_block_mask(block_size, qh.device()) : at::Tensor();
    for (const Group& g : make_groups(anchors, block_size, group_blocks, window)) {
      const GroupTensors t = group_tensors(qh, kc, vc, kb, vb, anchors, g, block_size, window);
      const at::Tensor o_g = out.narrow(2, g.first_row, g.rows).reshape({hkv, rep * g.rows, d});
      const at::Tensor do_g = d_out.narrow(2, g.first_row, g.rows).reshape({hkv, rep * g.rows, d});
      const at::Tensor lse_g = lse.narrow(2, g.first_row, g.rows).reshape({hkv, rep * g.rows});
      const at::Tensor delta = (d_out_f.narrow(2, g.first_row, g.rows).reshape({hkv, rep * g.rows, d}) * o_g).sum(-1);  // D = rowsum(dO o O)
      at::Tensor dq_g;
      // Part B, in [Hkv, rep, G, B, *] views.
      {
        at::Tensor scores_b = product(t.q_blocks, t.k_blk.transpose(-1, -2)) * scale;
        if (own.defined()) scores_b = scores_b.masked_fill(own.logical_not(), -INFINITY);
        const at::Tensor p = at::exp(scores_b - lse_g.view({hkv, rep, g.blocks, block_size, 1}));
        const at::Tensor p_op = p.to(op);
        const at::Tensor do_b = do_g.view({hkv, rep, g.blocks, block_size, d});
        dvb.narrow(1, g.first_row, g.rows)
            .add_(product(p_op.transpose(-1, -2), do_b).sum(1).reshape({hkv, g.rows, d}));
        const at::Tensor ds = (p * (product(do_b, t.v_blk.transpose(-1, -2)) -
                                    delta.view({hkv, rep, g.blocks, block_size, 1}))).to(op);
        dq_g = (product(ds, t.k_blk) * scale).reshape({hkv, rep * g.rows, d});
        dkb.narrow(1, g.first_row, g.rows)
            .add_((product(ds.transpose(-1, -2), t.q_blocks).sum(1) * scale).reshape({hkv, g.rows, d}));
      }
      // Part A: the staircase window of context keys.
      if (g.context > 0) {
        const at::Tensor scores = (product(t.q_rows, t.k_ctx.transpose(-1, -2)) * scale)
                                      .masked_fill(t.mask.logical_not(), -INFINITY);
        const at::Tensor p = at::exp(scores - lse_g.unsqueeze(-1));
        dvc.narrow(1, g.begin, g.context).add_(product(p.to(op).transpose(-1, -2), do_g));
        const at::Tensor ds = (p * (product(do_g, t.v_ctx.transpose(-1, -2)) - delta.unsqueeze(-1))).to(op);
        dq_g = dq_g + product(ds, t.k_ctx) * scale;
        dkc.narrow(1, g.begin, g.context).add_(product(ds.transpose(-1, -2), t.q_rows) * scale);
      }
      dq.narrow(2, g.first_row, g.rows).copy_(dq_g.view({hkv, rep, g.rows, d}));
    }
    auto back = [&](const at::Tensor& t, int64_t heads) {
      return t.reshape({heads, -1, d}).permute({1, 0, 2}).to(input_type).contiguous();
    };
    return {back(dq, hq), back(dkc, hkv), back(dvc, hkv), back(dkb, hkv), back(dvb, hkv),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};


// ---- GPU path on PyTorch's fused memory-efficient attention kernels -----------------------
// The same split, run by tuned kernels instead of materialised scores: part B (own blocks) is
// one variable-length call with a sequence per block; part A is one call per group with the
// staircase as an additive bias over the window [0, a_max). Each kernel returns its output and
// log-sum-exp; the parts merge through the log-sum-exp, and each part's backward kernel is
// given the merged output and log-sum-exp (split-KV identity). The kernels are not GQA-native:
// key-value heads are repeated for them (the math path above is GQA-native).
struct EfficientBlockAttentionFunction : public torch::autograd::Function<EfficientBlockAttentionFunction> {
  static at::Tensor expand_heads(const at::Tensor& t, int64_t rep) {
    return rep == 1 ? t.contiguous() : t.repeat_interleave(rep, 1).contiguous();
  }
  // Additive staircase bias for one group, [1, 1, rows, window] viewed from storage whose rows
  // are padded to a multiple of 16 elements (the kernel's alignment rule).
  static at::Tensor staircase_bias(const at::Tensor& anchors, const Group& g, int64_t block_size, int64_t window,
                                   const at::Tensor& like) {
    const int64_t padded = (g.context + 15) / 16 * 16;
    const at::Tensor visible = staircase_mask(anchors, g, block_size, window, like.device());  // [rows, context]
    at::Tensor storage = at::full({g.rows, padded}, -INFINITY, like.options());
    storage.narrow(1, 0, g.context).masked_fill_(visible, 0.0);
    return storage.narrow(1, 0, g.context).unsqueeze(0).unsqueeze(0);
  }
  // [heads, rows] -> the kernel's [batch, heads, ceil(rows/32)*32] layout.
  static at::Tensor kernel_lse(const at::Tensor& lse_rows_first, int64_t align = 32) {
    const int64_t rows = lse_rows_first.size(-1);
    const int64_t padded = (rows + align - 1) / align * align;
    return at::constant_pad_nd(lse_rows_first, {0, padded - rows}, 0.0).contiguous();
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_context,
                            const at::Tensor& v_context, const at::Tensor& k_block, const at::Tensor& v_block,
                            const at::Tensor& anchors, int64_t block_size, int64_t group_blocks, double scale,
                            int64_t window) {
    const int64_t rows = q.size(0), hq = q.size(1), rep = hq / k_context.size(1);
    const int64_t own_mask = window > 0 ? 1 : 0;  // the kernel's causal-from-top-left mask in a sliding layer
    const at::Tensor qc = q.contiguous();
    const at::Tensor kc = expand_heads(k_context, rep), vc = expand_heads(v_context, rep);
    const at::Tensor kb = expand_heads(k_block, rep), vb = expand_heads(v_block, rep);
    const at::Tensor cu = at::arange(0, rows + 1, block_size, qc.options().dtype(at::kInt));
    // Part B: a variable-length batch with one 16-token sequence per block.
    auto part_b = at::_efficient_attention_forward(qc.unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0), std::nullopt, cu,
                                                   cu, block_size, block_size, 0.0, own_mask, true, scale);
    const at::Tensor o_b = std::get<0>(part_b).squeeze(0).to(at::kFloat);                                  // [M, Hq, d]
    const at::Tensor lse_b = std::get<1>(part_b).narrow(2, 0, block_size).permute({1, 0, 2}).reshape({hq, rows});
    at::Tensor lse = lse_b.clone(), out = o_b.clone();
    const auto groups = make_groups(anchors, block_size, group_blocks, window);
    for (const Group& g : groups) {
      if (g.context == 0) continue;
      const at::Tensor bias = staircase_bias(anchors, g, block_size, window, qc).expand({1, hq, g.rows, g.context});
      auto part_a = at::_efficient_attention_forward(qc.narrow(0, g.first_row, g.rows).unsqueeze(0),
                                                     kc.narrow(0, g.begin, g.context).unsqueeze(0),
                                                     vc.narrow(0, g.begin, g.context).unsqueeze(0), bias, std::nullopt,
                                                     std::nullopt, std::nullopt, std::nullopt, 0.0, 0, true, scale);
      // Rows that see no context key (anchor 0; in a sliding layer, a window that ends at the
      // anchor): their part A is empty (lse -inf, output 0), whatever the kernel wrote for a fully
      // masked row.
      const at::Tensor empty_row = staircase_mask(anchors, g, block_size, window, qc.device()).any(1).logical_not();
      const at::Tensor lse_a = std::get<1>(part_a).squeeze(0).narrow(1, 0, g.rows).masked_fill(empty_row.unsqueeze(0), -INFINITY);
      const at::Tensor o_a = std::get<0>(part_a).squeeze(0).to(at::kFloat).masked_fill(empty_row.view({-1, 1, 1}), 0.0);
      const at::Tensor lse_b_g = lse_b.narrow(1, g.first_row, g.rows);
      const at::Tensor merged = at::logaddexp(lse_a, lse_b_g);
      const at::Tensor wa = at::exp(lse_a - merged).t().unsqueeze(-1), wb = at::exp(lse_b_g - merged).t().unsqueeze(-1);
      out.narrow(0, g.first_row, g.rows).copy_(wa * o_a + wb * o_b.narrow(0, g.first_row, g.rows));
      lse.narrow(1, g.first_row, g.rows).copy_(merged);
    }
    const at::Tensor result = out.to(q.scalar_type());
    ctx->save_for_backward({qc, kc, vc, kb, vb, result, lse, anchors, std::get<2>(part_b), std::get<3>(part_b)});
    ctx->saved_data["block_size"] = block_size;
    ctx->saved_data["group_blocks"] = group_blocks;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["rep"] = rep;
    ctx->saved_data["window"] = window;
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &kc = saved[1], &vc = saved[2], &kb = saved[3], &vb = saved[4];
    const at::Tensor &out = saved[5], &lse = saved[6], &anchors = saved[7], &seed = saved[8], &offset = saved[9];
    const int64_t block_size = ctx->saved_data["block_size"].toInt();
    const int64_t group_blocks = ctx->saved_data["group_blocks"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t rep = ctx->saved_data["rep"].toInt();
    const int64_t window = ctx->saved_data["window"].toInt();
    const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2), blocks = rows / block_size;
    const at::Tensor d_out = grad_outputs[0].to(q.scalar_type()).contiguous();
    const at::Tensor cu = at::arange(0, rows + 1, block_size, q.options().dtype(at::kInt));
    // Part B with the merged output and log-sum-exp, in the kernel's per-sequence LSE layout.
    const at::Tensor lse_b = kernel_lse(lse.view({hq, blocks, block_size}).permute({1, 0, 2}));
    auto grads_b = at::_efficient_attention_backward(d_out.unsqueeze(0), q.unsqueeze(0), kb.unsqueeze(0),
                                                     vb.unsqueeze(0), std::nullopt, out.unsqueeze(0), cu, cu, block_size,
                                                     block_size, lse_b, 0.0, seed, offset, window > 0 ? 1 : 0, false,
                                                     scale);
    at::Tensor dq = std::get<0>(grads_b).squeeze(0).to(at::kFloat);
    const at::Tensor dkb = std::get<1>(grads_b).squeeze(0).to(at::kFloat);
    const at::Tensor dvb = std::get<2>(grads_b).squeeze(0).to(at::kFloat);
    at::Tensor dkc = at::zeros(kc.sizes(), kc.options().dtype(at::kFloat));
    at::Tensor dvc = at::zeros(vc.sizes(), vc.options().dtype(at::kFloat));
    for (const Group& g : make_groups(anchors, block_size, group_blocks, window)) {
      if (g.context == 0) continue;
      const at::Tensor bias = staircase_bias(anchors, g, block_size, window, q).expand({1, hq, g.rows, g.context});
      const at::Tensor lse_g = kernel_lse(lse.narrow(1, g.first_row, g.rows)).unsqueeze(0);
      auto grads_a = at::_efficient_attention_backward(
          d_out.narrow(0, g.first_row, g.rows).unsqueeze(0), q.narrow(0, g.first_row, g.rows).unsqueeze(0),
          kc.narrow(0, g.begin, g.context).unsqueeze(0), vc.narrow(0, g.begin, g.context).unsqueeze(0), bias,
          out.narrow(0, g.first_row, g.rows).unsqueeze(0), std::nullopt, std::nullopt, g.rows, g.context, lse_g, 0.0,
          seed, offset, 0, false, scale);
      dq.narrow(0, g.first_row, g.rows).add_(std::get<0>(grads_a).squeeze(0).to(at::kFloat));
      dkc.narrow(0, g.begin, g.context).add_(std::get<1>(grads_a).squeeze(0).to(at::kFloat));
      dvc.narrow(0, g.begin, g.context).add_(std::get<2>(grads_a).squeeze(0).to(at::kFloat));
    }
    // Repeated key-value heads back to their groups: head h_q = h_kv * rep + r.
    auto fold = [&](const at::Tensor& t) {
      return t.view({t.size(0), hq / rep, rep, d}).sum(2).to(q.scalar_type());
    };
    return {dq.to(q.scalar_type()), fold(dkc), fold(dvc), fold(dkb), fold(dvb),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

#ifdef DFLASHD_WITH_CUDA
// ---- GPU path on the fused DFlash kernels (drafter/kernels/block_attention.h) ----------------
// The anchors (CPU, int64, checked) as int32 on `device`: through pinned memory, so the copy is
// asynchronous (a copy from pageable memory would wait for the stream to drain).
at::Tensor device_anchors(const at::Tensor& anchors, const at::Device& device) {
  at::Tensor host = at::empty({anchors.size(0)}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  const int64_t* from = anchors.data_ptr<int64_t>();
  int32_t* to = host.data_ptr<int32_t>();
  for (int64_t i = 0; i < anchors.size(0); ++i) to[i] = static_cast<int32_t>(from[i]);
  return host.to(device, /*non_blocking=*/true);
}

struct KernelBlockAttentionFunction : public torch::autograd::Function<KernelBlockAttentionFunction> {
  static kernels::BlockAttentionProblem problem(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                                const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& anchors,
                                                int64_t block_size, double scale, int64_t window) {
    kernels::BlockAttentionProblem p;
    p.window = static_cast<int>(std::min<int64_t>(window, kc.size(0) + block_size));  // wider sees everything
    p.q = q.data_ptr();
    p.k_context = kc.data_ptr();
    p.v_context = vc.data_ptr();
    p.k_block = kb.data_ptr();
    p.v_block = vb.data_ptr();
    p.anchors = anchors.data_ptr<int32_t>();
    p.blocks = static_cast<int>(anchors.size(0));
    p.block_size = static_cast<int>(block_size);
    p.context = static_cast<int>(kc.size(0));
    p.q_heads = static_cast<int>(q.size(1));
    p.kv_heads = static_cast<int>(kc.size(1));
    p.scale = static_cast<float>(scale);
    return p;
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k_context,
                            const at::Tensor& v_context, const at::Tensor& k_block, const at::Tensor& v_block,
                            const at::Tensor& anchors, int64_t block_size, double scale, int64_t window) {
    const c10::cuda::CUDAGuard guard(q.device());
    const at::Tensor qc = q.contiguous(), kc = k_context.contiguous(), vc = v_context.contiguous();
    const at::Tensor kb = k_block.contiguous(), vb = v_block.contiguous();
    const at::Tensor anchors_gpu = device_anchors(anchors, q.device());
    const kernels::BlockAttentionProblem p = problem(qc, kc, vc, kb, vb, anchors_gpu, block_size, scale, window);
    at::Tensor out = at::empty_like(qc);
    at::Tensor lse2 = at::empty({p.slots()}, qc.options().dtype(at::kFloat));
    kernels::block_attention_forward(p, out.data_ptr(), lse2.data_ptr<float>(), at::cuda::getCurrentCUDAStream().stream());
    ctx->save_for_backward({qc, kc, vc, kb, vb, anchors_gpu, out, lse2});
    ctx->saved_data["block_size"] = block_size;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["window"] = window;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &kc = saved[1], &vc = saved[2], &kb = saved[3], &vb = saved[4];
    const at::Tensor &anchors = saved[5], &out = saved[6], &lse2 = saved[7];
    const c10::cuda::CUDAGuard guard(q.device());
    const kernels::BlockAttentionProblem p =
        problem(q, kc, vc, kb, vb, anchors, ctx->saved_data["block_size"].toInt(), ctx->saved_data["scale"].toDouble(),
                ctx->saved_data["window"].toInt());
    const at::Tensor d_out = grad_outputs[0].to(q.scalar_type()).contiguous();
    const auto fp32 = q.options().dtype(at::kFloat);
    kernels::BlockAttentionBackward g;
    g.context_chunks = kernels::context_chunks_for(p, at::cuda::getCurrentDeviceProperties()->multiProcessorCount);
    at::Tensor delta = at::empty({p.slots()}, fp32), dq = at::empty_like(q);
    at::Tensor dkb = at::empty_like(kb), dvb = at::empty_like(vb), dkc = at::empty_like(kc), dvc = at::empty_like(vc);
    const at::Tensor partials = at::empty({g.partials_floats(p)}, fp32);
    g.out = out.data_ptr();
    g.d_out = d_out.data_ptr();
    g.lse2 = lse2.data_ptr<float>();
    g.delta = delta.data_ptr<float>();
    g.dq = dq.data_ptr();
    g.dk_block = dkb.data_ptr();
    g.dv_block = dvb.data_ptr();
    g.dk_context = dkc.data_ptr();
    g.dv_context = dvc.data_ptr();
    g.partials = partials.data_ptr<float>();
    kernels::block_attention_backward(p, g, at::cuda::getCurrentCUDAStream().stream());
    return {dq, dkc, dvc, dkb, dvb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};
#endif

BlockAttentionPath choose_path(const at::Tensor& q, int64_t block_size, BlockAttentionPath asked) {
  if (asked == BlockAttentionPath::kernels) {
    if (auto why = block_attention_kernels_unavailable(q, block_size)) {
      throw std::invalid_argument("block_attention: the fused kernels cannot run: " + *why);
    }
    return asked;
  }
  if (asked != BlockAttentionPath::automatic) return asked;
  if (!block_attention_kernels_unavailable(q, block_size)) return BlockAttentionPath::kernels;
  const bool efficient = q.is_cuda() && operand_type(q) != at::kFloat && q.size(2) % 8 == 0;
  return efficient ? BlockAttentionPath::efficient : BlockAttentionPath::math;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_context, const at::Tensor& v_context,
                  const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& anchors, int64_t block_size) {
  const auto fail = [](const std::string& m) { throw std::invalid_argument("block_attention: " + m); };
  if (q.dim() != 3 || k_context.dim() != 3 || k_block.dim() != 3) fail("q, k and v must be [tokens, heads, head_dim]");
  if (anchors.device().type() != at::kCPU || anchors.scalar_type() != at::kLong) fail("anchors must be int64 on the CPU");
  if (q.size(0) != anchors.size(0) * block_size) fail("q must have anchors * block_size rows");
  if (q.size(1) % k_context.size(1) != 0) fail("query heads must be a multiple of key-value heads");
  if (k_block.sizes() != v_block.sizes() || k_context.sizes() != v_context.sizes()) fail("k and v shapes differ");
  const int64_t* a = anchors.data_ptr<int64_t>();
  for (int64_t n = 0; n < anchors.size(0); ++n) {
    if (a[n] < 0 || a[n] >= k_context.size(0) || (n > 0 && a[n] < a[n - 1])) {
      fail("anchors must ascend within [0, context length)");
    }
  }
}

}  // namespace

std::optional<std::string> block_attention_kernels_unavailable(const at::Tensor& q, int64_t block_size) {
#ifndef DFLASHD_WITH_CUDA
  (void)q, (void)block_size;
  return std::string("this build has no CUDA kernels (configured with DFLASHD_CUDA=OFF or without a CUDA toolkit)");
#else
  if (!q.is_cuda()) return "device " + q.device().str() + " is not a GPU (the kernels are CUDA)";
  if (q.scalar_type() != at::kBFloat16) return std::string("dtype ") + c10::toString(q.scalar_type()) + ": the kernels take bfloat16";
  if (q.size(2) != kernels::kAttentionHeadDim) {
    return "head_dim " + std::to_string(q.size(2)) + ": the kernels take head size " + std::to_string(kernels::kAttentionHeadDim);
  }
  if (block_size > kernels::kAttentionMaxBlock) {
    return "block_size " + std::to_string(block_size) + ": the kernels take blocks of at most " +
           std::to_string(kernels::kAttentionMaxBlock);
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const std::string error = kernels::attention_kernels_unavailable_on_current_device();
  if (!error.empty()) return "GPU " + q.device().str() + ": " + error;
  return std::nullopt;
#endif
}

BlockAttentionPathInfo describe_block_attention_path(const at::Tensor& like, int64_t block_size,
                                                    BlockAttentionPath asked) {
  BlockAttentionPathInfo info;
  info.path = choose_path(like, block_size, asked);
  if (info.path == BlockAttentionPath::kernels) {
    info.name = "kernels";
    info.description = "fused CUDA kernels (dflashd DFlash block attention)";
    return info;
  }
  info.name = info.path == BlockAttentionPath::efficient ? "efficient" : "math";
  info.description = info.path == BlockAttentionPath::efficient ? "split path on PyTorch's memory-efficient attention kernels"
                                                                : "split path, portable math";
  if (asked != BlockAttentionPath::automatic) {
    info.description += " (as configured)";
  } else if (auto why = block_attention_kernels_unavailable(like, block_size)) {
    info.description += "; the fused kernels do not run: " + *why;
  }
  return info;
}

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_context, const at::Tensor& v_context,
                           const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& anchors,
                           const BlockAttentionShape& shape) {
  const at::Tensor a = anchors.contiguous();
  check_inputs(q, k_context, v_context, k_block, v_block, a, shape.block_size);
  const double scale = shape.scale > 0 ? shape.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  if (a.size(0) == 0) return at::zeros_like(q);
  switch (choose_path(q, shape.block_size, shape.path)) {
#ifdef DFLASHD_WITH_CUDA
    case BlockAttentionPath::kernels:
      return KernelBlockAttentionFunction::apply(q, k_context, v_context, k_block, v_block, a, shape.block_size, scale,
                                                 shape.sliding_window);
#endif
    case BlockAttentionPath::efficient:
      return EfficientBlockAttentionFunction::apply(q, k_context, v_context, k_block, v_block, a, shape.block_size,
                                                    shape.group_blocks, scale, shape.sliding_window);
    default:
      break;
  }
  return BlockAttentionFunction::apply(q, k_context, v_context, k_block, v_block, a, shape.block_size,
                                       shape.group_blocks, scale, shape.sliding_window);
}

at::Tensor block_attention_dense_reference(const at::Tensor& q, const at::Tensor& k_context,
                                           const at::Tensor& v_context, const at::Tensor& k_block,
                                           const at::Tensor& v_block, const at::Tensor& anchors,
                                           int64_t block_size, int64_t sliding_window) {
  const int64_t rows = q.size(0), context = k_context.size(0);
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(q.device());
  const at::Tensor row_anchor = anchors.to(q.device()).repeat_interleave(block_size);
  const at::Tensor row = at::arange(rows, long_options);
  const at::Tensor row_block = row.div(block_size, "floor");
  const at::Tensor keys = at::arange(context, long_options).unsqueeze(0);
  at::Tensor context_visible = keys < row_anchor.unsqueeze(1);
  at::Tensor block_visible = row_block.unsqueeze(1) == row_block.unsqueeze(0);
  if (sliding_window > 0) {  // SpecForge's sliding DFlash mask: the window on the context, causal in the block
    const at::Tensor position = row_anchor + row.remainder(block_size);
    context_visible = context_visible & (keys > (position - sliding_window).unsqueeze(1));
    block_visible = block_visible & (row.unsqueeze(0) <= row.unsqueeze(1));
  }
  const at::Tensor mask = at::cat({context_visible, block_visible}, 1);  // [M, S + M]
  const at::Tensor k = at::cat({k_context, k_block}).permute({1, 0, 2}).unsqueeze(0);
  const at::Tensor v = at::cat({v_context, v_block}).permute({1, 0, 2}).unsqueeze(0);
  const at::Tensor o = at::scaled_dot_product_attention(q.permute({1, 0, 2}).unsqueeze(0), k, v, mask, 0.0, false,
                                                        std::nullopt, /*enable_gqa=*/true);
  return o.squeeze(0).permute({1, 0, 2});
}

}  // namespace dflash::drafter
