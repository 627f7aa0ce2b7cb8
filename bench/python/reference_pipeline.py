"""The Python reference pipeline of bench/run_h200.sh e2e: what users run today, on the same GPU
in the same invocation as dflashd. Per sequence, as the Python trainers do it on one GPU:
transformers' target forward (random weights, bf16, up to the deepest tapped layer, hidden
states of the tapped layers) then SpecForge's DFlash training step (OnlineDFlashModel,
flex_attention with its compiled block mask, decay-weighted CE over a chunked LM head) and a
fused torch AdamW step. Whether transformers finds FLA's GatedDeltaNet kernels depends on the
PYTHONPATH the caller gives (the seed's slow path is the run without them).

MoE targets (qwen3_5_moe, qwen3_next) run transformers' experts implementation named by
DFLASHD_BENCH_EXPERTS (default grouped_mm: ATen's grouped GEMM, transformers' fastest; "eager" is
its per-expert loop).

Usage: reference_pipeline.py CONFIG_DIR LABEL [STEPS]    (3072-token sequences, 512 anchors, block 16,
taps by the DFlash rule; the drafter as dflashd's benches configure it: 5 layers of the target's
MLP width for dense targets, 8 layers of inner 3 x hidden for MoE targets; heads of 128, query heads
the largest power of two with heads x 128 <= hidden, a quarter as many key-value heads). Prints
one line of results.
"""
import importlib.util
import os
import sys
import time

import torch
from transformers import AutoConfig, Qwen3Config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "reference"))
from specforge_reference import import_specforge  # noqa: E402

S, ANCHORS, BLOCK, DRAFT_LAYERS = int(os.environ.get("DFLASHD_BENCH_TOKENS", 3072)), 512, 16, 5
DEVICE = os.environ.get("DFLASHD_BENCH_DEVICE", "cuda")  # "cpu": a smoke test of this script on tiny configs


def taps(num_layers, count=5):
    return [round(1 + j * (num_layers - 4) / (count - 1)) for j in range(count)]


def build_target(config_dir):
    config = AutoConfig.from_pretrained(config_dir)
    text = getattr(config, "text_config", config)
    layer_ids = taps(text.num_hidden_layers)
    text.num_hidden_layers = layer_ids[-1] + 1  # only the layers up to the deepest tap, as dflashd
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[: text.num_hidden_layers]
    text._attn_implementation = "sdpa"
    text.use_cache = False
    if getattr(text, "num_experts", 0):
        text._experts_implementation = os.environ.get("DFLASHD_BENCH_EXPERTS", "grouped_mm")
    if text.model_type.startswith("qwen3_5_moe"):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextModel as Model
    elif text.model_type.startswith("qwen3_next"):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextModel as Model
    elif text.model_type.startswith("qwen3_5"):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel as Model
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Model as Model
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEVICE):
        target = Model(text).eval().requires_grad_(False)
    torch.set_default_dtype(torch.float32)
    return text, target, layer_ids


def build_drafter(text, layer_ids):
    dflash, family = import_specforge()
    H, V = text.hidden_size, text.vocab_size
    mask_id = 248070 if V > 248070 else 151669
    moe = bool(getattr(text, "num_experts", 0))
    layers = 8 if moe else DRAFT_LAYERS
    inner = 3 * H if moe else text.intermediate_size
    heads = 1
    while 2 * heads * 128 <= H:
        heads *= 2
    config = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=inner,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=128,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e7},
                         max_position_embeddings=40960, layer_types=["full_attention"] * layers)
    config.block_size = BLOCK
    config.num_target_layers = layer_ids[-1] + 1
    config.dflash_config = {"mask_token_id": mask_id, "target_layer_ids": layer_ids}
    config._attn_implementation = "flex_attention"
    with torch.device(DEVICE):
        draft = dflash.DFlashDraftModel(config).to(torch.bfloat16)
        embed = torch.nn.Embedding(V, H).to(torch.bfloat16).requires_grad_(False)
        head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16).requires_grad_(False)
    model = family.OnlineDFlashModel(draft, head, embed, mask_token_id=mask_id, block_size=BLOCK,
                                     attention_backend="flex_attention", num_anchors=ANCHORS, loss_decay_gamma=7.0,
                                     objective_chunk_blocks=128)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4, fused=DEVICE == "cuda")
    return draft, model, optimizer


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main():
    config_dir, label = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    torch.manual_seed(0)
    text, target, layer_ids = build_target(config_dir)
    draft, model, optimizer = build_drafter(text, layer_ids)
    fla = importlib.util.find_spec("fla") is not None
    target_times, drafter_times = [], []
    for i in range(steps + 3):  # the first three compile and warm up
        ids = torch.randint(0, max(2, text.vocab_size - 1000), (1, S), device=DEVICE)
        mask = torch.ones(1, S, device=DEVICE)
        mask[:, :64] = 0
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            states = target(input_ids=ids, output_hidden_states=True).hidden_states
            features = torch.cat([states[j + 1] for j in layer_ids], dim=-1)
        del states
        sync()
        t1 = time.perf_counter()
        loss, _, _ = model(input_ids=ids, hidden_states=features, loss_mask=mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if i >= 3:
            target_times.append(t1 - t0)
            drafter_times.append(t2 - t1)
    target_times.sort()
    drafter_times.sort()
    t, d = target_times[len(target_times) // 2], drafter_times[len(drafter_times) // 2]
    print(f"python {label}: fla={'yes' if fla else 'no'} target {t:.3f} s + drafter step {d:.3f} s = "
          f"{S / (t + d):.0f} tokens/s; peak {torch.cuda.max_memory_allocated() / 2**30 if DEVICE == 'cuda' else 0:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
