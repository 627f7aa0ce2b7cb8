"""CTest: tools/prepare_data.py on a tiny tokenizer with a Qwen-style chat template, then dflashd
trains on its output. Usage: prepare_data_test.py TOOLS_DIR DFLASHD_BINARY WORK_DIR"""
import json
import os
import subprocess
import sys

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer(directory):
    words = ["system", "user", "assistant", "you", "are", "helpful", "hi", "hello", "how", "can", "i", "help",
             "what", "is", "two", "plus", "four", "thanks", "welcome", "bye"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "\n": 3}
    for w in words:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\n"), "isolated"),
                                                 pre_tokenizers.Split(Regex(r" +"), "removed")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    return fast


def run(args, expect_ok=True):
    p = subprocess.run(args, capture_output=True, text=True)
    if expect_ok and p.returncode != 0:
        sys.exit(f"FAILED: {' '.join(args)}\n{p.stdout}\n{p.stderr}")
    return p


def main():
    tools, binary, work = sys.argv[1], sys.argv[2], sys.argv[3]
    os.makedirs(work, exist_ok=True)
    tokenizer = make_tokenizer(os.path.join(work, "tokenizer"))
    chats = os.path.join(work, "chats.jsonl")
    lines = [
        {"messages": [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello how can i help"},
                      {"role": "user", "content": "what is two plus two"},
                      {"role": "assistant", "content": "four"}]},
        {"conversations": [{"from": "human", "value": "thanks"}, {"from": "gpt", "value": "welcome bye"}]},
    ]
    with open(chats, "w") as f:
        for _ in range(20):
            for line in lines:
                f.write(json.dumps(line) + "\n")
    out = os.path.join(work, "train.jsonl")
    python = sys.executable
    run([python, os.path.join(tools, "prepare_data.py"), "--tokenizer", os.path.join(work, "tokenizer"),
         "--in", chats, "--out", out])
    samples = [json.loads(l) for l in open(out)]
    assert len(samples) == 40, len(samples)
    # The first conversation: supervised exactly the assistant contents and their <|im_end|>\n.
    ids, mask = samples[0]["input_ids"], samples[0]["loss_mask"]
    text_tokens = tokenizer.convert_ids_to_tokens(ids)
    supervised = [t for t, m in zip(text_tokens, mask) if m]
    assert supervised == ["hello", "how", "can", "i", "help", "<|im_end|>", "\n", "four", "<|im_end|>", "\n"], supervised
    assert "user" not in supervised and mask[0] == 0
    ids2, mask2 = samples[1]["input_ids"], samples[1]["loss_mask"]
    assert [t for t, m in zip(tokenizer.convert_ids_to_tokens(ids2), mask2) if m] == ["welcome", "bye", "<|im_end|>", "\n"]

    # Errors name the file and line; --on-error skip counts instead.
    bad = os.path.join(work, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(json.dumps(lines[1]) + "\n")
        f.write(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
        f.write("{not json\n")
    p = run([python, os.path.join(tools, "prepare_data.py"), "--tokenizer", os.path.join(work, "tokenizer"),
             "--in", bad, "--out", os.path.join(work, "bad-out.jsonl")], expect_ok=False)
    assert p.returncode != 0 and f"{bad}:2: unknown role 'robot'" in p.stderr, p.stderr
    p = run([python, os.path.join(tools, "prepare_data.py"), "--tokenizer", os.path.join(work, "tokenizer"),
             "--in", bad, "--out", os.path.join(work, "skip-out.jsonl"), "--on-error", "skip"])
    assert "1 samples" in p.stdout and "2 skipped" in p.stdout, p.stdout

    # dflashd trains on the output (tiny preset target; its vocabulary covers these ids).
    config = os.path.join(work, "run.yaml")
    with open(config, "w") as f:
        f.write(f"run: {{output_dir: {work}/out}}\n"
                "target: {preset: tiny-qwen3_5, weights: random, dtype: float32}\n"
                "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
                "gpus: {device: cpu}\n"
                f"data: {{paths: [{out}], min_supervised_tokens: 2}}\n"
                "train: {max_steps: 4, anchors_per_sequence: 4}\n"
                "metrics: {listen: \"\"}\n")
    p = run([binary, "run", "-c", config])
    assert "run finished at step 4" in p.stderr, p.stderr
    assert os.path.exists(f"{work}/out/export/final/model.safetensors")

    # --prompts-only: the conversation up to its last assistant turn, with the generation prompt;
    # a conversation without an assistant turn is all prompt. `dflashd generate` decodes them.
    with open(chats, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "how are you"}]}) + "\n")
    prompts = os.path.join(work, "prompts.jsonl")
    p = run([python, os.path.join(tools, "prepare_data.py"), "--tokenizer", os.path.join(work, "tokenizer"),
             "--in", chats, "--out", prompts, "--prompts-only"])
    assert "41 prompts" in p.stdout, p.stdout
    rows = [json.loads(l) for l in open(prompts)]
    assert all(set(r) == {"input_ids"} for r in rows)
    first = tokenizer.convert_ids_to_tokens(rows[0]["input_ids"])
    assert first[-3:] == ["<|im_start|>", "assistant", "\n"], first
    assert "hello" in first and "four" not in first, first  # the earlier assistant turn kept, the last one cut
    assert tokenizer.convert_ids_to_tokens(rows[-1]["input_ids"])[-6:] == ["you", "<|im_end|>", "\n", "<|im_start|>",
                                                                          "assistant", "\n"], rows[-1]
    generated = os.path.join(work, "generated")
    p = run([binary, "generate", "--preset", "tiny-qwen3_5", "--device", "cpu", "--prompts", prompts, "--out",
             generated, "--max-new-tokens", "4", "--truncated", "keep"])
    samples = [json.loads(l) for name in sorted(os.listdir(generated)) if name.endswith(".jsonl")
               for l in open(os.path.join(generated, name))]
    assert len(samples) == 41, len(samples)
    by_index = {s["prompt_index"]: s for s in samples}
    assert by_index[0]["input_ids"][:len(rows[0]["input_ids"])] == rows[0]["input_ids"]
    assert sum(by_index[0]["loss_mask"]) == 4
    print("prepare_data: OK")


if __name__ == "__main__":
    main()
