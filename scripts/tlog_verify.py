#!/usr/bin/env python3
"""Verifies the gateway's transparency log from its HTTP paths alone, written
from the public specifications (C2SP signed-note, tlog-checkpoint, tlog-tiles,
tlog-cosignature; RFC 6962 §2.1 and RFC 9162 §2.1), not from the gateway's
Rust code.

    tlog_verify.py --url B --vkey VKEY [--state FILE] [--inclusion INDEX]
                   [--consistency OLD_SIZE] [--witness WVKEY ...] [--quorum N]
                   [--json]
    tlog_verify.py --self-test

B is the log's prefix (e.g. http://127.0.0.1:8080/v1/transparency), VKEY its
signed-note verifier key `<name>+<hex key id>+<base64(0x01 || pubkey)>`,
each WVKEY a witness's cosignature/v1 verifier key `<name>+<hex key
id>+<base64(0x04 || pubkey)>` (--witness may be repeated), N how many of
them must have cosigned (default: all listed).

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
- With --witness: witness cosignatures on that checkpoint
  (c2sp.org/tlog-cosignature, Ed25519 cosignature/v1). A WVKEY's key id must
  be SHA-256(name || 0x0A || 0x04 || public key)[:4]; a key of another type
  (0x01, a plain note key) is refused, and so is a witness listed twice. A
  signature line under a listed witness's name and key id is a cosignature:
  base64(key id || 8-byte big-endian timestamp || 64-byte Ed25519
  signature), the timestamp at most 2^63 - 1, signed over the lines
  `cosignature/v1` and `time <timestamp>`, then the checkpoint's note text
  (its final newline included, its signature lines not). One that does not
  verify (forged, moved from another checkpoint, its time altered) rejects
  the checkpoint; lines of keys not listed (another name or another key id,
  e.g. the same name with another key) are ignored. At least N distinct
  listed witnesses must have a valid cosignature; the failure names how many
  were found and how many were needed. Timestamps in the future are not
  refused (tlog-cosignature: verifiers MAY).
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
  (temporary file, fsync, rename). (The stored note's cosignatures are not
  checked again: it was verified when it was stored.)
- --inclusion INDEX: an RFC 9162 §2.1.3.1 inclusion proof built from tile
  hashes, verified by a spec-literal §2.1.3.2 verifier against the entry's
  leaf hash and the checkpoint's root. --consistency OLD_SIZE: a §2.1.4.1
  consistency proof from tile hashes, verified by a spec-literal §2.1.4.2
  verifier against the old root (the state's, when it has that size, else
  the root recomputed from the entries) and the checkpoint's root.

Output: one line `tlog_verify: OK ...` (and each proof and the witnesses as
a JSON line), or with --json one JSON object {origin, size, root (base64),
entries: [{index, leaf_hash (hex), bytes (hex)}], tiles_checked,
state_consistency?, inclusion?, consistency?, witnesses?}: roots in base64,
proof paths in hex; witnesses is {quorum, listed, cosigned: [{name, key_id
(hex), timestamp}]} in the order of the --witness options. Any failed check
prints one line `tlog_verify: FAIL <what>` on stderr and exits 1; usage
errors (a --quorum above the number of --witness keys, say) exit 2.

--self-test runs scripts/tlog_verify_selftest.py (spec vectors, proofs
against a naive Merkle tree, and good and tampered logs served on
localhost, cosigned ones included); its docstring lists what it checks.
"""

import argparse
import base64
import functools
import gzip
import hashlib
import json
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

HASH_SIZE = 32
TILE_HEIGHT = 8
TILE_WIDTH = 1 << TILE_HEIGHT  # 256 hashes in a full tile
SIG_TYPE_ED25519 = 0x01  # signed-note: Ed25519 note signatures
SIG_TYPE_COSIGNATURE_V1 = 0x04  # signed-note / tlog-cosignature: timestamped Ed25519 witness cosignatures
SIG_TYPE_NAMES = {SIG_TYPE_ED25519: "Ed25519", SIG_TYPE_COSIGNATURE_V1: "Ed25519 cosignature/v1"}
COSIGNATURE_V1_BYTES = 8 + 64  # tlog-cosignature timestamped_signature: u64 timestamp, Ed25519 signature
MAX_TIMESTAMP = (1 << 63) - 1  # tlog-cosignature: the timestamp "MUST NOT exceed 2^63 - 1"
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


