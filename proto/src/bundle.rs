//! The evidence bundle served at `GET /v1/attestation?nonce=…`, and its
//! offline verification: every stage's documents against the policy, the
//! binding of the verifier's nonce, the stage keys, and the model manifest.
//! A verified bundle yields the [`StageKeys`] that receipts are checked with.

use crate::attestation::{
    claims_binding, legacy_claims_binding, AnyVerifier, Evidence, EvidenceFormat, EvidencePurpose,
    EvidenceVerifier,
};
use crate::digest::Sha256Digest;
use crate::frames::StageClaims;
use crate::key_rotation::KeySet;
use crate::policy::Policy;
use crate::receipt::StageKeys;
use crate::report::{Check, CheckStatus};
use crate::sealing::KeyConfig;
use serde::{Deserialize, Serialize};

/// One stage's part of the bundle.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageEvidence {
    /// Stage index.
    pub index: u32,
    /// The stage's claims (keys, layers, manifest), also bound in both documents.
    pub claims: StageClaims,
    /// Evidence made at stage start (empty nonce); receipt links name its digest.
    pub boot_evidence: Evidence,
    /// Fresh evidence bound to the bundle's nonce.
    pub evidence: Evidence,
    /// The entry stage's HPKE keys, signed with its receipt key
    /// ([`KeySet`]); absent elsewhere (and from entry stages that predate
    /// key sets, whose claims carry their one key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_set: Option<serde_bytes::ByteBuf>,
}

/// What `GET /v1/attestation` returns (CBOR; JSON for people).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvidenceBundle {
    /// The verifier's nonce the fresh documents bind.
    #[serde(with = "serde_bytes")]
    pub nonce: Vec<u8>,
    /// The model manifest, exact bytes.
    #[serde(with = "serde_bytes")]
    pub manifest: Vec<u8>,
    /// Every stage, entry stage first.
    pub stages: Vec<StageEvidence>,
    /// Proofs that the stages' measurements are logged releases, from a
    /// gateway with a transparency log (required by a policy that names
    /// one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transparency: Option<crate::transparency::ReleaseProofs>,
}

/// What a verified bundle establishes.
#[derive(Clone, Debug)]
pub struct VerifiedBundle {
    /// Keys to check receipts with, in stage order.
    pub stage_keys: Vec<StageKeys>,
    /// The entry stage's (enclave-held) HPKE keys.
    pub entry_keys: Vec<KeyConfig>,
    /// Digest of the manifest.
    pub manifest_digest: Sha256Digest,
    /// Whether any stage's evidence is mock.
    pub mock: bool,
    /// Pinned form of each stage's measurement.
    pub measurements: Vec<String>,
}

/// Whether a bundle check accepts evidence made before documents carried a
/// purpose label (`user_data` = the legacy claims binding,
/// [`legacy_claims_binding`]). Such a document says nothing about what it
/// was made for, so a check that is about to trust a stage's keys refuses
/// it; only an offline check of a bundle archived before the label existed
/// has a reason to accept it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LegacyEvidence {
    /// Refused, naming the reason (the default, and what every online
    /// client path uses).
    #[default]
    Refuse,
    /// Accepted and reported as `LEGACY` (`gateway verify evidence` and
    /// `gateway verify receipt`, offline).
    Accept,
}

fn check(out: &mut Vec<Check>, name: String, r: Result<String, String>) -> bool {
    let ok = r.is_ok();
    let status = if ok {
        CheckStatus::Pass
    } else {
        CheckStatus::Fail
    };
    out.push(Check::new(status, name, r.unwrap_or_else(|e| e)));
    ok
}

impl EvidenceBundle {
    /// Verifies the bundle against `policy` and the nonce the verifier sent.
    /// Returns one line per check and, when all hold, what was established.
    /// Nitro documents are judged with the pinned AWS root at the system
    /// clock (see [`Self::verify_with`]).
    pub fn verify(
        &self,
        policy: &Policy,
        expected_nonce: &[u8],
    ) -> (Vec<Check>, Option<VerifiedBundle>) {
        self.verify_with(policy, expected_nonce, &AnyVerifier::default())
    }

