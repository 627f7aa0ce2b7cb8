"""The transformers target a reference script compares dflashd with: a tiny checkpoint directory
loaded in float32 on the CPU, as dflashd loads it (the language model of a Qwen3.5 VL checkpoint)."""
import torch
import transformers


def load_target(target_dir):
    config = transformers.AutoConfig.from_pretrained(target_dir)
    if config.model_type == "qwen3_5":  # the VL checkpoint's language model
        model = transformers.Qwen3_5ForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return model.float().eval()
