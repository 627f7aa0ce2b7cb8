"""Greedy generation with transformers' own `generate` (the reference for `dflashd generate`):
each prompt alone, float32 on the CPU, no sampling.

Usage: generate_reference.py TARGET_DIR PROMPTS.jsonl MAX_NEW_TOKENS STOP_IDS OUT.json
PROMPTS.jsonl: token JSON Lines ({"input_ids": [...]}). STOP_IDS: comma-separated ids ending a
response ("" for none). OUT.json: per prompt the prompt followed by the generated tokens (up to
and including a stop token).
"""
import json
import sys

import torch
import transformers

from reference_targets import load_target


def main():
    target_dir, prompts_path, max_new, stops, out_path = sys.argv[1:6]
    stop_ids = [int(s) for s in stops.split(",") if s]
    model = load_target(target_dir)
    settings = transformers.GenerationConfig(max_new_tokens=int(max_new), do_sample=False,
                                             eos_token_id=stop_ids or None, pad_token_id=0)
    results = []
    with open(prompts_path) as f:
        for line in f:
            ids = torch.tensor([json.loads(line)["input_ids"]])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=settings)
            results.append(out[0].tolist())
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main()