    /// As [`Self::verify`], with the documents checked by `verifier` (e.g.
    /// Nitro certificates judged at a given time). Fresh evidence is judged
    /// at the verifier's time; boot evidence (made at stage start, bound to
    /// no nonce) at its own time, since its leaf certificate expires hours
    /// after the stage started. Legacy evidence is refused
    /// ([`Self::verify_accepting`] says otherwise).
    pub fn verify_with(
        &self,
        policy: &Policy,
        expected_nonce: &[u8],
        verifier: &AnyVerifier,
    ) -> (Vec<Check>, Option<VerifiedBundle>) {
        self.verify_accepting(policy, expected_nonce, verifier, LegacyEvidence::Refuse)
    }

    /// As [`Self::verify_with`], with legacy evidence accepted or not.
    pub fn verify_accepting(
        &self,
        policy: &Policy,
        expected_nonce: &[u8],
        verifier: &AnyVerifier,
        legacy: LegacyEvidence,
    ) -> (Vec<Check>, Option<VerifiedBundle>) {
        let mut lines = Vec::new();
        let mut all = true;
        let manifest_digest = Sha256Digest::of(&self.manifest);
        all &= check(
            &mut lines,
            "nonce".into(),
            if self.nonce == expected_nonce {
                Ok(format!(
                    "bundle binds nonce {}",
                    hex::encode(expected_nonce)
                ))
            } else {
                Err("the bundle's nonce is not the one sent (stale or replayed evidence)".into())
            },
        );
        all &= check(
            &mut lines,
            "stage count".into(),
            if !self.stages.is_empty() && self.stages.len() == policy.stages.len() {
                Ok(format!("{} stages, as the policy names", self.stages.len()))
            } else {
                Err(format!(
                    "{} stages in the bundle, the policy names {}",
                    self.stages.len(),
                    policy.stages.len()
                ))
            },
        );
        let mut keys = Vec::new();
        let mut measurements = Vec::new();
        let mut mock = false;
        let mut next_layer = 0;
        for (pos, s) in self.stages.iter().enumerate() {
            let name = |what: &str| format!("stage {}: {what}", s.index);
            let r = self.verify_stage(
                pos,
                s,
                policy,
                expected_nonce,
                &manifest_digest,
                next_layer,
                verifier,
                legacy,
            );
            match r {
                Ok((k, m, is_mock, legacy)) => {
                    next_layer = s.claims.layer_end;
                    measurements.push(m.clone());
                    mock |= is_mock;
                    check(
                        &mut lines,
                        name("evidence"),
                        Ok(format!(
                            "{} evidence verifies; measurement {m} accepted; layers [{}, {}); keys and nonce bound{}",
                            if is_mock { "MOCK" } else { "hardware" },
                            k.layers[0],
                            k.layers[1],
                            if legacy {
                                "; LEGACY evidence made before documents carried a purpose label"
                            } else {
                                ""
                            }
                        )),
                    );
                    keys.push(k);
                }
                Err(e) => {
                    // Judge the next stage against this one's claimed range,
                    // so one bad stage is not reported twice.
                    next_layer = s.claims.layer_end;
                    all = false;
                    check(&mut lines, name("evidence"), Err(e));
                }
            }
        }
        if let Some(log) = &policy.transparency {
            let stages: Vec<_> = self
                .stages
                .iter()
                .zip(&measurements)
                .map(|(s, m)| crate::transparency::VerifiedStage {
                    index: s.index,
                    measurement: m,
                    layers: [s.claims.layer_start, s.claims.layer_end],
                })
                .collect();
            let logged = match &self.transparency {
                _ if !all || stages.len() != self.stages.len() => {
                    Err("not checked: a stage's evidence failed".into())
                }
                None => Err(format!(
                    "the policy requires each stage to be a release of log {}, and the bundle carries no proofs (a gateway without a transparency log, or a host that dropped them)",
                    crate::transparency::log_origin(&log.log_key).unwrap_or("?")
                )),
                Some(p) => p.check(log, &stages, &manifest_digest),
            };
            all &= check(&mut lines, "transparency log".into(), logged);
        }
        let entry_keys = match self.stages.first() {
            None => Err("the bundle has no stages".to_string()),
            Some(s) => entry_keys(&s.claims, s.key_set.as_deref().map(|k| &k[..])),
        };
        all &= check(
            &mut lines,
            "entry HPKE key".into(),
            entry_keys
                .as_ref()
                .map(|(_, detail)| detail.clone())
                .map_err(|e| e.clone()),
        );
        if let (Some(log), Some(first)) = (&policy.transparency, self.stages.first()) {
            // The keys a client is about to seal to must be logged too, so
            // that every key set ever published is in the log.
            let logged = match (&entry_keys, &self.transparency) {
                (Err(_), _) => Err("not checked: the entry keys did not verify".to_string()),
                (_, None) => Err("the bundle carries no log proofs".to_string()),
                (Ok((keys, _)), Some(p)) => {
                    let published = first.key_set.as_deref().unwrap_or(&first.claims.hpke_keys);
                    let ids: Vec<u8> = keys.iter().map(|k| k.key_id).collect();
                    p.check_key_set(log, published, &ids)
                }
            };
            all &= check(&mut lines, "logged key set".into(), logged);
        }
        let verified = (all).then(|| VerifiedBundle {
            stage_keys: keys,
            entry_keys: entry_keys.map(|(k, _)| k).unwrap_or_default(),
            manifest_digest,
            mock,
            measurements,
        });
        (lines, verified)
    }

