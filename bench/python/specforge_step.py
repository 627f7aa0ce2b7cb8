"""The Python peer of bench/drafter_step_bench: SpecForge's DFlash training step (OnlineDFlashModel,
flex_attention with its compiled block mask, hard-label decay-weighted CE over a chunked LM head)
at the Qwen3.5-27B drafter shape, random weights, bf16, on the GPU. Prints the median
forward+backward time after warm-up (the first calls compile). Run by bench/run_h200.sh.
"""
import os
import sys
import time

import torch
from transformers import Qwen3Config

# The same bypass of specforge's package __init__ files as the tests use.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "reference"))
from specforge_reference import import_specforge  # noqa: E402


def main():
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    dflash, family = import_specforge()
    H, V, S = 5120, 248320, 3072
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=17408, num_hidden_layers=5,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e7},
                         max_position_embeddings=40960, layer_types=["full_attention"] * 5)
    config.block_size = 16
    config.num_target_layers = 64
    config.dflash_config = {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    config._attn_implementation = "flex_attention"
    device = torch.device("cuda")
    with torch.device(device):
        draft = dflash.DFlashDraftModel(config).to(torch.bfloat16)
        embed = torch.nn.Embedding(V, H).to(torch.bfloat16).requires_grad_(False)
        head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16).requires_grad_(False)
    model = family.OnlineDFlashModel(draft, head, embed, mask_token_id=248070, block_size=16,
                                     attention_backend="flex_attention", num_anchors=512, loss_decay_gamma=7.0,
                                     objective_chunk_blocks=128)
    ids = torch.randint(0, 248000, (1, S), device=device)
    features = torch.randn(1, S, 5 * H, device=device, dtype=torch.bfloat16)
    mask = torch.ones(1, S, device=device)
    mask[:, :64] = 0
    times = []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _, _ = model(input_ids=ids, hidden_states=features, loss_mask=mask)
        loss.backward()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        draft.zero_grad(set_to_none=True)
    times.sort()
    print(f"specforge drafter step (flex_attention, compiled) forward+backward {times[len(times)//2]:.3f} s; "
          f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
