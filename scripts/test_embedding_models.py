#!/usr/bin/env python3
"""Bring-your-own embedding models against sentence-transformers: random-weight
BERT encoders in the sentence-transformers folder layout (each pooling the
stages serve: mean, CLS, max; with and without Normalize; a plain folder with
no modules.json; tensors with and without the `bert.` prefix; a cased
tokenizer_config.json over a lower-casing tokenizer.json) and XLM-RoBERTa
encoders (multilingual-e5's layout: mean + Normalize; and CLS under the
`roberta.` prefix) with a SentencePiece Unigram tokenizer, each served by
`gateway serve --embedding-model DIR` across two stages, f32 and bf16, its
vectors compared with sentence-transformers' on the same folder.

The fixtures are made here with numpy from fixed seeds (weights), the
shipped all-MiniLM-L6-v2 tokenizer (BERT) and a small multilingual
SentencePiece tokenizer in XLM-RoBERTa's files (committed in
gateway/tests/data/xlm-roberta-tokenizer/, made once with --make-tokenizer:
a Unigram model trained by the sentencepiece package, written as
transformers' XLM-RoBERTa converter writes tokenizer.json), so CI needs no
torch: the reference
vectors are made once with `--make-reference` in an environment with
scripts/requirements-reference.txt (torch, sentence-transformers) and kept in
gateway/tests/data/embedding_models_reference.json with every fixture file's
SHA-256. A fixture that no longer hashes as recorded stops the test (rerun
--make-reference), so the reference always describes the bytes served.

Passes when every vector has cosine >= 0.9999 (f32) / >= 0.999 (bf16) to the
reference, a pooling without Normalize keeps the reference's length within
1e-3 (f32) / 1e-2 (bf16), and every folder the stages do not serve (a Dense
module, a last-token pooling, two modes at once, do_lower_case, a default
prompt, a RoBERTa config, a tokenizer of the other family, pickle or sharded
weights, no tokenizer.json, ...) stops the gateway with an error naming what.

    python3 scripts/test_embedding_models.py                  # CI (scripts/test.sh)
    /tmp/refvenv/bin/python scripts/test_embedding_models.py --make-reference
    /tmp/refvenv/bin/python scripts/test_embedding_models.py --make-tokenizer
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINILM = os.path.join(ROOT, "models", "all-minilm-l6-v2")
REFERENCE = os.path.join(ROOT, "gateway", "tests", "data", "embedding_models_reference.json")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"]
XLMR_TOKENIZER = os.path.join(ROOT, "gateway", "tests", "data", "xlm-roberta-tokenizer")
XLMR_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
XLMR_VOCAB = 1502  # the committed tokenizer's pieces, <mask> included

HIDDEN, HEADS, INTER, LAYERS, POSITIONS, VOCAB = 64, 4, 128, 3, 128, 30522
MAX_SEQ = 48  # sentence_bert_config.json: shorter than the positions, so truncation is tested

TEXTS = [
    "The enclave processed the prompt.",
    "Ünïcödé accents, CAPITALS and digits 12345 are normalised by the tokenizer.",
    "short",
    "A much longer input that runs past the folder's max_seq_length of forty-eight tokens, "
    "so both sides must cut it at the same place: confidential computing keeps data "
    "encrypted while it is processed, inside hardware-isolated memory that the host "
    "cannot read, and attestation proves which code and which model ran there.",
    "Receipts bind each answer to the attested stages and the exact weights.",
    "x " * 5,
    # XLM-RoBERTa: transformers 5 drops the trailing spaces' `▁` that the
    # tokenizer.json pipeline alone would keep.
    "  leading,  double   and trailing spaces  ",
    "query: Пациент был госпитализирован вчера. 患者は昨日入院しました。 المريض دخل المستشفى",
    "Ｆｕｌｌｗｉｄｔｈ ﬁ ligature, e\u0301 combining, tab\there and a <mask> token",
    # XLM-RoBERTa: a literal <pad> takes the padding row's position and the
    # tokens after it move back by one (transformers numbers only the others).
    "before <pad> after, and <s> inside </s> the text",
]

# A small multilingual corpus for the XLM-RoBERTa tokenizer (--make-tokenizer),
# with the repository's English docs.
CORPUS = """The enclave processed the prompt and signed a receipt for the answer.
Confidential computing keeps data encrypted while it is processed.
Der Patient wurde gestern in die Klinik aufgenommen und untersucht.
Die Verschlüsselung schützt die Daten während der Verarbeitung im Speicher.
Le contrat a été signé par les deux parties à Paris le mois dernier.
Les données médicales sont protégées par le secret professionnel.
El tribunal dictó sentencia después de escuchar a los testigos.
Los resultados del análisis financiero se publicarán mañana por la mañana.
Il paziente ha ricevuto la diagnosi e la terapia è iniziata subito.
O banco central aumentou a taxa de juros pela terceira vez este ano.
Пациент был госпитализирован вчера вечером с высокой температурой.
Шифрование защищает данные во время обработки в памяти сервера.
患者は昨日入院し、検査を受けました。データは暗号化されています。
这份合同由双方于上个月在北京签署。医疗数据受到严格保护。
법원은 증인들의 진술을 들은 후 판결을 내렸습니다.
المريض دخل المستشفى أمس وأجريت له الفحوصات اللازمة.
Ο ασθενής εισήχθη στο νοσοκομείο χθες το βράδυ.
Hasta dün akşam hastaneye kaldırıldı ve tedavisine başlandı.
मरीज को कल रात अस्पताल में भर्ती कराया गया।
Bệnh nhân đã được đưa vào bệnh viện tối qua.
query: how are prompts protected inside the enclave?
passage: Attestation proves which code and which model ran inside the hardware.
Ünïcödé accents, CAPITALS and digits 12345 are normalised by the tokenizer.
"""

# name: (pooling mode or None for no modules.json, Normalize, tensor prefix,
# seed, the files' form: as sentence-transformers before 6 ("v2", the shipped
# MiniLM's) or 6 itself writes them)
FIXTURES = {
    "mean-normalize": ("mean", True, "", 1, "v2"),
    "cls-normalize": ("cls", True, "bert.", 2, "v6"),
    "max": ("max", False, "", 3, "v2"),
    "mean-v6": ("mean", False, "", 5, "v6"),
    "plain-folder": (None, False, "", 4, None),
    # tokenizer_config.json: do_lower_case false over a lower-casing
    # tokenizer.json (transformers builds the normalizer from the former) and
    # a model_max_length of 40, shorter than the positions.
    "cased-short": (None, False, "", 6, "cased"),
    # XLM-RoBERTa: multilingual-e5's layout, and CLS pooling of tensors
    # saved from an `XLMRobertaFor…` model (`roberta.`).
    "xlmr-mean-normalize": ("mean", True, "", 7, "v2"),
    "xlmr-cls": ("cls", False, "roberta.", 8, "v6"),
}


def is_xlmr(name):
    return name.startswith("xlmr")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def write_safetensors(path, tensors):
    """The safetensors format (a JSON header of names, dtypes, shapes and
    offsets, then the raw little-endian bytes), written directly so that CI
    needs no package for it; names sorted, so the bytes are fixed."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def bert_weights(seed, prefix, xlmr=False):
    """A BertModel's (xlmr: an XLMRobertaModel's, the same names) tensors."""
    rng = np.random.Generator(np.random.PCG64(seed))
    vocab, positions, types = (XLMR_VOCAB, POSITIONS + 2, 1) if xlmr else (VOCAB, POSITIONS, 2)

    def normal(*shape, std=0.08):
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm(name):
        return {f"{name}.weight": 1.0 + normal(HIDDEN, std=0.1), f"{name}.bias": normal(HIDDEN, std=0.1)}

    def dense(name, n_in, n_out):
        return {f"{name}.weight": normal(n_out, n_in), f"{name}.bias": normal(n_out, std=0.05)}

    t = {
        "embeddings.word_embeddings.weight": normal(vocab, HIDDEN, std=0.5),
        "embeddings.position_embeddings.weight": normal(positions, HIDDEN, std=0.2),
        "embeddings.token_type_embeddings.weight": normal(types, HIDDEN, std=0.2),
        **norm("embeddings.LayerNorm"),
    }
    for i in range(LAYERS):
        l = f"encoder.layer.{i}"
        for p in ("query", "key", "value"):
            t.update(dense(f"{l}.attention.self.{p}", HIDDEN, HIDDEN))
        t.update(dense(f"{l}.attention.output.dense", HIDDEN, HIDDEN))
        t.update(norm(f"{l}.attention.output.LayerNorm"))
        t.update(dense(f"{l}.intermediate.dense", HIDDEN, INTER))
        t.update(dense(f"{l}.output.dense", INTER, HIDDEN))
        t.update(norm(f"{l}.output.LayerNorm"))
    return {prefix + k: v for k, v in t.items()}


