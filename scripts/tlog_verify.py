#!/usr/bin/env python3
"""Verifies the gateway's transparency log from its HTTP paths alone, written
from the public specifications (C2SP signed-note, tlog-checkpoint, tlog-tiles;
RFC 6962 §2.1 and RFC 9162 §2.1), not from the gateway's Rust code.

    tlog_verify.py --url B --vkey VKEY [--state FILE] [--inclusion INDEX]
                   [--consistency OLD_SIZE] [--json]
    tlog_verify.py --self-test

B is the log's prefix (e.g. http://127.0.0.1:8080/v1/transparency), VKEY its
signed-note verifier key `<name>+<hex key id>+<base64(0x01 || pubkey)>`.

What is checked, and where the rule comes from:

- The checkpoint (`B/checkpoint`) is a signed note (c2sp.org/signed-note):
  UTF-8 without control characters other than newline; the text is split
  from the signature lines at the last blank line; each signature line is
  `— <name> <base64(key id || signature)>`. Lines from other keys (another
  name or another key id) are ignored; a line from VKEY that does not verify
  (Ed25519, RFC 8032, over the note text) rejects the note; at least one line
  from VKEY must verify. VKEY's key id must be SHA-256(name || 0x0A || 0x01 ||
  public key)[:4], as signed-note says for Ed25519.
- Its text is a tlog-checkpoint (c2sp.org/tlog-checkpoint): origin, decimal
  tree size without leading zeros, base64 root hash of 32 bytes. The origin
  must equal VKEY's name. Extension lines are refused: the gateway's log
  writes none.
- Every entry bundle (`B/tile/entries/<N>[.p/<W>]`, tlog-tiles "Log
  entries": big-endian uint16 length-prefixed entries) the tree holds is
  fetched; it must hold exactly its width of entries and nothing more. Each
  leaf hash is SHA-256(0x00 || entry) (RFC 6962 §2.1).
- Every hash tile (`B/tile/<L>/<N>[.p/<W>]`, tlog-tiles "Merkle Tree", height
  8) the tree holds is fetched: the full tiles and, at each level, the
  right-edge partial tile of width floor(size / 256**L) mod 256. Level-0
  hashes must equal the leaf hashes; a level-L hash must equal the Merkle
  Tree Hash of the full level-(L-1) tile below it. A partial tile or bundle
  that answers 404 is read from its full tile instead, as tlog-tiles lets
  clients do once a growing log has completed it. Responses may be gzipped
  unasked (tlog-tiles: "Logs MAY use Content-Encoding: gzip with no
  negotiation").
- The RFC 6962 root of all leaf hashes (any size, empty included) must equal
  the checkpoint's root.
- With --state FILE holding an earlier checkpoint note: it must verify with
  VKEY and name the same origin; the new tree may not be smaller; the root of
  the current tree's first old-size entries, read from the tiles, must equal
  the old root; and a consistency proof from the tiles between the two must
  verify (RFC 9162 §2.1.4.2). The new checkpoint's note then replaces FILE
  (temporary file, fsync, rename).
- --inclusion INDEX: an RFC 9162 §2.1.3.1 inclusion proof built from tile
  hashes, verified by a spec-literal §2.1.3.2 verifier against the entry's
  leaf hash and the checkpoint's root. --consistency OLD_SIZE: a §2.1.4.1
  consistency proof from tile hashes, verified by a spec-literal §2.1.4.2
  verifier against the old root (the state's, when it has that size, else
  the root recomputed from the entries) and the checkpoint's root.

Output: one line `tlog_verify: OK ...` (and each proof as a JSON line), or
with --json one JSON object {origin, size, root (base64), entries: [{index,
leaf_hash (hex), bytes (hex)}], tiles_checked, state_consistency?,
inclusion?, consistency?}: roots in base64, proof paths in hex. Any failed
check prints one line `tlog_verify: FAIL <what>` on stderr and exits 1;
usage errors exit 2.

--self-test (no network but localhost): the Go sumdb note test vectors
(golang.org/x/mod/sumdb/note note_test.go) and C2SP signed-note's example;
tile-built inclusion and consistency proofs and their verifiers against a
naive recursive RFC 6962 Merkle tree for every size 1..1000 (all pairs for
small sizes, the tile edges and a seeded random sample elsewhere); and whole
runs against small static logs served by http.server in a thread: good logs
(sizes 0, 1, 256, 257, 300; gzipped; cosigned; partial tiles gone after the
log grew; a state that grew), and refused ones: a flipped byte in a level-0
and a level-1 tile, a tampered entry, an extra entry, a root of another size,
a checkpoint signed by another key, a tampered checkpoint, a vkey whose key
id does not match, another origin, a missing tile, a shrunk and a forked
state, an inclusion index past the end.
"""

