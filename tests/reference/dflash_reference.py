"""Speculative decoding as z-lab's dflash package does it (dflash==0.1.0, dflash/model.py):
dflash_generate with the transformers target and the exported drafter loaded by dflash's own
DFlashDraftModel, in float32 on the CPU, greedy.

Usage: dflash_reference.py TARGET_DIR DRAFTER_DIR PROMPTS.json MAX_NEW_TOKENS OUT.json
PROMPTS.json: a list of token-id lists. OUT.json: per prompt {"output_ids": [...], "acceptance": [...],
"plain_greedy": [...]} (acceptance: dflash_generate's acceptance_lengths, the tokens each verify
step committed; plain_greedy: the target's own greedy decoding, every token from a full forward
without a cache, the lossless reference).
"""
import json
import sys
import time

import torch

import dflash.model as dflash_model
from reference_targets import load_target


def main():
    target_dir, drafter_dir, prompts_path, max_new, out_path = sys.argv[1:6]
    torch.manual_seed(0)
    # dflash_generate times with torch.cuda.synchronize when asked for its statistics; on the CPU
    # a plain clock does.
    dflash_model._cuda_time = time.perf_counter
    target = load_target(target_dir)
    draft = dflash_model.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).float().eval()
    results = []
    for prompt in json.load(open(prompts_path)):
        r = dflash_model.dflash_generate(draft, target, torch.tensor([prompt]), int(max_new), None,
                                         return_stats=True)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            while ids.shape[1] < r.output_ids.shape[1]:
                ids = torch.cat([ids, target(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        results.append({"output_ids": r.output_ids[0].tolist(), "acceptance": list(r.acceptance_lengths),
                        "plain_greedy": ids[0].tolist()})
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":
    main()