def bert_config(**over):
    c = {
        "architectures": ["BertModel"], "model_type": "bert", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": INTER, "hidden_act": "gelu", "max_position_embeddings": POSITIONS,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12, "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02, "pad_token_id": 0,
        "position_embedding_type": "absolute",
    }
    c.update(over)
    return c


def xlmr_config(**over):
    """An XLMRobertaModel's config.json (multilingual-e5's keys): positions
    for POSITIONS tokens after the padding id, one token type."""
    c = bert_config(architectures=["XLMRobertaModel"], model_type="xlm-roberta", vocab_size=XLMR_VOCAB,
                    max_position_embeddings=POSITIONS + 2, type_vocab_size=1, layer_norm_eps=1e-5,
                    pad_token_id=1, bos_token_id=0, eos_token_id=2)
    c.update(over)
    return c


def pooling_config(**modes):
    """A Pooling module's config.json in the boolean form sentence-transformers
    before 6 writes (the shipped all-MiniLM-L6-v2's)."""
    c = {"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
         "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
         "pooling_mode_lasttoken": False, "include_prompt": True}
    c.update({f"pooling_mode_{k}": v for k, v in modes.items()})
    return c


# Module types as sentence-transformers before 6 and 6 itself write them.
TYPES = {
    "v2": {k: f"sentence_transformers.models.{k}" for k in ("Transformer", "Pooling", "Normalize", "Dense")},
    "v6": {"Transformer": "sentence_transformers.base.modules.transformer.Transformer",
           "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
           "Normalize": "sentence_transformers.base.modules.normalize.Normalize"},
}


