//! RFC 9942 COSE Receipts of inclusion in the log: a tagged COSE_Sign1
//! signed by the log's Ed25519 key (EdDSA), whose protected header names
//! the verifiable data structure RFC9162_SHA256 (label 395 = 1), the key
//! (kid: the log's signed-note key id, 4 bytes) and the log (CWT claims,
//! label 15: `iss` = the origin), whose unprotected header carries the
//! inclusion proof (label 396: `{-1: [bstr .cbor [tree_size, leaf_index,
//! [path]]]}`), and whose payload is detached: the tree's root, which a
//! verifier recomputes from the entry and the proof (RFC 9162 §2.1.3.2).
//! The same tree as the log's C2SP checkpoints, so a receipt's root and
//! size can be compared with a (witnessed) checkpoint.

use super::note_key::{parse_verifier_key, ALG_ED25519};
use super::{log_origin, Hash};
use ciborium::Value;
use coset::{iana, CoseSign1, CoseSign1Builder, HeaderBuilder, Label, TaggedCborSerializable};
use ed25519_dalek::{Signer as _, SigningKey};
use tlog_tiles::{node_hash, record_hash};

/// Protected header label: verifiable data structure.
pub const HDR_VDS: i64 = 395;
/// Unprotected header label: verifiable data proofs.
pub const HDR_VDP: i64 = 396;
/// `vds` value: RFC 9162 SHA-256 Merkle tree.
pub const VDS_RFC9162_SHA256: i64 = 1;
/// `vdp` map key: inclusion proofs.
const VDP_INCLUSION: i64 = -1;
/// Protected header label: CWT claims (RFC 9597).
const HDR_CWT_CLAIMS: i64 = 15;

/// The root an RFC 9162 inclusion proof gives for the entry `leaf` at
/// `index` of a tree of `size` (§2.1.3.2); `None` for a malformed proof.
pub fn root_from_inclusion(size: u64, index: u64, leaf: &[u8], path: &[Hash]) -> Option<Hash> {
    if index >= size {
        return None;
    }
    let (mut f, mut s, mut r) = (index, size - 1, record_hash(leaf));
    for p in path {
        if s == 0 {
            return None;
        }
        if f & 1 == 1 || f == s {
            r = node_hash(*p, r);
            while f & 1 == 0 && f != 0 {
                f >>= 1;
                s >>= 1;
            }
        } else {
            r = node_hash(r, *p);
        }
        f >>= 1;
        s >>= 1;
    }
    (s == 0).then_some(r)
}

/// An RFC 9942 receipt that `entry` is record `index` of the tree of
/// `size` whose root is `root`, by the inclusion proof `path`, signed by
/// the log `origin`'s key.
pub fn sign_inclusion_receipt(
    key: &SigningKey,
    origin: &str,
    size: u64,
    index: u64,
    path: &[Hash],
    root: Hash,
) -> Vec<u8> {
    let mut typed = vec![ALG_ED25519];
    typed.extend_from_slice(key.verifying_key().as_bytes());
    let id = signed_note::key_id(origin, &typed);
    let proof = Value::Array(vec![
        Value::Integer(size.into()),
        Value::Integer(index.into()),
        Value::Array(path.iter().map(|h| Value::Bytes(h.0.to_vec())).collect()),
    ]);
    let mut proof_bytes = Vec::new();
    ciborium::into_writer(&proof, &mut proof_bytes).expect("CBOR to a Vec");
    CoseSign1Builder::new()
        .protected(
            HeaderBuilder::new()
                .algorithm(iana::Algorithm::EdDSA)
                .key_id(id.to_be_bytes().to_vec())
                .value(
                    HDR_CWT_CLAIMS,
                    Value::Map(vec![(Value::Integer(1.into()), Value::Text(origin.into()))]),
                )
                .value(HDR_VDS, Value::Integer(VDS_RFC9162_SHA256.into()))
                .build(),
        )
        .unprotected(
            HeaderBuilder::new()
                .value(
                    HDR_VDP,
                    Value::Map(vec![(
                        Value::Integer(VDP_INCLUSION.into()),
                        Value::Array(vec![Value::Bytes(proof_bytes)]),
                    )]),
                )
                .build(),
        )
        .create_detached_signature(&root.0, b"", |tbs| key.sign(tbs).to_bytes().to_vec())
        .build()
        .to_tagged_vec()
        .expect("COSE_Sign1 encoding cannot fail")
}

