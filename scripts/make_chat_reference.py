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

"ids" are `apply_chat_template`'s, which match special-token text anywhere
in the rendered prompt, content included; "content_ids" are the stage's
rule, content is text (docs/architecture.md): the template's own special
tokens matched, each message's content tokenized with
`split_special_tokens=True`. They are made here independently of the
stage's method: the content's place in the rendered text is found by
rendering with placeholders, and the text between the template's special
tokens is tokenized piece by piece (for a conversation without
special-token text in its content, that equals "ids", checked).

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


def content_is_text_ids(tok, msgs, text):
    """The prompt's ids with each message's content as text: the template's
    special tokens matched, content never cut at one."""
    marks = [f"\x00{i}\x00" for i in range(len(msgs))]
    placed = tok.apply_chat_template(
        [{**m, "content": k} for m, k in zip(msgs, marks)],
        tokenize=False, add_generation_prompt=True)
    # The rendered text as (piece, is content), content where its mark was.
    pieces, rest = [], placed
    for m, k in zip(msgs, marks):
        before, rest = rest.split(k, 1)
        pieces += [(before, False), (m["content"], True)]
    pieces.append((rest, False))
    assert "".join(p for p, _ in pieces) == text
    specials = sorted(tok.all_special_tokens + [t.content for t in tok.added_tokens_decoder.values()
                                                if t.special], key=len, reverse=True)
    # Runs of text between the template's special tokens, each tokenized
    # whole with special-token text split (the template's text holds none
    # but its markers).
    ids, run = [], ""
    for piece, content in pieces:
        while not content and piece:
            hit = min(((piece.find(t), -len(t), t) for t in specials if t in piece), default=None)
            if hit is None:
                run += piece
                break
            at, _, t = hit
            run += piece[:at]
            if run:
                ids += tok(run, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            run = ""
            ids.append(tok.convert_tokens_to_ids(t))
            piece = piece[at + len(t):]
        if content:
            run += piece
    if run:
        ids += tok(run, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids


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
        content_ids = content_is_text_ids(tok, msgs, text)
        if not any(t in m["content"] for m in msgs for t in tok.all_special_tokens):
            assert content_ids == ids, conv
        items.append({"request": conv, "template": msgs, "text": text, "ids": ids,
                      "content_ids": content_ids})
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
