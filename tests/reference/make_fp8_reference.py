"""An FP8 checkpoint saved by transformers and transformers' own FP8 forward of it, for the GPU
test Fp8.GpuTappedStatesMatchTransformersFp8 (target.dtype: float8 against the reference).

Usage: make_fp8_reference.py OUT_DIR   (needs a CUDA GPU: transformers quantises on one)
1. A tiny random Qwen3 (hidden 512, 8 heads of 64: every projection's input a multiple of 512) in
   bf16, perturbed as make_target_models.py does, saved to OUT_DIR/qwen3_bf16.
2. Loaded with FineGrainedFP8Config(weight_block_size=(128, 128)): transformers quantises every
   projection to e4m3 with a factor per 128x128 block; saved (its own layout: `weight` in e4m3,
   `weight_scale_inv`, quantization_config) to OUT_DIR/qwen3_fp8.
3. That checkpoint loaded back and run by transformers on the GPU (activations quantised per
   1x128 group, its block-scaled FP8 matmul): every decoder layer's output per sequence, each
   sequence alone, to OUT_DIR/qwen3_fp8_reference.safetensors in make_target_models.py's layout.
   transformers runs that matmul with a hub kernel (`kernels`, finegrained-fp8) that an offline
   host cannot fetch; FP8Linear.forward is then replaced by the same arithmetic in PyTorch
   (act_quant: factor = max|group| / 448, e4m3(x / factor); fp32 product of the dequantized
   operands; one rounding to the activations' dtype), and the script says so;
   the bf16 model's outputs likewise to OUT_DIR/qwen3_bf16_reference.safetensors (how far FP8 is
   from bf16, for scale). (Beside the checkpoints: a model directory's *.safetensors are its weights.)
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

import transformers
from make_target_models import write_reference  # this directory: every layer's output per sequence

LENGTHS = [200, 77, 130]
VOCAB = 1024


def emulated_fp8_linear(self, x):
    """transformers' FP8Linear forward with its kernel's arithmetic in PyTorch."""
    if self.weight.element_size() > 1:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    scale = next(getattr(self, n) for n in ("weight_scale_inv", "weight_scale") if hasattr(self, n))
    k, n = x.shape[-1], self.weight.shape[0]
    groups = x.reshape(-1, k // 128, 128).float()
    amax = groups.abs().amax(-1, keepdim=True)
    factor = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    activations = ((groups / factor).to(torch.float8_e4m3fn).float() * factor).reshape(-1, k)
    factors = scale.float().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    y = activations @ (self.weight.float() * factors).t()
    if self.bias is not None:
        y = y + self.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def use_emulated_matmul_if_needed():
    from transformers.integrations import finegrained_fp8
    try:
        finegrained_fp8._load_finegrained_fp8_kernel()
        print("transformers' finegrained-fp8 kernel loaded")
    except Exception as e:  # offline: the hub kernel cannot be fetched
        print(f"finegrained-fp8 kernel unavailable ({type(e).__name__}); FP8Linear.forward emulated in PyTorch")
        finegrained_fp8.FP8Linear.forward = emulated_fp8_linear


def quantise_like_transformers(source, directory):
    """The checkpoint FineGrainedFP8 writes, made here when its quantiser cannot run: every
    projection e4m3 with a factor per 128x128 block (max|block| / 448), quantization_config."""
    import json
    tensors = {}
    for name, w in load_file(os.path.join(source, "model.safetensors")).items():
        if w.ndim != 2 or not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        rows, columns = w.shape
        blocks = w.float().view(rows // 128, 128, columns // 128, 128)
        factor = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        tensors[name] = (blocks / factor[:, None, :, None]).view(rows, columns).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = factor.float()
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main():
    out = sys.argv[1]
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, head_dim=64, intermediate_size=1024, rope_theta=1e6,
                                      tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim >= 2 else 0.2))
    source, fp8_dir = os.path.join(out, "qwen3_bf16"), os.path.join(out, "qwen3_fp8")
    model.to(torch.bfloat16).save_pretrained(source)
    use_emulated_matmul_if_needed()
    try:
        quantised = transformers.AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.bfloat16, device_map="cuda",
            quantization_config=transformers.FineGrainedFP8Config(weight_block_size=(128, 128)))
        quantised.save_pretrained(fp8_dir)
        print("quantised by transformers (FineGrainedFP8Config)")
    except Exception as e:
        print(f"transformers' quantiser failed ({type(e).__name__}: {e}); quantised here in its layout")
        quantise_like_transformers(source, fp8_dir)
    stored = {}
    for f in os.listdir(fp8_dir):
        if f.endswith(".safetensors"):
            stored.update(load_file(os.path.join(fp8_dir, f)))
    fp8 = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    print(f"transformers {transformers.__version__}: {len(fp8)} e4m3 tensors, e.g. {fp8[0]} {tuple(stored[fp8[0]].shape)}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    print("reloaded:", type(reloaded.model.layers[0].mlp.down_proj).__name__,
          reloaded.model.layers[0].mlp.down_proj.weight.dtype)
    write_reference(out, reloaded.model, seed=6, name="qwen3_fp8_reference.safetensors", lengths=LENGTHS, vocab=VOCAB)
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16, device_map="cuda").eval()
    write_reference(out, bf16.model, seed=6, name="qwen3_bf16_reference.safetensors", lengths=LENGTHS, vocab=VOCAB)
    print("wrote", fp8_dir)


if __name__ == "__main__":
    main()
