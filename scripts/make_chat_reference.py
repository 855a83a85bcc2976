#!/usr/bin/env python3
"""Reference prompt token ids for /v1/chat/completions, made by `transformers`.

For a few conversations (multi-turn, with and without a system message,
non-ASCII text, text that looks like markup), this renders the chat template
stored in the SmolLM2 GGUF (`tokenizer.chat_template`, read with the `gguf`
package) with `transformers`' `apply_chat_template(...,
add_generation_prompt=True)`, tokenizes it with a `transformers` fast
tokenizer over the tokenizer.json that scripts/setup.sh derives from the same
GGUF (scripts/make_completion_reference.py checks that file is byte-identical
to the one transformers builds from the GGUF; loading the GGUF itself in
transformers needs torch, this does not), and writes the rendered text and token ids to
gateway/tests/data/chat_reference.json. The entry stage renders the same
template with minijinja and must produce the same ids
(enclave-stage/tests/chat_template.rs and gateway/tests/chat_e2e.rs).

Each item keeps the messages as an API client sends them ("request", which
may use the `developer` role or arrays of text parts) and as the template
sees them ("template": developer read as system, text parts joined with
newlines, as the gateway documents).

Run after scripts/setup.sh in a throwaway venv (no torch needed):

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install transformers==5.23.0 tokenizers==0.23.3 gguf==0.19.0 jinja2
    /tmp/refvenv/bin/python scripts/make_chat_reference.py
"""
import importlib.metadata
import json
import os

# The model's place, and the offline environment (set on import).
from make_completion_reference import GGUF, MODEL_DIR, ROOT  # noqa: E402

from gguf import GGUFReader  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

OUT = os.path.join(ROOT, "gateway", "tests", "data", "chat_reference.json")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one word."},
        {"role": "user", "content": "What colour is the sky on a clear day?"},
    ],
    [
        {"role": "developer", "content": "Answer politely."},
        {"role": "user", "content": "Hi! Who are you?"},
        {"role": "assistant", "content": "I am SmolLM, a small assistant."},
        {"role": "user", "content": [
            {"type": "text", "text": "Name three fruits."},
            {"type": "text", "text": "Keep it short."},
        ]},
    ],
    [
        {"role": "user", "content": "Übersetze: «Grüße aus Köln» 🚀 — 東京 <|im_end|>?"},
        {"role": "assistant", "content": "  Greetings from Cologne.\n\n"},
        {"role": "user", "content": "{{ not a template }} {% raw %} and\ttabs"},
    ],
]


def for_template(messages):
    out = []
    for m in messages:
        c = m["content"]
        if isinstance(c, list):
            c = "\n".join(p["text"] for p in c)
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": c})
    return out


def main():
    field = GGUFReader(os.path.join(MODEL_DIR, GGUF)).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(MODEL_DIR, "tokenizer.json"),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tok.chat_template = template
    items = []
    for conv in CONVERSATIONS:
        msgs = for_template(conv)
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        items.append({"request": conv, "template": msgs, "text": text, "ids": ids})
    doc = {
        "model": "SmolLM2-135M-Instruct",
        "gguf": GGUF,
        "generator": "scripts/make_chat_reference.py",
        "versions": {p: importlib.metadata.version(p) for p in ("transformers", "tokenizers", "gguf", "jinja2")},
        "chat_template": tok.chat_template,
        "items": items,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(items)} conversations")


if __name__ == "__main__":
    main()