def parse_vkey(vkey, sig_type=SIG_TYPE_ED25519, what="vkey"):
    """A signed-note verifier key of an Ed25519 type: (name, key id bytes, 32-byte public key).

    `<name>+<hex key id>+<base64(sig_type || public key)>`; a key of another
    signature type is refused, and so is a key id other than the one
    signed-note derives from name, type and key.
    """
    parts = vkey.split("+", 2)
    if len(parts) != 3:
        raise Failure(f"{what} {vkey!r} is not <name>+<key id>+<key>")
    name, hex_id, b64_key = parts
    if not valid_key_name(name):
        raise Failure(f"{what} name {name!r} is empty or holds a space or '+'")
    if not re.fullmatch(r"[0-9a-f]{8}", hex_id):
        raise Failure(f"{what} key id {hex_id!r} is not 8 lowercase hex digits")
    key = b64decode_strict(b64_key, f"{what} key")
    if len(key) != 33 or key[0] != sig_type:
        found = f"type 0x{key[0]:02x}, " if key else ""
        raise Failure(f"{what} {name}: key is not 0x{sig_type:02x} ({SIG_TYPE_NAMES[sig_type]}) followed by "
                      f"32 bytes ({found}{len(key)} bytes)")
    public_key = key[1:]
    if key_id(name, sig_type, public_key) != bytes.fromhex(hex_id):
        raise Failure(f"{what} {name}: key id {hex_id} is not SHA-256(name || 0x0A || 0x{sig_type:02x} || key)[:4] "
                      f"({key_id(name, sig_type, public_key).hex()})")
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
# C2SP tlog-cosignature (Ed25519 cosignature/v1)


def parse_witnesses(vkeys):
    """[(name, key id, public key)] of the --witness keys: each a 0x04 vkey, none listed twice."""
    witnesses = []
    for vkey in vkeys:
        name, kid, public_key = parse_vkey(vkey, SIG_TYPE_COSIGNATURE_V1, "witness vkey")
        if any((name, kid) == (n, k) for n, k, _ in witnesses):
            raise Failure(f"witness {name}+{kid.hex()} is listed twice")
        witnesses.append((name, kid, public_key))
    return witnesses


def cosignature_message(text, timestamp):
    """tlog-cosignature's Ed25519 signed message: `cosignature/v1`, `time <timestamp>`, then the note text."""
    return f"cosignature/v1\ntime {timestamp}\n".encode() + text.encode("utf-8")


def parse_cosignature(signature, who):
    """A timestamped_signature (after the key id) as (timestamp, 64-byte Ed25519 signature)."""
    if len(signature) != COSIGNATURE_V1_BYTES:
        raise Failure(f"cosignature by witness {who} is {len(signature)} bytes after its key id, not "
                      f"{COSIGNATURE_V1_BYTES} (an 8-byte timestamp and a 64-byte Ed25519 signature)")
    timestamp = int.from_bytes(signature[:8], "big")
    if timestamp > MAX_TIMESTAMP:
        raise Failure(f"cosignature by witness {who} has timestamp {timestamp}, over 2^63 - 1")
    return timestamp, signature[8:]


def verify_cosignatures(text, signatures, witnesses, quorum):
    """The listed witnesses that cosigned the note text; at least `quorum` of them, or a Failure.

    signatures are split_note's (name, key id, signature) lines. Lines of
    keys not listed are ignored (signed-note: "even if they share a name or
    ID (but not both) with a known key"); a line under a listed witness's
    name and key id must be a valid cosignature/v1 or the note is refused.
    A witness counts once however many lines it has (its latest time is
    reported).
    """
    by_id = {(name, kid): public_key for name, kid, public_key in witnesses}
    times = {}
    for sig_name, sig_kid, signature in signatures:
        public_key = by_id.get((sig_name, sig_kid))
        if public_key is None:
            continue
        who = f"{sig_name}+{sig_kid.hex()}"
        timestamp, ed25519_signature = parse_cosignature(signature, who)
        try:
            Ed25519PublicKey.from_public_bytes(public_key).verify(ed25519_signature,
                                                                  cosignature_message(text, timestamp))
        except InvalidSignature:
            raise Failure(f"cosignature by witness {who} (time {timestamp}) does not verify over "
                          f"cosignature/v1, its time and this checkpoint")
        times[(sig_name, sig_kid)] = max(timestamp, times.get((sig_name, sig_kid), 0))
    cosigned = [{"name": name, "key_id": kid.hex(), "timestamp": times[(name, kid)]}
                for name, kid, _ in witnesses if (name, kid) in times]
    if len(cosigned) < quorum:
        missing = [f"{name}+{kid.hex()}" for name, kid, _ in witnesses if (name, kid) not in times]
        raise Failure(f"witness quorum not met: {len(cosigned)} of the {len(witnesses)} listed witnesses "
                      f"cosigned the checkpoint, {quorum} needed (no valid cosignature from {', '.join(missing)})")
    return {"quorum": quorum, "listed": len(witnesses), "cosigned": cosigned}


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


