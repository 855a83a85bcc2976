#!/usr/bin/env python3
"""Checks an RFC 9942 COSE receipt with the PyPI `scitt-cose` package
(written by others, vds = 1: RFC9162_SHA256), for the transparency log's
receipt entries (docs/transparency.md).

    verify_cose_receipt.py --receipt FILE --entry-hex HEX --vkey VKEY

VKEY is the log's signed-note verifier key (`gateway log vkey`): its
Ed25519 public key is given to scitt-cose as PEM. Prints one JSON object
(ok, tree_size, leaf_index, root, errors) and exits 0 only when it verifies.
"""
import argparse
import base64
import json
import sys

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from scitt_cose.receipt import verify_receipt


def pem_of(vkey):
    name, key_id, b64 = vkey.split("+", 2)
    raw = base64.b64decode(b64, validate=True)
    if len(raw) != 33 or raw[0] != 1:
        sys.exit(f"{vkey!r} is not an Ed25519 signed-note verifier key")
    key = Ed25519PublicKey.from_public_bytes(raw[1:])
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--receipt", required=True)
    ap.add_argument("--entry-hex", required=True)
    ap.add_argument("--vkey", required=True)
    a = ap.parse_args()
    with open(a.receipt, "rb") as f:
        receipt = f.read()
    r = verify_receipt(receipt, leaf_entry_hex=a.entry_hex, log_public_key_pem=pem_of(a.vkey))
    print(json.dumps({"ok": r.ok, "tree_size": r.tree_size, "leaf_index": r.leaf_index,
                      "root": r.root, "errors": r.errors}))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
