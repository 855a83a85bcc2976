#!/usr/bin/env python3
"""The self-test of scripts/tlog_verify.py, which `tlog_verify.py --self-test` runs (this file also runs alone).

No network but localhost. What it checks:

- signed-note: the Go sumdb note test vectors (golang.org/x/mod/sumdb/note
  note_test.go) and C2SP signed-note's example, and their manglings;
  tlog-checkpoint texts.
- tlog-cosignature: a fixed cosignature/v1 vector (seed 32 x 0x02, name
  w.example/1, time 1679315147, tlog-cosignature's example checkpoint; its
  vkey and line printed and asserted as constants, Ed25519 being
  deterministic, to compare with other implementations); the signed message
  against the spec's example; the timestamp and key id of the spec's example
  line.
- tile-built inclusion and consistency proofs and their verifiers against a
  naive recursive RFC 6962 Merkle tree for every size 1..1000 (all pairs for
  small sizes, the tile edges and a seeded random sample elsewhere).
- whole runs against small static logs served by http.server in a thread:
  good logs (sizes 0, 1, 256, 257, 300; gzipped; with an unknown
  cosignature; partial tiles gone after the log grew; a state that grew),
  and refused ones: a flipped byte in a level-0 and a level-1 tile, a
  tampered entry, an extra entry, a root of another size, a checkpoint
  signed by another key, a tampered checkpoint, a vkey whose key id does
  not match, another origin, a missing tile, a shrunk and a forked state,
  an inclusion index past the end.
- witnesses (--witness, --quorum) on those logs, with witness keys made
  here: a quorum met (all listed; 2 of 3; an unlisted and a same-name
  other-key line beside them), a quorum not met (the message naming found
  vs needed), a cosignature moved to another checkpoint, a timestamp
  altered, one witness's two cosignatures counted once, a forged line
  still refused with --quorum 0, a timestamp over 2^63 - 1, a cosignature
  of the wrong length, a witness with the same name but another key ignored
  (it does not count), a 0x01 vkey refused as a witness key, a witness vkey
  whose key id does not match, a witness listed twice, a --quorum above the
  witnesses; and the command line itself (--witness, --quorum, --json; exit
  0, 1 and 2).
"""

import functools
import gzip
import hashlib
import http.server
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tlog_verify import (
    EM_DASH,
    EMPTY_ROOT,
    HASH_SIZE,
    SIG_TYPE_COSIGNATURE_V1,
    SIG_TYPE_ED25519,
    TILE_WIDTH,
    Failure,
    b64,
    b64decode_strict,
    check_consistency,
    consistency_path,
    cosignature_message,
    inclusion_path,
    key_id,
    leaf_hash,
    open_note,
    parse_checkpoint,
    parse_cosignature,
    parse_vkey,
    parse_witnesses,
    split_note,
    subtree_hash_from_tiles,
    tile_name,
    tiles_of_level,
    tree_root,
    verify_consistency_rfc9162,
    verify_cosignatures,
    verify_inclusion_rfc9162,
    verify_log,
)

VERIFIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tlog_verify.py")

GO_NOTE_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_NOTE_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
GO_NOTE_TEXT = ("If you think cryptography is the answer to your problem,\n"
                "then you don't know what your problem is.\n")
GO_PETER_SIG = ("\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXg"
                "KvqfqdngotpRZb6KE6RyyBwJnAM=\n")
GO_ENOCH_SIG = ("\u2014 EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTG"
                "wnWLox33WWd1RvMc+QQ=\n")
C2SP_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
C2SP_NOTE = ("This is an example message.\n\n\u2014 example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi"
             "2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n")


def expect(condition, what):
    """Raises AssertionError(what) unless condition holds."""
    if not condition:
        raise AssertionError(what)


def expect_failure(call, contains, what):
    """call() must raise Failure whose message holds `contains`; returns the message."""
    try:
        call()
    except Failure as e:
        expect(contains in str(e), f"{what}: failed with {str(e)!r}, not with {contains!r}")
        return str(e)
    raise AssertionError(f"{what}: passed, should have failed")


def make_vkey(name, private_key):
    """The signed-note vkey of an Ed25519 private key under a name."""
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{name}+{key_id(name, SIG_TYPE_ED25519, public).hex()}+{b64(bytes([SIG_TYPE_ED25519]) + public)}"


def sign_note(text, name, private_key):
    """A signature line by private_key under name over the note text."""
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signature = private_key.sign(text.encode("utf-8"))
    return f"{EM_DASH} {name} {b64(key_id(name, SIG_TYPE_ED25519, public) + signature)}\n"