import argparse
import base64
import functools
import gzip
import hashlib
import http.server
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

HASH_SIZE = 32
TILE_HEIGHT = 8
TILE_WIDTH = 1 << TILE_HEIGHT  # 256 hashes in a full tile
SIG_TYPE_ED25519 = 0x01
MAX_NOTE_BYTES = 1 << 20
MAX_SIGNATURES = 100  # signed-note: verifiers "MUST accept at least up to 16"
MAX_RESPONSE_BYTES = 32 << 20  # a full bundle is at most 256 * (2 + 65535) bytes
EM_DASH = "\u2014"


class Failure(Exception):
    """A check that did not hold; its message is the rest of the FAIL line."""


class NotFound(Failure):
    """A fetch answered HTTP 404."""


# ---------------------------------------------------------------------------
# RFC 6962 §2.1 Merkle Tree Hash


def leaf_hash(entry):
    """RFC 6962 §2.1: MTH({d}) = SHA-256(0x00 || d)."""
    return hashlib.sha256(b"\x00" + entry).digest()


def node_hash(left, right):
    """RFC 6962 §2.1: an interior node, SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 6962 §2.1: MTH({}) = SHA-256()


def largest_power_of_two_below(n):
    """The k of RFC 6962 §2.1: the largest power of two smaller than n (n > 1)."""
    return 1 << ((n - 1).bit_length() - 1)


def is_power_of_two(n):
    """True when n is 1, 2, 4, 8, ..."""
    return n > 0 and n & (n - 1) == 0


def perfect_subtree_hash(hashes):
    """The MTH of a complete subtree (a power-of-two count of hashes), pair by pair."""
    level = list(hashes)
    while len(level) > 1:
        level = [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def tree_root(leaf_hashes):
    """The RFC 6962 root of a tree of any size, from its leaf hashes.

    The tree is cut into its complete subtrees (one per set bit of the size,
    largest first) and their hashes are folded from the right, which is what
    the recursive definition of MTH works out to. (The self-test checks this
    against the recursive definition itself.)
    """
    if not leaf_hashes:
        return EMPTY_ROOT
    peaks = []
    start = 0
    for bit in reversed(range(len(leaf_hashes).bit_length())):
        if len(leaf_hashes) & (1 << bit):
            peaks.append(perfect_subtree_hash(leaf_hashes[start:start + (1 << bit)]))
            start += 1 << bit
    root = peaks[-1]
    for peak in reversed(peaks[:-1]):
        root = node_hash(peak, root)
    return root


# ---------------------------------------------------------------------------
# RFC 9162 §2.1.3 / §2.1.4 proofs


def inclusion_path(index, start, end, subtree_hash):
    """RFC 9162 §2.1.3.1 PATH(m, D[n]) for leaf start+index of D[start:end].

    subtree_hash(a, b) gives MTH(D[a:b]); the path lists the leaf's
    neighbour first and the root's child last.
    """
    n = end - start
    if n == 1:
        return []
    k = largest_power_of_two_below(n)
    if index < k:
        return inclusion_path(index, start, start + k, subtree_hash) + [subtree_hash(start + k, end)]
    return inclusion_path(index - k, start + k, end, subtree_hash) + [subtree_hash(start, start + k)]


def consistency_subproof(m, start, end, complete, subtree_hash):
    """RFC 9162 §2.1.4.1 SUBPROOF(m, D[start:end], b)."""
    n = end - start
    if m == n:
        return [] if complete else [subtree_hash(start, end)]
    k = largest_power_of_two_below(n)
    if m <= k:
        return consistency_subproof(m, start, start + k, complete, subtree_hash) + [subtree_hash(start + k, end)]
    return consistency_subproof(m - k, start + k, end, False, subtree_hash) + [subtree_hash(start, start + k)]


def consistency_path(old_size, new_size, subtree_hash):
    """RFC 9162 §2.1.4.1 PROOF(m, D[n]) = SUBPROOF(m, D[n], true), for 0 < m <= n."""
    return consistency_subproof(old_size, 0, new_size, True, subtree_hash)


def lsb(x):
    """RFC 9162's LSB(x): the least significant bit of x, as a truth value."""
    return x & 1 == 1


