//! `gateway log …`: the operator's verbs on a log folder. `init` makes a
//! log (a new key), `vkey` prints the verifier key clients pin,
//! `add-release` logs the releases of an image from its build record (what
//! `scripts/build-eif.sh` calls), `checkpoint` prints the latest signed
//! checkpoint and `entries` every entry as JSON lines.

use super::store::Log;
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use client::policy_build::BuildRecord;
use proto::digest::Sha256Digest;
use proto::transparency::{Entry, Measurement, ReleaseEntry};
use serde_json::json;
use std::path::PathBuf;

/// `gateway log …`
#[derive(Subcommand, Debug)]
pub enum LogCommand {
    /// Make a log in a folder (a new Ed25519 key, mode 0600) and print its
    /// verifier key.
    Init {
        /// The log's folder.
        #[arg(long)]
        dir: PathBuf,
        /// The log's name: the first line of every checkpoint, e.g.
        /// `example.com/inference-log`.
        #[arg(long)]
        origin: String,
    },
    /// Print the log's verifier key (signed-note form) for clients'
    /// `--log-key`.
    Vkey {
        /// The log's folder.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Log an enclave image's release: one entry per stage (its
    /// measurement, layers and model manifest) from the build record
    /// `scripts/build-eif.sh` wrote. Entries the log holds already are not
    /// added again.
    AddRelease(AddReleaseArgs),
    /// Print the latest signed checkpoint.
    Checkpoint {
        /// The log's folder.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Print every entry, one JSON object per line.
    Entries {
        /// The log's folder.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Print, as JSON, the size of an RFC 9942 receipt and of a checkpoint
    /// for a tree of N entries (scripts/bench_transparency.sh).
    #[command(hide = true)]
    ReceiptSize {
        /// The tree's size.
        #[arg(long)]
        entries: u64,
    },
}

/// The length of the inclusion path of record `index` in a tree of `size`
/// (RFC 9162 §2.1.3).
fn path_len(size: u64, index: u64) -> usize {
    if size <= 1 {
        return 0;
    }
    let k = 1u64 << (63 - (size - 1).leading_zeros());
    if index < k {
        1 + path_len(k, index)
    } else {
        1 + path_len(size - k, index - k)
    }
}

/// `gateway log add-release`
#[derive(Args, Debug)]
pub struct AddReleaseArgs {
    /// The log's folder.
    #[arg(long)]
    pub dir: PathBuf,
    /// The build record (`build-record.json`).
    pub record: PathBuf,
    /// Log the mock measurement of the record's binary (stages started
    /// with `--attestation mock`; development and tests) instead of its PCRs.
    #[arg(long)]
    pub mock: bool,
    /// With --mock: the policy file the stages are started with, when it
    /// is not the image's own.
    #[arg(long, requires = "mock")]
    pub stage_policy: Option<PathBuf>,
    /// The release's version text (default: the record's commit).
    #[arg(long)]
    pub version: Option<String>,
}

/// Runs `gateway log …`.
pub fn run(cmd: LogCommand) -> Result<()> {
    match cmd {
        LogCommand::Init { dir, origin } => {
            let log = Log::init(&dir, &origin)?;
            println!("{}", log.vkey());
        }
        LogCommand::Vkey { dir } => println!("{}", Log::open(&dir)?.vkey()),
        LogCommand::AddRelease(a) => add_release(a)?,
        LogCommand::Checkpoint { dir } => {
            let note = Log::open(&dir)?.stored_checkpoint()?;
            print!("{}", String::from_utf8_lossy(&note));
        }
        LogCommand::Entries { dir } => {
            let log = Log::open(&dir)?;
            for i in 0..log.size() {
                let bytes = log.entry(i).expect("below the size");
                println!("{}", describe(i, bytes));
            }
        }
        LogCommand::ReceiptSize { entries } => {
            anyhow::ensure!(entries > 0, "--entries must be at least 1");
            let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
            let origin = "bench.example/log";
            let hashes = path_len(entries, 0);
            let path = vec![proto::transparency::Hash([0xab; 32]); hashes];
            let root = proto::transparency::Hash([0xcd; 32]);
            let receipt =
                proto::transparency::sign_inclusion_receipt(&key, origin, entries, 0, &path, root);
            let note = proto::transparency::sign_checkpoint(&key, origin, entries, root)?;
            println!(
                "{}",
                json!({"entries": entries, "path_hashes": hashes,
                       "receipt_bytes": receipt.len(), "checkpoint_bytes": note.len()})
            );
        }
    }
    Ok(())
}

fn add_release(a: AddReleaseArgs) -> Result<()> {
    let text =
        std::fs::read(&a.record).with_context(|| format!("reading {}", a.record.display()))?;
    let record = BuildRecord::parse(std::str::from_utf8(&text).context("the record is not UTF-8")?)
        .with_context(|| a.record.display().to_string())?;
    let stage_policy = match &a.stage_policy {
        Some(p) => Some(
            Sha256Digest::of_file(p).with_context(|| format!("--stage-policy {}", p.display()))?,
        ),
        None => None,
    };
    let measured = record.measurement(a.mock, stage_policy.as_ref())?;
    let Some(measurement) = Measurement::of_evidence(&measured) else {
        bail!("the record's PCRs are not 48 bytes each");
    };
    let version = match (&a.version, &record.commit) {
        (Some(v), _) => v.clone(),
        (None, Some(c)) if !record.dirty => format!("commit {c}"),
        (None, Some(c)) => format!("commit {c} with uncommitted changes"),
        (None, None) => bail!("the record names no commit: pass --version"),
    };
    let leaves: Vec<Vec<u8>> = record
        .layers
        .iter()
        .map(|l| {
            Entry::Release(ReleaseEntry {
                measurement: measurement.clone(),
                manifest_digest: record.manifest,
                layers: (l[0], l[1]),
                version: version.clone(),
                build_record_digest: Sha256Digest::of(&text),
            })
            .to_bytes()
        })
        .collect();
    let mut log = Log::open(&a.dir)?;
    log.refresh()?;
    let before = log.size();
    let at = log.append_missing(&leaves)?;
    println!(
        "release {} ({}): {} stage entries at {:?}, {} new; log size {}",
        measured.pinned_form(),
        version,
        leaves.len(),
        at,
        log.size() - before,
        log.size()
    );
    Ok(())
}

/// One entry as a JSON line: its index, kind and fields (digests as hex).
pub fn describe(index: u64, bytes: &[u8]) -> serde_json::Value {
    match Entry::from_bytes(bytes) {
        Ok(Entry::Release(r)) => json!({
            "index": index,
            "kind": "release",
            "measurement": r.measurement.pinned_form(),
            "manifest_sha256": r.manifest_digest.hex(),
            "layers": [r.layers.0, r.layers.1],
            "version": r.version,
            "build_record_sha256": r.build_record_digest.hex(),
        }),
        Ok(Entry::KeySet(k)) => json!({
            "index": index,
            "kind": "key_set",
            "key_set_sha256": k.key_set_digest.hex(),
            "key_ids": k.key_ids,
        }),
        Ok(Entry::Receipt(r)) => json!({
            "index": index,
            "kind": "receipt",
            "receipt_sha256": r.receipt_digest.hex(),
        }),
        Err(e) => {
            json!({"index": index, "kind": "unreadable", "error": e, "bytes": hex::encode(bytes)})
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn inclusion_path_lengths_are_rfc9162s() {
        use super::path_len;
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9].map(|n| path_len(n, 0)),
            [0, 1, 2, 2, 3, 3, 4]
        );
        assert_eq!(path_len(5, 4), 1);
        assert_eq!(path_len(10_000_000, 0), 24);
    }
}
