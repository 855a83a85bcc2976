#!/usr/bin/env python3
"""Generate reference greedy completions of SmolLM2-135M-Instruct with transformers.

The Rust Llama path (enclave-stage/src/models/llama/) is tested against this file
(gateway/tests/data/completions_reference.json). It loads the SAME GGUF that
the stages serve, through `transformers`' GGUF support (weights dequantized to
float32, torch on CPU), and greedy-decodes 32 new tokens per prompt with a
plain argmax loop: no chat template, no BOS (the GGUF says add_bos_token
false and the transformers GGUF tokenizer adds none), and no stopping at EOS,
so every item has exactly 32 output ids.

It also checks that the tokenizer.json scripts/setup.sh derives from the GGUF
(models/smollm2-135m-instruct/tokenizer.json) is byte-identical to the one
transformers builds from the same file and gives the same ids on the prompts
and on a set of tricky strings, whose ids are stored too ("tokenizer_checks").

Run after scripts/setup.sh, in the reference venv plus `gguf` and `accelerate`
(transformers needs both to load a GGUF):

    /tmp/refvenv/bin/pip install -r scripts/requirements-reference.txt gguf==0.19.0 accelerate==1.15.0
    /tmp/refvenv/bin/python scripts/make_completion_reference.py

Nothing is fetched from a hub (HF_HUB_OFFLINE=1).
"""
import argparse
import importlib.metadata
import json
import os
import re
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = os.path.join(ROOT, "gateway", "tests", "data", "completions_reference.json")
NEW_TOKENS = 32

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a shopping list:\n1. Apples\n2. Bread\n3.",
    "Question: Why is the sky blue?\nAnswer:",
    "La capitale de l'Allemagne est",
    "Once upon a time, in a small village by the sea, there lived",
]

# Strings that exercise the pre-tokenizer and the byte-level alphabet.
TRICKY = [
    "",
    " ",
    "   leading and trailing   ",
    "a  b\n\n  c\t\td\r\n",
    "In 2024, 1234567 people paid $100.00 (99%).",
    "a  1, b   22, x\n  42",
    "version 3.14.159 and 0x1F",
    "café naïve Über straße",
    "東京は日本の首都です。",
    "Привет, мир! مرحبا بالعالم",
    "emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧",
    "I'm you'll we've THEY'RE",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n\treturn x**2  # square\n",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    import transformers
    import tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from place_models import gguf_tokenizer_json

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF, dtype=torch.float32)
    model.eval()

    # The setup-time tokenizer.json must be what transformers builds.
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, "tokenizer.json"), "rb") as f:
            hf_json = f.read()
    ours = gguf_tokenizer_json(os.path.join(MODEL_DIR, GGUF)).encode("utf-8")
    if ours != hf_json:
        sys.exit("tokenizer.json derived by place_models.py differs from transformers' GGUF tokenizer")
    placed = os.path.join(MODEL_DIR, "tokenizer.json")
    if os.path.exists(placed) and open(placed, "rb").read() != ours:
        sys.exit(f"{placed} differs from the derived tokenizer.json (rerun scripts/setup.sh)")
    fast = tokenizers.Tokenizer.from_str(ours.decode("utf-8"))

    def ids_of(text):
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if fast.encode(text, add_special_tokens=True).ids != ids:
            sys.exit(f"derived tokenizer disagrees with transformers on {text!r}")
        return ids

    checks = [{"text": t, "ids": ids_of(t)} for t in TRICKY]

    items = []
    for prompt in PROMPTS:
        prompt_ids = ids_of(prompt)
        out, gaps = [], []
        with torch.no_grad():
            res = model(torch.tensor([prompt_ids]), use_cache=True)
            for step in range(NEW_TOKENS):
                logits = res.logits[0, -1]
                top2 = torch.topk(logits, 2)
                nxt = int(top2.indices[0])
                gaps.append(float(top2.values[0] - top2.values[1]))
                out.append(nxt)
                if step + 1 < NEW_TOKENS:
                    res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values, use_cache=True)
        items.append({
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "output_ids": out,
            # Smallest top-1/top-2 logit gap over the 32 steps: how close the
            # greedy path came to a tie (a small gap is fragile to rounding).
            "min_top2_gap": round(min(gaps), 6),
            "text": tok.decode(out),
        })
        print(f"{prompt!r} -> {tok.decode(out)!r} (min gap {min(gaps):.4f})", file=sys.stderr)

    doc = {
        "model": "SmolLM2-135M-Instruct",
        "generated_by": (
            f"scripts/make_completion_reference.py with transformers=={transformers.__version__} "
            f"torch=={torch.__version__} gguf=={importlib.metadata.version('gguf')} "
            f"tokenizers=={tokenizers.__version__}; float32 weights dequantized from {GGUF}; "
            "greedy argmax, no BOS, no chat template, no EOS stop"
        ),
        "gguf": GGUF,
        "add_bos": False,
        "new_tokens": NEW_TOKENS,
        "items": items,
        "tokenizer_checks": checks,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        text = json.dumps(doc, indent=1, ensure_ascii=False)
        # One line per id list.
        text = re.sub(r"\[\s+([0-9,\s]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
        f.write(text + "\n")
    print(f"wrote {args.out}: {len(items)} prompts x {NEW_TOKENS} tokens, {len(checks)} tokenizer checks",
          file=sys.stderr)


if __name__ == "__main__":
    main()
