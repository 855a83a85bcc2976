//! Tests of the log formats: the Go sumdb note vector, checkpoints refused when tampered, signed by another key or naming another log, entries' exact bytes, and inclusion and consistency from tiles for every tree size 1..=300 (tile boundary 256).

use super::*;
use crate::digest::Sha256Digest;
use base64::Engine as _;
use sha2::{Digest as _, Sha256};
use std::cell::Cell;

// The Go sumdb note package's test vector (golang.org/x/mod/sumdb/note),
// also in the signed_note crate's documentation.
const GO_SKEY: &str =
    "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz";
const GO_VKEY: &str = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW";
const GO_NOTE: &str = "If you think cryptography is the answer to your problem,\n\
                       then you don't know what your problem is.\n\
                       \n\
                       — PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";

fn go_key() -> ed25519_dalek::SigningKey {
    let b64 = GO_SKEY.splitn(5, '+').nth(4).unwrap();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    assert_eq!(raw[0], 1, "Ed25519 algorithm byte");
    ed25519_dalek::SigningKey::from_bytes(&raw[1..].try_into().unwrap())
}

#[test]
fn key_encodings_match_the_go_vector() {
    let key = go_key();
    assert_eq!(signer_key("PeterNeumann", &key), GO_SKEY);
    assert_eq!(verifier_key("PeterNeumann", &key.verifying_key()), GO_VKEY);
}

#[test]
fn go_note_vector_signs_and_verifies() {
    let signer = signed_note::StandardSigner::new(&signer_key("PeterNeumann", &go_key())).unwrap();
    let text = GO_NOTE.split("\n\n").next().unwrap().to_string() + "\n";
    let mut n = signed_note::Note::new(text.as_bytes(), &[]).unwrap();
    n.add_sigs(&[&signer]).unwrap();
    assert_eq!(n.to_bytes(), GO_NOTE.as_bytes());
    let v = signed_note::StandardVerifier::new(GO_VKEY).unwrap();
    let parsed = signed_note::Note::from_bytes(GO_NOTE.as_bytes()).unwrap();
    parsed
        .verify(&signed_note::VerifierList::new(vec![Box::new(v)]))
        .unwrap();
}

const ORIGIN: &str = "example.com/aics-log";

fn log_key(seed: u8) -> ed25519_dalek::SigningKey {
    ed25519_dalek::SigningKey::from_bytes(&[seed; 32])
}

#[test]
fn checkpoint_round_trip_and_refusals() {
    let key = log_key(7);
    let vkey = verifier_key(ORIGIN, &key.verifying_key());
    let root = Hash([9; 32]);
    let note = sign_checkpoint(&key, ORIGIN, 42, root).unwrap();
    let text = String::from_utf8(note.clone()).unwrap();
    assert!(text.starts_with(&format!("{ORIGIN}\n42\n")), "{text}");
    let cp = verify_checkpoint(&note, &vkey, ORIGIN).unwrap();
    assert_eq!((cp.size(), *cp.hash()), (42, root));

    // Tampered body: another size under the same signature.
    let tampered = text.replacen("\n42\n", "\n43\n", 1);
    assert!(matches!(
        verify_checkpoint(tampered.as_bytes(), &vkey, ORIGIN),
        Err(CheckpointError::Signature(_))
    ));
    // Signed by another key with the same name: refused.
    let other = sign_checkpoint(&log_key(8), ORIGIN, 42, root).unwrap();
    assert!(verify_checkpoint(&other, &vkey, ORIGIN).is_err());
    // Another log's checkpoint, even validly signed by its own key.
    let elsewhere = sign_checkpoint(&key, "other.example/log", 42, root).unwrap();
    let evkey = verifier_key("other.example/log", &key.verifying_key());
    assert!(matches!(
        verify_checkpoint(&elsewhere, &evkey, ORIGIN),
        Err(CheckpointError::Origin { .. })
    ));
    // Not a checkpoint body.
    assert!(matches!(
        verify_checkpoint(b"garbage\n\n", &vkey, ORIGIN),
        Err(CheckpointError::Signature(_))
    ));
}

fn release(i: u32) -> Entry {
    Entry::Release(ReleaseEntry {
        measurement: if i.is_multiple_of(2) {
            Measurement::Mock(hex::encode([i as u8; 32]))
        } else {
            Measurement::Nitro {
                pcr0: vec![1; 48],
                pcr1: vec![2; 48],
                pcr2: vec![3; 48],
                pcr8: vec![0; 48],
            }
        },
        manifest_digest: Sha256Digest::of(&i.to_be_bytes()),
        layers: (0, 12 + i),
        version: format!("0.1.{i}"),
        build_record_digest: Sha256Digest::of(b"record"),
    })
}

fn entry(i: u32) -> Entry {
    match i % 3 {
        0 => release(i),
        1 => Entry::KeySet(KeySetEntry {
            key_set_digest: Sha256Digest::of(&i.to_le_bytes()),
            key_ids: vec![1, 2, (i % 256) as u8],
        }),
        _ => Entry::Receipt(ReceiptEntry {
            receipt_digest: Sha256Digest::of(&[i as u8]),
        }),
    }
}

