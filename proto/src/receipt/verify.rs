//! Verification of a receipt against stage keys from verified evidence:
//! one report line per check (`docs/receipts.md` §5).

use super::error::ReceiptError;
use super::format::{Link, OpenedKey, ReceiptBody, ReceiptVersion, Sealing};
use super::report::{CheckStatus, Report, VerifyReport};
use super::salt::{salted_digest, DigestSalt};
use super::sign::{link_digest, parse_receipt, parse_signed, verifies};
use crate::digest::Sha256Digest;
use serde::{Deserialize, Serialize};
pub(super) mod hex_or_bytes {
    //! `[u8; 32]` as lower-case hex in human-readable formats (JSON) and as a
    //! byte string otherwise (CBOR).
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8; 32], s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.serialize_str(&hex::encode(v))
        } else {
            serde_bytes::serialize(v, s)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 32], D::Error> {
        let v: Vec<u8> = if d.is_human_readable() {
            let s = String::deserialize(d)?;
            hex::decode(s.strip_prefix("sha256:").unwrap_or(&s)).map_err(D::Error::custom)?
        } else {
            serde_bytes::deserialize(d)?
        };
        v.try_into()
            .map_err(|_| D::Error::custom("expected 32 bytes"))
    }

    pub mod digest {
        use crate::digest::Sha256Digest;
        use serde::{Deserializer, Serializer};

        pub fn serialize<S: Serializer>(v: &Sha256Digest, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(&v.0, s)
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Sha256Digest, D::Error> {
            super::deserialize(d).map(Sha256Digest)
        }
    }
}

/// What the verifier trusts about one stage, taken from its verified
/// evidence. In JSON the digest and key are hex strings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageKeys {
    /// The stage's index (0 = entry stage).
    pub stage_index: u32,
    /// The stage's layer range `[start, end)` from its claims.
    pub layers: [u32; 2],
    /// Digest of the stage's evidence.
    #[serde(with = "hex_or_bytes::digest")]
    pub evidence_digest: Sha256Digest,
    /// The stage's Ed25519 receipt-signing public key.
    #[serde(with = "hex_or_bytes")]
    pub receipt_key: [u8; 32],
}

/// What to verify a receipt against.
#[derive(Clone, Copy, Debug)]
pub struct VerifyInputs<'a> {
    /// The receipt (COSE_Sign1 bytes).
    pub receipt: &'a [u8],
    /// Every stage's trusted keys, in stage order.
    pub stages: &'a [StageKeys],
    /// The exact request bytes the client sent, if kept.
    pub request: Option<&'a [u8]>,
    /// The exact response bytes the client received, if kept.
    pub response: Option<&'a [u8]>,
    /// The salt of the receipt's digests (v4), from the sealed response's
    /// trailer; needed to check `request` and `response`.
    pub digest_salt: Option<&'a DigestSalt>,
    /// The nonce the client sent, if any.
    pub expected_nonce: Option<&'a [u8]>,
    /// The manifest digest the evidence names, if it should be checked.
    pub expected_manifest: Option<Sha256Digest>,
    /// Whether the caller's policy accepts mock evidence.
    pub allow_mock: bool,
    /// The HPKE key the client sealed its request to, if it sealed it and
    /// kept the encapsulated key: checked against what the entry stage says
    /// it opened ([`Link::opened`]).
    pub sealed_to: Option<SealedTo<'a>>,
}

/// The HPKE key a client sealed its request to.
#[derive(Clone, Copy, Debug)]
pub struct SealedTo<'a> {
    /// The key id it sealed to.
    pub key_id: u8,
    /// The encapsulated key it sent (`hpke-encapsulated-key`).
    pub enc: &'a [u8],
}

impl<'a> VerifyInputs<'a> {
    /// Inputs with only the receipt and the stages; everything optional
    /// unset and mock forbidden.
    pub fn new(receipt: &'a [u8], stages: &'a [StageKeys]) -> Self {
        Self {
            receipt,
            stages,
            request: None,
            response: None,
            digest_salt: None,
            expected_nonce: None,
            expected_manifest: None,
            allow_mock: false,
            sealed_to: None,
        }
    }
}

