#!/usr/bin/env python3
"""The stages' GGUF loader against llama.cpp on the same files: random-weight
models of every architecture the stages load (`make_gguf_fixtures.py`),
quantized by llama.cpp into every tensor type they serve, compared position
by position.

For each file: 256 token ids teacher-forced one at a time (the stage's
decode path) give llama.cpp's and the stage's logits at every position;
top-1 agreement must be at least 99 % and the mean KL divergence
KL(llama.cpp ‖ stage) at most 0.01. A position where the stage's top token
is llama.cpp's second and llama.cpp's top two logits are within 0.3 of each
other is a tie and counts as agreeing (the raw agreement is printed and
reported beside it): llama.cpp rounds activations to 8 bits in its
quantized products, which moves its top logits by 0.05 rms against the
exact f32 computation the stage follows, and random weights make near-ties
that no rounding can settle the same way twice. An F32 file served in f32
is the exact computation on both sides and must agree at every position
(KL at most 1e-6, greedy identical). Then greedy decoding of 32 tokens after
a 64-token prefill (the stage's prefill path) must give the same ids, up
to a step where the stage took llama.cpp's second choice and llama.cpp's
own top two logits were within 0.3 of each other (random weights make such
ties; after one, both continuations are right).
A file with a tensor type or an architecture the stage does not load must be
refused with an error naming it.

The SentencePiece fixture (`llama-spm`, Llama 2's tokenizer kind) is also
checked as text: texts with leading and repeated spaces, tabs, newlines,
digits, accents, characters outside its vocabulary (byte fallback), emoji
and special tokens must be cut into exactly llama.cpp's ids and decoded
back into llama.cpp's text; and `gateway serve --model` on it must answer
a chat request whose prompt, rendered with the file's template, counts
exactly llama.cpp's tokens. So is the `phi3` fixture (its SentencePiece
vocabulary with Phi-3's chat markers, after which llama.cpp strips spaces,
and Phi-3's template), in Q4_K_M over 2 stages, and the `phi4-mini` one
(byte-level BPE under the `gpt-4o` rule, as Phi-4-mini's), the `phi4` one
(`dbrx`, Phi-4's template) and the `gemma2` one (Gemma's turn markers and
template, no space prefix; its 48-position window and soft caps are small
enough that the 256 positions depend on them: without the window the mean
KL is 0.09, without the score cap the F32 file's is 1.6e-3). And each byte-level split
rule the stage supports (`tokenizer.ggml.pre`: smollm, llama-bpe, qwen2,
dbrx for Phi-4, gpt-4o for Phi-4-mini) on SmolLM2's vocabulary relabelled
with it: the same texts and more where the rules differ (case changes in
and out of ASCII, combining marks, Devanagari, Thai, Arabic, contractions)
must be cut into llama.cpp's ids.

llama.cpp keeps its KV cache in f32 here (`type_k`/`type_v`), so the
remaining differences are its rounding of activations to 8 bits in its
quantized products and the summation order.

Run by scripts/test.sh with the test virtualenv of `scripts/llama_venv.sh
--test`:
  test_gguf_models.py --bin target/release/examples/gguf_logits
      --source models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
      --dir target/gguf-fixtures [--report FILE.json] [--only llama]
Opt-in, the 1B-class shape of the benchmark (hidden 2048, 16 layers, GQA
32/8) in F16 (served in q4_1 and in f32) and Q4_K_M: the same with
`--shape 1b --dir target/bench-models` (about 2 minutes once the files exist).
"""

import argparse
import ctypes
import json
import os
import subprocess
import sys
import re
import tempfile
import unicodedata

import numpy as np

import gguf
import llama_cpp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_gguf_fixtures  # noqa: E402
import place_models  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIONS = 256
PROMPT = 64
GREEDY = 32
MIN_TOP1 = 0.99
MAX_KL = 0.01
# F32 weights served in f32 against llama.cpp's F32 path (measured 1e-12).
EXACT_KL = 1e-6
# An F16 file served in f32 against llama.cpp's F16 path.
F16_KL = 1e-4
# llama.cpp rounds activations to 8 bits in its quantized products; on these
# files its top logits differ from the stage's by 0.05 rms (0.26 at most),
# the stage's being the exact f32 computation's up to 16-bit rounding.
TIE = 0.3

