//! Target `receipt`: signed receipts and receipt links (COSE_Sign1 over
//! deterministic CBOR), the sealed response's receipt trailer, the entry
//! stage's signed HPKE key sets, and the full verification a client runs.
//!
//! Properties: only the genuine receipts of the test vectors verify against
//! their stage keys (no other bytes, however close, are accepted); a trailer
//! and a key set are accepted only in their one (deterministic) encoding.

use proto::digest::Sha256Digest;
use proto::key_rotation::KeySet;
use proto::receipt::{
    decode_canonical, parse_unverified, verify_receipt, DigestSalt, Link, ReceiptTrailer, SealedTo,
    StageKeys, VerifyInputs,
};
use std::sync::OnceLock;

/// The valid receipt of the test vectors and what it was made over
/// (`proto/tests/vectors/receipts/cases.json`, case `valid`).
pub const VALID: &[u8] = include_bytes!("../../../proto/tests/vectors/receipts/valid.cbor");
const STAGE_KEYS: &str = include_str!("../../../proto/tests/vectors/receipts/stage_keys.json");
const REQUEST: &[u8] = include_bytes!("../../../proto/tests/vectors/receipts/request.json");
const RESPONSE: &[u8] = include_bytes!("../../../proto/tests/vectors/receipts/response.json");
const NONCE: &[u8] = b"nonce-0001";
const MANIFEST: &str = "e987b465c0e39202d4a9e9736c2502597037cf732e4e2eceba5f0dd82e47f7e4";
const SALT: [u8; 32] = [0x5a; 32];
const SEALED_KEY_ID: u8 = 5;
const SEALED_ENC: [u8; 32] = [0x11; 32];

/// The vectors' receipts whose case expects `ok` (`cases.json`).
fn genuine() -> &'static [Vec<u8>] {
    static OK: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    OK.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../proto/tests/vectors/receipts");
        let cases: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(dir.join("cases.json")).expect("cases.json"))
                .expect("cases");
        cases
            .iter()
            .filter(|c| c["expect"] == "ok")
            .map(|c| std::fs::read(dir.join(c["receipt"].as_str().expect("name"))).expect("vector"))
            .collect()
    })
}

fn stage_keys() -> &'static [StageKeys] {
    static KEYS: OnceLock<Vec<StageKeys>> = OnceLock::new();
    KEYS.get_or_init(|| serde_json::from_str(STAGE_KEYS).expect("vector stage keys"))
}

/// Runs one input: the first byte picks verification or one parser.
pub fn run(data: &[u8]) {
    let Some((which, bytes)) = crate::selector(data) else {
        return;
    };
    match which % 5 {
        0 => _ = verifies(bytes),
        1 => {
            let _ = parse_unverified(bytes);
            let _ = decode_canonical(bytes);
        }
        2 => {
            let _ = Link::from_cbor(bytes);
        }
        3 => {
            if let Ok(t) = ReceiptTrailer::decode(bytes) {
                assert_eq!(t.encode(), bytes, "a trailer has one encoding");
            }
        }
        _ => {
            if let Ok(set) = KeySet::from_cbor(bytes) {
                assert_eq!(set.to_cbor(), bytes, "a key set has one encoding");
            }
            let _ = KeySet::verify(bytes, &stage_keys()[0].receipt_key);
        }
    }
}

/// Verifies `receipt` against the vectors' stage keys and inputs.
pub fn verifies(receipt: &[u8]) -> bool {
    let salt: DigestSalt = SALT;
    let inputs = VerifyInputs {
        request: Some(REQUEST),
        response: Some(RESPONSE),
        digest_salt: Some(&salt),
        expected_nonce: Some(NONCE),
        expected_manifest: Some(Sha256Digest::from_hex(MANIFEST).expect("hex")),
        allow_mock: true,
        sealed_to: Some(SealedTo {
            key_id: SEALED_KEY_ID,
            enc: &SEALED_ENC,
        }),
        ..VerifyInputs::new(receipt, stage_keys())
    };
    let report = verify_receipt(&inputs);
    let _ = report.to_json();
    if report.ok() {
        assert!(
            genuine().iter().any(|g| g == receipt),
            "only the genuine receipts of the vectors verify"
        );
    }
    report.ok()
}