pub(super) fn check_stage_keys(stages: &[StageKeys]) -> Result<String, ReceiptError> {
    let bad = |m: String| Err(ReceiptError::BadStageKeys(m));
    if stages.is_empty() {
        return bad("no stages".into());
    }
    for (i, s) in stages.iter().enumerate() {
        if s.stage_index as usize != i {
            return bad(format!("entry {i} has stage index {}", s.stage_index));
        }
        if s.layers[0] >= s.layers[1] {
            return bad(format!("stage {i} has an empty layer range"));
        }
        if i > 0 && stages[i - 1].layers[1] != s.layers[0] {
            return bad(format!(
                "stage {i}'s layers do not follow stage {}'s",
                i - 1
            ));
        }
        if stages[..i].iter().any(|p| p.receipt_key == s.receipt_key) {
            return bad(format!(
                "stage {i} shares its receipt key with another stage"
            ));
        }
    }
    Ok(format!(
        "{} stages, layers {}..{}",
        stages.len(),
        stages[0].layers[0],
        stages[stages.len() - 1].layers[1]
    ))
}

pub(super) fn stage_of(stages: &[StageKeys], key: &[u8; 32]) -> Option<u32> {
    stages
        .iter()
        .find(|s| &s.receipt_key == key)
        .map(|s| s.stage_index)
}

/// Verifies a receipt. Never panics on hostile input; every failure is a
/// failed check with its reason. The verdict is the first failure in this
/// order: stage keys, receipt structure and headers, receipt signature,
/// signer, payload, mock policy, manifest, chain length, each link in order
/// (structure, signature, signer, payload, stage index, receipt id, layers,
/// evidence, previous-link digest, data flow), chain end, request bytes,
/// response bytes, nonce. A failure of the first five stops verification.
pub fn verify_receipt(inputs: &VerifyInputs<'_>) -> VerifyReport {
    let mut r = Report(Vec::new());
    let receipt = verify_into(inputs, &mut r);
    let sealing_proven =
        r.0.iter()
            .any(|c| c.name == "sealing" && c.status == CheckStatus::Pass);
    VerifyReport {
        checks: r.0,
        receipt,
        sealing_proven,
    }
}

pub(super) fn verify_into(inputs: &VerifyInputs<'_>, r: &mut Report) -> Option<ReceiptBody> {
    let stages = inputs.stages;
    if !r.check("stage_keys", check_stage_keys(stages)) {
        return None;
    }
    let exit = &stages[stages.len() - 1];

    let (signed, version) = r.require("receipt.structure", parse_receipt(inputs.receipt))?;
    r.pass(
        "receipt.structure",
        format!(
            "COSE_Sign1, EdDSA, {}, 32-byte kid",
            version.receipt_content_type()
        ),
    );
    if !r.check(
        "receipt.signature",
        if verifies(&signed, &signed.kid) {
            Ok(format!("valid under kid {}", hex::encode(signed.kid)))
        } else {
            Err(ReceiptError::BadSignature)
        },
    ) {
        return None;
    }
    let signer = if signed.kid == exit.receipt_key {
        Ok(format!("exit stage {}'s receipt key", exit.stage_index))
    } else {
        match stage_of(stages, &signed.kid) {
            Some(stage) => Err(ReceiptError::SignerNotExitStage { stage }),
            None => Err(ReceiptError::UnknownSigner),
        }
    };
    if !r.check("receipt.signer", signer) {
        return None;
    }
    let body = r.require(
        "receipt.payload",
        ReceiptBody::from_cbor(&signed.payload, version),
    )?;
    r.pass(
        "receipt.payload",
        format!(
            "id {}, {} {}, sequence {}, sealing {}",
            hex::encode(body.receipt_id),
            body.endpoint,
            body.model_id,
            body.sequence,
            body.sealing.as_str()
        ),
    );

    r.check(
        "mock",
        match (body.mock, inputs.allow_mock) {
            (false, _) => Ok("not mock".into()),
            (true, true) => Ok("MOCK receipt (allowed by policy)".into()),
            (true, false) => Err(ReceiptError::MockNotAllowed),
        },
    );
    match inputs.expected_manifest {
        Some(m) => {
            r.check(
                "manifest",
                if m == body.manifest_digest {
                    Ok(format!("manifest {}", m.hex()))
                } else {
                    Err(ReceiptError::ManifestMismatch)
                },
            );
        }
        None => r.skip("manifest", "no expected manifest given"),
    }

    let entry_link = check_chain(&body, stages, r);

    let content = [
        (
            "request",
            inputs.request,
            body.request_digest,
            ReceiptError::RequestMismatch,
        ),
        (
            "response",
            inputs.response,
            body.response_digest,
            ReceiptError::ResponseMismatch,
        ),
    ];
    for (name, bytes, carried, mismatch) in content {
        let Some(bytes) = bytes else {
            r.skip(name, format!("no {name} bytes given"));
            continue;
        };
        let plain = Sha256Digest::of(bytes);
        let outcome = match (body.version.salted(), inputs.digest_salt) {
            (false, _) if plain == carried => Ok(format!("sha256 {}", carried.hex())),
            (true, Some(salt)) if salted_digest(salt, &plain) == carried => {
                Ok(format!("salted sha256 {}", carried.hex()))
            }
            (true, None) => Err(ReceiptError::DigestSaltMissing),
            _ => Err(mismatch),
        };
        r.check(name, outcome);
    }
    match (inputs.expected_nonce, &body.client_nonce) {
        (None, None) => r.skip("nonce", "no nonce expected or carried"),
        (None, Some(n)) => r.skip("nonce", format!("carries {} (not checked)", hex::encode(n))),
        (Some(_), None) => r.fail("nonce", ReceiptError::NonceMissing),
        (Some(e), Some(n)) => {
            r.check(
                "nonce",
                if e == n.as_slice() {
                    Ok(format!("matches {}", hex::encode(n)))
                } else {
                    Err(ReceiptError::NonceMismatch)
                },
            );
        }
    }
    check_sealing(&body, entry_link.as_ref(), inputs.sealed_to, r);
    Some(body)
}

