//! Measurement policy: which stage evidence a verifier accepts.
//!
//! `config/policy.toml` pins, per stage, the measurements that may serve it
//! (mock measurements, and Nitro PCR sets in `[[stages.nitro]]`) and the
//! layer range it must claim, and says whether mock evidence and Nitro
//! debug-mode enclaves are acceptable at all. See `docs/protocol.md` and
//! `docs/attestation.md`.

use crate::claims::StageClaims;
use crate::evidence::{EvidenceFormat, Measurement, Pcrs, VerifiedDocument};
use serde::{Deserialize, Serialize};

/// One accepted Nitro PCR set (hex, 96 digits = SHA-384). PCR0, 1 and 2 are
/// required; PCR3 (IAM role), PCR4 (instance id) and PCR8 (EIF signing
/// certificate) are checked when given.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NitroPcrPolicy {
    /// Enclave image file.
    pub pcr0: String,
    /// Linux kernel and bootstrap.
    pub pcr1: String,
    /// Application.
    pub pcr2: String,
    /// IAM role of the parent instance.
    #[serde(default)]
    pub pcr3: Option<String>,
    /// Parent instance id.
    #[serde(default)]
    pub pcr4: Option<String>,
    /// Certificate the EIF was signed with.
    #[serde(default)]
    pub pcr8: Option<String>,
}

impl NitroPcrPolicy {
    fn pinned(&self) -> impl Iterator<Item = (u8, &str)> {
        [
            (0, Some(&self.pcr0)),
            (1, Some(&self.pcr1)),
            (2, Some(&self.pcr2)),
            (3, self.pcr3.as_ref()),
            (4, self.pcr4.as_ref()),
            (8, self.pcr8.as_ref()),
        ]
        .into_iter()
        .filter_map(|(i, v)| v.map(|v| (i, v.as_str())))
    }

    /// Whether every PCR it names has exactly this value in `pcrs`.
    pub fn matches(&self, pcrs: &Pcrs) -> bool {
        self.pinned().all(|(i, want)| {
            pcrs.get(i)
                .is_some_and(|have| want.eq_ignore_ascii_case(&hex::encode(have)))
        })
    }

    /// Printable form, as `Pcrs::pinned_form` prints a document's.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .pinned()
            .map(|(i, v)| format!("pcr{i}={}", v.to_ascii_lowercase()))
            .collect();
        format!("nitro:{}", parts.join(","))
    }

    fn validate(&self, stage: u32) -> Result<(), String> {
        for (i, v) in self.pinned() {
            if v.len() != 96 || hex::decode(v).is_err() {
                return Err(format!(
                    "stages[index = {stage}].nitro: pcr{i} must be 96 hex digits (SHA-384)"
                ));
            }
        }
        Ok(())
    }
}

/// Whether two Nitro measurements are the same enclave image: PCR0, 1, 2
/// and 8 all present and equal.
fn same_image(a: &Pcrs, b: &Pcrs) -> bool {
    [0u8, 1, 2, 8]
        .iter()
        .all(|&i| a.get(i).is_some() && a.get(i) == b.get(i))
}

/// One stage's entry in the policy.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct StagePolicy {
    /// Position in the pipeline (0 = entry stage).
    pub index: u32,
    /// Layer range `[start, end)` this stage must claim.
    pub layers: [u32; 2],
    /// Accepted mock measurements in pinned form (`mock:<hex>`).
    #[serde(default)]
    pub measurements: Vec<String>,
    /// Accepted Nitro PCR sets (`[[stages.nitro]]`); a Nitro document must
    /// match one of them.
    #[serde(default)]
    pub nitro: Vec<NitroPcrPolicy>,
}

