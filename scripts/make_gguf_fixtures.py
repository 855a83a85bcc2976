#!/usr/bin/env python3
"""Random-weight GGUF models of real shapes, one per architecture the stages
load (llama, qwen2, qwen3, phi3, gemma2), written in F32 with the `gguf` package
(maintained with llama.cpp) and quantized by llama.cpp itself into every
tensor type the stages serve, so that both implementations read the same
bytes (`scripts/test_gguf_models.py` compares them).

The tokenizer (SmolLM2's 49,152-token BPE, its special tokens and chat
template) is copied from the shipped SmolLM2 GGUF, so llama.cpp loads a
real vocabulary and the fixtures exercise the stages' tokenizer-from-GGUF
path as a user's file would. `llama-spm` instead has a SentencePiece BPE
vocabulary as Llama 2's is made (`tokenizer.ggml.model = llama`: scores,
byte-fallback tokens), trained here with the `sentencepiece` package on the
fixed English text of `scripts/data/quality-text.txt` (1,000 pieces) and written as llama.cpp's
converter writes one, with a Llama-2-style chat template.

Shapes are small but keep the features that differ between families:
- `llama`: grouped-query attention (4 heads, 2 KV heads), an output head
  tied to the token embedding, and Llama 3's `rope_freqs` factors;
- `qwen2`: q/k/v biases, a separate output head, NEOX rotary, linear
  rotary scaling (factor 4);
- `qwen3`: per-head q/k RMSNorm, and heads wider than the hidden width
  shares (4 × 128 = 512 against a hidden width of 256), as in Qwen3;
- `llama-spm`: the `llama` shape without `rope_freqs`, with the
  SentencePiece tokenizer above (Llama 2, TinyLlama, Mistral 7B v0.1);
- `phi3`: the SentencePiece tokenizer with Phi-3's chat markers and
  template, Phi-3's fused tensors (one `attn_qkv`, one `ffn_up` holding the
  gate and up halves), a separate output head, NEOX rotary, and Phi-3.5's
  LongRoPE: `rope_factors_long`/`rope_factors_short` with an original
  context of 256 (under llama.cpp's 512-token context and the file's 2048,
  so both sides use the long factors) and `rope.scaling.attn_factor`;
- `phi4`: Phi-4's kind: `phi3` blocks with heads of 128, GQA, a separate
  head and no LongRoPE, byte-level BPE under the `dbrx` split rule
  (SmolLM2's vocabulary with Phi-4's `<|im_sep|>`) and Phi-4's template;
- `phi4-mini`: as `phi3` with Phi-4-mini's partial rotary embedding (96
  of a head's 128 dimensions turned, the rest passed), a tied head, and
  Phi-4-mini's tokenizer kind: byte-level BPE with the `gpt-4o` split rule
  (SmolLM2's vocabulary with Phi-3's chat markers added);
- `gemma2`: Gemma 2's blocks (an RMSNorm after attention and after the
  feed-forward product, GELU, the embedding scaled by sqrt(hidden), soft
  caps of scores and logits, a sliding window on even layers: window and
  caps small enough to matter here), heads of 128 with GQA, a tied head,
  the SentencePiece tokenizer with Gemma's turn markers and no space
  prefix, and Gemma 2's template.
Widths are multiples of 256 so the K-quants apply to every matrix.

Usage: make_gguf_fixtures.py --source SmolLM2.gguf --out DIR [--shape 1b]
  (`--shape 1b`: the 1B-class llama shape of issue 31, hidden 2048,
  16 layers, GQA 32/8, written in F16: for benchmarks and opt-in tests)
"""

import argparse
import os
import sys

import numpy as np

import gguf

