//! Receipt test vectors in `tests/vectors/receipts/`.
//!
//! `vectors_verify_as_expected` reads only the files (so the vectors in the
//! repository are what the suite checks) and verifies each case against its
//! expected reason. `vectors_match_generator` regenerates them from fixed
//! seeds and requires the files to be byte-identical; run with
//! `UPDATE_RECEIPT_VECTORS=1` to rewrite them after a deliberate format change.

use ciborium::value::Value;
use ed25519_dalek::SigningKey;
use proto::digest::Sha256Digest;
use proto::receipt::{
    link_digest, salted_digest, sign_link, sign_receipt, verify_receipt, CheckStatus, DigestSalt,
    Link, OpenedKey, ReceiptBody, ReceiptId, ReceiptVersion, SealedTo, Sealing, StageKeys,
    VerifyInputs, RECEIPT_CONTENT_TYPE,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/receipts")
}

/// One case of `cases.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Case {
    name: String,
    description: String,
    /// Receipt file (raw COSE_Sign1 bytes).
    receipt: String,
    /// Request bytes file, if the verifier is given one.
    request: Option<String>,
    /// Response bytes file, if the verifier is given one.
    response: Option<String>,
    /// Expected client nonce (hex), if any.
    nonce: Option<String>,
    /// Expected manifest digest (hex), if any.
    manifest: Option<String>,
    /// The salt of the receipt's digests (hex), if the verifier is given it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    digest_salt: Option<String>,
    /// Whether the policy allows mock receipts.
    allow_mock: bool,
    /// The key the client sealed to: `{"key_id", "enc" (hex)}`, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sealed_to: Option<SealedToJson>,
    /// `"ok"` or the reason code of the first failure.
    expect: String,
}

/// The `sealed_to` input of a case.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SealedToJson {
    key_id: u8,
    /// The client's encapsulated key, hex.
    enc: String,
}

/// The key the valid receipt's entry stage opened: the client's.
const KEY_ID: u8 = 5;
const ENC: [u8; 32] = [0x11; 32];
/// What a host that opened the request itself sends on instead.
const HOST_ENC: [u8; 32] = [0x22; 32];

fn client_sealing() -> Option<SealedToJson> {
    Some(SealedToJson {
        key_id: KEY_ID,
        enc: hex::encode(ENC),
    })
}

const MANIFEST: &str = "e987b465c0e39202d4a9e9736c2502597037cf732e4e2eceba5f0dd82e47f7e4";
const NONCE: &[u8] = b"nonce-0001";
const REQUEST: &[u8] = br#"{"model":"all-MiniLM-L6-v2","input":["The quick brown fox"]}"#;
const RESPONSE: &[u8] = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.25,-0.5]}],"model":"all-MiniLM-L6-v2","usage":{"prompt_tokens":6,"total_tokens":6}}"#;
const OTHER_REQUEST: &[u8] = br#"{"model":"all-MiniLM-L6-v2","input":["The quick brown fix"]}"#;
const OTHER_RESPONSE: &[u8] = br#"{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.25,-0.75]}],"model":"all-MiniLM-L6-v2","usage":{"prompt_tokens":6,"total_tokens":6}}"#;
const RECEIPT_ID: ReceiptId = [
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
];
const STAGES: usize = 3;
/// The salt of the valid receipt's digests (v4).
const DIGEST_SALT: DigestSalt = [0x5a; 32];

/// The digest a current (salted) receipt carries for `bytes`.
fn digest(bytes: &[u8]) -> Sha256Digest {
    salted_digest(&DIGEST_SALT, &Sha256Digest::of(bytes))
}

fn key(label: &str) -> SigningKey {
    SigningKey::from_bytes(&Sha256Digest::of(format!("receipt test vector: {label}").as_bytes()).0)
}

struct Gen {
    keys: Vec<SigningKey>,
    stages: Vec<StageKeys>,
}