/// A measurement policy.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Whether mock evidence is acceptable (never in production).
    pub allow_mock: bool,
    /// Also accept the measurement of the locally built stage binary (the
    /// one the gateway launches itself, or the verifying stage's own binary).
    /// For local development only; requires `allow_mock`.
    #[serde(default)]
    pub trust_local_build: bool,
    /// Accept Nitro enclaves in debug mode (PCRs zero; the parent can read
    /// their memory). Development only.
    #[serde(default)]
    pub allow_debug: bool,
    /// Inside an enclave: also accept a Nitro neighbour whose PCR0, 1, 2
    /// and 8 equal this enclave's own (every stage runs the same EIF, whose
    /// policy cannot pin its own PCRs). Needs the verifier's own Nitro
    /// measurement; nothing else has one.
    #[serde(default)]
    pub trust_same_image: bool,
    /// Model manifest digest every stage must claim (hex), if pinned.
    #[serde(default)]
    pub manifest_sha256: Option<String>,
    /// A transparency log every stage's measurement must be a release of
    /// (`[transparency]`): the evidence bundle must carry the proofs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transparency: Option<LogPolicy>,
    /// Per-stage entries.
    pub stages: Vec<StagePolicy>,
}

/// `[transparency]` of a policy: the log whose release entries the stages'
/// measurements must be, proven by the evidence bundle.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogPolicy {
    /// The log's verifier key, in signed-note form (`gateway log vkey`).
    pub log_key: String,
    /// Witnesses' verifier keys (C2SP tlog-cosignature, `gateway witness
    /// vkey`): the log's checkpoint must carry cosignatures from
    /// [`LogPolicy::quorum`] of them, so that the log cannot show this
    /// client a view it hides from the witnesses.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub witnesses: Vec<String>,
    /// How many distinct witnesses must cosign (default: all listed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub witness_quorum: Option<u32>,
    /// Every receipt must be proven logged: its receipt entry included in
    /// the log (an RFC 9942 inclusion receipt, `GET
    /// /v1/receipts/{id}/inclusion`, from a gateway with `[transparency]
    /// log_receipts = true`) before its answer is accepted.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub receipts_logged: bool,
}

impl LogPolicy {
    /// A policy for the log `log_key` without witnesses.
    pub fn new(log_key: String) -> Self {
        Self {
            log_key,
            witnesses: Vec::new(),
            witness_quorum: None,
            receipts_logged: false,
        }
    }

    /// How many of the witnesses must cosign a checkpoint.
    pub fn quorum(&self) -> usize {
        self.witness_quorum
            .map_or(self.witnesses.len(), |q| q as usize)
    }
}

/// Why a policy check failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// Mock evidence where the policy forbids it.
    #[error("stage {stage}: mock evidence is not accepted by this policy (allow_mock = false)")]
    MockNotAllowed {
        /// Stage index.
        stage: u32,
    },
    /// The policy has no entry for this stage.
    #[error("stage {stage}: the policy has no entry for this stage")]
    UnknownStage {
        /// Stage index.
        stage: u32,
    },
    /// The measurement is not pinned.
    #[error("stage {stage}: measurement {found} is not in the policy (accepted: {accepted})")]
    Measurement {
        /// Stage index.
        stage: u32,
        /// The measurement found.
        found: String,
        /// What the policy accepts.
        accepted: String,
    },
    /// A Nitro enclave in debug mode where the policy forbids it.
    #[error("stage {stage}: the Nitro enclave runs in debug mode (PCRs zero) and the policy does not allow debug enclaves (allow_debug = false)")]
    DebugEnclave {
        /// Stage index.
        stage: u32,
    },
    /// Claimed layer range differs.
    #[error("stage {stage}: claims layers [{found_start}, {found_end}) but the policy expects [{want_start}, {want_end})")]
    Layers {
        /// Stage index.
        stage: u32,
        /// Claimed start.
        found_start: u32,
        /// Claimed end.
        found_end: u32,
        /// Expected start.
        want_start: u32,
        /// Expected end.
        want_end: u32,
    },
    /// Claimed manifest differs.
    #[error("stage {stage}: serves model manifest {found}, the policy pins {want}")]
    Manifest {
        /// Stage index.
        stage: u32,
        /// Claimed digest.
        found: String,
        /// Pinned digest.
        want: String,
    },
}

