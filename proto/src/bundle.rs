//! The evidence bundle served at `GET /v1/attestation?nonce=…`, and its
//! offline verification: every stage's documents against the policy, the
//! binding of the verifier's nonce, the stage keys, and the model manifest.
//! A verified bundle yields the [`StageKeys`] that receipts are checked with.

use crate::attestation::{claims_binding, AnyVerifier, Evidence, EvidenceFormat, EvidenceVerifier};
use crate::digest::Sha256Digest;
use crate::frames::StageClaims;
use crate::policy::Policy;
use crate::receipt::StageKeys;
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

/// One line of a verification report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Whether it held.
    pub ok: bool,
    /// Details or the reason it failed.
    pub detail: String,
}

fn check(out: &mut Vec<Check>, name: String, r: Result<String, String>) -> bool {
    let ok = r.is_ok();
    let detail = r.unwrap_or_else(|e| e);
    out.push(Check { name, ok, detail });
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
    /// after the stage started.
    pub fn verify_with(
        &self,
        policy: &Policy,
        expected_nonce: &[u8],
        verifier: &AnyVerifier,
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
            );
            match r {
                Ok((k, m, is_mock)) => {
                    next_layer = s.claims.layer_end;
                    measurements.push(m.clone());
                    mock |= is_mock;
                    check(
                        &mut lines,
                        name("evidence"),
                        Ok(format!(
                            "{} evidence verifies; measurement {m} accepted; layers [{}, {}); keys and nonce bound",
                            if is_mock { "MOCK" } else { "hardware" },
                            k.layers[0],
                            k.layers[1]
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
        let entry_keys = self
            .stages
            .first()
            .map(|s| KeyConfig::decode_list(&s.claims.hpke_keys))
            .transpose()
            .map_err(|e| e.to_string())
            .and_then(|k| {
                k.filter(|k| !k.is_empty())
                    .ok_or_else(|| "the entry stage publishes no HPKE key".to_string())
            });
        all &= check(
            &mut lines,
            "entry HPKE key".into(),
            entry_keys
                .as_ref()
                .map(|k| format!("{} key(s), bound in stage 0's evidence", k.len()))
                .map_err(|e| e.clone()),
        );
        let verified = (all).then(|| VerifiedBundle {
            stage_keys: keys,
            entry_keys: entry_keys.unwrap_or_default(),
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
    ) -> Result<(StageKeys, String, bool), String> {
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
        for (what, doc) in [("fresh", &fresh), ("boot", &boot)] {
            if doc.user_data != claims_binding(doc.format, &claims_bytes) {
                return Err(format!("{what} evidence does not bind these claims"));
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
        ))
    }
}