SHAPES = {
    # name: (arch, hidden, ffn, layers, heads, kv_heads, head_dim, tied, rope_freqs)
    "llama": ("llama", 256, 512, 2, 4, 2, 64, True, True),
    "qwen2": ("qwen2", 256, 512, 2, 4, 2, 64, False, False),
    "qwen3": ("qwen3", 256, 512, 2, 4, 2, 128, True, False),
    "llama-1b": ("llama", 2048, 8192, 16, 32, 8, 64, True, False),
    # Llama 2's tokenizer kind: SentencePiece BPE (below), no rope_freqs.
    "llama-spm": ("llama", 256, 512, 2, 4, 2, 64, True, False),
    # Fused q/k/v and gate/up, LongRoPE factors (below).
    "phi3": ("phi3", 256, 512, 2, 4, 2, 64, False, False),
    # Phi-4-mini's kind: heads of 128 with a rotary embedding on 96 of them
    # (ROPE_DIMS), a tied head, LongRoPE.
    "phi4-mini": ("phi3", 256, 512, 2, 2, 1, 128, True, False),
    # Phi-4's kind: heads of 128, GQA, a separate head, no LongRoPE, rotary
    # base 250000, Llama 3's split rule as `dbrx` (below).
    "phi4": ("phi3", 256, 512, 2, 2, 1, 128, False, False),
    # Gemma 2's kind: post-norms, GELU, soft caps, a sliding window on the
    # even layers (GEMMA2 below), the head tied, heads of 128 with GQA.
    "gemma2": ("gemma2", 256, 512, 2, 2, 1, 128, True, False),
}

# Gemma 2's window and caps, small enough to matter on these shapes: the
# 256 teacher-forced positions and the 64-token prefill reach past a
# 48-position window, and scores (std ~2) and logits (std ~3) reach into
# caps of 5 and 10 (Gemma 2's own are 4096, 50 and 30).
GEMMA2 = {"window": 48, "attn_cap": 5.0, "final_cap": 10.0}
GEMMA2_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Gemma 2's chat template (google/gemma-2-2b-it's tokenizer_config.json).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# Rotary widths narrower than the head.
ROPE_DIMS = {"phi4-mini": 96}

# Phi-3's chat markers, added to its SentencePiece vocabulary (llama.cpp's
# vocabulary loader looks them up for a phi3 file), and its chat template.
PHI3_TOKENS = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
    "{{ eos_token }}{% endif %}"
)

# Phi-4's chat template.
PHI4_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + "
    "message['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}"
)

# A Llama-2-style chat template for the SentencePiece fixture.
SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST] {{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}"
    " {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def spm_tokenizer(w: gguf.GGUFWriter, text_files: list, extra: tuple = (),
                  template: str = "", space_prefix: bool = True) -> int:
    """Trains a small SentencePiece BPE vocabulary (1,000 pieces, byte
    fallback, as Llama 2's tokenizer is made) on `text_files` and writes it
    as llama.cpp's converter writes a SentencePiece model: pieces, scores,
    token types, `tokenizer.ggml.model = llama`, BOS added by default.
    Returns the vocab size."""
    import io

    import sentencepiece as spm

    lines = [l for f in text_files for l in open(f, encoding="utf-8").read().splitlines() if l.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=1000, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True,
        allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=["<tool_call>", "</tool_call>", *extra], minloglevel=2, num_threads=1)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        kind = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif piece in extra:
            # As llama.cpp's converter types the tokens a tokenizer's
            # configuration marks special (Phi-3's chat markers).
            kind = gguf.TokenType.CONTROL
        elif piece in ("<tool_call>", "</tool_call>"):
            kind = gguf.TokenType.USER_DEFINED
        tokens.append(piece.encode("utf-8"))
        scores.append(sp.get_score(i))
        types.append(kind)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(template or SPM_TEMPLATE)
    if not space_prefix:
        # Gemma's SentencePiece adds no space before the text.
        w.add_add_space_prefix(False)
    return len(tokens)