impl Policy {
    /// Parses a policy from TOML text.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        let p: Policy = toml::from_str(text).map_err(|e| e.to_string())?;
        if p.trust_local_build && !p.allow_mock {
            return Err(
                "trust_local_build requires allow_mock (it only applies to mock evidence)".into(),
            );
        }
        for s in &p.stages {
            for n in &s.nitro {
                n.validate(s.index)?;
            }
        }
        Ok(p)
    }

    /// Reads and parses a policy file.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        let text =
            std::fs::read_to_string(path).map_err(|e| format!("policy {}: {e}", path.display()))?;
        Self::from_toml(&text).map_err(|e| format!("policy {}: {e}", path.display()))
    }

    /// The entry for a stage.
    pub fn stage(&self, index: u32) -> Option<&StagePolicy> {
        self.stages.iter().find(|s| s.index == index)
    }

    /// Checks a verified document and the stage's claims against the policy.
    ///
    /// `local_build` is the verifier's own measurement: the locally built
    /// stage binary's mock measurement (accepted for mock evidence only when
    /// `trust_local_build` is set), or inside an enclave its own Nitro PCRs
    /// (accepted only when `trust_same_image` is set).
    pub fn check(
        &self,
        doc: &VerifiedDocument,
        claims: &StageClaims,
        local_build: Option<&Measurement>,
    ) -> Result<(), PolicyError> {
        self.check_measurement(doc, claims.stage_index, local_build)?;
        self.check_claims(claims)
    }

    /// The measurement part of [`Self::check`] alone: whether `doc`'s
    /// format and measurement may serve stage `stage` (mock allowed, debug
    /// allowed, pinned or the verifier's own).
    pub fn check_measurement(
        &self,
        doc: &VerifiedDocument,
        stage: u32,
        local_build: Option<&Measurement>,
    ) -> Result<(), PolicyError> {
        match (&doc.measurement, doc.format) {
            (Measurement::Mock(_), EvidenceFormat::Mock) => {
                if !self.allow_mock {
                    return Err(PolicyError::MockNotAllowed { stage });
                }
                self.check_mock_measurement(doc, stage, local_build)?
            }
            (Measurement::Nitro(pcrs), EvidenceFormat::Nitro) => {
                self.check_nitro_measurement(pcrs, stage, local_build)?
            }
            _ => {
                return Err(PolicyError::Measurement {
                    stage,
                    found: doc.measurement.pinned_form(),
                    accepted: "a measurement of the document's own format".into(),
                })
            }
        }
        Ok(())
    }

    fn check_nitro_measurement(
        &self,
        pcrs: &Pcrs,
        stage: u32,
        local_build: Option<&Measurement>,
    ) -> Result<(), PolicyError> {
        if pcrs.is_debug() && !self.allow_debug {
            return Err(PolicyError::DebugEnclave { stage });
        }
        let entry = self
            .stage(stage)
            .ok_or(PolicyError::UnknownStage { stage })?;
        let pinned = entry.nitro.iter().any(|p| p.matches(pcrs));
        let same = self.trust_same_image
            && matches!(local_build, Some(Measurement::Nitro(own)) if same_image(own, pcrs));
        if pinned || same {
            return Ok(());
        }
        let mut accepted: Vec<String> = entry.nitro.iter().map(|p| p.describe()).collect();
        if self.trust_same_image {
            accepted.push("this enclave's own image (trust_same_image)".into());
        }
        Err(PolicyError::Measurement {
            stage,
            found: pcrs.pinned_form(),
            accepted: if accepted.is_empty() {
                "no Nitro PCR set".into()
            } else {
                accepted.join(" | ")
            },
        })
    }

    fn check_mock_measurement(
        &self,
        doc: &VerifiedDocument,
        stage: u32,
        local_build: Option<&Measurement>,
    ) -> Result<(), PolicyError> {
        let entry = self
            .stage(stage)
            .ok_or(PolicyError::UnknownStage { stage })?;
        let found = doc.measurement.pinned_form();
        let pinned = entry
            .measurements
            .iter()
            .any(|m| m.eq_ignore_ascii_case(&found));
        let local = self.trust_local_build && local_build == Some(&doc.measurement);
        if !pinned && !local {
            let mut accepted: Vec<String> = entry.measurements.clone();
            if self.trust_local_build {
                accepted.push(match local_build {
                    Some(m) => format!("{} (local build)", m.pinned_form()),
                    None => "the local build (unknown here)".into(),
                });
            }
            return Err(PolicyError::Measurement {
                stage,
                found,
                accepted: if accepted.is_empty() {
                    "nothing".into()
                } else {
                    accepted.join(", ")
                },
            });
        }
        Ok(())
    }

    /// The claims' layer range and manifest against the stage's entry.
    fn check_claims(&self, claims: &StageClaims) -> Result<(), PolicyError> {
        let stage = claims.stage_index;
        let entry = self
            .stage(stage)
            .ok_or(PolicyError::UnknownStage { stage })?;
        if [claims.layer_start, claims.layer_end] != entry.layers {
            return Err(PolicyError::Layers {
                stage,
                found_start: claims.layer_start,
                found_end: claims.layer_end,
                want_start: entry.layers[0],
                want_end: entry.layers[1],
            });
        }
        if let Some(want) = &self.manifest_sha256 {
            if !want.eq_ignore_ascii_case(&claims.manifest_sha256.hex()) {
                return Err(PolicyError::Manifest {
                    stage,
                    found: claims.manifest_sha256.hex(),
                    want: want.clone(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::Sha256Digest;

    fn doc(m: &Measurement) -> VerifiedDocument {
        VerifiedDocument {
            format: EvidenceFormat::Mock,
            module_id: "x".into(),
            timestamp_ms: 0,
            measurement: m.clone(),
            public_key: vec![],
            user_data: vec![],
            nonce: vec![],
        }
    }

    fn claims(index: u32, start: u32, end: u32) -> StageClaims {
        StageClaims {
            stage_index: index,
            num_stages: 2,
            layer_start: start,
            layer_end: end,
            model_id: "m".into(),
            manifest_sha256: Sha256Digest::of(b"manifest"),
            receipt_key: [7; 32],
            hpke_keys: Vec::new(),
            weights: None,
        }
    }

    #[test]
    fn pinned_local_and_rejected() {
        let good = Measurement::Mock(Sha256Digest::of(b"good"));
        let other = Measurement::Mock(Sha256Digest::of(b"other"));
        let text = format!(
            "allow_mock = true\n[[stages]]\nindex = 0\nlayers = [0, 3]\nmeasurements = [\"{}\"]\n",
            good.pinned_form()
        );
        let p = Policy::from_toml(&text).unwrap();
        assert!(p.check(&doc(&good), &claims(0, 0, 3), None).is_ok());
        let err = p
            .check(&doc(&other), &claims(0, 0, 3), Some(&other))
            .unwrap_err();
        assert!(
            matches!(err, PolicyError::Measurement { stage: 0, .. }),
            "{err}"
        );
        assert!(matches!(
            p.check(&doc(&good), &claims(0, 0, 2), None),
            Err(PolicyError::Layers { .. })
        ));
        assert!(matches!(
            p.check(&doc(&good), &claims(1, 3, 6), None),
            Err(PolicyError::UnknownStage { stage: 1 })
        ));

        let local = Policy::from_toml(
            "allow_mock = true\ntrust_local_build = true\n[[stages]]\nindex = 0\nlayers = [0, 3]\n",
        )
        .unwrap();
        assert!(local
            .check(&doc(&other), &claims(0, 0, 3), Some(&other))
            .is_ok());
        assert!(local
            .check(&doc(&other), &claims(0, 0, 3), Some(&good))
            .is_err());

        let strict =
            Policy::from_toml(&text.replace("allow_mock = true", "allow_mock = false")).unwrap();
        assert_eq!(
            strict.check(&doc(&good), &claims(0, 0, 3), None),
            Err(PolicyError::MockNotAllowed { stage: 0 })
        );
        assert!(
            Policy::from_toml("allow_mock = false\ntrust_local_build = true\nstages = []").is_err()
        );
    }
}
