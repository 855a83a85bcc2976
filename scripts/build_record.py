#!/usr/bin/env python3
"""Writes the build record of an enclave build (scripts/build-eif.sh), and reads PCRs from nitro-cli's output.

    build_record.py write --out DIR/build-record.json --binary FILE --model-dir DIR \
        --stage-policy FILE --layers 0..3,3..6 [--image NAME] [--nitro-output FILE] ...
    build_record.py pcrs NITRO_CLI_OUTPUT   # the policy's pcrN = "..." lines

The record says what was built from what, so that anyone who rebuilds the
same commit can compare: the enclave binary's sha256; the inputs' digests
(Cargo.lock, the Dockerfile, every model file as copied into the image, the
manifest, the in-enclave policy); the toolchain (`rustc -vV`, `cargo -V`,
the musl C compiler, the target, the features, RUSTFLAGS with the machine's
paths replaced by their names); the source commit and SOURCE_DATE_EPOCH; the
pipeline the image runs (layers, CMD); where an image was built, its layers'
digests (`RootFS.Layers`, the uncompressed layer tars); where nitro-cli ran,
its version and PCR0/1/2 (PCR8 when signed); for a `build-eif.sh
--debug-policy` image (first bring-up only), stage_policy.debug_policy. Paths on the build machine are
left out, so two builds of one commit in different folders write the same
record. `gateway policy from-build` writes a client policy from it.
The JSON has sorted keys and no time of writing.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys

FORMAT = "enclave-stage build record v1"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def command_output(args):
    """A command's stdout, stripped; None when it cannot run."""
    try:
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def nitro_pcrs(path):
    """PCR0/1/2 (and PCR8 when present) from nitro-cli build-enclave's output
    (text with one JSON object), lower-case hex; exits with a message when
    the output is not that."""
    text = open(path).read()
    start = text.find("{")
    if start < 0:
        sys.exit(f"{path}: no JSON object in nitro-cli's output")
    try:
        m = json.JSONDecoder().raw_decode(text[start:])[0]["Measurements"]
    except (ValueError, KeyError, TypeError) as e:
        sys.exit(f"{path}: not nitro-cli build-enclave output ({e!r})")
    out = {}
    for k in ("PCR0", "PCR1", "PCR2", "PCR8"):
        v = m.get(k)
        if v is None:
            if k == "PCR8":
                continue
            sys.exit(f"{path}: no {k} in Measurements")
        if not re.fullmatch(r"[0-9a-fA-F]{96}", v):
            sys.exit(f"{path}: {k} is not 96 hex digits (SHA-384)")
        out[k.lower()] = v.lower()
    return out


def model_files(model_dir):
    """Every file under the model folder (as `cp -rL` copies it into the
    image), by its path relative to the folder, with its sha256."""
    files = {}
    for root, dirs, names in os.walk(model_dir, followlinks=True):
        dirs.sort()
        for n in sorted(names):
            full = os.path.join(root, n)
            files[os.path.relpath(full, model_dir)] = sha256_file(full)
    return files


def image_layers(image):
    out = command_output(["docker", "image", "inspect", "-f", "{{json .RootFS.Layers}}", image])
    if out is None:
        sys.exit(f"docker image inspect {image} failed")
    return json.loads(out)


def layer_ranges(spec):
    return [[int(a), int(b)] for a, b in (r.split("..") for r in spec.split(","))]


def write(a):
    rustc = command_output(["rustc", "-vV"])
    if rustc is None:
        sys.exit("rustc -vV failed")
    musl = command_output(["dpkg-query", "-W", "-f", "${Version}", "musl-tools"])
    record = {
        "format": FORMAT,
        "source": {
            "commit": a.commit or None,
            "dirty": {"yes": True, "no": False}.get(a.dirty),
            "source_date_epoch": int(a.source_date_epoch),
        },
        "build": {
            "command": a.command,
            "target": a.target,
            "features": a.features.split(",") if a.features else [],
            "rustflags": a.rustflags,
            "cflags": a.cflags,
            "rustc": rustc.splitlines(),
            "cargo": command_output(["cargo", "-V"]),
            "cc": (command_output([a.cc, "--version"]) or "").splitlines()[:1],
            "musl_tools": musl,
        },
        "binary": {"file": "enclave-stage", "sha256": sha256_file(a.binary)},
        "inputs": {
            "Cargo.lock": sha256_file("Cargo.lock"),
            "docker/enclave-stage.Dockerfile": sha256_file("docker/enclave-stage.Dockerfile"),
        },
        "model": {
            "name": os.path.basename(os.path.normpath(a.model_dir)),
            "manifest_sha256": sha256_file(os.path.join(a.model_dir, "manifest.json")),
            "files": model_files(a.model_dir),
        },
        "stage_policy": {
            "path_in_image": "/config/policy.toml",
            "sha256": sha256_file(a.stage_policy),
        },
        "pipeline": {"layers": layer_ranges(a.layers), "cmd": json.loads(a.cmd) if a.cmd else None},
    }
    if a.debug_policy:
        # build-eif.sh --debug-policy: the in-enclave policy accepts
        # debug-mode neighbours (a first bring-up image, never production).
        record["stage_policy"]["debug_policy"] = True
    if a.image:
        record["image"] = {"layers": image_layers(a.image)}
    if a.nitro_output:
        record["nitro"] = {"nitro_cli": a.nitro_cli_version or None, **nitro_pcrs(a.nitro_output)}
    with open(a.out, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    w = sub.add_parser("write", help="write a build record")
    w.add_argument("--out", required=True)
    w.add_argument("--binary", required=True)
    w.add_argument("--model-dir", required=True)
    w.add_argument("--stage-policy", required=True)
    w.add_argument("--layers", required=True)
    w.add_argument("--cmd", default="", help="the enclave's CMD as JSON")
    w.add_argument("--commit", default="")
    w.add_argument("--dirty", default="", choices=["", "yes", "no"])
    w.add_argument("--source-date-epoch", required=True)
    w.add_argument("--command", required=True, help="the cargo command, without machine paths")
    w.add_argument("--target", required=True)
    w.add_argument("--features", default="")
    w.add_argument("--rustflags", default="")
    w.add_argument("--cflags", default="")
    w.add_argument("--cc", default="musl-gcc")
    w.add_argument("--image", default="", help="a docker image whose layers to record")
    w.add_argument("--nitro-output", default="", help="nitro-cli build-enclave's output")
    w.add_argument("--nitro-cli-version", default="")
    w.add_argument("--debug-policy", action="store_true",
                   help="build-eif.sh --debug-policy: the image accepts debug-mode enclaves")
    r = sub.add_parser("pcrs", help="print a policy's pcrN lines from nitro-cli's output")
    r.add_argument("file")
    a = p.parse_args()
    if a.verb == "pcrs":
        for k, v in nitro_pcrs(a.file).items():
            print(f'{k} = "{v}"')
    else:
        write(a)


if __name__ == "__main__":
    main()