def copy_field(w: gguf.GGUFWriter, key: str, field, value=None) -> None:
    """Writes GGUF metadata `field` (read by `gguf.GGUFReader`) into `w` as
    `key` with its own type, with `value` in place of its contents where
    given."""
    value = field.contents() if value is None else value
    vtype = field.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        w.add_key_value(key, value, vtype, sub_type=field.types[-1])
    else:
        w.add_key_value(key, value, vtype)


def copy_tokenizer(src: str, w: gguf.GGUFWriter, pre=None, extra=(), template=None) -> int:
    """Copies every tokenizer.* key of `src` into `w` (with the split rule
    `pre`, the control tokens `extra` appended and the chat template
    `template` where given); returns the vocab size."""
    r = gguf.GGUFReader(src)
    vocab = 0
    for key, field in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.pre" and pre:
            value = pre
        if key == "tokenizer.chat_template" and template:
            value = template
        if key == "tokenizer.ggml.tokens":
            value = value + list(extra)
        if key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.CONTROL)] * len(extra)
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
        copy_field(w, key, field, value)
    return vocab


def write_model(name: str, src: str, path: str, seed: int, f16: bool) -> None:
    arch, hidden, ffn, layers, heads, kv, hd, tied, rope_freqs = SHAPES[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random-{name}")
    if name == "phi4":
        # Phi-4's tokenizer kind: byte-level BPE under `dbrx` (SmolLM2's
        # vocabulary, which has <|im_start|> and <|im_end|>, plus Phi-4's
        # <|im_sep|>) and Phi-4's template.
        vocab = copy_tokenizer(src, w, "dbrx", ("<|im_sep|>",), PHI4_TEMPLATE)
    elif name == "phi4-mini":
        # Phi-4-mini's tokenizer kind: byte-level BPE split by llama.cpp's
        # `gpt-4o` rule (SmolLM2's vocabulary and merges), with Phi-3's chat
        # markers as control tokens and its template.
        vocab = copy_tokenizer(src, w, "gpt-4o", PHI3_TOKENS[1:], PHI3_TEMPLATE)
    elif name == "llama-spm" or arch in ("phi3", "gemma2"):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        text = [os.path.join(root, "scripts", "data", "quality-text.txt")]
        if arch == "gemma2":
            vocab = spm_tokenizer(w, text, GEMMA2_TOKENS, GEMMA2_TEMPLATE, space_prefix=False)
        elif arch == "phi3":
            vocab = spm_tokenizer(w, text, PHI3_TOKENS, PHI3_TEMPLATE)
        else:
            vocab = spm_tokenizer(w, text)
    else:
        vocab = copy_tokenizer(src, w)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    rope_dim = ROPE_DIMS.get(name, hd)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_freq_base(250000.0 if name == "phi4" else
                         {"llama": 100000.0, "phi3": 10000.0}.get(arch, 1000000.0))
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        m = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(scale)
        return m.astype(np.float16) if f16 else m

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Logits of a few units' spread, as a trained model's: the head's rows
    # are scaled so that a unit-RMS hidden state gives logits of std ~3.
    embd = mat(vocab, hidden, 3.0 / np.sqrt(hidden))
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", norm(hidden))
    if not tied:
        # A separate head: the embedding plus 8 % noise, distinct bytes with
        # a next-token distribution as peaked as the tied fixtures' (mean
        # top probability about 0.8). A head of pure noise gives a flat
        # distribution whose top two tokens are often within rounding of
        # each other, which no trained model has.
        head = embd.astype(np.float32) + mat(vocab, hidden, 0.25 / np.sqrt(hidden)).astype(np.float32)
        w.add_tensor("output.weight", head.astype(embd.dtype))
    if rope_freqs:
        # Factors as Llama 3's tensor holds them, spread over every pair
        # (Llama 3's own leave the fast pairs at 1), so that within the
        # test's 256 positions a factor dropped, or multiplied instead of
        # divided, moves the angles by many radians.
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2, dtype=np.float32))
    if arch == "phi3" and name != "phi4":
        # Phi-3.5's LongRoPE, as llama.cpp's converter writes it: both
        # factor sets, the original context, and the attention factor
        # sqrt(1 + ln(scale) / ln(original)) that scales cos and sin.
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 12.0, rope_dim // 2, dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 1.5, rope_dim // 2, dtype=np.float32))
        w.add_rope_scaling_orig_ctx_len(256)
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(8.0) / np.log(256))))
    if arch == "gemma2":
        w.add_sliding_window(GEMMA2["window"])
        w.add_attn_logit_softcapping(GEMMA2["attn_cap"])
        w.add_final_logit_softcapping(GEMMA2["final_cap"])
    if arch == "qwen2":
        # Linear rotary scaling (positions divided by 4), as llama.cpp reads it.
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)
    q_out = heads * hd
    # The residual projections scaled by 1/sqrt(2 × layers), as GPT-2
    # initialises them (0.5 for the 2-layer shapes), so that a deep stack
    # does not drown the embedding's path and the next-token distribution
    # stays as peaked as a trained model's.
    res = 1.0 / np.sqrt(2 * layers)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(hidden))
        if arch == "phi3":
            # q, k and v rows in one matrix, in that order.
            w.add_tensor(p + "attn_qkv.weight", mat(q_out + 2 * kv * hd, hidden, 1.0 / np.sqrt(hidden)))
        else:
            w.add_tensor(p + "attn_q.weight", mat(q_out, hidden, 1.0 / np.sqrt(hidden)))
            w.add_tensor(p + "attn_k.weight", mat(kv * hd, hidden, 1.0 / np.sqrt(hidden)))
            w.add_tensor(p + "attn_v.weight", mat(kv * hd, hidden, 1.0 / np.sqrt(hidden)))
        w.add_tensor(p + "attn_output.weight", mat(hidden, q_out, res / np.sqrt(q_out)))
        if arch == "qwen2":
            for t, n in (("attn_q", q_out), ("attn_k", kv * hd), ("attn_v", kv * hd)):
                w.add_tensor(p + t + ".bias", (0.2 * rng.standard_normal(n)).astype(np.float32))
        if arch == "qwen3":
            w.add_tensor(p + "attn_q_norm.weight", norm(hd))
            w.add_tensor(p + "attn_k_norm.weight", norm(hd))
        w.add_tensor(p + "ffn_norm.weight", norm(hidden))
        if arch == "phi3":
            # The gate's rows, then the up projection's, in one matrix.
            w.add_tensor(p + "ffn_up.weight", mat(2 * ffn, hidden, 1.0 / np.sqrt(hidden)))
        else:
            w.add_tensor(p + "ffn_gate.weight", mat(ffn, hidden, 1.0 / np.sqrt(hidden)))
            w.add_tensor(p + "ffn_up.weight", mat(ffn, hidden, 1.0 / np.sqrt(hidden)))
        w.add_tensor(p + "ffn_down.weight", mat(hidden, ffn, res / np.sqrt(ffn)))
        if arch == "gemma2":
            # Norms of the attention and feed-forward outputs (stored, as
            # llama.cpp's converter writes Gemma's, with the 1 added).
            w.add_tensor(p + "post_attention_norm.weight", norm(hidden))
            w.add_tensor(p + "post_ffw_norm.weight", norm(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", required=True, help="a GGUF whose tokenizer to copy")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="small", choices=["small", "1b"])
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = ["llama-1b"] if args.shape == "1b" else [
        "llama", "qwen2", "qwen3", "llama-spm", "phi3", "phi4-mini", "phi4", "gemma2"]
    f16 = args.shape == "1b"
    for i, name in enumerate(names):
        path = os.path.join(args.out, f"{name}.{'F16' if f16 else 'F32'}.gguf")
        if os.path.exists(path):
            continue
        tmp = path + ".part"
        write_model(name, args.source, tmp, seed=1000 + i, f16=f16)
        os.replace(tmp, path)
        print(f"fixtures: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