/// What a verified inclusion receipt proves.
#[derive(Clone, Debug, PartialEq)]
pub struct ProvenInclusion {
    /// The tree's size.
    pub size: u64,
    /// The entry's index.
    pub index: u64,
    /// The tree's root, signed by the log's key.
    pub root: Hash,
}

fn header(rest: &[(Label, Value)], label: i64) -> Option<&Value> {
    rest.iter()
        .find(|(l, _)| *l == Label::Int(label))
        .map(|(_, v)| v)
}

/// Checks an RFC 9942 receipt for the entry `entry` against the log whose
/// signed-note verifier key is `vkey`; what it proves, or why not.
pub fn verify_inclusion_receipt(
    receipt: &[u8],
    vkey: &str,
    entry: &[u8],
) -> Result<ProvenInclusion, String> {
    let (origin, id, key) =
        parse_verifier_key(vkey, ALG_ED25519).map_err(|why| format!("the log key: {why}"))?;
    let s = CoseSign1::from_tagged_slice(receipt).map_err(|e| format!("not a COSE_Sign1: {e}"))?;
    let p = &s.protected.header;
    if p.alg
        != Some(coset::RegisteredLabelWithPrivate::Assigned(
            iana::Algorithm::EdDSA,
        ))
    {
        return Err("the receipt is not signed with EdDSA".into());
    }
    if header(&p.rest, HDR_VDS) != Some(&Value::Integer(VDS_RFC9162_SHA256.into())) {
        return Err("the receipt's structure is not RFC9162_SHA256 (vds 1)".into());
    }
    if p.key_id.as_slice() != id.to_be_bytes() {
        return Err("the receipt names another key".into());
    }
    if s.payload.is_some() {
        return Err("the receipt's payload is attached (it must be detached)".into());
    }
    let proofs = match header(&s.unprotected.rest, HDR_VDP) {
        Some(Value::Map(m)) => m
            .iter()
            .find(|(k, _)| *k == Value::Integer(VDP_INCLUSION.into()))
            .map(|(_, v)| v),
        _ => None,
    };
    let Some(Value::Array(proofs)) = proofs else {
        return Err("the receipt carries no inclusion proof".into());
    };
    let [Value::Bytes(proof)] = &proofs[..] else {
        return Err("the receipt carries not exactly one inclusion proof".into());
    };
    let proof: Value =
        ciborium::from_reader(&proof[..]).map_err(|_| "the inclusion proof is not CBOR")?;
    let (size, index, path) = match proof {
        Value::Array(a) => match &a[..] {
            [Value::Integer(n), Value::Integer(i), Value::Array(path)] => (
                u64::try_from(*n).map_err(|_| "tree size")?,
                u64::try_from(*i).map_err(|_| "leaf index")?,
                path.iter()
                    .map(|h| match h {
                        Value::Bytes(b) => <[u8; 32]>::try_from(&b[..]).ok().map(Hash),
                        _ => None,
                    })
                    .collect::<Option<Vec<_>>>()
                    .ok_or("a path hash is not 32 bytes")?,
            ),
            _ => return Err("the inclusion proof is not [size, index, path]".into()),
        },
        _ => return Err("the inclusion proof is not [size, index, path]".into()),
    };
    let root = root_from_inclusion(size, index, entry, &path)
        .ok_or("the inclusion proof does not fit the tree size and index")?;
    s.verify_detached_signature(&root.0, b"", |sig, tbs| {
        let sig = ed25519_dalek::Signature::from_slice(sig).map_err(|_| ())?;
        key.verify_strict(tbs, &sig).map_err(|_| ())
    })
    .map_err(|_| format!("the receipt is not signed by log {origin}'s key over the proven root"))?;
    Ok(ProvenInclusion { size, index, root })
}

