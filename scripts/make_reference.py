#!/usr/bin/env python3
"""Generate reference embeddings of all-MiniLM-L6-v2 with sentence-transformers.

The gateway's Rust embedding path is tested against this file
(gateway/tests/data/embeddings_reference.json). Run after scripts/setup.sh,
in an environment with scripts/requirements-reference.txt installed, e.g.

    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install -r scripts/requirements-reference.txt
    /tmp/refvenv/bin/python scripts/make_reference.py

The model is loaded from the local folder models/all-minilm-l6-v2 only
(HF_HUB_OFFLINE=1); nothing is fetched from a hub.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(ROOT, "models", "all-minilm-l6-v2")
OUT = os.path.join(ROOT, "gateway", "tests", "data", "embeddings_reference.json")

LONG_1 = (
    "Confidential computing protects data while it is being processed by running the "
    "workload inside a hardware-isolated trusted execution environment. The host "
    "operating system, the hypervisor and the cloud operator cannot read the memory of "
    "the enclave, and a remote party can check what code is running there by verifying "
    "a signed attestation document that contains measurements of the enclave image. "
    "An inference gateway built on this idea accepts requests over an ordinary HTTP "
    "API, forwards the sensitive parts to the enclave over a narrow channel, and "
    "returns results together with a receipt that binds the answer to the measured "
    "code and to the exact model weights that produced it, so that clients do not "
    "have to trust the operator of the machine."
)

LONG_2 = (
    "The quick brown fox jumps over the lazy dog. " * 4
    + "Sphinx of black quartz, judge my vow! Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump; the five boxing wizards jump quickly. "
    "Numbers like 3.14159, 2.71828 and 1.41421 appear next to dates such as "
    "2024-02-29 and identifiers such as req_01HZX9K3M7 and sha256:9f86d081884c7d65. "
    "Mixed punctuation (brackets), [square ones], {curly ones}, <angle ones> and "
    "quotes \"double\" and 'single' all go through the WordPiece tokenizer."
)

# > 256 word pieces: exercises truncation at max_seq_length = 256.
LONG_3 = " ".join(
    [
        "In the beginning the universe was created, and this has made a lot of people "
        "very angry and been widely regarded as a bad move.",
        "Many were increasingly of the opinion that they had all made a big mistake in "
        "coming down from the trees in the first place, and some said that even the "
        "trees had been a bad move and that no one should ever have left the oceans.",
    ]
    + [
        f"Paragraph {i}: the embedding model reads at most two hundred and fifty-six "
        f"word pieces, including the classification and separator tokens, and silently "
        f"drops everything that follows, so this sentence number {i} may never be seen."
        for i in range(1, 9)
    ]
)

# German, several paragraphs: long and non-English (accents stripped by the
# uncased tokenizer, many word pieces per word).
LONG_4 = (
    "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist "
    "Verpflichtung aller staatlichen Gewalt. Das Deutsche Volk bekennt sich darum zu "
    "unverletzlichen und unveräußerlichen Menschenrechten als Grundlage jeder "
    "menschlichen Gemeinschaft, des Friedens und der Gerechtigkeit in der Welt. "
    "Jeder hat das Recht auf die freie Entfaltung seiner Persönlichkeit, soweit er "
    "nicht die Rechte anderer verletzt und nicht gegen die verfassungsmäßige Ordnung "
    "oder das Sittengesetz verstößt. Jeder hat das Recht auf Leben und körperliche "
    "Unversehrtheit. Die Freiheit der Person ist unverletzlich."
)

TEXTS = [
    # short / trivial
    "Hello, world!",
    "cat",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome",
    "The weather is lovely today.",
    "?!...",
    "   padded with spaces and a tab\t  ",
    "\nnewline first, then text\n",
    "UPPERCASE Letters And MiXeD CaSe",
    "1234567890 3.14159 -42 1e-9 0xDEADBEEF",
    "def add(a, b):\n    return a + b  # Python",
    "fn main() { println!(\"{}\", vec![1, 2, 3].iter().sum::<i32>()); }",
    "https://example.com/path?q=confidential+inference&lang=en#top",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber",
    # non-English
    "Der schnelle braune Fuchs springt \u00fcber den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "\u6211\u559c\u6b22\u5728\u665a\u4e0a\u8bfb\u4e66\u3002",
    "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043a\u0430\u043a \u0434\u0435\u043b\u0430?",
    "\U0001F600\U0001F680\U0001F525 emoji party \U0001F389",
    "\u00bfD\u00f3nde est\u00e1 la biblioteca?",
    # long
    LONG_1,
    LONG_2,
    LONG_3,
    LONG_4,
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=MODEL_DIR)
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    if not os.path.isfile(os.path.join(args.model_dir, "model.safetensors")):
        sys.exit(f"model not found in {args.model_dir}: run scripts/setup.sh first")

    import numpy as np
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model_dir, device="cpu", local_files_only=True)
    model.eval()
    assert model.max_seq_length == 256, model.max_seq_length
    assert all(t for t in TEXTS), "empty strings are rejected by the API"

    items = []
    for text in TEXTS:
        # `preprocess` replaces the deprecated `tokenize` in sentence-transformers >= 6.
        tokenize = getattr(model, "preprocess", None) or model.tokenize
        feats = tokenize([text])
        n_tokens = int(feats["attention_mask"][0].sum())
        # One text per call: no padding in the batch, like a single API input.
        emb = model.encode([text], batch_size=1, convert_to_numpy=True,
                           normalize_embeddings=False, show_progress_bar=False)[0]
        emb = emb.astype(np.float32)
        assert emb.shape == (384,), emb.shape
        norm = float(np.linalg.norm(emb.astype(np.float64)))
        assert abs(norm - 1.0) < 1e-5, f"not normalised ({norm}) for {text!r}"
        items.append({"text": text, "tokens": n_tokens,
                      "embedding": [float(x) for x in emb.tolist()]})

    n_trunc = sum(1 for it in items if it["tokens"] == 256)
    n_long = sum(1 for it in items if it["tokens"] > 128)
    assert n_trunc >= 1 and n_long >= 3, (n_trunc, n_long)

    doc = {
        "model": "all-MiniLM-L6-v2",
        "generated_by": (
            f"scripts/make_reference.py with sentence-transformers=="
            f"{sentence_transformers.__version__} torch=={torch.__version__}"
        ),
        "max_seq_length": model.max_seq_length,
        "items": items,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    # json.dumps writes floats with repr(): shortest round-trip, full precision.
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(items)} items to {os.path.relpath(args.out, ROOT)} "
          f"({n_long} over 128 tokens, {n_trunc} truncated at 256); {doc['generated_by']}")


if __name__ == "__main__":
    main()
