"""An FP8 checkpoint saved by transformers and transformers' own FP8 forward of it, for the GPU
test Fp8.GpuTappedStatesMatchTransformersFp8 (target.dtype: float8 against the reference).

Usage: make_fp8_reference.py OUT_DIR   (needs a CUDA GPU: transformers quantises on one)
1. A tiny random Qwen3 (hidden 256, heads of 64: every projection whole 128-wide groups) in
   bf16, perturbed as make_target_models.py does, saved to OUT_DIR/qwen3_bf16.
2. Loaded with FineGrainedFP8Config(weight_block_size=(128, 128)): transformers quantises every
   projection to e4m3 with a factor per 128x128 block; saved (its own layout: `weight` in e4m3,
   `weight_scale_inv`, quantization_config) to OUT_DIR/qwen3_fp8.
3. That checkpoint loaded back and run by transformers on the GPU (activations quantised per
   1x128 group, its block-scaled FP8 matmul): every decoder layer's output per sequence, each
   sequence alone, to OUT_DIR/qwen3_fp8/reference.safetensors in make_target_models.py's layout;
   the bf16 model's outputs likewise to OUT_DIR/qwen3_fp8/bf16_reference.safetensors (how far FP8
   is from bf16, for scale).
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers

LENGTHS = [200, 77, 130]
VOCAB = 1024


def capture(model, ids):
    outputs, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        def hook(_module, _inputs, output, i=i):
            outputs[i] = (output[0] if isinstance(output, tuple) else output).detach().float().cpu()
        hooks.append(layer.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=ids.cuda())
    for h in hooks:
        h.remove()
    return outputs


def write_reference(model, path):
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for s, length in enumerate(LENGTHS):
        ids = torch.randint(0, VOCAB, (1, length), generator=g)
        tensors[f"seq.{s}.input_ids"] = ids[0].clone()
        for i, out in capture(model, ids).items():
            tensors[f"seq.{s}.layer.{i}"] = out[0].contiguous()
    save_file(tensors, path)


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, intermediate_size=512, rope_theta=1e6,
                                      tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim >= 2 else 0.2))
    source, fp8_dir = os.path.join(out, "qwen3_bf16"), os.path.join(out, "qwen3_fp8")
    model.to(torch.bfloat16).save_pretrained(source)
    quantised = transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, device_map="cuda",
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=(128, 128)))
    quantised.save_pretrained(fp8_dir)
    stored = {}
    for f in os.listdir(fp8_dir):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(fp8_dir, f)))
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    print(f"transformers {transformers.__version__}: {len(fp8)} e4m3 tensors, e.g. {fp8[0]} {tuple(stored[fp8[0]].shape)}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, device_map="cuda").eval()
    print("reloaded:", type(reloaded.model.layers[0].mlp.down_proj).__name__,
          reloaded.model.layers[0].mlp.down_proj.weight.dtype)
    write_reference(reloaded, os.path.join(fp8_dir, "reference.safetensors"))
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map="cuda").eval()
    write_reference(bf16, os.path.join(fp8_dir, "bf16_reference.safetensors"))
    print("wrote", fp8_dir)


if __name__ == "__main__":
    main()