/// Checks `inclusion`, an RFC 9942 receipt, against the log whose verifier
/// key is `vkey` for the receipt entry of `receipt` (its COSE_Sign1 bytes):
/// what it proves, or why not, in the one message every client gives.
pub fn verify_receipt_logged(
    vkey: &str,
    receipt: &[u8],
    inclusion: &[u8],
) -> Result<ProvenInclusion, String> {
    let origin = log_origin(vkey).unwrap_or("?");
    verify_inclusion_receipt(inclusion, vkey, &super::ReceiptEntry::leaf_of(receipt))
        .map_err(|why| format!("the receipt is not proven logged in {origin}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transparency::{verifier_key, HashStore};

    const ORIGIN: &str = "test.example/log";

    fn tree(n: u64) -> (HashStore, Vec<Vec<u8>>) {
        let mut t = HashStore::new();
        let entries: Vec<Vec<u8>> = (0..n).map(|i| format!("entry {i}").into_bytes()).collect();
        for e in &entries {
            t.append(e).unwrap();
        }
        (t, entries)
    }

    #[test]
    fn the_rfc9162_fold_gives_every_root_of_small_trees() {
        for n in 1..=40u64 {
            let (t, entries) = tree(n);
            for i in 0..n {
                let path = t.prove_inclusion(n, i).unwrap();
                let root = root_from_inclusion(n, i, &entries[i as usize], &path);
                assert_eq!(root, Some(t.root(n).unwrap()), "size {n} index {i}");
                assert_eq!(root_from_inclusion(n, n, &entries[i as usize], &path), None);
                if !path.is_empty() {
                    assert_eq!(
                        root_from_inclusion(n, i, &entries[i as usize], &path[1..]),
                        None,
                        "a short path, size {n} index {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn receipts_verify_for_their_entry_and_key_only() {
        let key = SigningKey::from_bytes(&[3; 32]);
        let vkey = verifier_key(ORIGIN, &key.verifying_key());
        let (t, entries) = tree(300);
        let (i, n) = (257u64, 300u64);
        let path = t.prove_inclusion(n, i).unwrap();
        let r = sign_inclusion_receipt(&key, ORIGIN, n, i, &path, t.root(n).unwrap());
        assert_eq!(r[0], 0xd2, "tag 18: COSE_Sign1");
        let got = verify_inclusion_receipt(&r, &vkey, &entries[i as usize]).unwrap();
        assert_eq!((got.size, got.index, got.root), (n, i, t.root(n).unwrap()));
        // Another entry, another key, a flipped byte: refused.
        assert!(verify_inclusion_receipt(&r, &vkey, &entries[0]).is_err());
        let other = verifier_key(ORIGIN, &SigningKey::from_bytes(&[4; 32]).verifying_key());
        assert!(verify_inclusion_receipt(&r, &other, &entries[i as usize]).is_err());
        for at in [r.len() - 1, r.len() / 2, 20] {
            let mut bad = r.clone();
            bad[at] ^= 1;
            assert!(
                verify_inclusion_receipt(&bad, &vkey, &entries[i as usize]).is_err(),
                "byte {at}"
            );
        }
        // An attached payload binds nothing to the entry: refused.
        let mut s = CoseSign1::from_tagged_slice(&r).unwrap();
        s.payload = Some(t.root(n).unwrap().0.to_vec());
        let attached = s.to_tagged_vec().unwrap();
        let err = verify_inclusion_receipt(&attached, &vkey, &entries[i as usize]).unwrap_err();
        assert!(err.contains("attached"), "{err}");
    }
}