impl Gen {
    fn new() -> Self {
        let keys: Vec<_> = (0..STAGES)
            .map(|i| key(&format!("stage {i} receipt key")))
            .collect();
        let stages = (0..STAGES)
            .map(|i| StageKeys {
                stage_index: i as u32,
                layers: [2 * i as u32, 2 * i as u32 + 2],
                evidence_digest: Sha256Digest::of(
                    format!("receipt test vector: stage {i} evidence").as_bytes(),
                ),
                receipt_key: keys[i].verifying_key().to_bytes(),
            })
            .collect();
        Self { keys, stages }
    }

    fn links(&self) -> Vec<Link> {
        let act = |i: usize| {
            digest(format!("receipt test vector: activations {i}->{}", i + 1).as_bytes())
        };
        (0..STAGES)
            .map(|i| Link {
                receipt_id: RECEIPT_ID,
                stage_index: i as u32,
                layers: self.stages[i].layers,
                evidence_digest: self.stages[i].evidence_digest,
                received_digest: if i == 0 { digest(REQUEST) } else { act(i - 1) },
                sent_digest: if i + 1 == STAGES {
                    digest(RESPONSE)
                } else {
                    act(i)
                },
                prev_link_digest: None,
                opened: (i == 0).then(|| OpenedKey::of(KEY_ID, &ENC)),
            })
            .collect()
    }

    /// Signs the links before the exit stage's in order (each by its
    /// stage's key), chaining digests; returns them and the exit stage's
    /// link, which the receipt carries unsigned on its own.
    fn chain(&self, links: &[Link]) -> (Vec<Vec<u8>>, Link) {
        let (exit, upstream) = links.split_last().unwrap();
        let mut out: Vec<Vec<u8>> = Vec::new();
        for (i, l) in upstream.iter().enumerate() {
            let mut l = l.clone();
            l.prev_link_digest = out.last().map(|p| link_digest(p));
            out.push(sign_link(&self.keys[i], &l));
        }
        let mut exit = exit.clone();
        exit.prev_link_digest = out.last().map(|p| link_digest(p));
        (out, exit)
    }

    fn body(&self, (chain, exit_link): (Vec<Vec<u8>>, Link)) -> ReceiptBody {
        ReceiptBody {
            version: ReceiptVersion::CURRENT,
            receipt_id: RECEIPT_ID,
            issued_at_ms: 1_767_225_600_000,
            endpoint: "/v1/embeddings".into(),
            model_id: "all-MiniLM-L6-v2".into(),
            manifest_digest: Sha256Digest::from_hex(MANIFEST).unwrap(),
            request_digest: digest(REQUEST),
            response_digest: digest(RESPONSE),
            client_nonce: Some(NONCE.to_vec()),
            sequence: 42,
            mock: true,
            sealing: Sealing::Enclave,
            chain,
            exit_link,
        }
    }

    fn exit(&self) -> &SigningKey {
        &self.keys[STAGES - 1]
    }

    fn receipt_with_links(&self, edit: impl Fn(&mut Vec<Link>)) -> Vec<u8> {
        let mut ls = self.links();
        edit(&mut ls);
        sign_receipt(self.exit(), &self.body(self.chain(&ls)))
    }

    /// Edits the signed links and the exit stage's link after chaining.
    fn receipt_with_chain(&self, edit: impl Fn(&mut Vec<Vec<u8>>, &mut Link)) -> Vec<u8> {
        let (mut c, mut exit) = self.chain(&self.links());
        edit(&mut c, &mut exit);
        sign_receipt(self.exit(), &self.body((c, exit)))
    }

