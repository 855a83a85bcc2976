//! Tests of witness cosignatures (C2SP tlog-cosignature) and the
//! tlog-witness request body: the signed message's exact bytes, quorum
//! counting, forged and moved cosignatures, and malformed requests.

use super::*;
use base64::Engine as _;
use ed25519_dalek::{SigningKey, Verifier as _};

const ORIGIN: &str = "test.example/log";

fn key(b: u8) -> SigningKey {
    SigningKey::from_bytes(&[b; 32])
}

fn checkpoint(size: u64, leaf: u8) -> Vec<u8> {
    sign_checkpoint(&key(1), ORIGIN, size, Hash([leaf; 32])).unwrap()
}

fn witness(name: &str, b: u8, time: u64) -> Cosigner {
    Cosigner::new(name, key(b), time).unwrap()
}

#[test]
fn a_cosignature_signs_the_c2sp_message() {
    let note = checkpoint(5, 7);
    let w = witness("w.example/1", 2, 1_679_315_147);
    let line = w.cosign(&note).unwrap();
    let (name, b64) = line
        .strip_prefix("— ")
        .unwrap()
        .trim_end()
        .split_once(' ')
        .unwrap();
    assert_eq!(name, "w.example/1");
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    assert_eq!(
        raw.len(),
        4 + 8 + 64,
        "key id, timestamp, Ed25519 signature"
    );
    assert_eq!(&raw[4..12], &1_679_315_147u64.to_be_bytes());
    // The key id: SHA-256(name || "\n" || 0x04 || key)[:4].
    let mut typed = vec![4u8];
    typed.extend_from_slice(key(2).verifying_key().as_bytes());
    assert_eq!(
        u32::from_be_bytes(raw[..4].try_into().unwrap()),
        signed_note::key_id("w.example/1", &typed)
    );
    // The message: header, time line, the checkpoint's text.
    let text = std::str::from_utf8(&note)
        .unwrap()
        .split("\n\n")
        .next()
        .unwrap();
    let msg = format!("cosignature/v1\ntime 1679315147\n{text}\n");
    let sig = ed25519_dalek::Signature::from_bytes(raw[12..].try_into().unwrap());
    key(2).verifying_key().verify(msg.as_bytes(), &sig).unwrap();
    // The vkey names the same key and id.
    let v = CosignatureVerifier::new(&w.vkey()).unwrap();
    assert_eq!(v.witness_name(), "w.example/1");
}

#[test]
fn a_quorum_counts_distinct_valid_witnesses_only() {
    let note = checkpoint(5, 7);
    let (a, b, c) = (
        witness("a.example", 2, 10),
        witness("b.example", 3, 11),
        witness("c.example", 4, 12),
    );
    let note =
        add_cosignatures(&note, &[a.cosign(&note).unwrap(), b.cosign(&note).unwrap()]).unwrap();
    verify_checkpoint(
        &note,
        &verifier_key(ORIGIN, &key(1).verifying_key()),
        ORIGIN,
    )
    .unwrap();
    let all = [a.vkey(), b.vkey(), c.vkey()];
    let got = verify_cosignatures(&note, &all).unwrap();
    assert_eq!(
        got,
        vec![
            Cosigned {
                witness: "a.example".into(),
                time: 10
            },
            Cosigned {
                witness: "b.example".into(),
                time: 11
            }
        ]
    );
    // A witness listed twice counts once.
    assert_eq!(
        verify_cosignatures(&note, &[a.vkey(), a.vkey()])
            .unwrap()
            .len(),
        1
    );
    // The log's own signature is not a cosignature (another key type).
    assert!(CosignatureVerifier::new(&verifier_key(ORIGIN, &key(1).verifying_key())).is_err());
    // Re-cosigning replaces the witness's line rather than adding one.
    let again =
        add_cosignatures(&note, &[witness("a.example", 2, 99).cosign(&note).unwrap()]).unwrap();
    assert_eq!(
        std::str::from_utf8(&again)
            .unwrap()
            .matches("— a.example ")
            .count(),
        1
    );
    assert_eq!(
        verify_cosignatures(&again, &[a.vkey()]).unwrap()[0].time,
        99
    );
    // Quorums through the policy.
    let mut policy = crate::policy::LogPolicy::new(verifier_key(ORIGIN, &key(1).verifying_key()));
    policy.witnesses = all.to_vec();
    assert!(check_quorum(&note, &policy)
        .unwrap_err()
        .contains("carries 2 valid"));
    policy.witness_quorum = Some(2);
    assert!(check_quorum(&note, &policy)
        .unwrap()
        .contains("cosigned by 2"));
    policy.witness_quorum = Some(4);
    assert!(check_quorum(&note, &policy)
        .unwrap_err()
        .contains("names 3 witnesses"));
}