    #[allow(clippy::too_many_arguments)]
    fn verify_stage(
        &self,
        pos: usize,
        s: &StageEvidence,
        policy: &Policy,
        nonce: &[u8],
        manifest_digest: &Sha256Digest,
        next_layer: u32,
        verifier: &AnyVerifier,
        accept_legacy: LegacyEvidence,
    ) -> Result<(StageKeys, String, bool, bool), String> {
        let c = &s.claims;
        if s.index as usize != pos || c.stage_index != s.index {
            return Err(format!(
                "out of order (position {pos}, claims stage {})",
                c.stage_index
            ));
        }
        if c.layer_start != next_layer {
            return Err(format!(
                "layers start at {}, expected {next_layer}",
                c.layer_start
            ));
        }
        if c.num_stages as usize != self.stages.len() {
            return Err(format!(
                "claims {} stages, the bundle has {}",
                c.num_stages,
                self.stages.len()
            ));
        }
        if &c.manifest_sha256 != manifest_digest {
            return Err("serves a different model manifest than the bundle's".into());
        }
        let claims_bytes = crate::cbor::to_vec(c);
        let fresh = verifier
            .verify(&s.evidence)
            .map_err(|e| format!("fresh evidence: {e}"))?;
        let boot = verifier
            .at_document_time()
            .verify(&s.boot_evidence)
            .map_err(|e| format!("boot evidence: {e}"))?;
        // Documents made before evidence carried a purpose verify, as such,
        // only where the caller accepts them; a document made for another
        // purpose never does.
        let mut legacy = false;
        for (what, doc, purpose) in [
            ("fresh", &fresh, EvidencePurpose::Attestation),
            ("boot", &boot, EvidencePurpose::Boot),
        ] {
            if doc.user_data == legacy_claims_binding(doc.format, &claims_bytes) {
                if accept_legacy == LegacyEvidence::Refuse {
                    return Err(format!(
                        "{what} evidence has the LEGACY claims binding (made before documents \
                         carried a purpose label), refused here: only an offline check of an \
                         archived bundle (`gateway verify evidence`) accepts it"
                    ));
                }
                legacy = true;
            } else if doc.user_data != claims_binding(doc.format, purpose, &claims_bytes) {
                return Err(format!(
                    "{what} evidence does not bind these claims for its purpose ({})",
                    purpose.label()
                ));
            }
            if doc.public_key != c.receipt_key {
                return Err(format!("{what} evidence does not bind the receipt key"));
            }
        }
        if fresh.measurement != boot.measurement {
            return Err("boot and fresh evidence have different measurements".into());
        }
        if fresh.nonce != nonce {
            return Err("fresh evidence does not bind the nonce (stale or replayed)".into());
        }
        policy.check(&fresh, c, None).map_err(|e| e.to_string())?;
        Ok((
            StageKeys {
                stage_index: c.stage_index,
                layers: [c.layer_start, c.layer_end],
                evidence_digest: s.boot_evidence.digest(),
                receipt_key: c.receipt_key,
            },
            fresh.measurement.pinned_form(),
            fresh.format == EvidenceFormat::Mock,
            legacy,
        ))
    }
}

