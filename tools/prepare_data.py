#!/usr/bin/env python3
"""prepare_data.py: chat-formatted JSONL -> the token JSONL dflashd trains on.

Input lines: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
(OpenAI style), or {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}, ...]}
(ShareGPT style). Output lines: {"input_ids": [...], "loss_mask": [...]}, the conversation
rendered by the target's own chat template and tokenizer, loss_mask 1 on the tokens of the
assistant turns (their content and the template's end-of-turn tokens), 0 elsewhere.

The daemon reads token ids only; this script is where the tokenizer lives. It needs the
transformers package and the target's tokenizer files (tokenizer.json, tokenizer_config.json
with the chat template), and no network:

  python3 tools/prepare_data.py --tokenizer /models/Qwen3-8B --in chats.jsonl --out train.jsonl \\
      [--max-length 3072] [--on-error skip]

With --prompts-only it writes the prompts `dflashd generate` regenerates responses for instead:
{"input_ids": [...]}, the conversation up to its last assistant turn (earlier turns kept as
written; all of it when it has none), rendered with the template's generation prompt (the
assistant turn's opening), so the target continues where the assistant would speak.

A line that is not JSON, has no conversation, an unknown role, no assistant turn, or whose
template renders a conversation so that a shorter prefix is not a prefix of it (the assistant
spans could not be located) is an error naming the file and line, or with --on-error skip is
skipped and counted. Prints counts at the end.
"""
import argparse
import json
import sys

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}


class BadLine(Exception):
    pass


def messages_of(sample, need_assistant=True):
    if "messages" in sample:
        turns = [(m.get("role"), m.get("content")) for m in sample["messages"]]
    elif "conversations" in sample:
        turns = [(m.get("from"), m.get("value")) for m in sample["conversations"]]
    else:
        raise BadLine('no "messages" or "conversations"')
    out = []
    for role, content in turns:
        if role not in ROLES:
            raise BadLine(f"unknown role {role!r} (known: {', '.join(sorted(ROLES))})")
        if not isinstance(content, str):
            raise BadLine(f"a {role} turn has no text content")
        out.append({"role": ROLES[role], "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise BadLine("no assistant turn: nothing to supervise")
    return out


def render(tokenizer, messages, generation_prompt=False):
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def convert(tokenizer, messages, max_length):
    text = render(tokenizer, messages)
    spans = []  # character ranges of the assistant turns in text
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True) if i > 0 else ""
        through = render(tokenizer, messages[: i + 1])
        if not text.startswith(before) or not text.startswith(through) or len(through) < len(before):
            raise BadLine("the chat template does not render this conversation's prefixes as prefixes "
                          "(e.g. it rewrites earlier turns); its assistant spans cannot be located")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = [1 if any(a <= start and end <= b and end > start for a, b in spans) else 0 for start, end in offsets]
    if max_length:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def prompt_ids(tokenizer, messages, max_length):
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=len(messages))
    if last == 0:
        raise BadLine("the conversation opens with the assistant: no prompt")
    text = render(tokenizer, messages[:last], generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_length and len(ids) > max_length:
        raise BadLine(f"the prompt has {len(ids)} tokens, more than --max-length {max_length}")
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory with the target's tokenizer files")
    parser.add_argument("--in", dest="inputs", required=True, nargs="+", help="chat JSONL files")
    parser.add_argument("--out", required=True, help="output JSONL (written to OUT.tmp, renamed at the end)")
    parser.add_argument("--max-length", type=int, default=0, help="truncate to this many tokens (0: keep all)")
    parser.add_argument("--on-error", choices=["error", "skip"], default="error")
    parser.add_argument("--prompts-only", action="store_true",
                        help="write prompts for `dflashd generate` (up to the last assistant turn)")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        sys.exit(f"prepare_data: {args.tokenizer} has no chat template (tokenizer_config.json: chat_template)")
    if not tokenizer.is_fast:
        sys.exit(f"prepare_data: {args.tokenizer} has no fast tokenizer (tokenizer.json): offsets are needed")
    written = skipped = tokens = supervised = 0
    tmp = args.out + ".tmp"
    with open(tmp, "w") as out:
        for path in args.inputs:
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        try:
                            sample = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise BadLine(f"not JSON ({e.msg})")
                        messages = messages_of(sample, need_assistant=not args.prompts_only)
                        if args.prompts_only:
                            ids, mask = prompt_ids(tokenizer, messages, args.max_length), []
                        else:
                            ids, mask = convert(tokenizer, messages, args.max_length)
                    except BadLine as e:
                        if args.on_error == "error":
                            sys.exit(f"prepare_data: {path}:{number}: {e}")
                        skipped += 1
                        continue
                    line = {"input_ids": ids} if args.prompts_only else {"input_ids": ids, "loss_mask": mask}
                    out.write(json.dumps(line, separators=(",", ":")) + "\n")
                    written += 1
                    tokens += len(ids)
                    supervised += sum(mask)
    import os
    os.replace(tmp, args.out)
    what = "prompts" if args.prompts_only else "samples"
    print(f"prepare_data: {written} {what}, {tokens} tokens ({supervised} supervised), {skipped} skipped -> {args.out}")


if __name__ == "__main__":
    main()