def verify_log(base, vkey, state_path=None, inclusion=None, consistency=None, witnesses=(), quorum=None):
    """Everything the command line asks for; returns the JSON-able result or raises Failure.

    witnesses are witness vkeys; quorum (default: all of them) how many must
    have cosigned the checkpoint.
    """
    base = base.rstrip("/")
    parse_vkey(vkey)
    witness_keys = parse_witnesses(witnesses)
    quorum = len(witness_keys) if quorum is None else quorum
    if not 0 <= quorum <= len(witness_keys):
        raise Failure(f"--quorum {quorum} is not between 0 and the {len(witness_keys)} --witness keys")
    note = fetch(f"{base}/checkpoint")
    origin, size, root = verify_checkpoint_note(note, vkey)
    cosignatures = None
    if witness_keys:
        text, signatures = split_note(note)
        cosignatures = verify_cosignatures(text, signatures, witness_keys, quorum)
    state = read_state(state_path, vkey) if state_path else None  # same origin: both are the vkey's name
    entries, leaf_hashes, tiles = verify_tree(base, size, root)
    result = {"origin": origin, "size": size, "root": b64(root),
              "entries": [{"index": i, "leaf_hash": leaf_hashes[i].hex(), "bytes": e.hex()}
                          for i, e in enumerate(entries)]}
    if cosignatures is not None:
        result["witnesses"] = cosignatures
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


def main():
    """Command line: verify a log, or --self-test."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the log's prefix, e.g. http://127.0.0.1:8080/v1/transparency")
    parser.add_argument("--vkey", help="the log's signed-note verifier key <name>+<key id>+<base64 key>")
    parser.add_argument("--state", help="file with the last verified checkpoint note; checked, then replaced")
    parser.add_argument("--inclusion", type=int, metavar="INDEX", help="also prove entry INDEX's inclusion")
    parser.add_argument("--consistency", type=int, metavar="OLD_SIZE", help="also prove consistency from OLD_SIZE")
    parser.add_argument("--witness", action="append", default=[], metavar="WVKEY",
                        help="a witness's cosignature/v1 verifier key <name>+<key id>+<base64(0x04 || key)>; "
                             "repeatable")
    parser.add_argument("--quorum", type=int, metavar="N",
                        help="how many --witness keys must have cosigned the checkpoint (default: all)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--self-test", action="store_true", help="run the built-in tests")
    args = parser.parse_args()
    if args.self_test:
        # scripts/tlog_verify_selftest.py, beside this file (it imports this module).
        from tlog_verify_selftest import self_test
        self_test()
        return 0
    if not args.url or not args.vkey:
        parser.error("--url and --vkey are required (or --self-test)")
    if args.quorum is not None and not 0 <= args.quorum <= len(args.witness):
        parser.error(f"--quorum {args.quorum} is not between 0 and the number of --witness keys "
                     f"({len(args.witness)})")
    try:
        result = verify_log(args.url, args.vkey, args.state, args.inclusion, args.consistency,
                            args.witness, args.quorum)
    except Failure as e:
        print(f"tlog_verify: FAIL {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(f"tlog_verify: OK {result['origin']} size {result['size']} root {result['root']}: "
          f"{result['size']} entries and {result['tiles_checked']} tiles checked" + (
              f"; {len(result['witnesses']['cosigned'])} of {result['witnesses']['listed']} witnesses cosigned "
              f"(quorum {result['witnesses']['quorum']})" if "witnesses" in result else ""))
    for key in ("witnesses", "state_consistency", "inclusion", "consistency"):
        if key in result:
            print(json.dumps({key: result[key]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