/// The entry stage's HPKE keys, newest first, with a line saying where they
/// come from: its signed key set (checked against the receipt key its
/// claims carry, so only after its evidence verified is the answer
/// trusted), else the keys in its claims. Used by bundle verification and
/// by the gateway, which gets the set over the host channel.
pub fn entry_keys(
    claims: &StageClaims,
    key_set: Option<&[u8]>,
) -> Result<(Vec<KeyConfig>, String), String> {
    let (keys, detail) = match key_set {
        Some(signed) => {
            let set = KeySet::verify(signed, &claims.receipt_key)
                .map_err(|e| format!("stage 0's signed HPKE key set: {e}"))?;
            let detail = format!(
                "{} key(s), signed at {} by stage 0's attested receipt key",
                set.keys.len(),
                set.issued_at
            );
            (set.configs(), detail)
        }
        None => {
            let keys = KeyConfig::decode_list(&claims.hpke_keys).map_err(|e| e.to_string())?;
            let detail = format!("{} key(s), bound in stage 0's evidence", keys.len());
            (keys, detail)
        }
    };
    if keys.is_empty() {
        return Err("the entry stage publishes no HPKE key".into());
    }
    Ok((keys, detail))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attestation::{attest_claims, mock_measurement, AttestationProvider, MockProvider};

    const MANIFEST: &[u8] = b"manifest";

    fn claims() -> StageClaims {
        StageClaims {
            stage_index: 0,
            num_stages: 1,
            layer_start: 0,
            layer_end: 6,
            model_id: "m".into(),
            manifest_sha256: Sha256Digest::of(MANIFEST),
            receipt_key: receipt_signer().verifying_key().to_bytes(),
            hpke_keys: KeyConfig::encode_list(&[
                crate::sealing::ServerKey::derive(1, b"k").config()
            ]),
            weights: None,
        }
    }

    /// A one-stage bundle whose fresh and boot documents `make` builds
    /// from the provider, the claims and the nonce; and a policy pinning
    /// the provider's measurement.
    fn bundle(
        make: impl Fn(&MockProvider, &StageClaims, &[u8]) -> Evidence,
        boot: impl Fn(&MockProvider, &StageClaims) -> Evidence,
    ) -> (EvidenceBundle, Policy) {
        let m = mock_measurement(
            &Sha256Digest::of(b"bin"),
            &Sha256Digest::of(MANIFEST),
            &Sha256Digest::of(b"policy"),
        );
        let p = MockProvider::new("stage-0", &m);
        let c = claims();
        let policy = Policy::from_toml(&format!(
            "allow_mock = true\n[[stages]]\nindex = 0\nlayers = [0, 6]\nmeasurements = [\"{}\"]\n",
            m.pinned_form()
        ))
        .unwrap();
        let b = EvidenceBundle {
            nonce: b"nonce".to_vec(),
            manifest: MANIFEST.to_vec(),
            transparency: None,
            stages: vec![StageEvidence {
                index: 0,
                evidence: make(&p, &c, b"nonce"),
                boot_evidence: boot(&p, &c),
                claims: c,
                key_set: None,
            }],
        };
        (b, policy)
    }

    fn purposed(
        purpose: EvidencePurpose,
    ) -> impl Fn(&MockProvider, &StageClaims, &[u8]) -> Evidence {
        move |p, c, nonce| attest_claims(p, &c.receipt_key, purpose, c, nonce).unwrap()
    }

    fn boot(p: &MockProvider, c: &StageClaims) -> Evidence {
        attest_claims(p, &c.receipt_key, EvidencePurpose::Boot, c, &[]).unwrap()
    }

    /// Issue 18, finding 6: fresh evidence must have been made for
    /// `/v1/attestation`; channel or boot documents binding the same key,
    /// nonce and claims are refused.
    #[test]
    fn fresh_evidence_must_be_made_for_attestation() {
        let (b, policy) = bundle(purposed(EvidencePurpose::Attestation), boot);
        let (lines, ok) = b.verify(&policy, b"nonce");
        assert!(ok.is_some(), "{lines:?}");
        assert!(!lines.iter().any(|l| l.detail.contains("LEGACY")));
        for wrong in [EvidencePurpose::Channel, EvidencePurpose::Boot] {
            let (b, policy) = bundle(purposed(wrong), boot);
            let (lines, ok) = b.verify(&policy, b"nonce");
            assert!(ok.is_none(), "{wrong:?} accepted");
            assert!(
                lines
                    .iter()
                    .any(|l| l.failed() && l.detail.contains("for its purpose (attestation)")),
                "{lines:?}"
            );
        }
        // Boot evidence made for the channel purpose is refused too.
        let (b, policy) = bundle(purposed(EvidencePurpose::Attestation), |p, c| {
            attest_claims(p, &c.receipt_key, EvidencePurpose::Channel, c, &[]).unwrap()
        });
        assert!(b.verify(&policy, b"nonce").1.is_none());
    }

    /// A bundle archived before documents carried a purpose still
    /// verifies where the caller accepts legacy evidence, and says it is
    /// legacy evidence; by default it is refused (issue 34, item 5).
    #[test]
    fn legacy_evidence_verifies_as_legacy_only_when_accepted() {
        let legacy = |p: &MockProvider, c: &StageClaims, nonce: &[u8]| {
            let ud = legacy_claims_binding(p.format(), &crate::cbor::to_vec(c));
            p.attest(&c.receipt_key, &ud, nonce).unwrap()
        };
        let (b, policy) = bundle(legacy, |p, c| legacy(p, c, &[]));
        let v = AnyVerifier::default();
        let (lines, ok) = b.verify_accepting(&policy, b"nonce", &v, LegacyEvidence::Accept);
        assert!(ok.is_some(), "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.passed() && l.detail.contains("LEGACY")),
            "{lines:?}"
        );
        for (lines, ok) in [
            b.verify(&policy, b"nonce"),
            b.verify_accepting(&policy, b"nonce", &v, LegacyEvidence::Refuse),
        ] {
            assert!(ok.is_none(), "legacy evidence accepted by default");
            assert!(
                lines
                    .iter()
                    .any(|l| l.failed() && l.detail.contains("LEGACY claims binding")),
                "{lines:?}"
            );
        }
        // Only one of the two documents legacy: refused as well.
        let (b, policy) = bundle(purposed(EvidencePurpose::Attestation), |p, c| {
            legacy(p, c, &[])
        });
        assert!(b.verify(&policy, b"nonce").1.is_none());
        assert!(b
            .verify_accepting(&policy, b"nonce", &v, LegacyEvidence::Accept)
            .1
            .is_some());
    }

    fn receipt_signer() -> ed25519_dalek::SigningKey {
        ed25519_dalek::SigningKey::from_bytes(&[7; 32])
    }

    /// After a rotation the entry keys come from the set the entry stage
    /// signed with its attested receipt key; a set signed by any other key
    /// fails the bundle.
    #[test]
    fn a_rotated_key_set_signed_by_the_entry_stage_replaces_its_claimed_key() {
        let (mut b, policy) = bundle(purposed(EvidencePurpose::Attestation), boot);
        let rotated = crate::sealing::ServerKey::derive(42, b"rotated").config();
        let set = KeySet {
            issued_at: 1_700_000_000,
            keys: vec![(rotated.clone(), None)],
        };
        b.stages[0].key_set = Some(serde_bytes::ByteBuf::from(set.sign(&receipt_signer())));
        let (lines, ok) = b.verify(&policy, b"nonce");
        assert_eq!(ok.expect("verifies").entry_keys, vec![rotated], "{lines:?}");
        assert!(lines
            .iter()
            .any(|l| l.detail.contains("signed at 1700000000")));
        let forged = set.sign(&ed25519_dalek::SigningKey::from_bytes(&[8; 32]));
        b.stages[0].key_set = Some(serde_bytes::ByteBuf::from(forged));
        let (lines, ok) = b.verify(&policy, b"nonce");
        assert!(ok.is_none());
        assert!(
            lines
                .iter()
                .any(|l| l.failed() && l.detail.contains("signed HPKE key set")),
            "{lines:?}"
        );
    }
}