#[test]
fn entries_round_trip_deterministically() {
    for i in 0..12 {
        let e = entry(i);
        let b = e.to_bytes();
        assert_eq!(Entry::from_bytes(&b).unwrap(), e);
        assert_eq!(e.to_bytes(), b, "same entry, same bytes");
        let mut h = Sha256::new();
        h.update([0u8]);
        h.update(&b);
        assert_eq!(
            e.leaf_hash().0,
            <[u8; 32]>::from(h.finalize()),
            "RFC 6962 leaf"
        );
    }
    // A receipt entry's exact bytes: {1: 3, 2: h'00..'}.
    let r = Entry::Receipt(ReceiptEntry {
        receipt_digest: Sha256Digest([0; 32]),
    });
    let mut want = vec![0xa2, 0x01, 0x03, 0x02, 0x58, 0x20];
    want.extend([0; 32]);
    assert_eq!(r.to_bytes(), want);
}

#[test]
fn malformed_entries_are_refused() {
    let b = release(0).to_bytes();
    let mut trailing = b.clone();
    trailing.push(0);
    assert!(Entry::from_bytes(&trailing).is_err());
    // A receipt with an extra key; unknown kind; a short digest.
    assert!(Entry::from_bytes(&[0xa3, 0x01, 0x03, 0x02, 0x40, 0x03, 0x00]).is_err());
    assert!(Entry::from_bytes(&[0xa1, 0x01, 0x09]).is_err());
    assert!(Entry::from_bytes(&[0xa2, 0x01, 0x03, 0x02, 0x41, 0x00]).is_err());
    // Keys out of order (not deterministic CBOR).
    let mut swapped = vec![0xa2, 0x02, 0x58, 0x20];
    swapped.extend([0; 32]);
    swapped.extend([0x01, 0x03]);
    assert!(Entry::from_bytes(&swapped).is_err());
}

/// Tiles cut from a `HashStore`, optionally with one byte of one tile
/// flipped; counts the tiles read.
struct StoreTiles<'a> {
    store: &'a HashStore,
    tamper: Option<(u8, u64)>,
    reads: Cell<usize>,
}

impl TileReader for StoreTiles<'_> {
    fn height(&self) -> u8 {
        TILE_HEIGHT
    }

    fn read_tiles(&self, tiles: &[Tile]) -> Result<Vec<Vec<u8>>, tlog_tiles::Error> {
        self.reads.set(self.reads.get() + tiles.len());
        tiles
            .iter()
            .map(|t| {
                let mut data = t.read_data(self.store)?;
                if self.tamper == Some((t.level(), t.level_index())) {
                    data[0] ^= 1;
                }
                Ok(data)
            })
            .collect()
    }

    fn save_tiles(&self, _: &[Tile], _: &[Vec<u8>]) {}
}

#[test]
fn inclusion_and_consistency_from_tiles_for_sizes_1_to_300() {
    let leaves: Vec<Vec<u8>> = (0..300).map(|i| entry(i).to_bytes()).collect();
    let mut store = HashStore::new();
    let mut roots = vec![];
    for leaf in &leaves {
        store.append(leaf).unwrap();
        roots.push(store.root(store.size()).unwrap());
    }
    let tiles = StoreTiles {
        store: &store,
        tamper: None,
        reads: Cell::new(0),
    };
    for size in 1..=300u64 {
        let root = roots[size as usize - 1];
        for i in 0..size {
            let p = prove_inclusion_from_tiles(&tiles, size, root, i).unwrap();
            check_inclusion(&p, size, root, i, &leaves[i as usize]).unwrap();
            let wrong = (i + 1) % size;
            if wrong != i {
                assert!(check_inclusion(&p, size, root, i, &leaves[wrong as usize]).is_err());
            }
        }
        for old in 1..=size {
            let old_root = roots[old as usize - 1];
            let p = prove_consistency_from_tiles(&tiles, size, root, old).unwrap();
            check_consistency(&p, size, root, old, old_root).unwrap();
            if old < size {
                // A fork: another old root is not consistent.
                assert!(check_consistency(&p, size, root, old, roots[old as usize]).is_err());
            }
        }
    }
    assert!(tiles.reads.get() > 0);
}

#[test]
fn a_tampered_tile_is_refused() {
    let mut store = HashStore::new();
    for i in 0..300 {
        store.append(&entry(i).to_bytes()).unwrap();
    }
    let root = store.root(300).unwrap();
    // Level 0: the full tile 0 (entries 0..256) and the partial tile 1.
    // tlog_tiles 0.2 does not always authenticate a full tile against its
    // parent (at 300 the tree-hash tiles are fewer than its subtrees), so a
    // tampered tile may yield a proof: the check against the root refuses it.
    let leaf = entry(3).to_bytes();
    for tamper in [(0, 0), (0, 1), (1, 0)] {
        let tiles = StoreTiles {
            store: &store,
            tamper: Some(tamper),
            reads: Cell::new(0),
        };
        let checked = prove_inclusion_from_tiles(&tiles, 300, root, 3)
            .map_err(|e| e.to_string())
            .and_then(|p| check_inclusion(&p, 300, root, 3, &leaf).map_err(|e| e.to_string()));
        assert!(checked.is_err(), "tile {tamper:?}");
    }
}