def verify_inclusion_rfc9162(leaf_index, tree_size, hash_, inclusion_path_, root_hash):
    """RFC 9162 §2.1.3.2, step by step; True when the proof verifies."""
    # 1. If leaf_index is greater than or equal to tree_size, fail.
    if leaf_index >= tree_size:
        return False
    # 2. Set fn to leaf_index and sn to tree_size - 1.
    fn, sn = leaf_index, tree_size - 1
    # 3. Set r to hash.
    r = hash_
    # 4. For each value p in the inclusion_path array:
    for p in inclusion_path_:
        # a. If sn is 0, then stop the iteration and fail the proof verification.
        if sn == 0:
            return False
        # b. If LSB(fn) is set, or if fn is equal to sn, then:
        if lsb(fn) or fn == sn:
            # i. Set r to HASH(0x01 || p || r).
            r = node_hash(p, r)
            # ii. If LSB(fn) is not set, then right-shift both fn and sn
            #     equally until either LSB(fn) is set or fn is 0.
            while not lsb(fn) and fn != 0:
                fn >>= 1
                sn >>= 1
        # Otherwise: i. Set r to HASH(0x01 || r || p).
        else:
            r = node_hash(r, p)
        # c. Finally, right-shift both fn and sn one time.
        fn >>= 1
        sn >>= 1
    # 5. Compare sn to 0. Compare r against the root_hash. If sn is equal to
    #    0 and r and the root_hash are equal, then the log has proven the
    #    inclusion of hash. Otherwise, fail the proof verification.
    return sn == 0 and r == root_hash


def verify_consistency_rfc9162(first, second, first_hash, second_hash, consistency_path_):
    """RFC 9162 §2.1.4.2, step by step, for 0 < first < second; True when it verifies."""
    path = list(consistency_path_)
    # 1. If consistency_path is an empty array, stop and fail the proof verification.
    if not path:
        return False
    # 2. If first is an exact power of 2, then prepend first_hash to the
    #    consistency_path array.
    if is_power_of_two(first):
        path.insert(0, first_hash)
    # 3. Set fn to first - 1 and sn to second - 1.
    fn, sn = first - 1, second - 1
    # 4. If LSB(fn) is set, then right-shift both fn and sn equally until
    #    LSB(fn) is not set.
    while lsb(fn):
        fn >>= 1
        sn >>= 1
    # 5. Set both fr and sr to the first value in the consistency_path array.
    fr = sr = path[0]
    # 6. For each subsequent value c in the consistency_path array:
    for c in path[1:]:
        # a. If sn is 0, then stop the iteration and fail the proof verification.
        if sn == 0:
            return False
        # b. If LSB(fn) is set, or if fn is equal to sn, then:
        if lsb(fn) or fn == sn:
            # i. Set fr to HASH(0x01 || c || fr).
            fr = node_hash(c, fr)
            # ii. Set sr to HASH(0x01 || c || sr).
            sr = node_hash(c, sr)
            # iii. If LSB(fn) is not set, then right-shift both fn and sn
            #      equally until either LSB(fn) is set or fn is 0.
            while not lsb(fn) and fn != 0:
                fn >>= 1
                sn >>= 1
        # Otherwise: i. Set sr to HASH(0x01 || sr || c).
        else:
            sr = node_hash(sr, c)
        # c. Finally, right-shift both fn and sn one time.
        fn >>= 1
        sn >>= 1
    # 7. After completing iterating through the consistency_path array as
    #    described above, verify that the fr calculated is equal to the
    #    first_hash supplied, that the sr calculated is equal to the
    #    second_hash supplied, and that sn is 0.
    return fr == first_hash and sr == second_hash and sn == 0


