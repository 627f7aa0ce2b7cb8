"""Builds tiny random target models with transformers (the reference implementation) and the
outputs of every decoder layer for a few sequences, for the C++ parity tests.

Usage: make_target_models.py OUT_DIR
Writes OUT_DIR/<family>/ as a Hugging Face model directory (config.json + safetensors) and
OUT_DIR/<family>/reference.safetensors with, per sequence s, `seq.<s>.input_ids` and
`seq.<s>.layer.<i>` (the output of decoder layer i, captured by a forward hook: exactly what
dflashd calls "layer id i"). Each sequence runs alone through transformers (batch 1, no
padding) so the reference is unambiguous; dflashd runs them packed in one batch, which tests
that nothing leaks across sequences.

Shapes are deliberately odd: value heads a multiple > 1 of key heads, key and value head
dims that differ, partial rotary, GQA, lengths of several 64-token chunks plus a remainder.
Runs on CPU in float32, seeded; takes a few seconds.
"""
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers

LENGTHS = [150, 37, 65]  # 2 chunks + 22, less than one chunk, one chunk + 1
VOCAB = 320


def perturb(model, seed):
    """HF initialises norms to 0/1 and biases to 0: move every parameter so each path matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 8, generator=g)))
            else:
                scale = 0.05 if p.ndim >= 2 else 0.2
                p.add_(torch.randn(p.shape, generator=g) * scale)


def capture_layers(text_model, input_ids):
    """Every decoder layer's output (fp32, on the CPU) for input_ids run on the model's device."""
    outputs = {}
    hooks = []
    for i, layer in enumerate(text_model.layers):
        def hook(_module, _inputs, output, i=i):
            outputs[i] = (output[0] if isinstance(output, tuple) else output).detach().float().cpu()
        hooks.append(layer.register_forward_hook(hook))
    with torch.no_grad():
        text_model(input_ids=input_ids.to(next(text_model.parameters()).device))
    for h in hooks:
        h.remove()
    return outputs


def write_reference(directory, text_model, seed, name="reference.safetensors", lengths=LENGTHS, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for s, length in enumerate(lengths):
        ids = torch.randint(0, vocab, (1, length), generator=g)
        tensors[f"seq.{s}.input_ids"] = ids[0].clone()
        for i, out in capture_layers(text_model, ids).items():
            tensors[f"seq.{s}.layer.{i}"] = out[0].contiguous()
    save_file(tensors, os.path.join(directory, name))


def hybrid_text(**extra):
    base = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, intermediate_size=80, rms_norm_eps=1e-6,
                linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
                linear_value_head_dim=24, linear_conv_kernel_dim=4,
                layer_types=["linear_attention", "linear_attention", "full_attention",
                             "linear_attention", "full_attention", "linear_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                tie_word_embeddings=False)
    base.update(extra)
    return base


def build(family, out):
    torch.manual_seed(0)
    directory = os.path.join(out, family)
    os.makedirs(directory, exist_ok=True)
    shard = None
    if family == "qwen3_5":
        # The VL checkpoint layout: text config nested, weights under model.language_model.
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=48,
                      patch_size=4, spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=hybrid_text(), vision_config=vision)
        model = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
        text_model = model.model.language_model
    elif family == "qwen3_5_moe":
        text = hybrid_text(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                           shared_expert_intermediate_size=28)
        del text["intermediate_size"]
        config = transformers.Qwen3_5MoeTextConfig(**text)
        model = transformers.Qwen3_5MoeForCausalLM(config).float().eval()
        text_model = model.model
    elif family == "qwen3_next":
        text = hybrid_text(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                           shared_expert_intermediate_size=28, decoder_sparse_step=1, mlp_only_layers=[1],
                           norm_topk_prob=False)
        text.pop("rope_parameters")
        text.update(rope_theta=1e7, partial_rotary_factor=0.25)
        config = transformers.Qwen3NextConfig(**text)
        model = transformers.Qwen3NextForCausalLM(config).float().eval()
        text_model = model.model
    elif family == "qwen3":
        config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=5,
                                          num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                          intermediate_size=80, rope_theta=1e6, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config).float().eval()
        text_model = model.model
        shard = "40KB"  # a sharded checkpoint with model.safetensors.index.json
    elif family == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=5,
                                          num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
                                          rms_norm_eps=1e-5,
                                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                           "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32},
                                          tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config).float().eval()
        text_model = model.model
    else:
        raise SystemExit(f"unknown family {family}")
    perturb(model, seed=len(family))
    if shard:
        model.save_pretrained(directory, max_shard_size=shard)
    else:
        model.save_pretrained(directory)
    if family == "qwen3_5":
        # Real Qwen3.5 checkpoints ship an MTP head that a feature extractor must ignore.
        path = os.path.join(directory, "model.safetensors")
        tensors = load_file(path)
        tensors["mtp.fc.weight"] = torch.randn(48, 96)
        save_file(tensors, path, metadata={"format": "pt"})
    write_reference(directory, text_model, seed=len(family))


FP8_BLOCK = 16  # smaller than the releases' 128 so that the tiny weights span several blocks


def build_fp8(source, out):
    """OUT/<source>_fp8: the source checkpoint with every projection block-scaled FP8 (e4m3, one
    fp32 factor per FP8_BLOCK x FP8_BLOCK block in `<name>_scale_inv`, quantization_config as
    Qwen's *-FP8 releases write it); its reference is transformers' own forward of that
    checkpoint (FineGrainedFP8Config(dequantize=True), on the CPU)."""
    src, directory = os.path.join(out, source), os.path.join(out, source + "_fp8")
    os.makedirs(directory, exist_ok=True)
    tensors, source_tensors = {}, {}
    for file_name in sorted(os.listdir(src)):  # the source may be sharded; the FP8 copy is one file
        if file_name.endswith(".safetensors") and file_name != "reference.safetensors":
            source_tensors.update(load_file(os.path.join(src, file_name)))
    for name, w in source_tensors.items():
        if w.ndim != 2 or not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        rows, columns = w.shape
        rb, cb = -(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK)
        padded = torch.zeros(rb * FP8_BLOCK, cb * FP8_BLOCK)
        padded[:rows, :columns] = w.float()
        blocks = padded.view(rb, FP8_BLOCK, cb, FP8_BLOCK)
        factor = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # e4m3's largest finite value
        q = (blocks / factor[:, None, :, None]).view(rb * FP8_BLOCK, cb * FP8_BLOCK)[:rows, :columns]
        tensors[name] = q.to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = factor.float()
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True,
                                                              weight_block_size=(FP8_BLOCK, FP8_BLOCK)))
    write_reference(directory, model.float().eval().model, seed=len(source))


def main():
    out = sys.argv[1]
    families = sys.argv[2:] or ["qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3", "llama"]
    for family in families:
        build(family, out)
    if "qwen3" in families:
        build_fp8("qwen3", out)
    with open(os.path.join(out, "families.json"), "w") as f:
        json.dump({"families": families, "transformers": transformers.__version__}, f)


if __name__ == "__main__":
    main()