    /// Every file of the vector directory, by name.
    fn files(&self) -> BTreeMap<String, Vec<u8>> {
        let mut files = BTreeMap::new();
        let mut cases = Vec::new();
        let mut add = |name: &str, description: &str, receipt: Vec<u8>, expect: &str| {
            let file = format!("{name}.cbor");
            files.insert(file.clone(), receipt);
            cases.push(Case {
                name: name.into(),
                description: description.into(),
                receipt: file,
                request: Some("request.json".into()),
                response: Some("response.json".into()),
                nonce: Some(hex::encode(NONCE)),
                manifest: Some(MANIFEST.into()),
                digest_salt: Some(hex::encode(DIGEST_SALT)),
                allow_mock: true,
                sealed_to: client_sealing(),
                expect: expect.into(),
            });
        };
        let valid = self.receipt_with_links(|_| {});
        add(
            "valid",
            "a valid receipt; every input given",
            valid.clone(),
            "ok",
        );

        let mut flipped = valid.clone();
        let mid = flipped.len() / 2;
        flipped[mid] ^= 0x01;
        add(
            "flipped_byte",
            "the valid receipt with one payload bit flipped",
            flipped,
            "bad_signature",
        );
        add(
            "unknown_signer",
            "the valid payload signed by a key in no stage's evidence",
            sign_receipt(&key("foreign key"), &self.body(self.chain(&self.links()))),
            "unknown_signer",
        );
        add(
            "signer_not_exit_stage",
            "the valid payload signed by stage 0's key instead of the exit stage's",
            sign_receipt(&self.keys[0], &self.body(self.chain(&self.links()))),
            "signer_not_exit_stage",
        );
        add(
            "stage_swapped",
            "stage 1's link signed by a key in no evidence (an unattested stage)",
            self.receipt_with_chain(|c, _| {
                let mut l = self.links()[1].clone();
                l.prev_link_digest = Some(link_digest(&c[0]));
                c[1] = sign_link(&key("foreign key"), &l);
            }),
            "link_unknown_signer",
        );
        add(
            "chain_reordered",
            "signed links 0 and 1 swapped",
            self.receipt_with_chain(|c, _| c.swap(0, 1)),
            "link_wrong_stage",
        );
        add(
            "chain_dropped",
            "link 1 removed",
            self.receipt_with_chain(|c, _| {
                c.remove(1);
            }),
            "chain_length",
        );
        add(
            "chain_duplicated",
            "link 1 present twice",
            self.receipt_with_chain(|c, _| {
                let l = c[1].clone();
                c.insert(1, l);
            }),
            "chain_length",
        );
        add(
            "exit_link_in_chain",
            "the exit stage's link also signed on its own and appended to the signed links",
            self.receipt_with_chain(|c, exit| c.push(sign_link(self.exit(), exit))),
            "chain_length",
        );
        add(
            "link_bad_signature",
            "one byte of link 1's payload flipped (receipt re-signed)",
            self.receipt_with_chain(|c, _| {
                let n = c[1].len();
                c[1][n - 100] ^= 0x01;
            }),
            "link_bad_signature",
        );
        add(
            "link_stage_index",
            "stage 1 claims index 2 in its link",
            self.receipt_with_links(|ls| ls[1].stage_index = 2),
            "link_stage_index",
        );
        add(
            "link_receipt_id",
            "stage 2's link names another receipt id",
            self.receipt_with_links(|ls| ls[2].receipt_id = [0xff; 16]),
            "link_receipt_id",
        );
        add(
            "link_layers",
            "stage 1's link claims layers [2, 5)",
            self.receipt_with_links(|ls| ls[1].layers = [2, 5]),
            "link_layers",
        );
        add(
            "link_evidence",
            "stage 0's link names another evidence digest",
            self.receipt_with_links(|ls| {
                ls[0].evidence_digest = Sha256Digest::of(b"other evidence")
            }),
            "link_evidence",
        );
        add(
            "link_prev_digest",
            "the exit stage's link (stage 2) points at link 0 instead of link 1",
            self.receipt_with_chain(|c, exit| exit.prev_link_digest = Some(link_digest(&c[0]))),
            "link_prev_digest",
        );
        add(
            "link_data_flow",
            "stage 2 received something other than what stage 1 sent",
            self.receipt_with_links(|ls| {
                ls[2].received_digest = Sha256Digest::of(b"other activations")
            }),
            "link_data_flow",
        );
        add(
            "chain_request_digest",
            "stage 0 received something other than the receipt's request",
            self.receipt_with_links(|ls| ls[0].received_digest = Sha256Digest::of(OTHER_REQUEST)),
            "chain_request_digest",
        );
        add(
            "chain_response_digest",
            "the exit stage sent something other than the receipt's response",
            self.receipt_with_links(|ls| ls[2].sent_digest = Sha256Digest::of(OTHER_RESPONSE)),
            "chain_response_digest",
        );
        add(
            "sealing_resealed_by_host",
            "the entry stage opened another encapsulated key than the client's (the host \
             opened the request and re-sealed it), yet the receipt says \"enclave\"",
            self.receipt_with_links(|ls| ls[0].opened = Some(OpenedKey::of(KEY_ID, &HOST_ENC))),
            "sealing_mismatch",
        );
        add(
            "link_opened_missing",
            "the entry stage's link does not say which key it opened",
            self.receipt_with_links(|ls| ls[0].opened = None),
            "link_opened",
        );
        add(
            "link_opened_misplaced",
            "a later stage's link claims to have opened the request",
            self.receipt_with_links(|ls| ls[1].opened = Some(OpenedKey::of(KEY_ID, &ENC))),
            "link_opened",
        );
        let mut gateway = self.body(self.chain(&{
            let mut ls = self.links();
            ls[0].opened = Some(OpenedKey::of(0x80, &HOST_ENC));
            ls
        }));
        gateway.sealing = Sealing::Gateway;
        add(
            "sealing_gateway",
            "sealed to the gateway's key: the entry stage opened the gateway's re-sealing \
             and the receipt says \"gateway\"",
            sign_receipt(self.exit(), &gateway),
            "ok",
        );
        let mut no_nonce = self.body(self.chain(&self.links()));
        no_nonce.client_nonce = None;
        add(
            "nonce_missing",
            "a receipt without a client nonce, one expected",
            sign_receipt(self.exit(), &no_nonce),
            "nonce_missing",
        );
        add(
            "not_canonical",
            "the valid payload with its map keys in descending order, properly signed",
            {
                let bytes = self.body(self.chain(&self.links())).to_cbor();
                let Value::Map(mut entries) =
                    ciborium::from_reader::<Value, _>(&bytes[..]).unwrap()
                else {
                    unreachable!()
                };
                entries.reverse();
                let mut payload = Vec::new();
                ciborium::into_writer(&Value::Map(entries), &mut payload).unwrap();
                proto::receipt::sign(self.exit(), RECEIPT_CONTENT_TYPE, payload)
            },
            "not_canonical",
        );

        // Cases that reuse valid.cbor with other verifier inputs.
        let reuse = |name: &str, description: &str, expect: &str| Case {
            name: name.into(),
            description: description.into(),
            receipt: "valid.cbor".into(),
            request: Some("request.json".into()),
            response: Some("response.json".into()),
            nonce: Some(hex::encode(NONCE)),
            manifest: Some(MANIFEST.into()),
            digest_salt: Some(hex::encode(DIGEST_SALT)),
            allow_mock: true,
            sealed_to: client_sealing(),
            expect: expect.into(),
        };
        cases.push(Case {
            request: None,
            response: None,
            nonce: None,
            manifest: None,
            digest_salt: None,
            sealed_to: None,
            ..reuse(
                "valid_minimal",
                "the valid receipt with no optional input (request, response, nonce, manifest skipped)",
                "ok",
            )
        });
        cases.push(Case {
            request: Some("other_request.json".into()),
            ..reuse(
                "request_mismatch",
                "the valid receipt checked against another request's bytes",
                "request_mismatch",
            )
        });
        cases.push(Case {
            response: Some("other_response.json".into()),
            ..reuse(
                "response_mismatch",
                "the valid receipt checked against another response's bytes",
                "response_mismatch",
            )
        });
        cases.push(Case {
            digest_salt: None,
            ..reuse(
                "digest_salt_missing",
                "the valid receipt checked against its request and response without the \
                 salt of its digests",
                "digest_salt_missing",
            )
        });
        cases.push(Case {
            digest_salt: Some(hex::encode([0xa5; 32])),
            ..reuse(
                "digest_salt_wrong",
                "the valid receipt checked with another salt: the request does not match",
                "request_mismatch",
            )
        });
        cases.push(Case {
            nonce: Some(hex::encode(b"nonce-0002")),
            ..reuse(
                "nonce_mismatch",
                "the valid receipt with another expected nonce",
                "nonce_mismatch",
            )
        });
        cases.push(Case {
            manifest: Some(Sha256Digest::of(b"other manifest").hex()),
            ..reuse(
                "manifest_mismatch",
                "the valid receipt with another expected manifest digest",
                "manifest_mismatch",
            )
        });
        cases.push(Case {
            allow_mock: false,
            ..reuse(
                "mock_not_allowed",
                "the valid (mock) receipt under a policy that forbids mock evidence",
                "mock_not_allowed",
            )
        });

        cases.push(Case {
            sealed_to: Some(SealedToJson {
                key_id: KEY_ID,
                enc: hex::encode(HOST_ENC),
            }),
            ..reuse(
                "sealing_not_the_clients_key",
                "the valid receipt checked by a client that sealed with another encapsulated key",
                "sealing_mismatch",
            )
        });
        let mut json = |name: &str, bytes: Vec<u8>| {
            files.insert(name.to_string(), bytes);
        };
        json("request.json", REQUEST.to_vec());
        json("response.json", RESPONSE.to_vec());
        json("other_request.json", OTHER_REQUEST.to_vec());
        json("other_response.json", OTHER_RESPONSE.to_vec());
        let mut stage_keys = serde_json::to_vec_pretty(&self.stages).unwrap();
        stage_keys.push(b'\n');
        json("stage_keys.json", stage_keys);
        let mut cases_json = serde_json::to_vec_pretty(&cases).unwrap();
        cases_json.push(b'\n');
        json("cases.json", cases_json);
        files
    }
}