def make_witness_vkey(name, private_key):
    """The tlog-cosignature vkey (type 0x04) of an Ed25519 private key under a name."""
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    kid = key_id(name, SIG_TYPE_COSIGNATURE_V1, public)
    return f"{name}+{kid.hex()}+{b64(bytes([SIG_TYPE_COSIGNATURE_V1]) + public)}"


def cosign(text, name, private_key, timestamp):
    """A cosignature/v1 line by private_key under name over the checkpoint text at timestamp."""
    public = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signature = private_key.sign(cosignature_message(text, timestamp))
    blob = key_id(name, SIG_TYPE_COSIGNATURE_V1, public) + timestamp.to_bytes(8, "big") + signature
    return f"{EM_DASH} {name} {b64(blob)}\n"


# tlog-cosignature's example checkpoint, cosigned at its example time by a
# key made from a fixed seed: Ed25519 is deterministic, so these are constants
# another implementation must reproduce.
FIXED_SEED = bytes([0x02]) * 32
FIXED_NAME = "w.example/1"
FIXED_TIME = 1679315147
FIXED_CHECKPOINT = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
FIXED_VKEY = "w.example/1+c9fde0ca+BIE5dw6ofRdfVqNUZsNMfszLjYqRtO43ol32D1uPybOU"
FIXED_LINE = ("\u2014 w.example/1 yf3gygAAAABkGFDLUwBLV8e4tjvb6qEHiNTQjDZIX+7tvd038taw9A7W/cQ7ZhSah0uJMOI6CTPez5qwHtE49"
              "MrkWhU349mtYmi3Dw==\n")
# The spec's signed message for that checkpoint and time, as tlog-cosignature prints it.
SPEC_MESSAGE = (b"cosignature/v1\ntime 1679315147\nexample.com/behind-the-sofa\n20852163\n"
                b"CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n")
# The witness line of tlog-cosignature's example note (its key is not published).
SPEC_WITNESS_LINE = ("\u2014 witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJs"
                     "X3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==")


def self_test_fixed_cosignature():
    """The fixed cosignature/v1 vector, printed once and held to its constants; the spec's example line."""
    key = Ed25519PrivateKey.from_private_bytes(FIXED_SEED)
    vkey = make_witness_vkey(FIXED_NAME, key)
    line = cosign(FIXED_CHECKPOINT, FIXED_NAME, key, FIXED_TIME)
    print(f"tlog_verify: self-test fixed cosignature/v1 vector (seed 32 x 0x02, time {FIXED_TIME}):")
    print(f"tlog_verify:   vkey {vkey}")
    print(f"tlog_verify:   line {line.rstrip()}")
    expect(cosignature_message(FIXED_CHECKPOINT, FIXED_TIME) == SPEC_MESSAGE, "signed message differs from the spec's")
    expect(vkey == FIXED_VKEY, f"fixed witness vkey {vkey} is not {FIXED_VKEY}")
    expect(line == FIXED_LINE, f"fixed cosignature line {line!r} is not {FIXED_LINE!r}")
    note = FIXED_CHECKPOINT + "\n" + FIXED_LINE
    text, signatures = split_note(note.encode())
    result = verify_cosignatures(text, signatures, parse_witnesses([FIXED_VKEY]), 1)
    expect(result["cosigned"] == [{"name": FIXED_NAME, "key_id": "c9fde0ca", "timestamp": FIXED_TIME}],
           f"fixed vector: {result}")
    # The spec's example line: key id, then the big-endian timestamp of its example message.
    (name, kid, signature), = split_note(("x\n\n" + SPEC_WITNESS_LINE + "\n").encode())[1]
    expect((name, kid.hex()) == ("witness.example.com/w1", "8d66cf3f"), "the spec's witness line: name, key id")
    expect(parse_cosignature(signature, name)[0] == FIXED_TIME, "the spec's witness line: timestamp")