def check_consistency(old_size, new_size, old_root, new_root, path):
    """Consistency of two tree heads for any 0 <= old_size <= new_size.

    RFC 9162 §2.1.4 defines proofs only for 0 < m < n; the two edge cases are
    settled here: a tree is consistent with itself (empty proof, equal roots)
    and the empty tree (root SHA-256()) with every tree (empty proof).
    """
    if old_size == new_size:
        return not path and old_root == new_root
    if old_size == 0:
        return not path and old_root == EMPTY_ROOT
    return 0 < old_size < new_size and verify_consistency_rfc9162(old_size, new_size, old_root, new_root, path)


# ---------------------------------------------------------------------------
# C2SP signed-note and tlog-checkpoint


def key_id(name, sig_type, public_key):
    """signed-note: key ID = SHA-256(key name || 0x0A || signature type || public key)[:4]."""
    return hashlib.sha256(name.encode() + b"\n" + bytes([sig_type]) + public_key).digest()[:4]


def valid_key_name(name):
    """signed-note: key names are non-empty and hold no Unicode spaces and no '+'."""
    return bool(name) and "+" not in name and not any(ch.isspace() for ch in name)


def b64decode_strict(text, what):
    """Standard base64 (RFC 4648 §4) with padding and nothing else, or a Failure."""
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise Failure(f"{what} is not base64: {e}")


def parse_vkey(vkey):
    """A signed-note Ed25519 verifier key: (name, key id bytes, 32-byte public key).

    `<name>+<hex key id>+<base64(0x01 || public key)>`; the key id must be
    the one signed-note derives from name and key, or the key is refused.
    """
    parts = vkey.split("+", 2)
    if len(parts) != 3:
        raise Failure("vkey is not <name>+<key id>+<key>")
    name, hex_id, b64_key = parts
    if not valid_key_name(name):
        raise Failure(f"vkey name {name!r} is empty or holds a space or '+'")
    if not re.fullmatch(r"[0-9a-f]{8}", hex_id):
        raise Failure(f"vkey key id {hex_id!r} is not 8 lowercase hex digits")
    key = b64decode_strict(b64_key, "vkey key")
    if len(key) != 33 or key[0] != SIG_TYPE_ED25519:
        raise Failure("vkey key is not 0x01 (Ed25519) followed by 32 bytes")
    public_key = key[1:]
    if key_id(name, SIG_TYPE_ED25519, public_key) != bytes.fromhex(hex_id):
        raise Failure(f"vkey key id {hex_id} is not SHA-256(name || 0x0A || 0x01 || key)[:4] "
                      f"({key_id(name, SIG_TYPE_ED25519, public_key).hex()})")
    return name, bytes.fromhex(hex_id), public_key


def split_note(note):
    """A signed note's (text, [(name, key id, signature)]), checking its form only."""
    if len(note) > MAX_NOTE_BYTES:
        raise Failure(f"note is {len(note)} bytes, over {MAX_NOTE_BYTES}")
    try:
        message = note.decode("utf-8")
    except UnicodeDecodeError:
        raise Failure("note is not UTF-8")
    if any(ord(ch) < 0x20 and ch != "\n" for ch in message):
        raise Failure("note holds a control character other than newline")
    split = message.rfind("\n\n")
    if split < 0:
        raise Failure("note has no blank line before its signatures")
    text, sig_block = message[:split + 1], message[split + 2:]
    if not sig_block.endswith("\n"):
        raise Failure("note's signature lines do not end in a newline")
    signatures = []
    for line in sig_block[:-1].split("\n"):
        signatures.append(parse_signature_line(line))
    if len(signatures) > MAX_SIGNATURES:
        raise Failure(f"note has {len(signatures)} signatures, over {MAX_SIGNATURES}")
    return text, signatures


def parse_signature_line(line):
    """`— <name> <base64(key id || signature)>` as (name, key id, signature)."""
    prefix = EM_DASH + " "
    fields = line[len(prefix):].split(" ") if line.startswith(prefix) else []
    if len(fields) != 2 or not valid_key_name(fields[0]):
        raise Failure(f"note has a malformed signature line {line!r}")
    blob = b64decode_strict(fields[1], f"signature of {fields[0]}")
    if len(blob) < 5:
        raise Failure(f"signature of {fields[0]} is too short")
    return fields[0], blob[:4], blob[4:]


