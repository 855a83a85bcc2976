//! Proofs, carried in an evidence bundle, that each stage's measurement is
//! a release entry of a transparency log: the log's signed checkpoint and,
//! per stage, the entry and its inclusion proof. A policy that names a log
//! key ([`crate::policy::LogPolicy`]) requires them, so `gateway verify`,
//! `gateway proxy` and the Python package check them offline and at each use.

use super::{check_inclusion, verify_checkpoint, verify_cosignatures, Entry, Hash};
use crate::digest::Sha256Digest;
use crate::policy::LogPolicy;
use serde::{Deserialize, Serialize};

/// The log's checkpoint and one proof per stage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseProofs {
    /// The checkpoint the proofs are against, as a signed note.
    #[serde(with = "serde_bytes")]
    pub checkpoint: Vec<u8>,
    /// One per stage, in stage order.
    pub stages: Vec<StageReleaseProof>,
}

/// One stage's release entry and its inclusion proof.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageReleaseProof {
    /// The stage's index.
    pub stage: u32,
    /// The entry's index in the log.
    pub index: u64,
    /// The entry's bytes (its leaf).
    #[serde(with = "serde_bytes")]
    pub entry: Vec<u8>,
    /// The inclusion proof: the RFC 6962 path hashes, 32 bytes each.
    pub proof: Vec<serde_bytes::ByteBuf>,
}

/// What one stage's evidence showed, to be matched with its release.
pub struct VerifiedStage<'a> {
    /// The stage's index.
    pub index: u32,
    /// Its measurement in pinned form (`mock:…`, `nitro:pcr0=…`).
    pub measurement: &'a str,
    /// Its layer range.
    pub layers: [u32; 2],
}

/// The log's name in a signed-note verifier key (`<name>+<id>+<key>`).
pub fn log_origin(vkey: &str) -> Result<&str, String> {
    // The key's base64 may hold '+' itself: name, id, then the rest.
    match vkey.splitn(3, '+').collect::<Vec<_>>()[..] {
        [name, id, key] if !name.is_empty() && !id.is_empty() && !key.is_empty() => Ok(name),
        _ => Err("the log key is not a signed-note verifier key (<name>+<id>+<key>)".into()),
    }
}

impl ReleaseProofs {
    /// Checks that every stage in `stages` is a release entry of the
    /// policy's log, for `manifest`, proven included in a checkpoint signed
    /// by the log's key and cosigned by the policy's quorum of witnesses; a
    /// summary, or why not.
    pub fn check(
        &self,
        log: &LogPolicy,
        stages: &[VerifiedStage],
        manifest: &Sha256Digest,
    ) -> Result<String, String> {
        let origin = log_origin(&log.log_key)?;
        let cp = verify_checkpoint(&self.checkpoint, &log.log_key, origin)
            .map_err(|e| format!("the log's checkpoint: {e}"))?;
        let witnessed = check_quorum(&self.checkpoint, log)?;
        if self.stages.len() != stages.len() {
            return Err(format!(
                "{} release proofs for {} stages",
                self.stages.len(),
                stages.len()
            ));
        }
        let mut at = Vec::new();
        for (p, s) in self.stages.iter().zip(stages) {
            let fail = |why: String| format!("stage {}: {why}", s.index);
            if p.stage != s.index {
                return Err(fail(format!("the proof is for stage {}", p.stage)));
            }
            let Ok(Entry::Release(r)) = Entry::from_bytes(&p.entry) else {
                return Err(fail("the proven entry is not a release entry".into()));
            };
            if !r.is_release_of(s.measurement, manifest, s.layers) {
                return Err(fail(format!(
                    "entry {} is the release of {} (layers [{}, {}), manifest {}), not of this stage's {} (layers [{}, {}))",
                    p.index,
                    r.measurement.pinned_form(),
                    r.layers.0,
                    r.layers.1,
                    r.manifest_digest.hex(),
                    s.measurement,
                    s.layers[0],
                    s.layers[1]
                )));
            }
            let path = p
                .proof
                .iter()
                .map(|h| <[u8; 32]>::try_from(&h[..]).map(Hash))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| fail("a proof hash is not 32 bytes".into()))?;
            check_inclusion(&path, cp.size(), *cp.hash(), p.index, &p.entry).map_err(|_| {
                fail(format!(
                    "entry {} is not proven included in {origin} at size {}",
                    p.index,
                    cp.size()
                ))
            })?;
            at.push(p.index);
        }
        Ok(format!(
            "every stage is a release of log {origin} (entries {at:?}), proven included at size {} under the policy's key{witnessed}",
            cp.size()
        ))
    }
}

/// Checks that `note` carries cosignatures from the policy's quorum of
/// witnesses; a phrase for the summary, or why not.
pub fn check_quorum(note: &[u8], log: &LogPolicy) -> Result<String, String> {
    let need = log.quorum();
    if need == 0 {
        return Ok(String::new());
    }
    if need > log.witnesses.len() {
        return Err(format!(
            "the policy requires {need} witness cosignatures and names {} witnesses",
            log.witnesses.len()
        ));
    }
    let got = verify_cosignatures(note, &log.witnesses)
        .map_err(|e| format!("the log's checkpoint: {e}"))?;
    let names: Vec<_> = got.iter().map(|c| c.witness.as_str()).collect();
    if got.len() < need {
        return Err(format!(
            "the log's checkpoint carries {} valid cosignature(s) from the policy's witnesses ({names:?}), the policy requires {need}: a checkpoint the witnesses did not see (a split view), or witnesses not reached",
            got.len()
        ));
    }
    Ok(format!(
        ", cosigned by {} of the policy's witnesses {names:?}",
        got.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::log_origin;

    #[test]
    fn a_log_origin_is_read_from_keys_whose_base64_holds_plus_signs() {
        assert_eq!(
            log_origin("example.com/log+1a2b3c4d+AQ+b/c+d=="),
            Ok("example.com/log")
        );
        assert_eq!(
            log_origin("example.com/log+1a2b3c4d+AQID"),
            Ok("example.com/log")
        );
        for bad in ["", "name", "name+id", "+id+key", "name++key", "name+id+"] {
            assert!(log_origin(bad).is_err(), "{bad}");
        }
    }
}