/// Whether the entry stage opened the key the client sealed to.
pub(super) fn check_sealing(
    body: &ReceiptBody,
    entry_link: Option<&Link>,
    sealed_to: Option<SealedTo<'_>>,
    r: &mut Report,
) {
    let claimed = body.sealing.as_str();
    if body.version == ReceiptVersion::V2 {
        r.skip(
            "sealing",
            format!(
                "a v2 receipt does not say which key the entry stage opened: \
                 sealing {claimed:?} is the host's word"
            ),
        );
        return;
    }
    let Some(opened) = entry_link.and_then(|l| l.opened) else {
        r.skip("sealing", "the entry stage's link is unusable");
        return;
    };
    let Some(client) = sealed_to else {
        r.skip(
            "sealing",
            format!(
                "the receipt says {claimed:?} (the host's word); the entry stage opened {opened}: \
                 give the client's encapsulated key to check that it was the client's"
            ),
        );
        return;
    };
    let yours = opened == OpenedKey::of(client.key_id, client.enc);
    let mismatch = || {
        ReceiptError::SealingMismatch(if yours {
            format!("the receipt says {claimed:?}, but the entry stage opened the client's own key")
        } else {
            format!(
                "the receipt says {claimed:?}, but the entry stage opened {opened}, not the key \
                 the client sealed to (key id {}): the host opened the request",
                client.key_id
            )
        })
    };
    r.check(
        "sealing",
        match (yours, body.sealing) {
            (true, Sealing::Enclave) => Ok(format!(
                "enclave: the entry stage opened the key the client sealed to ({opened}); \
                 the host relayed ciphertext only"
            )),
            (false, Sealing::Gateway) => Ok(format!(
                "gateway: the entry stage opened {opened}, not the client's: the gateway opened \
                 the request and re-sealed it (the client sealed to the gateway's key)"
            )),
            _ => Err(mismatch()),
        },
    );
}