def open_note(note, vkey):
    """The text of a signed note that carries a valid Ed25519 signature by vkey.

    signed-note: signatures from other keys (another name or another key
    id) are ignored; one from this key that fails to verify rejects the
    whole note; with no valid signature from it the note is rejected.
    """
    name, kid, public_key = parse_vkey(vkey)
    text, signatures = split_note(note)
    verifier = Ed25519PublicKey.from_public_bytes(public_key)
    verified = 0
    for sig_name, sig_kid, signature in signatures:
        if sig_name != name or sig_kid != kid:
            continue
        try:
            verifier.verify(signature, text.encode("utf-8"))
        except InvalidSignature:
            raise Failure(f"signature by {name}+{kid.hex()} does not verify over the note text")
        verified += 1
    if not verified:
        raise Failure(f"no signature by {name}+{kid.hex()} (the vkey) on the note")
    return text


def parse_checkpoint(text):
    """tlog-checkpoint text as (origin, size, root hash bytes)."""
    lines = text.split("\n")
    if lines[-1] != "" or len(lines) < 4:
        raise Failure("checkpoint text is not origin, size and root hash lines")
    lines = lines[:-1]
    if any(not line for line in lines):
        raise Failure("checkpoint text has an empty line")
    if len(lines) > 3:
        raise Failure(f"checkpoint has {len(lines) - 3} extension line(s); this log writes none")
    origin, size_text, root_text = lines
    if not re.fullmatch(r"0|[1-9][0-9]*", size_text):
        raise Failure(f"checkpoint tree size {size_text!r} is not a decimal without leading zeros")
    root = b64decode_strict(root_text, "checkpoint root hash")
    if len(root) != HASH_SIZE:
        raise Failure(f"checkpoint root hash is {len(root)} bytes, not {HASH_SIZE}")
    return origin, int(size_text), root


def verify_checkpoint_note(note, vkey):
    """(origin, size, root) of a checkpoint note signed by vkey, whose origin is vkey's name."""
    text = open_note(note, vkey)
    origin, size, root = parse_checkpoint(text)
    name = parse_vkey(vkey)[0]
    if origin != name:
        raise Failure(f"checkpoint origin {origin!r} is not the vkey's name {name!r}")
    return origin, size, root


# ---------------------------------------------------------------------------
# C2SP tlog-tiles paths and fetching


def encode_tile_index(n):
    """tlog-tiles <N>: zero-padded 3-digit elements, all but the last x-prefixed (1234067 -> x001/x234/067)."""
    groups = [f"{n % 1000:03d}"]
    n //= 1000
    while n:
        groups.append(f"x{n % 1000:03d}")
        n //= 1000
    return "/".join(reversed(groups))


def tile_name(level, index, width):
    """The path of a hash tile below `tile/` ("entries" as level for a bundle), e.g. 0/x001/234.p/17."""
    suffix = "" if width == TILE_WIDTH else f".p/{width}"
    return f"{level}/{encode_tile_index(index)}{suffix}"


