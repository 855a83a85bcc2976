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
    /// The entry stage's published HPKE key set as a key-set entry, with
    /// its inclusion proof (gateways before key-set logging send none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_set: Option<EntryProof>,
}

/// An entry and its inclusion proof against the bundle's checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryProof {
    /// The entry's index in the log.
    pub index: u64,
    /// The entry's bytes (its leaf).
    #[serde(with = "serde_bytes")]
    pub entry: Vec<u8>,
    /// The inclusion proof: the RFC 6962 path hashes, 32 bytes each.
    pub proof: Vec<serde_bytes::ByteBuf>,
}

/// Checks that `entry` is record `index` of the tree `cp` by `proof`.
fn check_included(
    cp: &super::Checkpoint,
    index: u64,
    entry: &[u8],
    proof: &[serde_bytes::ByteBuf],
) -> Result<(), String> {
    let path = proof
        .iter()
        .map(|h| <[u8; 32]>::try_from(&h[..]).map(Hash))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| "a proof hash is not 32 bytes".to_string())?;
    check_inclusion(&path, cp.size(), *cp.hash(), index, entry).map_err(|_| {
        format!(
            "entry {index} is not proven included in {} at size {}",
            cp.origin(),
            cp.size()
        )
    })
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
    super::note_key::split_key(vkey)
        .map(|(name, _, _)| name)
        .ok_or_else(|| "the log key is not a signed-note verifier key (<name>+<id>+<key>)".into())
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
            check_included(&cp, p.index, &p.entry, &p.proof).map_err(fail)?;
            at.push(p.index);
        }
        Ok(format!(
            "every stage is a release of log {origin} (entries {at:?}), proven included at size {} under the policy's key{witnessed}",
            cp.size()
        ))
    }

    /// Checks that the entry stage's published key set (`published`: the
    /// signed key-set bytes, or the key list its evidence binds) with the
    /// key ids `key_ids` is a key-set entry of the policy's log, proven
    /// included in the bundle's checkpoint (whose signature and witnesses
    /// [`Self::check`] judges); a summary, or why not.
    pub fn check_key_set(
        &self,
        log: &LogPolicy,
        published: &[u8],
        key_ids: &[u8],
    ) -> Result<String, String> {
        let origin = log_origin(&log.log_key)?;
        let cp = verify_checkpoint(&self.checkpoint, &log.log_key, origin)
            .map_err(|e| format!("the log's checkpoint: {e}"))?;
        let Some(p) = &self.key_set else {
            return Err(format!(
                "the bundle proves no key-set entry: keys {key_ids:?} are not shown logged in {origin}"
            ));
        };
        let Ok(Entry::KeySet(k)) = Entry::from_bytes(&p.entry) else {
            return Err("the proven entry is not a key-set entry".into());
        };
        let digest = Sha256Digest::of(published);
        if k.key_set_digest != digest || k.key_ids != key_ids {
            return Err(format!(
                "entry {} logs the key set {} (keys {:?}), not the one the entry stage publishes, {} (keys {key_ids:?})",
                p.index,
                k.key_set_digest.hex(),
                k.key_ids,
                digest.hex()
            ));
        }
        check_included(&cp, p.index, &p.entry, &p.proof)?;
        Ok(format!(
            "keys {key_ids:?} are key-set entry {} of log {origin}, proven included at size {}",
            p.index,
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
            log_origin("example.com/log+1a2b3c4d+AQ+b/c+d"),
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