/// Runs the chain checks; returns the entry stage's link if it is usable.
pub(super) fn check_chain(
    body: &ReceiptBody,
    stages: &[StageKeys],
    r: &mut Report,
) -> Option<Link> {
    let links = body.links();
    r.check(
        "chain.length",
        if links == stages.len() {
            Ok(format!(
                "{} signed links and the exit stage's link",
                body.chain.len()
            ))
        } else {
            Err(ReceiptError::ChainLength {
                expected: stages.len(),
                got: links,
            })
        },
    );
    let exit_stage = stages[stages.len() - 1].stage_index;
    let mut prev: Option<Link> = None;
    let mut entry: Option<Link> = None;
    for (i, stage) in stages.iter().enumerate().take(links) {
        let name = |what: &str| format!("link[{i}].{what}");
        let link = match body.chain.get(i) {
            Some(bytes) => check_link(i, bytes, body.version, stage, stages, r),
            None => {
                // The exit stage's link: signed by the receipt's signature,
                // whose key `receipt.signer` found to be the exit stage's.
                r.pass(name("signature"), "covered by the receipt's signature");
                let signer = if stage.stage_index == exit_stage {
                    Ok(format!("exit stage {exit_stage}'s receipt key"))
                } else {
                    Err(ReceiptError::LinkWrongStage {
                        position: i,
                        signer_stage: exit_stage,
                    })
                };
                r.check(name("signer"), signer)
                    .then(|| body.exit_link.clone())
            }
        };
        let Some(link) = link else {
            prev = None;
            continue;
        };
        r.check(
            name("stage_index"),
            if link.stage_index as usize == i {
                Ok(format!("stage {i}"))
            } else {
                Err(ReceiptError::LinkStageIndex {
                    position: i,
                    got: link.stage_index,
                })
            },
        );
        if body.version != ReceiptVersion::V2 {
            r.check(
                name("opened"),
                match (i, link.opened) {
                    (0, Some(o)) => Ok(format!("the entry stage opened {o}")),
                    (1.., None) => Ok("not the entry stage".into()),
                    _ => Err(ReceiptError::LinkOpened { position: i }),
                },
            );
        }
        r.check(
            name("receipt_id"),
            if link.receipt_id == body.receipt_id {
                Ok("matches the receipt".into())
            } else {
                Err(ReceiptError::LinkReceiptId { position: i })
            },
        );
        r.check(
            name("layers"),
            if link.layers == stage.layers {
                Ok(format!("layers {}..{}", link.layers[0], link.layers[1]))
            } else {
                Err(ReceiptError::LinkLayers { position: i })
            },
        );
        r.check(
            name("evidence"),
            if link.evidence_digest == stage.evidence_digest {
                Ok(format!("evidence {}", link.evidence_digest.hex()))
            } else {
                Err(ReceiptError::LinkEvidence { position: i })
            },
        );
        let expected_prev = (i > 0).then(|| link_digest(&body.chain[i - 1]));
        r.check(
            name("prev_link"),
            if link.prev_link_digest == expected_prev {
                Ok(match expected_prev {
                    Some(d) => format!("follows link {} ({})", i - 1, d.hex()),
                    None => "first link (null)".into(),
                })
            } else {
                Err(ReceiptError::LinkPrevDigest { position: i })
            },
        );
        if i == 0 {
            r.check(
                name("data_flow"),
                if link.received_digest == body.request_digest {
                    Ok("received the receipt's request".into())
                } else {
                    Err(ReceiptError::ChainRequestDigest)
                },
            );
        } else if let Some(p) = &prev {
            r.check(
                name("data_flow"),
                if link.received_digest == p.sent_digest {
                    Ok(format!("received what stage {} sent", i - 1))
                } else {
                    Err(ReceiptError::LinkDataFlow { position: i })
                },
            );
        } else {
            r.skip(name("data_flow"), "previous link unusable");
        }
        if i == 0 {
            entry = Some(link.clone());
        }
        prev = Some(link);
    }
    if links == stages.len() {
        match &prev {
            Some(last) => {
                r.check(
                    "chain.response",
                    if last.sent_digest == body.response_digest {
                        Ok("exit stage sent the receipt's response".into())
                    } else {
                        Err(ReceiptError::ChainResponseDigest)
                    },
                );
            }
            None => r.skip("chain.response", "last link unusable"),
        }
    }
    entry
}

/// Structure, signature, signer and payload of link `i`.
pub(super) fn check_link(
    i: usize,
    bytes: &[u8],
    version: ReceiptVersion,
    stage: &StageKeys,
    stages: &[StageKeys],
    r: &mut Report,
) -> Option<Link> {
    let name = |what: &str| format!("link[{i}].{what}");
    let malformed = |detail: String| ReceiptError::LinkMalformed {
        position: i,
        detail,
    };
    let parsed = parse_signed(bytes, version.link_content_type());
    let signed = r.require(
        name("structure"),
        parsed.map_err(|e| malformed(e.to_string())),
    )?;
    if !verifies(&signed, &signed.kid) {
        r.fail(
            name("signature"),
            ReceiptError::LinkBadSignature { position: i },
        );
        return None;
    }
    r.pass(name("signature"), "valid under its kid");
    let signer = if signed.kid == stage.receipt_key {
        Ok(format!("stage {}'s receipt key", stage.stage_index))
    } else {
        match stage_of(stages, &signed.kid) {
            Some(signer_stage) => Err(ReceiptError::LinkWrongStage {
                position: i,
                signer_stage,
            }),
            None => Err(ReceiptError::LinkUnknownSigner { position: i }),
        }
    };
    if !r.check(name("signer"), signer) {
        return None;
    }
    match Link::from_cbor_as(&signed.payload, version) {
        Ok(l) => {
            r.pass(name("payload"), "decodes");
            Some(l)
        }
        Err(e) => {
            let e = match e {
                ReceiptError::Malformed(d) => malformed(d),
                ReceiptError::NotCanonical => malformed("not deterministic CBOR".into()),
                other => other,
            };
            r.fail(name("payload"), e);
            None
        }
    }
}