#[test]
fn forged_or_moved_cosignatures_are_refused() {
    let note = checkpoint(5, 7);
    let a = witness("a.example", 2, 10);
    let line = a.cosign(&note).unwrap();
    // A cosignature moved onto another checkpoint does not verify.
    let other = add_cosignatures(&checkpoint(6, 8), std::slice::from_ref(&line)).unwrap();
    let err = verify_cosignatures(&other, &[a.vkey()]).unwrap_err();
    assert!(
        err.to_string()
            .contains("a.example's cosignature does not verify"),
        "{err}"
    );
    // Another timestamp under the same signature does not verify.
    let mut raw = base64::engine::general_purpose::STANDARD
        .decode(line.trim_end().rsplit_once(' ').unwrap().1)
        .unwrap();
    raw[11] ^= 1;
    let forged = format!(
        "— a.example {}\n",
        base64::engine::general_purpose::STANDARD.encode(&raw)
    );
    let bad = add_cosignatures(&note, &[forged]).unwrap();
    assert!(verify_cosignatures(&bad, &[a.vkey()]).is_err());
    // A witness with the same name and another key is not the policy's.
    let imposter = witness("a.example", 9, 10);
    let signed = add_cosignatures(&note, &[imposter.cosign(&note).unwrap()]).unwrap();
    assert_eq!(verify_cosignatures(&signed, &[a.vkey()]).unwrap(), vec![]);
}

#[test]
fn witness_keys_round_trip_and_malformed_ones_are_refused() {
    let text = cosigner_key("w.example/1", &key(5));
    let (name, k) = parse_cosigner_key(&text).unwrap();
    assert_eq!(
        (name.as_str(), k.to_bytes()),
        ("w.example/1", key(5).to_bytes())
    );
    let log_skey = signer_key(ORIGIN, &key(5));
    assert!(
        parse_cosigner_key(&log_skey).is_err(),
        "a log key (type 0x01)"
    );
    let vkey = witness("w.example/1", 5, 0).vkey();
    for bad in [
        vkey.replacen("w.example/1", "w.example/2", 1), // id no longer matches
        vkey.replacen('+', "+0", 1),
        "w.example+00000000+BA==".to_string(),
        "no-plus".to_string(),
    ] {
        assert!(CosignatureVerifier::new(&bad).is_err(), "{bad}");
    }
}

#[test]
fn add_checkpoint_bodies_round_trip_and_malformed_ones_are_refused() {
    let req = AddCheckpoint {
        old_size: 20,
        proof: vec![Hash([1; 32]), Hash([2; 32])],
        checkpoint: checkpoint(25, 3),
    };
    let body = req.to_bytes();
    assert!(body.starts_with(b"old 20\nAQEB"));
    assert_eq!(AddCheckpoint::parse(&body).unwrap(), req);
    let first = AddCheckpoint {
        old_size: 0,
        proof: vec![],
        checkpoint: checkpoint(1, 3),
    };
    assert_eq!(AddCheckpoint::parse(&first.to_bytes()).unwrap(), first);
    let cp = String::from_utf8(checkpoint(25, 3)).unwrap();
    let h = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
    for bad in [
        format!("old 020\n\n{cp}"),
        format!("old -1\n\n{cp}"),
        format!("old 5\n{cp}"),
        format!("old 0\n{h}\n\n{cp}"),
        format!("old 5\nAQ==\n\n{cp}"),
        format!("old 5\n{}\n{cp}", format!("{h}\n").repeat(64)),
        "old 5".to_string(),
    ] {
        assert!(AddCheckpoint::parse(bad.as_bytes()).is_err(), "{bad:?}");
    }
    assert_eq!(parse_decimal("0"), Some(0));
    assert_eq!(parse_decimal("10"), Some(10));
    for bad in ["", "01", "+1", "1 ", "99999999999999999999999"] {
        assert_eq!(parse_decimal(bad), None, "{bad:?}");
    }
}

#[test]
fn the_python_verifiers_fixed_vector_is_ours() {
    // scripts/tlog_verify_selftest.py, written from the C2SP texts alone,
    // fixes this witness key and cosignature (seed 32 x 0x02).
    let w = witness("w.example/1", 2, 1_679_315_147);
    assert_eq!(
        w.vkey(),
        "w.example/1+c9fde0ca+BIE5dw6ofRdfVqNUZsNMfszLjYqRtO43ol32D1uPybOU"
    );
    let note = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n\
                — example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7u5/Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n";
    assert_eq!(
        w.cosign(note.as_bytes()).unwrap(),
        "— w.example/1 yf3gygAAAABkGFDLUwBLV8e4tjvb6qEHiNTQjDZIX+7tvd038taw9A7W/cQ7ZhSah0uJMOI6CTPez5qwHtE49MrkWhU349mtYmi3Dw==\n"
    );
}

#[test]
fn a_witness_answer_signed_by_another_key_is_refused() {
    let note = checkpoint(5, 7);
    let a = witness("a.example", 2, 10);
    // The witness's own answer: its line, kept.
    let line = a.cosign(&note).unwrap();
    assert_eq!(witness_answer(&note, &a.vkey(), &line).unwrap(), vec![line]);
    // The same name under another key (another id): nothing of it is kept.
    let imposter = witness("a.example", 9, 10);
    let err = witness_answer(&note, &a.vkey(), &imposter.cosign(&note).unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("holds no cosignature by a.example"),
        "{err}"
    );
    // Its key id, over another checkpoint: refused, not stored.
    let moved = a.cosign(&checkpoint(6, 8)).unwrap();
    assert!(witness_answer(&note, &a.vkey(), &moved).is_err());
    // Nothing at all.
    assert!(witness_answer(&note, &a.vkey(), "").is_err());
}