#[test]
fn vectors_match_generator() {
    let files = Gen::new().files();
    let dir = dir();
    if std::env::var_os("UPDATE_RECEIPT_VECTORS").is_some() {
        // Atomic replacement (write + rename): the other test may be reading.
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in &files {
            let tmp = dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, bytes).unwrap();
            std::fs::rename(&tmp, dir.join(name)).unwrap();
        }
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let ours = name.ends_with(".cbor") || name.ends_with(".json");
            if ours && !files.contains_key(&name) {
                std::fs::remove_file(p).unwrap();
            }
        }
    }
    for (name, bytes) in &files {
        let on_disk = std::fs::read(dir.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e} (UPDATE_RECEIPT_VECTORS=1 regenerates)"));
        assert!(
            &on_disk == bytes,
            "{name} differs from the generator (UPDATE_RECEIPT_VECTORS=1 regenerates)"
        );
    }
    let mut listed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".cbor") || n.ends_with(".json"))
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        files.keys().cloned().collect::<Vec<_>>(),
        "stray or missing vector files"
    );
}

#[test]
fn vectors_verify_as_expected() {
    let dir = dir();
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let stages: Vec<StageKeys> = serde_json::from_slice(&read("stage_keys.json")).unwrap();
    let cases: Vec<Case> = serde_json::from_slice(&read("cases.json")).unwrap();
    assert!(cases.len() >= 20);
    let mut seen_reasons = std::collections::BTreeSet::new();
    for case in &cases {
        let receipt = read(&case.receipt);
        let request = case.request.as_deref().map(read);
        let response = case.response.as_deref().map(read);
        let nonce = case.nonce.as_deref().map(|n| hex::decode(n).unwrap());
        let salt: Option<DigestSalt> = case
            .digest_salt
            .as_deref()
            .map(|s| hex::decode(s).unwrap().try_into().unwrap());
        let inputs = VerifyInputs {
            receipt: &receipt,
            stages: &stages,
            request: request.as_deref(),
            response: response.as_deref(),
            digest_salt: salt.as_ref(),
            expected_nonce: nonce.as_deref(),
            expected_manifest: case
                .manifest
                .as_deref()
                .map(|m| Sha256Digest::from_hex(m).unwrap()),
            allow_mock: case.allow_mock,
            sealed_to: None,
        };
        let enc = case
            .sealed_to
            .as_ref()
            .map(|s| hex::decode(&s.enc).unwrap());
        let mut inputs = inputs;
        inputs.sealed_to = case.sealed_to.as_ref().map(|s| SealedTo {
            key_id: s.key_id,
            enc: enc.as_deref().unwrap(),
        });
        let report = verify_receipt(&inputs);
        let got = report.failure().map_or("ok", |e| e.code());
        assert_eq!(
            got,
            case.expect,
            "case {}: {}\n{}",
            case.name,
            case.description,
            report
                .checks
                .iter()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(
            seen_reasons.insert(case.name.clone()),
            "duplicate case name"
        );
    }
    // The valid vector: every byte flipped is rejected.
    let valid = read("valid.cbor");
    let verify = |receipt: &[u8]| {
        let mut inputs = VerifyInputs::new(receipt, &stages);
        inputs.allow_mock = true;
        verify_receipt(&inputs).ok()
    };
    assert!(verify(&valid));
    for i in 0..valid.len() {
        let mut bad = valid.clone();
        bad[i] ^= 0x80;
        assert!(!verify(&bad), "flip at byte {i} accepted");
    }
}

/// The stage keys, receipt, request and response kept in `dir()/version`
/// as the stages of that format made them (plain digests, no salt).
fn read_legacy(version: &str) -> (Vec<StageKeys>, Vec<u8>, Vec<u8>, Vec<u8>) {
    let dir = dir().join(version);
    let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
    let stages: Vec<StageKeys> = serde_json::from_slice(&read("stage_keys.json")).unwrap();
    (
        stages,
        read("valid.cbor"),
        read("request.json"),
        read("response.json"),
    )
}

/// Inputs for a kept legacy receipt: everything given, no salt.
fn legacy_inputs<'a>(
    (stages, receipt, request, response): &'a (Vec<StageKeys>, Vec<u8>, Vec<u8>, Vec<u8>),
) -> VerifyInputs<'a> {
    let mut inputs = VerifyInputs::new(receipt, stages);
    inputs.request = Some(request);
    inputs.response = Some(response);
    inputs.expected_nonce = Some(NONCE);
    inputs.expected_manifest = Some(Sha256Digest::from_hex(MANIFEST).unwrap());
    inputs.allow_mock = true;
    inputs.sealed_to = Some(SealedTo {
        key_id: KEY_ID,
        enc: &ENC,
    });
    inputs
}