def tiles_of_level(size, level):
    """[(index, width)] of the tiles at a level in a tree of `size` entries (full, then the partial one)."""
    count = size // TILE_WIDTH ** level  # hashes at this level
    tiles = [(n, TILE_WIDTH) for n in range(count // TILE_WIDTH)]
    if count % TILE_WIDTH:
        tiles.append((count // TILE_WIDTH, count % TILE_WIDTH))
    return tiles


def fetch(url):
    """GET url's body (gzip undone), or a Failure naming the URL."""
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip, identity"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
            encoding = response.headers.get("Content-Encoding", "identity")
    except urllib.error.HTTPError as e:
        raise (NotFound if e.code == 404 else Failure)(f"fetch {url}: HTTP {e.code}")
    except (urllib.error.URLError, OSError) as e:
        raise Failure(f"fetch {url}: {getattr(e, 'reason', e)}")
    if len(body) > MAX_RESPONSE_BYTES:
        raise Failure(f"fetch {url}: more than {MAX_RESPONSE_BYTES} bytes")
    if encoding == "gzip":
        body = gzip.decompress(body)
    elif encoding != "identity":
        raise Failure(f"fetch {url}: unknown Content-Encoding {encoding!r}")
    return body


def fetch_tile(base, level, index, width):
    """(name, data, full) of a hash tile or an entry bundle (level "entries") at its width.

    A partial one that is gone (404) is read from the full tile instead, as
    tlog-tiles lets clients do ("MAY fetch the full tile ... as a fallback
    in case the partial tile is not available anymore"); then full is True
    and the caller keeps the first `width` hashes or entries.
    """
    name = tile_name(level, index, width)
    try:
        return name, fetch(f"{base}/tile/{name}"), False
    except NotFound:
        if width == TILE_WIDTH:
            raise
    name = tile_name(level, index, TILE_WIDTH)
    return name, fetch(f"{base}/tile/{name}"), True


def parse_bundle(data, name, width):
    """The entries of an entry bundle (big-endian uint16 length, then the bytes), exactly `width` of them."""
    entries = []
    at = 0
    while at < len(data):
        if at + 2 > len(data):
            raise Failure(f"entry bundle {name} ends inside an entry's length")
        length = int.from_bytes(data[at:at + 2], "big")
        if at + 2 + length > len(data):
            raise Failure(f"entry bundle {name}: the length of its entry {len(entries)} runs past the end")
        entries.append(data[at + 2:at + 2 + length])
        at += 2 + length
    if len(entries) != width:
        raise Failure(f"entry bundle {name} holds {len(entries)} entries, want {width}")
    return entries


def split_hashes(data, name, width):
    """A hash tile's hashes, exactly `width` of them."""
    if len(data) != width * HASH_SIZE:
        raise Failure(f"tile {name} is {len(data)} bytes, want {width} hashes ({width * HASH_SIZE} bytes)")
    return [data[i:i + HASH_SIZE] for i in range(0, len(data), HASH_SIZE)]


# ---------------------------------------------------------------------------
# The whole tree from its tiles


def fetch_entries(base, size):
    """Every entry of the tree, from its entry bundles."""
    entries = []
    for index, width in tiles_of_level(size, 0):
        name, data, full = fetch_tile(base, "entries", index, width)
        entries += parse_bundle(data, name, TILE_WIDTH if full else width)[:width]
    return entries


def check_level0(base, size, leaf_hashes, tiles):
    """Fetches the level-0 tiles into `tiles`; each hash must be its entry's leaf hash."""
    for index, width in tiles_of_level(size, 0):
        name, data, full = fetch_tile(base, 0, index, width)
        data = split_hashes(data, name, TILE_WIDTH if full else width)[:width]
        for i, served in enumerate(data):
            entry = index * TILE_WIDTH + i
            if served != leaf_hashes[entry]:
                raise Failure(f"tile {name} hash {i} differs from entry {entry}'s leaf hash")
        tiles[(0, index)] = b"".join(data)


def check_upper_levels(base, size, leaf_hashes, tiles):
    """Fetches the tiles of level 1 and up into `tiles`, each hash checked against the level below.

    tlog-tiles: hash i of tile n at level L is MTH(D[(n*256+i)*256**L :
    (n*256+i+1)*256**L]), i.e. the MTH of the full level-(L-1) tile n*256+i.
    The level below is the recomputed one (equal to the served one, as
    checked before).
    """
    below = leaf_hashes
    level = 1
    while size // TILE_WIDTH ** level:
        expected = [perfect_subtree_hash(below[j:j + TILE_WIDTH])
                    for j in range(0, len(below) - TILE_WIDTH + 1, TILE_WIDTH)]
        for index, width in tiles_of_level(size, level):
            name, data, full = fetch_tile(base, level, index, width)
            data = split_hashes(data, name, TILE_WIDTH if full else width)[:width]
            for i, served in enumerate(data):
                j = index * TILE_WIDTH + i
                if served != expected[j]:
                    raise Failure(f"tile {name} hash {i} differs from the hash of tile "
                                  f"{tile_name(level - 1, j, TILE_WIDTH)} below it")
            tiles[(level, index)] = b"".join(data)
        below = expected
        level += 1


def stored_hash_from_tiles(tiles, height, index):
    """MTH of the complete subtree of 2**height entries starting at entry index * 2**height, from tile hashes.

    Its hash is either one tile hash (height a multiple of 8) or the MTH of
    2**(height % 8) consecutive hashes of one tile at level height // 8.
    """
    level, within = divmod(height, TILE_HEIGHT)
    first = index << within
    tile_index, offset = divmod(first, TILE_WIDTH)
    data = tiles.get((level, tile_index))
    count = 1 << within
    if data is None or (offset + count) * HASH_SIZE > len(data):
        raise Failure(f"no tile holds the subtree of height {height} at index {index}")
    hashes = [data[(offset + i) * HASH_SIZE:(offset + i + 1) * HASH_SIZE] for i in range(count)]
    return perfect_subtree_hash(hashes)


def subtree_hash_from_tiles(tiles, start, end):
    """MTH(D[start:end]) from tile hashes only (RFC 6962 §2.1's split where the range is not one complete subtree)."""
    n = end - start
    if is_power_of_two(n) and start % n == 0:
        return stored_hash_from_tiles(tiles, n.bit_length() - 1, start // n)
    k = largest_power_of_two_below(n)
    return node_hash(subtree_hash_from_tiles(tiles, start, start + k), subtree_hash_from_tiles(tiles, start + k, end))


def b64(data):
    """Standard base64 text of bytes."""
    return base64.b64encode(data).decode()


def verify_tree(base, size, root):
    """Fetches and checks every bundle and tile of the tree; returns (entries, leaf hashes, tiles)."""
    entries = fetch_entries(base, size)
    leaf_hashes = [leaf_hash(e) for e in entries]
    tiles = {}
    check_level0(base, size, leaf_hashes, tiles)
    check_upper_levels(base, size, leaf_hashes, tiles)
    recomputed = tree_root(leaf_hashes)
    if recomputed != root:
        raise Failure(f"root for size {size} recomputed from the entries ({b64(recomputed)}) "
                      f"differs from the checkpoint's ({b64(root)})")
    return entries, leaf_hashes, tiles


# ---------------------------------------------------------------------------
# Proofs from tiles, state


def prove_inclusion(tiles, index, size, leaf, root):
    """An inclusion proof for entry index from tile hashes, verified per RFC 9162 §2.1.3.2."""
    if not 0 <= index < size:
        raise Failure(f"--inclusion {index}: the tree has {size} entries")
    path = inclusion_path(index, 0, size, functools.partial(subtree_hash_from_tiles, tiles))
    if not verify_inclusion_rfc9162(index, size, leaf, path, root):
        raise Failure(f"inclusion proof of entry {index} built from the tiles does not verify "
                      f"against the checkpoint's root")
    return {"index": index, "tree_size": size, "leaf_hash": leaf.hex(), "root": b64(root),
            "path": [h.hex() for h in path]}


def prove_consistency(tiles, old_size, old_root, size, root):
    """A consistency proof from old_size to size from tile hashes, verified per RFC 9162 §2.1.4.2."""
    if not 0 <= old_size <= size:
        raise Failure(f"consistency from size {old_size}: the tree has {size} entries")
    path = []
    if 0 < old_size:
        path = consistency_path(old_size, size, functools.partial(subtree_hash_from_tiles, tiles))
    if not check_consistency(old_size, size, old_root, root, path):
        raise Failure(f"consistency proof from size {old_size} (root {b64(old_root)}) to size {size} "
                      f"built from the tiles does not verify")
    return {"old_size": old_size, "new_size": size, "old_root": b64(old_root), "new_root": b64(root),
            "path": [h.hex() for h in path]}


def read_state(path, vkey):
    """(origin, size, root, note) of the checkpoint stored in the state file, or None when there is none."""
    try:
        with open(path, "rb") as f:
            note = f.read()
    except FileNotFoundError:
        return None
    try:
        return verify_checkpoint_note(note, vkey) + (note,)
    except Failure as e:
        raise Failure(f"state {path}: {e}")


def check_against_state(state, size, root, tiles):
    """The new tree extends the stored one: not smaller, same root for its size, a consistency proof verifies."""
    _, old_size, old_root, _ = state
    if old_size > size:
        raise Failure(f"log shrank: the stored checkpoint has {old_size} entries, this one {size}")
    old_recomputed = subtree_hash_from_tiles(tiles, 0, old_size) if old_size else EMPTY_ROOT
    if old_recomputed != old_root:
        raise Failure(f"fork: the stored checkpoint's root for size {old_size} ({b64(old_root)}) differs "
                      f"from the root of this tree's first {old_size} entries ({b64(old_recomputed)})")
    return prove_consistency(tiles, old_size, old_root, size, root)


def write_state(path, note):
    """Replaces the state file with the checkpoint note: a temporary file beside it, fsync, rename."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tlog_verify-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(note)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def verify_log(base, vkey, state_path=None, inclusion=None, consistency=None):
    """Everything the command line asks for; returns the JSON-able result or raises Failure."""
    base = base.rstrip("/")
    parse_vkey(vkey)
    note = fetch(f"{base}/checkpoint")
    origin, size, root = verify_checkpoint_note(note, vkey)
    state = read_state(state_path, vkey) if state_path else None  # same origin: both are the vkey's name
    entries, leaf_hashes, tiles = verify_tree(base, size, root)
    result = {"origin": origin, "size": size, "root": b64(root),
              "entries": [{"index": i, "leaf_hash": leaf_hashes[i].hex(), "bytes": e.hex()}
                          for i, e in enumerate(entries)]}
    if state:
        result["state_consistency"] = check_against_state(state, size, root, tiles)
    if inclusion is not None:
        leaf = leaf_hashes[inclusion] if 0 <= inclusion < size else b""
        result["inclusion"] = prove_inclusion(tiles, inclusion, size, leaf, root)
    if consistency is not None:
        if state and state[1] == consistency:
            old_root = state[2]
        else:
            old_root = tree_root(leaf_hashes[:consistency]) if 0 <= consistency <= size else b""
        result["consistency"] = prove_consistency(tiles, consistency, old_root, size, root)
    if state_path:
        write_state(state_path, note)
    result["tiles_checked"] = len(tiles)
    return result


# ---------------------------------------------------------------------------
# Self-test

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


@functools.lru_cache(maxsize=None)
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


def write_static_log(directory, entries, private_key, origin, extra_lines="", text=None):
    """Writes a log's checkpoint, entry bundles and hash tiles as files below directory (the prefix).

    The checkpoint is signed by private_key under the name origin, with
    extra_lines after its signature; text replaces its true text.
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
    files["checkpoint"] = (text + "\n" + sign_note(text, origin, private_key) + extra_lines).encode()
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
    return messages


def self_test():
    """Runs every self-test; prints what it checked and how long it took."""
    started = time.monotonic()
    self_test_notes()
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
    print(f"tlog_verify: self-test OK: note vectors; {proofs} tile-built proofs at sizes 1..1000 against the naive "
          f"tree; {len(messages)} bad logs and requests refused ({time.monotonic() - started:.1f} s)")


# ---------------------------------------------------------------------------


def main():
    """Command line: verify a log, or --self-test."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the log's prefix, e.g. http://127.0.0.1:8080/v1/transparency")
    parser.add_argument("--vkey", help="the log's signed-note verifier key <name>+<key id>+<base64 key>")
    parser.add_argument("--state", help="file with the last verified checkpoint note; checked, then replaced")
    parser.add_argument("--inclusion", type=int, metavar="INDEX", help="also prove entry INDEX's inclusion")
    parser.add_argument("--consistency", type=int, metavar="OLD_SIZE", help="also prove consistency from OLD_SIZE")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--self-test", action="store_true", help="run the built-in tests")
    args = parser.parse_args()
    try:
        if args.self_test:
            self_test()
            return 0
        if not args.url or not args.vkey:
            parser.error("--url and --vkey are required (or --self-test)")
        result = verify_log(args.url, args.vkey, args.state, args.inclusion, args.consistency)
    except Failure as e:
        print(f"tlog_verify: FAIL {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"tlog_verify: OK {result['origin']} size {result['size']} root {result['root']}: "
          f"{result['size']} entries and {result['tiles_checked']} tiles checked")
    for key in ("state_consistency", "inclusion", "consistency"):
        if key in result:
            print(json.dumps({key: result[key]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