def self_test_notes():
    """The Go sumdb note vectors and C2SP signed-note's example, their manglings, and checkpoint texts."""
    seed = b64decode_strict(GO_NOTE_SKEY.split("+", 4)[4], "Go skey")[1:]
    peter = Ed25519PrivateKey.from_private_bytes(seed)
    expect(make_vkey("PeterNeumann", peter) == GO_NOTE_VKEY, "Go skey's public key is not Go's vkey")
    expect(GO_NOTE_TEXT + "\n" + sign_note(GO_NOTE_TEXT, "PeterNeumann", peter) == GO_NOTE_TEXT + "\n" + GO_PETER_SIG,
           "signing Go's text does not give Go's signed note")
    note = (GO_NOTE_TEXT + "\n" + GO_PETER_SIG).encode()
    expect(open_note(note, GO_NOTE_VKEY) == GO_NOTE_TEXT, "Go's signed note does not open")
    both = (GO_NOTE_TEXT + "\n" + GO_PETER_SIG + GO_ENOCH_SIG).encode()
    expect(open_note(both, GO_NOTE_VKEY) == GO_NOTE_TEXT, "Peter's key, Enoch's line ignored")
    expect(open_note(both, GO_ENOCH_VKEY) == GO_NOTE_TEXT, "Enoch's key, Peter's line ignored")
    expect(open_note(C2SP_NOTE.encode(), C2SP_VKEY) == "This is an example message.\n", "C2SP example")
    expect_failure(lambda: open_note(note.replace(b"cryptography", b"Cryptography"), GO_NOTE_VKEY),
                   "does not verify", "tampered Go note")
    expect_failure(lambda: open_note(note, GO_ENOCH_VKEY), "no signature", "Go note, another key")
    expect_failure(lambda: parse_vkey(GO_NOTE_VKEY.replace("c74f20a3", "c74f20a4")), "key id", "vkey id mangled")
    expect_failure(lambda: parse_vkey("PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"),
                   "Ed25519", "Go's unknown-algorithm vkey")
    expect_failure(lambda: open_note(note.replace(b"\n\n", b"\n"), GO_NOTE_VKEY), "blank line", "no blank line")
    expect_failure(lambda: open_note(note + b"\x07\n", GO_NOTE_VKEY), "control", "control character")
    # The note text may hold blank lines; the signatures start after the last one.
    key = Ed25519PrivateKey.generate()
    text = "a\n\nb\n"
    expect(open_note((text + "\n" + sign_note(text, "k", key)).encode(), make_vkey("k", key)) == text,
           "a note text with a blank line")
    # A line with Peter's name but another key id is someone else's: ignored.
    other = sign_note(GO_NOTE_TEXT, "PeterNeumann", Ed25519PrivateKey.generate())
    expect(open_note((GO_NOTE_TEXT + "\n" + other + GO_PETER_SIG).encode(), GO_NOTE_VKEY) == GO_NOTE_TEXT,
           "same name, other key id is not ignored")
    # tlog-checkpoint text.
    root = b64(EMPTY_ROOT)
    expect(parse_checkpoint(f"o\n0\n{root}\n") == ("o", 0, EMPTY_ROOT), "checkpoint of the empty tree")
    expect_failure(lambda: parse_checkpoint(f"o\n1\n{root}\next\n"), "extension", "extension line")
    expect_failure(lambda: parse_checkpoint(f"o\n01\n{root}\n"), "leading zeros", "size 01")
    expect_failure(lambda: parse_checkpoint(f"o\n1\n{root[:-4]}\n"), "not 32", "short root")
    expect_failure(lambda: parse_checkpoint(f"o\n1\n{root}"), "not origin, size", "no final newline")


@functools.cache
def naive_mth(entries, start, end):
    """RFC 6962 §2.1 MTH(D[start:end]) by its recursive definition (entries: a tuple of bytes)."""
    n = end - start
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return hashlib.sha256(b"\x00" + entries[start]).digest()
    k = 1
    while k * 2 < n:
        k *= 2
    return hashlib.sha256(b"\x01" + naive_mth(entries, start, start + k) + naive_mth(entries, start + k, end)).digest()


def naive_tiles(entries, size):
    """The hash tiles of the tree D[0:size] by tlog-tiles' formula.

    Hash i of tile n at level l is MTH(D[(n*256+i)*256**l : (n*256+i+1)*256**l]).
    """
    tiles = {}
    level = 0
    while size // TILE_WIDTH ** level:
        span = TILE_WIDTH ** level
        for index, width in tiles_of_level(size, level):
            first = index * TILE_WIDTH
            tiles[(level, index)] = b"".join(naive_mth(entries, (first + i) * span, (first + i + 1) * span)
                                             for i in range(width))
        level += 1
    return tiles