# (label, llama.cpp file type, pure: every matrix in that one type)
TYPES = [
    ("F32", None, True),
    ("F16", llama_cpp.LLAMA_FTYPE_MOSTLY_F16, True),
    ("BF16", llama_cpp.LLAMA_FTYPE_MOSTLY_BF16, True),
    ("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, True),
    ("Q4_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, True),
    ("Q4_1", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1, True),
    ("Q4_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_S, True),
    ("Q5_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q5_K_S, True),
    ("Q6_K", llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K, True),
    # What people download: Q4_K with Q6_K where llama.cpp's rules put it.
    ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, False),
]


def quantize(src: str, dst: str, ftype: int, pure: bool) -> None:
    if os.path.exists(dst):
        return
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    params.pure = pure
    tmp = dst + ".part"
    rc = llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama.cpp could not quantize {src} to {dst} (rc {rc})")
    os.replace(tmp, dst)


def reference(path: str, tokens: list[int]) -> tuple[np.ndarray, list[int], list[float]]:
    """llama.cpp's logits at every position, its greedy continuation, and
    the margin between its top two logits at each greedy step."""
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        n_threads=2,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        verbose=False,
    )
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.reset()
    llm.eval(tokens[:PROMPT])
    greedy, margins = [], []
    while len(greedy) < GREEDY:
        row = llm.scores[llm.n_tokens - 1]
        t = int(np.argmax(row))
        second = int(np.argsort(row)[-2])
        greedy.append(t)
        margins.append((float(row[t] - row[second]), second))
        llm.eval([t])
    del llm
    return scores, greedy, margins


def greedy_agrees(ref: list[int], got: list[int], margins: list) -> tuple[bool, str]:
    """Identical, or identical up to a step where the stage took llama.cpp's
    second choice and llama.cpp's top two logits were within TIE of each
    other: a tie at the level of the two implementations' rounding (after
    it the continuations are different texts, both right)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            margin, second = margins[i]
            if b == second and margin < TIE:
                return True, f"same to a tie at step {i} (margin {margin:.3f})"
            return False, f"DIFFERENT at step {i} (margin {margin:.3f})"
    return len(ref) == len(got), "same"


def ours(bin_path: str, path: str, weights: str, tokens: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tok = os.path.join(d, "tokens")
        out = os.path.join(d, "logits")
        with open(tok, "w") as f:
            f.write(",".join(map(str, tokens)))
        p = subprocess.run(
            [bin_path, path, weights, tok, out, str(PROMPT), str(GREEDY)],
            capture_output=True,
            text=True,
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )
        if p.returncode == 3:
            return json.loads(p.stdout)
        if p.returncode != 0:
            raise SystemExit(f"gguf_logits failed on {path}:\n{p.stderr}")
        res = json.loads(p.stdout)
        res["logits"] = np.fromfile(out, dtype="<f4").reshape(len(tokens), -1)
        return res


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float, float]:
    """Top-1 agreement (raw, and counting ties as agreeing), mean and
    largest KL(ref ‖ got) over positions. A tie: the stage's top token is
    llama.cpp's second and llama.cpp's top two are within TIE."""
    lr, lg = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lr) * (lr - lg)).sum(axis=-1)
    r, g = ref.argmax(-1), got.argmax(-1)
    order = np.argsort(ref, axis=-1)
    second = order[:, -2]
    rows = np.arange(len(ref))
    tie = (g == second) & (ref[rows, r] - ref[rows, second] < TIE)
    return float((r == g).mean()), float(((r == g) | tie).mean()), float(kl.mean()), float(kl.max())


def refused(bin_path: str, path: str, must_name: str, tokens: list[int]) -> str | None:
    res = ours(bin_path, path, "q4_1", tokens)
    err = res.get("error")
    if err is None:
        return f"{os.path.basename(path)} was loaded; it must be refused naming {must_name}"
    if must_name not in err:
        return f"{os.path.basename(path)} refused without naming {must_name}: {err}"
    print(f"  refused, as it must be: {err}")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--report")
    ap.add_argument("--gateway", default=os.path.join(ROOT, "target", "release", "gateway"),
                    help="the gateway binary, served the SentencePiece fixture")
    ap.add_argument("--only", help="one architecture")
    ap.add_argument("--shape", default="small", choices=["small", "1b"],
                    help="1b: the 1B-class llama shape instead, F16 and Q4_K_M only "
                         "(opt-in: 2.8 GB of files and a few minutes)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    subprocess.run(
        [sys.executable, make_gguf_fixtures.__file__, "--source", args.source, "--out", args.dir,
         "--shape", args.shape],
        check=True,
    )
    rng = np.random.default_rng(7)
    vocab = gguf.GGUFReader(args.source).fields["tokenizer.ggml.tokens"].contents()
    all_tokens = [int(t) for t in rng.integers(0, len(vocab), POSITIONS)]

    failures, rows = [], []
    if args.shape == "1b":
        archs, base, types = ["llama-1b"], "F16", [("F16", None, True), TYPES[-1]]
    else:
        archs = [args.only] if args.only else [
            "llama", "qwen2", "qwen3", "llama-spm", "phi3", "phi4-mini", "phi4", "gemma2"]
        base, types = "F32", TYPES
    for arch in archs:
        f32 = os.path.join(args.dir, f"{arch}.{base}.gguf")
        # The SentencePiece fixture's tokenizer is its point: its file in
        # F32 and Q4_K_M is enough for the model.
        arch_types = [TYPES[0], TYPES[-1]] if arch == "llama-spm" else types
        vocab_n = len(gguf.GGUFReader(f32).fields["tokenizer.ggml.tokens"].contents())
        tokens = [t % vocab_n for t in all_tokens]
        for label, ftype, pure in arch_types:
            path = f32 if ftype is None else os.path.join(args.dir, f"{arch}.{label}.gguf")
            if ftype is not None:
                quantize(f32, path, ftype, pure)
            ref, ref_greedy, margins = reference(path, tokens)
            # q4_1 is the serving default: 4-bit blocks as stored, Q8_0 as
            # stored, wider types re-quantized to Q8_0. The F32 file is also
            # served in f32, the exact path.
            formats = ["q4_1", "f32"] if label == base else ["q4_1"]
            for weights in formats:
                res = ours(args.bin, path, weights, tokens)
                if "error" in res:
                    failures.append(f"{arch} {label} ({weights}) refused: {res['error']}")
                    continue
                raw, top1, kl, kl_max = compare(ref, res["logits"])
                same, how = greedy_agrees(ref_greedy, res["greedy"], margins)
                row = {
                    "architecture": arch,
                    "type": label,
                    "weights": weights,
                    "top1_raw": raw,
                    "top1": top1,
                    "mean_kl": kl,
                    "max_kl": kl_max,
                    "greedy": how,
                    "weight_bytes": res["weight_bytes"],
                }
                rows.append(row)
                ok = top1 >= MIN_TOP1 and kl <= MAX_KL and same
                if label == "F32" and weights == "f32":
                    # The exact path on both sides: no rounding to excuse.
                    ok = ok and raw == 1.0 and kl <= EXACT_KL and how == "same"
                elif weights == "f32":
                    # F16 weights: llama.cpp rounds the activations to f16
                    # for their products (measured KL 4e-6).
                    ok = ok and kl <= F16_KL
                print(
                    f"  {arch:6} {label:7} as {weights:5}: top-1 {top1 * 100:6.2f} % "
                    f"(raw {raw * 100:6.2f} %)  "
                    f"mean KL {kl:.2e} (max {kl_max:.2e})  greedy {how}"
                    f"  {'ok' if ok else 'FAIL'}",
                    flush=True,
                )
                if not ok:
                    failures.append(f"{arch} {label} ({weights}): {row}")

    if "llama-spm" in archs:
        spm = os.path.join(args.dir, "llama-spm.F32.gguf")
        failures += check_tokenizer(args.bin, spm)
        failures += check_served(args.gateway, spm, args.dir, "<s>[INST] Name a colour. [/INST]")
    if "phi3" in archs:
        # Phi-3's template and markers (llama.cpp strips the spaces after a
        # Phi-3 file's special tokens), split over 2 stages.
        phi3 = os.path.join(args.dir, "phi3.Q4_K_M.gguf")
        failures += check_tokenizer(args.bin, phi3)
        failures += check_served(args.gateway, phi3, args.dir,
                                 "<|user|>\nName a colour.<|end|>\n<|assistant|>\n")

    if "phi4-mini" in archs:
        # Phi-4-mini's kind: byte-level BPE under llama.cpp's gpt-4o rule,
        # Phi-3's markers as control tokens, partial rotary; over 2 stages.
        phi4 = os.path.join(args.dir, "phi4-mini.Q4_K_M.gguf")
        failures += check_tokenizer(args.bin, phi4)
        failures += check_served(args.gateway, phi4, args.dir,
                                 "<|user|>\nName a colour.<|end|>\n<|assistant|>\n", bos=False)
    if "phi4" in archs:
        # Phi-4's kind: byte-level BPE under dbrx, Phi-4's template.
        phi4 = os.path.join(args.dir, "phi4.Q4_K_M.gguf")
        failures += check_tokenizer(args.bin, phi4)
        failures += check_served(args.gateway, phi4, args.dir,
                                 "<|im_start|>user<|im_sep|>Name a colour.<|im_end|>"
                                 "<|im_start|>assistant<|im_sep|>", bos=False)

    if "gemma2" in archs:
        # Gemma 2's template and turn markers, no space prefix; over 2
        # stages (layer 0 windowed, layer 1 global).
        gemma2 = os.path.join(args.dir, "gemma2.Q4_K_M.gguf")
        failures += check_tokenizer(args.bin, gemma2)
        failures += check_served(args.gateway, gemma2, args.dir,
                                 "<s><start_of_turn>user\nName a colour.<end_of_turn>\n"
                                 "<start_of_turn>model\n")

    tokens = [t % len(vocab) for t in all_tokens]
    refusals = 0
    if args.shape == "small":
        failures += check_split_rules(args.bin, args.source, args.dir)
        # Refusals: a tensor type and an architecture the stage does not load.
        q2k = os.path.join(args.dir, f"{archs[0]}.Q2_K.gguf")
        quantize(f"{args.dir}/{archs[0]}.F32.gguf", q2k, llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K, True)
        for problem in (
            refused(args.bin, q2k, "Q2K", tokens),
            refused(args.bin, unsupported_arch(args.dir, args.source), "gemma3", tokens),
        ):
            refusals += 1
            if problem:
                failures.append(problem)

    if args.report:
        with open(args.report, "w") as f:
            json.dump({"positions": POSITIONS, "greedy": GREEDY, "rows": rows}, f, indent=1)
    if failures:
        print("test_gguf_models: FAILED", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"test_gguf_models: {len(rows)} file/format pairs agree with llama.cpp; "
          f"{refusals} refusals named")
    return 0


# Texts that exercise SentencePiece's spaces, byte fallback and special tokens.
TEXTS = [
    "Hello world", " leading space", "two  spaces and\ttab", "lines\n\nbreak\n",
    "digits 2024 and 3.14159", "café naïve résumé", "你好，世界", "emoji 🙂 and 🚀!",
    "<s>[INST] hi [/INST]", "<tool_call>call<tool_call>x</tool_call>", "   ", "a</s>b",
    "The enclave processed the prompt; receipts bind each answer to the attested stages.",
    # Phi-3's markers (pieces in the llama-spm vocabulary).
    "<|user|>\n  hi<|end|>\n<|assistant|>\n", "<|endoftext|> after </s> x",
    "<tool_call> call </tool_call>\n x",
]


def detokenize(llm, ids: list) -> str:
    """llama.cpp's `llama_detokenize`: the first token's space prefix
    removed (as the stage and transformers decode), control tokens not
    rendered. (llama-cpp-python's `Llama.detokenize` keeps the prefix.)"""
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    size = 64 + 16 * len(ids)
    buf = ctypes.create_string_buffer(size)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, False)
    if n < 0:
        raise SystemExit(f"llama_detokenize needs {-n} bytes")
    return buf.raw[:n].decode("utf-8", errors="replace")


# Texts where split rules differ: case changes in and out of ASCII,
# combining marks, scripts with marks, contractions, digit runs, newlines.
SPLIT_TEXTS = [
    "HelloWorld XMLHttpRequest don't DON'T I'M 12345 path/to/x\n\n  y",
    "straßeÜber naïveÉcole", "приветМир", "aÉ éÉ", "cafe\u0301 au lait",
    "नमस्ते दुनिया", "สวัสดีครับ", "مَرْحَبًا", "it'ſ", "ǅungla ǈa", "1234567 ١٢٣٤",
    "tabs\t\tand\r\n\r\nlines  \n", "日本語のテキスト、中文。", "x" * 40 + " ok",
]

# Byte-level split rules (`tokenizer.ggml.pre`) checked against llama.cpp on
# SmolLM2's vocabulary and merges relabelled with each, with the two
# documented differences: (what llama.cpp is given for a text, which texts
# are left out)
SPLIT_RULES = {
    # GPT-2's rule, as transformers applies to "smollm" (scripts/place_models.py:
    # the shipped tokenizer.json is transformers'); llama.cpp splits digits off
    # first, so a space before a digit stays alone where GPT-2's rule may merge
    # it (" ١" in SmolLM2's merges): such texts are left out.
    "smollm": (lambda t: t, lambda t: re.search(r"\s\d", t)),
    "llama-bpe": (lambda t: t, lambda t: False),
    # Qwen2's tokenizer.json composes (NFC) before splitting; llama.cpp does
    # not: it is given the composed text.
    "qwen2": (lambda t: unicodedata.normalize("NFC", t), lambda t: False),
    "dbrx": (lambda t: t, lambda t: False),
    "gpt-4o": (lambda t: t, lambda t: False),
}


def word_vocabulary(texts: list) -> dict:
    """A byte-level BPE vocabulary whose merges build every
    whitespace-separated word of `texts` (with and without a leading space)
    byte by byte into one token: a word becomes one token exactly when a
    split rule keeps it in one piece, so the ids show where a rule splits
    (SmolLM2's merges rarely span the places where rules differ)."""
    spell = place_models._bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    known, merges = set(tokens), []
    for text in texts:
        for word in text.split():
            for w in (word, " " + word):
                chars = [spell[b] for b in w.encode()]
                cur = chars[0]
                for c in chars[1:]:
                    if cur + c not in known:
                        known.add(cur + c)
                        tokens.append(cur + c)
                        merges.append(f"{cur} {c}")
                    cur += c
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [1] * len(tokens)}


def vocab_file(source: str, path: str, pre: str, vocabulary=None) -> str:
    """`source`'s metadata (no tensors) with `tokenizer.ggml.pre` = `pre`
    (and `vocabulary`'s tokens, merges and types instead of its own):
    enough for llama.cpp's vocab-only load and the stage's tokenizer."""
    r = gguf.GGUFReader(source)
    w = gguf.GGUFWriter(path, r.fields["general.architecture"].contents())
    vocabulary = vocabulary or {}
    for key, value in vocabulary.items():
        if key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        else:
            w.add_array(key, value)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.ggml.pre") \
                or key in vocabulary:
            continue
        if key.endswith("_token_id") and vocabulary:
            w.add_key_value(key, 0, gguf.GGUFValueType.UINT32)
            continue
        make_gguf_fixtures.copy_field(w, key, field)
    w.add_string("tokenizer.ggml.pre", pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check_split_rules(bin_path: str, source: str, d: str) -> list:
    failures = []
    words = word_vocabulary(TEXTS + SPLIT_TEXTS)
    for pre, (given, left_out) in SPLIT_RULES.items():
        texts = [t for t in TEXTS + SPLIT_TEXTS if not left_out(t)]
        for vocab_name, vocabulary in (("SmolLM2's", None), ("the texts' words", words)):
            path = vocab_file(source, os.path.join(d, f"vocab-{pre}-{len(vocabulary or [])}.gguf"),
                              pre, vocabulary)
            failures += check_tokenizer(bin_path, path, texts,
                                        f"split rule {pre}, {vocab_name} vocabulary", given)
    return failures


def check_tokenizer(bin_path: str, path: str, texts=None, label=None, given=None) -> list:
    """The stage's tokenizer built from the file against llama.cpp's: ids
    (special tokens matched, none added) and the text decoded back;
    llama.cpp tokenizes `given(text)` where a documented difference says
    so."""
    texts = texts or TEXTS
    label = label or os.path.basename(path)
    given = given or (lambda t: t)
    sentencepiece = gguf.GGUFReader(path).fields["tokenizer.ggml.model"].contents() == "llama"
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    p = subprocess.run([bin_path, "--tokenize", path, f.name], capture_output=True, text=True)
    os.unlink(f.name)
    if p.returncode != 0:
        return [f"tokenizing with {os.path.basename(path)} failed: {p.stdout}{p.stderr}"]
    ours = json.loads(p.stdout)
    failures = []
    for text, ids, back in zip(texts, ours["ids"], ours["texts"]):
        want = llm.tokenize(given(text).encode(), add_bos=False, special=True)
        want_back = detokenize(llm, want)
        # SentencePiece: llama.cpp spends its one leading-space removal on
        # the first token even when that is a control token rendering
        # nothing (`<s>`); the stage, as transformers, removes the first
        # space of what is rendered. (Byte-level BPE removes none.)
        if sentencepiece and want \
                and llm._model.token_get_attr(want[0]) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL \
                and want_back.startswith(" "):
            want_back = want_back[1:]
        if ids != want:
            failures.append(f"{label}: ids of {text!r}: {ids}, llama.cpp {want}")
        elif back != want_back:
            failures.append(f"{label}: text of {text!r}: {back!r}, llama.cpp {want_back!r}")
    print(f"  {label} tokenizer: {len(texts) - len(failures)} of {len(texts)} texts cut and "
          f"decoded as llama.cpp does", flush=True)
    return failures


def check_served(gateway: str, path: str, d: str, chat_prompt: str, bos: bool = True) -> list:
    """`gateway serve --model` on a fixture (split over 2 stages) answers
    chat and a raw completion; each prompt counts llama.cpp's tokens: the
    chat's (`chat_prompt`: the file's template rendered, with whatever BOS
    it writes itself) as the text says, the raw one's with the BOS llama.cpp
    adds for this file (`add_bos_token`; `bos`: the file says to add one)."""
    import re
    import time
    import urllib.request

    out = tempfile.NamedTemporaryFile("w+", suffix=".out")
    log = tempfile.NamedTemporaryFile("w+", suffix=".log")
    proc = subprocess.Popen(
        [gateway, "serve", "--listen", "127.0.0.1:0", "--model", path, "--stages", "2",
         "--model-cache", os.path.join(d, "models")],
        cwd=ROOT, stdout=out, stderr=log,
        env={**os.environ, "GATEWAY_RECEIPTS__STORE": "memory", "RUST_BACKTRACE": "0"})
    try:
        url = None
        for _ in range(600):
            out.seek(0)
            m = re.search(r"^GATEWAY LISTENING (\S+)", out.read(), re.M)
            if m:
                url = m.group(1)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        if url is None:
            log.seek(0)
            return [f"gateway serve --model {os.path.basename(path)} did not start:\n{log.read()[-3000:]}"]
        model = "random-" + os.path.basename(path).split(".")[0]
        body = {"model": model, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Name a colour."}]}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
        body = {"model": model, "max_tokens": 4, "prompt": "Name a colour."}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = json.load(r)
    finally:
        proc.send_signal(2)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    want = len(llm.tokenize(chat_prompt.encode(), add_bos=False, special=True))
    got = answer["usage"]["prompt_tokens"]
    print(f"  {model} served: chat answered ({answer['usage']['completion_tokens']} tokens), "
          f"prompt {got} tokens, llama.cpp {want}", flush=True)
    if got != want or not isinstance(answer["choices"][0]["message"]["content"], str):
        return [f"served {model} chat: prompt {got} tokens, llama.cpp {want}: {answer}"]
    # llama.cpp's add_special: the BOS where the file's add_bos_token says.
    want = len(llm.tokenize(b"Name a colour.", add_bos=True, special=True))
    got = raw["usage"]["prompt_tokens"]
    print(f"  {model} served: raw completion prompt {got} tokens, llama.cpp {want}", flush=True)
    if got != want or want != len(llm.tokenize(b"Name a colour.", add_bos=False)) + bos:
        return [f"served {model} completion: prompt {got} tokens, llama.cpp {want}: {raw}"]
    return []


def unsupported_arch(d: str, source: str) -> str:
    """A small GGUF whose architecture is gemma3."""
    path = os.path.join(d, "gemma3.gguf")
    if not os.path.exists(path):
        w = gguf.GGUFWriter(path, "gemma3")
        w.add_block_count(1)
        w.add_embedding_length(256)
        w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


if __name__ == "__main__":
    sys.exit(main())