def modules(normalize, extra=(), form="v2"):
    t = TYPES[form]
    m = [{"idx": 0, "name": "0", "path": "", "type": t["Transformer"]},
         {"idx": 1, "name": "1", "path": "1_Pooling", "type": t["Pooling"]}]
    for kind in (["Normalize"] if normalize else []) + list(extra):
        path = "" if kind == "Normalize" and form == "v2" else f"{len(m)}_{kind}"
        m.append({"idx": len(m), "name": str(len(m)), "path": path, "type": t[kind]})
    return m


def make_fixture(d, mode, normalize, prefix, seed, form, xlmr=False):
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    if xlmr:
        for f in XLMR_TOKENIZER_FILES:
            shutil.copy(os.path.join(XLMR_TOKENIZER, f), d)
    else:
        for f in TOKENIZER_FILES:
            shutil.copy(os.path.join(MINILM, f), d)
    write_json(os.path.join(d, "config.json"), xlmr_config() if xlmr else bert_config())
    write_safetensors(os.path.join(d, "model.safetensors"), bert_weights(seed, prefix, xlmr))
    if form == "cased":
        tc = json.load(open(os.path.join(MINILM, "tokenizer_config.json")))
        tc.update(do_lower_case=False, model_max_length=40)
        write_json(os.path.join(d, "tokenizer_config.json"), tc)
    if mode is None:
        return
    write_json(os.path.join(d, "modules.json"), modules(normalize, form=form))
    if form == "v2":
        key = {"mean": "mean_tokens", "cls": "cls_token", "max": "max_tokens"}[mode]
        write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(**{key: True}))
        write_json(os.path.join(d, "sentence_bert_config.json"),
                   {"max_seq_length": MAX_SEQ, "do_lower_case": False})
    else:
        write_json(os.path.join(d, "1_Pooling", "config.json"),
                   {"embedding_dimension": HIDDEN, "pooling_mode": mode, "include_prompt": True})
        if normalize:
            write_json(os.path.join(d, "2_Normalize", "config.json"),
                       {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"})
        write_json(os.path.join(d, "sentence_bert_config.json"), {
            "transformer_task": "feature-extraction", "max_seq_length": MAX_SEQ,
            "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
            "module_output_name": "token_embeddings"})


def file_digests(d):
    out = {}
    for base, _, files in os.walk(d):
        for f in files:
            p = os.path.join(base, f)
            out[os.path.relpath(p, d)] = sha256(p)
    return dict(sorted(out.items()))


def make_all(root):
    for name, (mode, normalize, prefix, seed, form) in FIXTURES.items():
        make_fixture(os.path.join(root, name), mode, normalize, prefix, seed, form, is_xlmr(name))


def make_tokenizer(work):
    """XLM-RoBERTa's tokenizer files for a small vocabulary: a SentencePiece
    Unigram model trained on CORPUS (and the repository's English docs) with
    XLM-RoBERTa's normalization (nmt_nfkc), written as transformers'
    XLMRobertaConverter writes tokenizer.json (fairseq's ids: <s> <pad> </s>
    <unk> first, the pieces after SentencePiece's three specials, <mask>
    last), with multilingual-e5's tokenizer_config.json."""
    import glob

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import Unigram

    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(CORPUS * 8)
        for doc in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
            f.write(open(doc).read())
    prefix = os.path.join(work, "sp")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=XLMR_VOCAB - 2,
                                   model_type="unigram", character_coverage=1.0,
                                   normalization_rule_name="nmt_nfkc", minloglevel=2)
    m = pb.ModelProto()
    m.ParseFromString(open(prefix + ".model", "rb").read())
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(p.piece, p.score) for p in m.pieces[3:]] + [("<mask>", 0.0)]
    assert len(vocab) == XLMR_VOCAB, len(vocab)
    t = Tokenizer(Unigram(vocab, unk_id=3, byte_fallback=False))
    t.normalizer = normalizers.Sequence([normalizers.Precompiled(m.normalizer_spec.precompiled_charsmap),
                                         normalizers.Replace(Regex(" {2,}"), " ")])
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    specials = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": XLMR_VOCAB - 1}
    t.add_special_tokens([AddedToken(c, special=True, normalized=False, lstrip=c == "<mask>") for c in specials])
    os.makedirs(XLMR_TOKENIZER, exist_ok=True)
    t.save(os.path.join(XLMR_TOKENIZER, "tokenizer.json"))
    decoder = {str(i): {"content": c, "lstrip": c == "<mask>", "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for c, i in specials.items()}
    named = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>",
             "pad_token": "<pad>", "sep_token": "</s>", "unk_token": "<unk>"}
    write_json(os.path.join(XLMR_TOKENIZER, "tokenizer_config.json"), {
        **named, "added_tokens_decoder": decoder, "clean_up_tokenization_spaces": True,
        "model_max_length": 512, "tokenizer_class": "XLMRobertaTokenizer"})
    write_json(os.path.join(XLMR_TOKENIZER, "special_tokens_map.json"), {
        **named, "mask_token": {"content": "<mask>", "lstrip": True, "normalized": False, "rstrip": False,
                                "single_word": False}})
    print(f"wrote {XLMR_TOKENIZER}")


def make_reference(root):
    import sentence_transformers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    out = {"_comment": "made by scripts/test_embedding_models.py --make-reference; do not edit",
           "versions": {"sentence-transformers": sentence_transformers.__version__,
                        "transformers": transformers.__version__, "torch": torch.__version__},
           "texts": TEXTS, "fixtures": {}}
    for name in FIXTURES:
        d = os.path.join(root, name)
        model = SentenceTransformer(d, device="cpu")
        model.eval()
        vecs = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True,
                            normalize_embeddings=False)
        print(f"{name}: {model}", file=sys.stderr)
        out["fixtures"][name] = {"files": file_digests(d),
                                 "max_seq_length": model.max_seq_length,
                                 "vectors": [[float(f"{x:.8g}") for x in v] for v in vecs.tolist()]}
    write_json(REFERENCE, out)
    print(f"wrote {REFERENCE}")