/// A v2 receipt (before links said which key the entry stage opened),
/// kept as the stages of that format made it: it still verifies, and says
/// that its `sealing` is the host's word.
#[test]
fn v2_receipt_still_verifies_as_v2() {
    let kept = read_legacy("v2");
    let mut inputs = legacy_inputs(&kept);
    let report = verify_receipt(&inputs);
    assert!(report.ok(), "{:#?}", report.checks);
    let body = report.receipt.as_ref().unwrap();
    assert_eq!(body.version, ReceiptVersion::V2);
    assert_eq!(body.sealing, Sealing::Enclave);
    let sealing = report.checks.iter().find(|c| c.name == "sealing").unwrap();
    assert_eq!(sealing.status, CheckStatus::Skipped);
    assert!(sealing.detail.contains("v2"), "{}", sealing.detail);
    assert_eq!(report.proven_sealing(), None);
    // Its bytes still matter: one flipped response byte fails.
    let mut other = kept.3.clone();
    other[10] ^= 1;
    inputs.response = Some(&other);
    assert_eq!(
        verify_receipt(&inputs).failure().map(|e| e.code()),
        Some("response_mismatch")
    );
}

/// A v3 receipt (plain SHA-256 digests), kept as the stages of that format
/// made it: it verifies without a salt, sealing proven, as v3.
#[test]
fn v3_receipt_still_verifies_as_v3() {
    let kept = read_legacy("v3");
    let mut inputs = legacy_inputs(&kept);
    let report = verify_receipt(&inputs);
    assert!(report.ok(), "{:#?}", report.checks);
    let body = report.receipt.as_ref().unwrap();
    assert_eq!(body.version, ReceiptVersion::V3);
    assert_eq!(body.request_digest, Sha256Digest::of(&kept.2));
    assert_eq!(report.proven_sealing(), Some(Sealing::Enclave));
    let mut other = kept.2.clone();
    other[10] ^= 1;
    inputs.request = Some(&other);
    assert_eq!(
        verify_receipt(&inputs).failure().map(|e| e.code()),
        Some("request_mismatch")
    );
}
