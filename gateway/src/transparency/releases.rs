//! `[transparency]` and what `gateway serve` writes to the log at start:
//! for each pipeline that trusts the stage binary the gateway launches
//! (`trust_local_build`), one release entry per stage with the local
//! build's mock measurement, so that a client can pin it from the log
//! (`gateway policy pin --log-key`) instead of from what the server says.
//! A release of a reproducible image is logged by `gateway log add-release`
//! from its build record instead.

use super::store::{check_origin, Log};
use crate::pipeline::Pipeline;
use anyhow::{Context, Result};
use proto::digest::Sha256Digest;
use proto::transparency::{Entry, Measurement, ReleaseEntry};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The version text of a local build's release entries.
pub const LOCAL_BUILD_VERSION: &str = concat!("local build, gateway ", env!("CARGO_PKG_VERSION"));

/// `[transparency]`: the operator's transparency log, served under
/// `/v1/transparency/` (off when the table is absent).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TransparencyConfig {
    /// The log's folder (`gateway log init --dir`). When it holds no log,
    /// the gateway makes one there at start, with a new key.
    pub dir: PathBuf,
    /// The origin (name) of a log made at start: the first line of its
    /// checkpoints and the name in its verifier key.
    #[serde(default = "default_origin")]
    pub origin: String,
    /// At start, log a release entry for each stage of a pipeline whose
    /// policy trusts the locally built stage binary (development).
    #[serde(default = "yes")]
    pub log_local_build: bool,
    /// Witnesses asked to cosign each new checkpoint (C2SP tlog-witness);
    /// their cosignatures are served with it.
    #[serde(default)]
    pub witnesses: Vec<WitnessConfig>,
    /// How often the current checkpoint is offered to witnesses that have
    /// not cosigned it (seconds).
    #[serde(default = "default_witness_interval")]
    pub witness_interval_secs: u64,
    /// Log the digest of every receipt the gateway keeps (never its
    /// content); `GET /v1/receipts/{id}/inclusion` then serves an RFC 9942
    /// COSE receipt of its inclusion.
    #[serde(default)]
    pub log_receipts: bool,
    /// With `log_receipts`: receipts are appended in batches, one every
    /// this many milliseconds at most (one fsync and checkpoint each).
    #[serde(default = "default_receipt_batch")]
    pub receipt_batch_ms: u64,
}

fn default_receipt_batch() -> u64 {
    100
}

/// `[[transparency.witnesses]]`: one witness.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WitnessConfig {
    /// Its submission prefix (`<url>/add-checkpoint` is posted to). Plain
    /// HTTP suffices: the answer is a signature checked against `vkey`.
    pub url: String,
    /// Its verifier key (`gateway witness vkey`).
    pub vkey: String,
}

fn default_witness_interval() -> u64 {
    60
}

fn default_origin() -> String {
    "localhost/confidential-gateway".into()
}

fn yes() -> bool {
    true
}

impl TransparencyConfig {
    /// Refuses an origin that cannot name a signed-note key.
    pub fn check(&self, key: &dyn Fn(&str) -> String) -> Result<()> {
        check_origin(&self.origin).with_context(|| key("transparency.origin"))?;
        for (i, w) in self.witnesses.iter().enumerate() {
            proto::transparency::CosignatureVerifier::new(&w.vkey)
                .with_context(|| key(&format!("transparency.witnesses[{i}].vkey")))?;
            reqwest::Url::parse(&w.url)
                .with_context(|| key(&format!("transparency.witnesses[{i}].url")))?;
        }
        if self.witness_interval_secs == 0 {
            anyhow::bail!(
                "{}: must be at least 1",
                key("transparency.witness_interval_secs")
            );
        }
        Ok(())
    }

    /// Opens the log, making it first when the folder holds none.
    pub fn open(&self) -> Result<Log> {
        open_or_init(&self.dir, &self.origin)
    }
}

/// Opens the log in `dir`, or makes one named `origin` when `dir` has no key.
pub fn open_or_init(dir: &Path, origin: &str) -> Result<Log> {
    if dir.join("key").exists() {
        return Log::open(dir);
    }
    let log = Log::init(dir, origin)?;
    tracing::info!(dir = %dir.display(), vkey = %log.vkey(), "transparency log created");
    Ok(log)
}

/// The release entries of a local build: one per stage, with its layers.
pub fn local_build_entries(
    measurement: &proto::evidence::Measurement,
    manifest: &Sha256Digest,
    layers: &[[u32; 2]],
) -> Vec<Entry> {
    let Some(m) = Measurement::of_evidence(measurement) else {
        return Vec::new();
    };
    layers
        .iter()
        .map(|l| {
            Entry::Release(ReleaseEntry {
                measurement: m.clone(),
                manifest_digest: *manifest,
                layers: (l[0], l[1]),
                version: LOCAL_BUILD_VERSION.into(),
                // No build record: a local development build.
                build_record_digest: Sha256Digest([0; 32]),
            })
        })
        .collect()
}

/// Appends the release entries of every locally built pipeline the log does
/// not hold yet; returns how many entries the pipelines have in all.
pub fn log_local_builds(log: &Arc<Mutex<Log>>, pipelines: &[Arc<Pipeline>]) -> Result<usize> {
    let mut leaves = Vec::new();
    for p in pipelines {
        if let Some((m, layers)) = p.local_build() {
            for e in local_build_entries(m, &p.manifest.digest, &layers) {
                let leaf = e.to_bytes();
                if !leaves.contains(&leaf) {
                    leaves.push(leaf);
                }
            }
        }
    }
    if !leaves.is_empty() {
        let mut log = log.lock().unwrap();
        log.refresh()?;
        let before = log.size();
        log.append_missing(&leaves)?;
        tracing::info!(
            entries = leaves.len(),
            new = log.size() - before,
            size = log.size(),
            "local build releases in the transparency log"
        );
    }
    Ok(leaves.len())
}
