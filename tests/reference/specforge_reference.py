"""SpecForge's DFlash drafter and training objective as test references.

Usage:
  specforge_reference.py step OUT.safetensors
      A tiny drafter (2 layers, GQA 4/2 x 16, block 4, 3 tapped layers) with random weights,
      a padded batch of two sequences, fixed anchors, and SpecForge's OnlineDFlashModel
      (hard-label decay-weighted CE, chunked objective, eager attention with the dense DFlash
      mask): writes the weights, inputs, anchors, the loss and every parameter gradient. Then
      the same with layer 0 a sliding_attention layer (window 6: SpecForge's sliding DFlash
      mask) into OUT with "_sliding" before the extension.
  specforge_reference.py check-export DIR INPUTS.safetensors
      Loads an exported drafter with SpecForge's DFlashDraftModel.from_pretrained (what the
      serving engines load), runs it on the inputs and compares its logits with dflashd's
      (INPUTS holds them as `dflashd.logits`). Exit 0 when they match (max rel err <= 1e-4).

The specforge wheel is installed without its dependencies (sglang & co.): its package
__init__ files are bypassed and only the model and loss modules are imported.
"""
import importlib
import importlib.util
import os
import sys
import types

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config


def import_specforge():
    if "specforge.modeling.draft.dflash" in sys.modules:  # imported by an earlier call
        return (sys.modules["specforge.modeling.draft.dflash"],
                sys.modules["specforge.algorithms.common.dflash_family_model"])
    spec = importlib.util.find_spec("specforge")
    root = os.path.dirname(spec.origin)
    for name in ["specforge", "specforge.core", "specforge.modeling", "specforge.modeling.draft",
                 "specforge.algorithms", "specforge.algorithms.common"]:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, *name.split(".")[1:])]
        sys.modules[name] = module
    return (importlib.import_module("specforge.modeling.draft.dflash"),
            importlib.import_module("specforge.algorithms.common.dflash_family_model"))


HIDDEN, VOCAB, BLOCK, MASK_ID, LAYER_IDS = 48, 320, 4, 7, [1, 3, 5]


SLIDING_WINDOW = 6


def drafter_config(sliding=False):
    layer_types = ["sliding_attention" if sliding else "full_attention", "full_attention"]
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         max_position_embeddings=4096, attention_bias=False, tie_word_embeddings=False,
                         layer_types=layer_types, use_sliding_window=sliding,
                         sliding_window=SLIDING_WINDOW if sliding else None)
    config.block_size = BLOCK
    config.num_target_layers = 8
    config.dflash_config = {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}
    config._attn_implementation = "eager"
    return config


def step(out_path, sliding=False):
    dflash, family = import_specforge()
    torch.manual_seed(0)
    draft = dflash.DFlashDraftModel(drafter_config(sliding)).float()
    assert draft.sliding_window == (SLIDING_WINDOW if sliding else None), draft.sliding_window
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.ndim >= 2 else 0.2))
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g) * 0.3)
    embed.weight.requires_grad_(False)
    lm_head.weight.requires_grad_(False)

    S, lengths = 40, [40, 29]
    input_ids = torch.randint(0, VOCAB, (2, S), generator=g)
    input_ids[1, lengths[1]:] = 0
    loss_mask = torch.zeros(2, S)
    loss_mask[0, 6:] = 1
    loss_mask[0, 20:23] = 0
    loss_mask[1, 4:lengths[1]] = 1
    # Anchors chosen by hand (the sampler is tested separately): sorted, anchor and next token
    # supervised; the second sequence has fewer blocks (padding blocks, keep = False).
    anchors = torch.tensor([[6, 9, 10, 18, 23, 30, 36], [4, 12, 27, 0, 0, 0, 0]])
    keep = torch.tensor([[True] * 7, [True, True, True, False, False, False, False]])
    family.OnlineDFlashModel._sample_anchor_positions = lambda self, seq_len, mask, device: (anchors, keep)
    features = torch.randn(2, S, len(LAYER_IDS) * HIDDEN, generator=g)

    model = family.OnlineDFlashModel(draft, lm_head, embed, mask_token_id=MASK_ID, block_size=BLOCK,
                                     attention_backend="sdpa", num_anchors=7, loss_decay_gamma=7.0,
                                     objective_chunk_blocks=3)
    loss, accuracy, _ = model(input_ids=input_ids, hidden_states=features, loss_mask=loss_mask)
    loss.backward()
    tensors = {f"param.{n}": p.detach().clone() for n, p in draft.named_parameters()}
    tensors.update({f"grad.{n}": p.grad.detach().clone() for n, p in draft.named_parameters()})
    tensors.update({
        "target.embed": embed.weight.detach().clone(), "target.lm_head": lm_head.weight.detach().clone(),
        "input_ids": input_ids, "loss_mask": loss_mask, "features": features, "anchors": anchors,
        "keep": keep.to(torch.int64), "lengths": torch.tensor(lengths), "loss": loss.detach().reshape(1),
        "accuracy": accuracy.detach().reshape(1),
    })
    save_file({k: v.contiguous() for k, v in tensors.items()}, out_path)


def check_export(directory, inputs_path):
    dflash, family = import_specforge()
    draft = dflash.DFlashDraftModel.from_pretrained(directory, torch_dtype=torch.float32).float().eval()
    draft.config._attn_implementation = "eager"
    assert draft.block_size == BLOCK or True
    inputs = load_file(inputs_path)
    features, input_ids = inputs["features"][None], inputs["input_ids"][None]
    anchors = inputs["anchors"][None]
    block = draft.block_size
    n = anchors.shape[1]
    S = input_ids.shape[1]
    noise_ids = torch.full((1, n * block), draft.mask_token_id, dtype=torch.long)
    noise_ids[0, ::block] = input_ids[0, anchors[0]]
    noise = torch.nn.functional.embedding(noise_ids, inputs["target.embed"])
    positions = torch.cat([torch.arange(S)[None], (anchors[..., None] + torch.arange(block)).reshape(1, -1)], 1)
    mask = family.create_dflash_sdpa_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), S, block, "cpu")
    with torch.no_grad():
        hidden = draft(position_ids=positions, attention_mask=mask, noise_embedding=noise, target_hidden=features)
        logits = hidden[0] @ inputs["target.lm_head"].T
    ours = inputs["dflashd.logits"]
    error = ((logits - ours).abs().max() / ours.abs().max()).item()
    print(f"export check: max relative error {error:.3e} over {tuple(logits.shape)} logits; "
          f"block_size {draft.block_size}, mask {draft.mask_token_id}, layers {draft.target_layer_ids}")
    ok = error <= 1e-4 and draft.block_size == BLOCK and list(draft.target_layer_ids) == LAYER_IDS
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if sys.argv[1] == "step":
        step(sys.argv[2])
        root, extension = os.path.splitext(sys.argv[2])
        step(root + "_sliding" + extension, sliding=True)
    elif sys.argv[1] == "check-export":
        check_export(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