def check_proofs_at(entries, size, tiles, indices, old_sizes):
    """Inclusion and consistency proofs of one tree size, from tiles, against the naive tree; returns the count."""
    root = naive_mth(entries, 0, size)
    from_tiles = functools.partial(subtree_hash_from_tiles, tiles)
    naive = functools.partial(naive_mth, entries)
    checked = 0
    for index in indices:
        leaf = naive_mth(entries, index, index + 1)
        path = inclusion_path(index, 0, size, from_tiles)
        expect(path == inclusion_path(index, 0, size, naive), f"inclusion {index}/{size}: tiles differ from naive")
        expect(verify_inclusion_rfc9162(index, size, leaf, path, root), f"inclusion {index}/{size} fails")
        expect(not verify_inclusion_rfc9162(index, size, leaf[::-1], path, root), f"inclusion {index}/{size}: bad leaf")
        if path:
            bad = [path[0][:-1] + bytes([path[0][-1] ^ 1])] + path[1:]
            expect(not verify_inclusion_rfc9162(index, size, leaf, bad, root), f"inclusion {index}/{size}: bad path")
            if index ^ 1 < size:
                expect(not verify_inclusion_rfc9162(index ^ 1, size, leaf, path, root),
                       f"inclusion {index}/{size}: sibling's index")
        checked += 1
    for old in old_sizes:
        old_root = naive_mth(entries, 0, old)
        path = consistency_path(old, size, from_tiles)
        expect(path == consistency_path(old, size, naive), f"consistency {old}->{size}: tiles differ from naive")
        expect(check_consistency(old, size, old_root, root, path), f"consistency {old}->{size} fails")
        expect(not check_consistency(old, size, old_root[::-1], root, path), f"consistency {old}->{size}: bad old")
        if path:
            bad = path[:-1] + [path[-1][:-1] + bytes([path[-1][-1] ^ 1])]
            expect(not check_consistency(old, size, old_root, root, bad), f"consistency {old}->{size}: bad path")
        checked += 1
    return checked


