"""transformers' batched generate at a target's shapes (random weights, bf16, one GPU): the peer
of `dflashd generate` in `bench/run_h200.sh generate`.

Usage: hf_generate.py CONFIG_DIR PROMPTS.jsonl NEW_TOKENS BATCH [BATCH ...]
Prints per batch size: "python generate: batch B, N new tokens in S s, T tok/s". Greedy, no stop
token (every sequence decodes NEW_TOKENS), prompts left-padded to the longest in the batch. On a
GPU without flash-linear-attention the GatedDeltaNet layers use transformers' torch fallback
(what users get without installing FLA).
"""
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import transformers

DEVICE = os.environ.get("DFLASHD_BENCH_DEVICE", "cuda")  # cpu: a check of the script on a tiny config


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build(config_dir):
    config = AutoConfig.from_pretrained(config_dir)
    text = getattr(config, "text_config", config)
    text._attn_implementation = "sdpa"
    if text.model_type.startswith("qwen3_5") and not text.model_type.startswith("qwen3_5_moe"):
        cls = transformers.Qwen3_5ForCausalLM
    else:
        cls = AutoModelForCausalLM
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        model = cls._from_config(text).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    return model


def main():
    config_dir, prompts_path, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    batches = [int(b) for b in sys.argv[4:]]
    prompts = [json.loads(line)["input_ids"] for line in open(prompts_path)]
    model = build(config_dir)
    settings = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
    for batch in batches:
        rows = prompts[:batch]
        longest = max(len(p) for p in rows)
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in rows], device=DEVICE)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in rows], device=DEVICE)
        model.generate(ids[:, :8], attention_mask=mask[:, :8],
                       generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0))
        sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, generation_config=settings)
        sync()
        seconds = time.perf_counter() - start
        produced = (out.shape[1] - longest) * batch
        print(f"python generate: batch {batch}, {produced} new tokens in {seconds:.1f} s, "
              f"{produced / seconds:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