# ---- serving -----------------------------------------------------------------

def embeddings_only_config(path):
    """config/gateway.toml without its [completions] tables: these runs serve
    embeddings only."""
    keep = []
    skipping = False
    for line in open(os.path.join(ROOT, "config", "gateway.toml")):
        if line.startswith("["):
            skipping = line.startswith("[completions") or line.startswith("[[completions")
        if not skipping:
            keep.append(line)
    with open(path, "w") as f:
        f.writelines(keep)


class Gateway:
    def __init__(self, gateway, config, model_dir, cache, weights, stages=2):
        env = dict(os.environ, GATEWAY_PIPELINE__WEIGHTS=weights,
                   GATEWAY_RECEIPTS__STORE="memory", RUST_BACKTRACE="0")
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.out = tempfile.NamedTemporaryFile("w+", suffix=".out", delete=False)
        self.proc = subprocess.Popen(
            [gateway, "serve", "--config", config, "--listen", "127.0.0.1:0",
             "--embedding-model", model_dir, "--embedding-stages", str(stages),
             "--model-cache", cache],
            cwd=ROOT, env=env, stdout=self.out, stderr=self.log)
        self.url = None

    def wait(self, timeout=120):
        """The URL once listening; None (and the log) if the gateway exited."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.out.seek(0)
            for line in self.out.read().splitlines():
                if line.startswith("GATEWAY LISTENING "):
                    self.url = line.split(" ", 2)[2].strip()
                    return self.url
            if self.proc.poll() is not None:
                return None
            time.sleep(0.1)
        raise SystemExit("gateway did not start in time:\n" + self.logs())

    def logs(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(2)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def embed(self, model, inputs):
        req = urllib.request.Request(
            self.url + "/v1/embeddings",
            data=json.dumps({"model": model, "input": inputs}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            body = json.load(r)
        return [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]

    def model_ids(self):
        with urllib.request.urlopen(self.url + "/v1/models", timeout=10) as r:
            return [m["id"] for m in json.load(r)["data"]]


def compare(got, want, normalized, weights):
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    cos = float(g @ w / (np.linalg.norm(g) * np.linalg.norm(w)))
    rel = abs(np.linalg.norm(g) - np.linalg.norm(w)) / np.linalg.norm(w)
    cos_min, rel_max = (0.9999, 1e-3) if weights == "f32" else (0.999, 1e-2)
    ok = cos >= cos_min and (normalized or rel <= rel_max)
    return ok, cos, rel


def check_served(args, ref, work):
    failures = []
    config = os.path.join(work, "gateway.toml")
    embeddings_only_config(config)
    for name, (mode, normalize, _, _, _) in FIXTURES.items():
        d = os.path.join(work, name)
        r = ref["fixtures"][name]
        for weights in ("f32", "bf16"):
            cache = os.path.join(work, "cache")
            shutil.rmtree(cache, ignore_errors=True)
            gw = Gateway(args.gateway, config, d, cache, weights)
            try:
                if gw.wait() is None:
                    failures.append(f"{name} {weights}: the gateway did not start:\n{gw.logs()[-3000:]}")
                    continue
                ids = gw.model_ids()
                if name not in ids:
                    failures.append(f"{name}: /v1/models lists {ids}, not {name}")
                written = [json.load(open(os.path.join(cache, f, "manifest.json")))
                           for f in os.listdir(cache) if f.startswith(name + "-")]
                if [m["max_seq_len"] for m in written] != [r["max_seq_length"]]:
                    failures.append(f"{name}: manifest max_seq_len {[m['max_seq_len'] for m in written]}, "
                                    f"sentence-transformers' {r['max_seq_length']}")
                # All texts in one request (one padded micro-batch), then one alone.
                together = gw.embed(name, TEXTS)
                alone = gw.embed(name, [TEXTS[1]])
                worst = (1.0, 0.0)
                for i, (got, want) in enumerate(zip(together + alone, r["vectors"] + [r["vectors"][1]])):
                    ok, cos, rel = compare(got, want, normalize, weights)
                    worst = (min(worst[0], cos), max(worst[1], rel))
                    if not ok:
                        failures.append(f"{name} {weights} text {i}: cosine {cos:.6f}, length off {rel:.2e}")
                    if normalize and abs(np.linalg.norm(got) - 1) > 1e-4:
                        failures.append(f"{name} {weights} text {i}: Normalize, but length {np.linalg.norm(got)}")
                print(f"  {name:15} {weights:5} {len(together) + 1} vectors: min cosine {worst[0]:.7f}, "
                      f"max length difference {worst[1]:.1e}")
            finally:
                gw.stop()
    return failures


def refusal_cases(work):
    """(name, how to spoil a copy of a fixture, words the error must contain,
    the fixture: mean-normalize unless named)"""

    def spoil_modules(extra):
        return lambda d: write_json(os.path.join(d, "modules.json"), modules(True, extra))

    def spoil_pooling(**modes):
        return lambda d: write_json(os.path.join(d, "1_Pooling", "config.json"), pooling_config(**modes))

    def spoil_config(**over):
        return lambda d: write_json(os.path.join(d, "config.json"), bert_config(**over))

    def spoil_tokenizer_config(**over):
        def spoil(d):
            tc = json.load(open(os.path.join(d, "tokenizer_config.json")))
            tc.update(over)
            write_json(os.path.join(d, "tokenizer_config.json"), tc)
        return spoil

    def rename(a, b):
        return lambda d: os.rename(os.path.join(d, a), os.path.join(d, b))

    def remove(a):
        return lambda d: os.remove(os.path.join(d, a))

    def sentence_bert(**over):
        def spoil(d):
            c = {"max_seq_length": MAX_SEQ, "do_lower_case": False}
            c.update(over)
            write_json(os.path.join(d, "sentence_bert_config.json"), c)
        return spoil

    def default_prompt(d):
        write_json(os.path.join(d, "config_sentence_transformers.json"),
                   {"prompts": {"query": "query: "}, "default_prompt_name": "query"})

    def shard(d):
        os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00001.safetensors"))
        write_json(os.path.join(d, "model.safetensors.index.json"), {"weight_map": {}})

    def transformer_subfolder(d):
        m = modules(True)
        m[0]["path"] = "0_Transformer"
        write_json(os.path.join(d, "modules.json"), m)

    return [
        ("dense-module", spoil_modules(["Dense"]), ["Dense"]),
        ("lasttoken", spoil_pooling(lasttoken=True), ["lasttoken", "not served"]),
        ("two-modes", spoil_pooling(mean_tokens=True, cls_token=True), ["several pooling modes", "cls"]),
        ("lower-case", sentence_bert(do_lower_case=True), ["do_lower_case"]),
        ("too-short", sentence_bert(max_seq_length=2), ["max_seq_len 2", "special tokens"]),
        ("default-prompt", default_prompt, ["default_prompt_name"]),
        ("subfolder", transformer_subfolder, ["0_Transformer"]),
        ("sharded", shard, ["sharded"]),
        ("tokenizer-class", spoil_tokenizer_config(tokenizer_class="XLMRobertaTokenizer"),
         ["XLMRobertaTokenizer"]),
        ("zero-width", spoil_config(intermediate_size=0), ["intermediate_size is 0"]),
        ("roberta", spoil_config(model_type="roberta"), ["a roberta embedding model", "bert, xlm-roberta"]),
        ("xlmr-bert-tokenizer", spoil_config(**xlmr_config(vocab_size=VOCAB)), ["BertTokenizer"]),
        ("xlmr-no-positions", lambda d: write_json(os.path.join(d, "config.json"),
                                                   xlmr_config(max_position_embeddings=2)),
         ["max_position_embeddings 2", "no position"], "xlmr-mean-normalize"),
        ("xlmr-wordpiece", lambda d: shutil.copy(os.path.join(MINILM, "tokenizer.json"), d),
         ["Unigram", "WordPiece"], "xlmr-mean-normalize"),
        ("gelu-new", spoil_config(hidden_act="gelu_new"), ["gelu_new"]),
        ("relative-positions", spoil_config(position_embedding_type="relative_key"), ["relative_key"]),
        ("pickle", rename("model.safetensors", "pytorch_model.bin"), ["pytorch_model.bin"]),
        ("no-tokenizer", remove("tokenizer.json"), ["tokenizer.json"]),
    ]


def check_refusals(args, work):
    failures = []
    config = os.path.join(work, "gateway.toml")
    for i, (name, spoil, words, *base) in enumerate(refusal_cases(work)):
        # A neutral folder name: the words must come from the error.
        d = os.path.join(work, "refused", f"case{i}")
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(os.path.join(work, (base or ["mean-normalize"])[0]), d)
        spoil(d)
        gw = Gateway(args.gateway, config, d, os.path.join(work, "cache"), "f32")
        try:
            url = gw.wait()
            log = gw.logs()
        finally:
            gw.stop()
        # The error's lines (an error and its causes, one per line).
        lines = [l for l in log.splitlines() if not l.startswith("{")]
        if url is not None:
            failures.append(f"refusal {name}: the gateway started")
        elif not any(all(w in l for w in words) for l in lines):
            failures.append(f"refusal {name}: no error line names {words}:\n{log[-2000:]}")
        else:
            line = next(l for l in lines if all(w in l for w in words))
            print(f"  refused {name:18} {line.strip()[-160:]}")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-reference", action="store_true",
                    help="make the fixtures and write the reference with sentence-transformers")
    ap.add_argument("--make-tokenizer", action="store_true",
                    help="train and write the XLM-RoBERTa fixtures' tokenizer (sentencepiece, tokenizers)")
    ap.add_argument("--gateway", default=os.path.join(ROOT, "target", "release", "gateway"))
    ap.add_argument("--dir", default=os.path.join(ROOT, "target", "embedding-fixtures"))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if args.make_tokenizer:
        make_tokenizer(args.dir)
        return
    make_all(args.dir)
    if args.make_reference:
        make_reference(args.dir)
        return
    ref = json.load(open(REFERENCE))
    if ref["texts"] != TEXTS:
        raise SystemExit("the texts differ from the reference's: rerun --make-reference")
    for name in FIXTURES:
        have = file_digests(os.path.join(args.dir, name))
        if have != ref["fixtures"][name]["files"]:
            raise SystemExit(f"fixture {name} no longer hashes as the reference records: "
                             "rerun --make-reference (scripts/requirements-reference.txt)")
    print(f"fixtures as the reference recorded them (sentence-transformers "
          f"{ref['versions']['sentence-transformers']}); served across 2 stages:")
    failures = check_served(args, ref, args.dir)
    print("folders the stages do not serve:")
    failures += check_refusals(args, args.dir)
    if failures:
        print("\nFAILED:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)
    print("embedding models: all agree with sentence-transformers, all refusals named")


if __name__ == "__main__":
    main()