def self_test_merkle(rng):
    """Roots, tiles and proofs for every size 1..1000 against the naive recursive tree; returns the proof count."""
    entries = tuple(f"entry {i}".encode() for i in range(1000))
    leaf_hashes = [leaf_hash(e) for e in entries]
    edges = {1, 2, 3, 255, 256, 257, 511, 512, 513, 767, 768, 769, 999, 1000}
    proofs = 0
    for size in range(1, 1001):
        root = naive_mth(entries, 0, size)
        expect(tree_root(leaf_hashes[:size]) == root, f"tree_root({size}) differs from the naive MTH")
        tiles = naive_tiles(entries, size)
        expect(subtree_hash_from_tiles(tiles, 0, size) == root, f"root from tiles at size {size}")
        if size <= 40:
            indices, olds = range(size), range(1, size + 1)
        elif size in edges:
            picks = {0, size - 1, size // 2} | {i for i in (255, 256, 257, 511, 512) if i < size}
            indices = sorted(picks | set(rng.sample(range(size), 8)))
            olds = sorted({1, size, size - 1} | {o for o in (255, 256, 257, 512) if o <= size}
                          | set(rng.sample(range(1, size + 1), 8)))
        else:
            indices, olds = [rng.randrange(size)], [rng.randrange(1, size + 1)]
        proofs += check_proofs_at(entries, size, tiles, indices, olds)
    expect(tree_root([]) == EMPTY_ROOT and check_consistency(0, 5, EMPTY_ROOT, b"", []), "empty tree")
    expect(not check_consistency(0, 5, leaf_hashes[0], b"", []), "an empty tree with another root")
    # Proofs that hash up to a real root but claim the wrong tree size (RFC 9162 §2.1.3.2 steps 4a and 5).
    h0, h1, two = leaf_hashes[0], leaf_hashes[1], naive_mth(entries, 0, 2)
    expect(verify_inclusion_rfc9162(1, 2, h1, [h0], two), "leaf 1 of 2")
    expect(not verify_inclusion_rfc9162(0, 1, h1, [h0], two), "leaf 1 of 2 claimed as leaf 0 of 1 (step 4a)")
    expect(not verify_inclusion_rfc9162(0, 3, h0, [h1], two), "leaf 0 of 2 claimed in a tree of 3 (step 5)")
    expect(not verify_inclusion_rfc9162(2, 2, h0, [h1], two), "leaf 0 of 2 claimed as leaf 2 of 2 (step 1)")
    path = consistency_path(3, 7, functools.partial(naive_mth, entries))
    expect(not verify_consistency_rfc9162(3, 7, naive_mth(entries, 0, 3), naive_mth(entries, 0, 7), path + [h0]),
           "consistency 3->7 with a hash too many")
    return proofs


def write_static_log(directory, entries, private_key, origin, extra_lines="", text=None, cosigners=()):
    """Writes a log's checkpoint, entry bundles and hash tiles as files below directory (the prefix).

    The checkpoint is signed by private_key under the name origin, then
    cosigned by each (name, private key, timestamp) of cosigners, with
    extra_lines after those signatures; text replaces its true text.
    """
    size = len(entries)
    entries_tuple = tuple(entries)
    files = {}
    for index, width in tiles_of_level(size, 0):
        chunk = entries[index * TILE_WIDTH:index * TILE_WIDTH + width]
        files[f"tile/{tile_name('entries', index, width)}"] = b"".join(len(e).to_bytes(2, "big") + e for e in chunk)
    for (level, index), data in naive_tiles(entries_tuple, size).items():
        files[f"tile/{tile_name(level, index, len(data) // HASH_SIZE)}"] = data
    root = naive_mth(entries_tuple, 0, size)
    text = text or f"{origin}\n{size}\n{b64(root)}\n"
    cosignatures = "".join(cosign(text, name, key, timestamp) for name, key, timestamp in cosigners)
    files["checkpoint"] = (text + "\n" + sign_note(text, origin, private_key) + cosignatures + extra_lines).encode()
    for path, data in files.items():
        full = os.path.join(directory, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data)
    return files


def read_bytes(path):
    """A file's bytes."""
    with open(path, "rb") as f:
        return f.read()


def flip_byte(path, offset):
    """Flips the low bit of one byte of a file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    """A static file handler that does not log each request."""

    def log_message(self, *args):
        pass


class GzipHandler(QuietHandler):
    """Serves every file gzipped, unasked (tlog-tiles: "Logs MAY use Content-Encoding: gzip with no negotiation")."""

    def do_GET(self):
        """The file at the path, gzipped, or 404."""
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:
            body = gzip.compress(f.read())
        self.send_response(200)
        self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_directory(directory, handler_class=QuietHandler):
    """Serves directory on 127.0.0.1 from a daemon thread; returns (server, base URL)."""
    handler = functools.partial(handler_class, directory=directory)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def self_test_served(root_dir, url, gzip_url):
    """Whole runs of verify_log against static logs: good ones and tampered ones."""
    origin = "example.com/tlog-verify-self-test"
    key = Ed25519PrivateKey.generate()
    vkey = make_vkey(origin, key)
    entries = [bytes([i % 251]) * (i % 7) + f"entry {i}".encode() for i in range(300)]
    fork = entries[:100] + [b"forked"] + entries[101:200]

    def log(name, log_entries, **kwargs):
        """Writes one static log under root_dir/name and returns its prefix URL."""
        write_static_log(os.path.join(root_dir, name, "v1/transparency"), log_entries, key, origin, **kwargs)
        return f"{url}/{name}/v1/transparency"

    good = log("good", entries)
    result = verify_log(good, vkey, inclusion=299, consistency=37)
    expect(result["size"] == 300 and len(result["entries"]) == 300, "good log: entries")
    expect(result["entries"][5]["bytes"] == entries[5].hex(), "good log: entry bytes")
    expect(result["tiles_checked"] == 3, "good log: 2 level-0 tiles and 1 level-1 tile")
    expect(verify_log(f"{gzip_url}/good/v1/transparency", vkey)["entries"] == result["entries"], "gzipped")
    for size in (0, 1, 256, 257):
        verify_log(log(f"size{size}", entries[:size]), vkey)
    # A checkpoint at 300 after the log reached 512: level 0's partial tiles
    # of width 44 are gone, the full ones are read instead.
    later = log("later", entries)
    log("later", entries + [b"more"] * 212, text=f"{origin}\n300\n{b64(naive_mth(tuple(entries), 0, 300))}\n")
    for gone in ("tile/0/001.p/44", "tile/entries/001.p/44"):
        os.remove(os.path.join(root_dir, "later/v1/transparency", gone))
    expect(verify_log(later, vkey)["entries"] == result["entries"], "partial tiles read from full ones")
    other_key = Ed25519PrivateKey.generate()
    cosigned = log("cosigned", entries, extra_lines=sign_note("x", "witness.example", other_key))
    verify_log(cosigned, vkey)

    messages = [expect_failure(lambda: verify_log(good, vkey, inclusion=300), "--inclusion 300", "index 300 of 300")]
    state = os.path.join(root_dir, "state")
    verify_log(log("first100", entries[:100]), vkey, state_path=state)
    result = verify_log(good, vkey, state_path=state, consistency=100)
    expect(result["state_consistency"]["old_size"] == 100, "state: grown from 100")
    expect(read_bytes(state) == read_bytes(os.path.join(root_dir, "good/v1/transparency/checkpoint")),
           "state: the new checkpoint is stored")
    verify_log(good, vkey, state_path=state)  # the same checkpoint again
    messages.append(expect_failure(lambda: verify_log(log("shrunk", entries[:200]), vkey, state_path=state),
                                   "log shrank", "shrunk log"))
    fork_state = os.path.join(root_dir, "fork-state")
    verify_log(log("first150", entries[:150]), vkey, state_path=fork_state)
    messages.append(expect_failure(lambda: verify_log(log("fork200", fork), vkey, state_path=fork_state),
                                   "fork: the stored checkpoint's root for size 150", "forked log"))

    bad = log("bad-tile0", entries)
    flip_byte(os.path.join(root_dir, "bad-tile0/v1/transparency/tile/0/000"), 17 * 32 + 5)
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "tile 0/000 hash 17 differs from entry 17's",
                                   "flipped level-0 tile byte"))
    bad = log("bad-tile1", entries)
    flip_byte(os.path.join(root_dir, "bad-tile1/v1/transparency/tile/1/000.p/1"), 0)
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "tile 1/000.p/1 hash 0", "flipped level-1 byte"))
    bad = log("bad-entry", entries)
    flip_byte(os.path.join(root_dir, "bad-entry/v1/transparency/tile/entries/001.p/44"), 2)
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "tile 0/001.p/44 hash 0 differs from entry 256's",
                                   "tampered entry"))
    root300 = b64(naive_mth(tuple(entries), 0, 300))
    bad = log("bad-root", entries[:299], text=f"{origin}\n299\n{root300}\n")
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "root for size 299", "root of another size"))
    bad = log("bad-body", entries)
    path = os.path.join(root_dir, "bad-body/v1/transparency/checkpoint")
    data = read_bytes(path)
    with open(path, "wb") as f:
        f.write(data.replace(b"\n300\n", b"\n301\n"))
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "does not verify", "tampered checkpoint body"))
    bad = log("other-key", entries)
    messages.append(expect_failure(lambda: verify_log(bad, make_vkey(origin, other_key)), "no signature by",
                                   "checkpoint signed by another key"))
    renamed = vkey.replace(origin, "example.com/another-log", 1)  # the key id no longer matches
    messages.append(expect_failure(lambda: verify_log(good, renamed), "key id", "vkey with another name"))
    bad = log("other-origin", entries, text=f"example.com/another-log\n300\n{root300}\n")
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "checkpoint origin",
                                   "checkpoint of another origin signed by this key"))
    bad = log("extra-entry", entries)
    with open(os.path.join(root_dir, "extra-entry/v1/transparency/tile/entries/001.p/44"), "ab") as f:
        f.write(b"\x00\x01x")
    messages.append(expect_failure(lambda: verify_log(bad, vkey), "holds 45 entries, want 44", "extra entry"))
    os.remove(os.path.join(root_dir, "good/v1/transparency/tile/1/000.p/1"))
    messages.append(expect_failure(lambda: verify_log(good, vkey), "HTTP 404", "missing tile"))
    return messages + self_test_witnesses(log, vkey, entries, origin)


def key_handle(vkey):
    """A vkey's `<name>+<key id>`, as the verifier's messages name a key (its base64 may hold '+')."""
    return "+".join(vkey.split("+", 2)[:2])


def checkpoint_lines(url):
    """The signature lines of the checkpoint a static log serves, by the log's prefix URL."""
    with urllib.request.urlopen(f"{url}/checkpoint") as response:
        return response.read().decode().split("\n\n")[-1].splitlines(keepends=True)


def self_test_witnesses(log, vkey, entries, origin):
    """--witness and --quorum against cosigned copies of the served test logs; returns the refusals' messages."""
    names = [f"witness.example/w{i}" for i in range(1, 5)]
    keys = [Ed25519PrivateKey.generate() for _ in names]
    wvkeys = [make_witness_vkey(name, key) for name, key in zip(names, keys)]
    t0 = 1_700_000_000
    three = [(names[i], keys[i], t0 + i) for i in range(3)]
    stranger = Ed25519PrivateKey.generate()
    unlisted = sign_note("x", "witness.example/unlisted", stranger)  # not a listed key: ignored

    cosigned = log("w-cosigned", entries, cosigners=three, extra_lines=unlisted)
    result = verify_log(cosigned, vkey, witnesses=wvkeys[:3], inclusion=7)
    expect(result["witnesses"] == {"quorum": 3, "listed": 3, "cosigned": [
        {"name": names[i], "key_id": wvkeys[i].split("+")[1], "timestamp": t0 + i} for i in range(3)]},
        f"three witnesses: {result['witnesses']}")
    result = verify_log(cosigned, vkey, witnesses=[wvkeys[3], wvkeys[0], wvkeys[2]], quorum=2)
    expect([w["name"] for w in result["witnesses"]["cosigned"]] == [names[0], names[2]], "2 of 3, listed order")
    expect("witnesses" not in verify_log(cosigned, vkey), "no --witness: no witness check")
    # A witness's name with another key (so another key id) is someone else's line: ignored, and it does not count.
    impostor = cosign(f"{origin}\n{len(entries)}\n{b64(tree_root([leaf_hash(e) for e in entries]))}\n",
                      names[0], stranger, t0)
    impostor_log = log("w-impostor", entries, cosigners=three[1:], extra_lines=impostor)
    verify_log(impostor_log, vkey, witnesses=wvkeys[1:3])
    messages = [expect_failure(lambda: verify_log(impostor_log, vkey, witnesses=wvkeys[:3]),
                               "witness quorum not met: 2 of the 3 listed witnesses cosigned the checkpoint, 3 needed",
                               "same name, another key: does not count")]
    messages.append(expect_failure(lambda: verify_log(cosigned, vkey, witnesses=wvkeys),
                                   "3 of the 4 listed witnesses cosigned the checkpoint, 4 needed", "quorum not met"))
    one = log("w-one", entries[:299], cosigners=three[:1])
    messages.append(expect_failure(lambda: verify_log(one, vkey, witnesses=wvkeys[:3], quorum=2),
                                   f"1 of the 3 listed witnesses cosigned the checkpoint, 2 needed (no valid "
                                   f"cosignature from {key_handle(wvkeys[1])}", "quorum 2, one cosigner"))
    # Two cosignatures by one witness count once; its latest time is reported.
    twice = log("w-twice", entries, cosigners=[(names[0], keys[0], t0 + 5), (names[0], keys[0], t0 + 9)])
    result = verify_log(twice, vkey, witnesses=wvkeys[:2], quorum=1)
    expect(result["witnesses"]["cosigned"] == [{"name": names[0], "key_id": wvkeys[0].split("+")[1],
                                                "timestamp": t0 + 9}], f"one witness twice: {result['witnesses']}")
    messages.append(expect_failure(lambda: verify_log(twice, vkey, witnesses=wvkeys[:2]),
                                   "1 of the 2 listed witnesses cosigned the checkpoint, 2 needed",
                                   "one witness's two cosignatures counted twice"))
    # A cosignature of the 300-entry checkpoint put on the 299-entry one.
    w1_line = [line for line in checkpoint_lines(cosigned) if line.startswith(f"{EM_DASH} {names[0]} ")]
    expect(len(w1_line) == 1, "w1's line")
    moved = log("w-moved", entries[:299], cosigners=three[1:], extra_lines=w1_line[0])
    messages.append(expect_failure(lambda: verify_log(moved, vkey, witnesses=wvkeys[:3], quorum=2),
                                   f"cosignature by witness {key_handle(wvkeys[0])} (time {t0}) does not verify",
                                   "cosignature moved to another checkpoint"))
    # The same line with its timestamp one second later.
    blob = bytearray(b64decode_strict(w1_line[0].split(" ")[2].strip(), "w1's line"))
    blob[4:12] = (t0 + 1).to_bytes(8, "big")
    retimed_line = f"{EM_DASH} {names[0]} {b64(bytes(blob))}\n"
    retimed = log("w-retimed", entries, cosigners=three[1:], extra_lines=retimed_line)
    messages.append(expect_failure(lambda: verify_log(retimed, vkey, witnesses=wvkeys[:3], quorum=1),
                                   f"(time {t0 + 1}) does not verify", "timestamp altered"))
    messages.append(expect_failure(lambda: verify_log(retimed, vkey, witnesses=wvkeys[:1], quorum=0),
                                   "does not verify", "a forged line with --quorum 0"))
    verify_log(retimed, vkey, witnesses=wvkeys[1:3])  # witnesses that do not include w1 ignore its line
    late = log("w-late", entries, cosigners=[(names[0], keys[0], 1 << 63)])
    messages.append(expect_failure(lambda: verify_log(late, vkey, witnesses=wvkeys[:1]), "over 2^63 - 1",
                                   "timestamp 2^63"))
    verify_log(log("w-max", entries, cosigners=[(names[0], keys[0], (1 << 63) - 1)]), vkey, witnesses=wvkeys[:1])
    short_line = f"{EM_DASH} {names[0]} {b64(bytes(blob[:4]) + bytes(blob[12:]))}\n"  # no timestamp
    short = log("w-short", entries, extra_lines=short_line)
    messages.append(expect_failure(lambda: verify_log(short, vkey, witnesses=wvkeys[:1]), "not 72",
                                   "cosignature without its timestamp"))
    # Witness keys themselves.
    messages.append(expect_failure(lambda: verify_log(cosigned, vkey, witnesses=[make_vkey(names[0], keys[0])]),
                                   "key is not 0x04", "a 0x01 vkey as a witness key"))
    kid = wvkeys[0].split("+")[1]
    bad_kid = wvkeys[0].replace(f"+{kid}+", f"+{int(kid, 16) ^ 1:08x}+", 1)
    messages.append(expect_failure(lambda: verify_log(cosigned, vkey, witnesses=[bad_kid]),
                                   "key id", "witness vkey with a key id that does not match"))
    messages.append(expect_failure(lambda: verify_log(cosigned, vkey, witnesses=[wvkeys[0], wvkeys[0]]),
                                   "listed twice", "a witness listed twice"))
    messages.append(expect_failure(lambda: verify_log(cosigned, vkey, witnesses=wvkeys[:2], quorum=3),
                                   "--quorum 3", "quorum above the witnesses"))
    expect_failure(lambda: parse_vkey(wvkeys[0]), "key is not 0x01", "a witness key as the log's vkey")
    self_test_command_line(cosigned, vkey, wvkeys)
    return messages


def run_verifier(*args):
    """tlog_verify.py's command line in a child process: (exit status, stdout, stderr)."""
    child = subprocess.run([sys.executable, VERIFIER, *args], check=False, capture_output=True, text=True, timeout=120)
    return child.returncode, child.stdout, child.stderr


def self_test_command_line(url, vkey, wvkeys):
    """--witness, --quorum and --json as a shell passes them; exit 0 (OK), 1 (FAIL) and 2 (usage)."""
    witness_args = [arg for w in wvkeys for arg in ("--witness", w)]
    rc, out, err = run_verifier("--url", url, "--vkey", vkey, "--quorum", "3", "--json", *witness_args)
    expect(rc == 0, f"command line, quorum 3 of 4: exit {rc}: {err}")
    witnesses = json.loads(out)["witnesses"]
    expect((witnesses["quorum"], witnesses["listed"], len(witnesses["cosigned"])) == (3, 4, 3),
           f"command line --json witnesses: {witnesses}")
    rc, out, err = run_verifier("--url", url, "--vkey", vkey, *witness_args[:6])
    expect(rc == 0 and "3 of 3 witnesses cosigned (quorum 3)" in out, f"command line OK line: {rc} {out} {err}")
    rc, out, err = run_verifier("--url", url, "--vkey", vkey, *witness_args)
    expect(rc == 1 and err.startswith("tlog_verify: FAIL witness quorum not met: 3 of the 4") and "4 needed" in err,
           f"command line, quorum 4 of 4: exit {rc}: {err}")
    rc, out, err = run_verifier("--url", url, "--vkey", vkey, "--quorum", "5", *witness_args)
    expect(rc == 2 and "--quorum 5" in err, f"command line, --quorum 5 of 4: exit {rc}: {err}")


def self_test():
    """Runs every self-test; prints what it checked and how long it took."""
    started = time.monotonic()
    self_test_notes()
    self_test_fixed_cosignature()
    proofs = self_test_merkle(random.Random(49))
    with tempfile.TemporaryDirectory(prefix="tlog_verify-") as root_dir:
        server, url = serve_directory(root_dir)
        gzip_server, gzip_url = serve_directory(root_dir, GzipHandler)
        try:
            messages = self_test_served(root_dir, url, gzip_url)
        finally:
            for s in (server, gzip_server):
                s.shutdown()
                s.server_close()
    for message in messages:
        print(f"tlog_verify: self-test refused as expected: {message}")
    print(f"tlog_verify: self-test OK: note vectors; the cosignature/v1 vector; {proofs} tile-built proofs at "
          f"sizes 1..1000 against the naive tree; {len(messages)} bad logs, cosignatures, keys and requests "
          f"refused ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    self_test()
