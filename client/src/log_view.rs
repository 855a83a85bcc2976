//! A client's read of a transparency log (C2SP tlog-tiles over HTTP): the
//! checkpoint, verified against the log's verifier key, and every entry,
//! read from the entry bundles and rehashed into the whole tree, whose root
//! must be the checkpoint's. Every entry read is then one the log's key
//! committed to: nothing the host served unsigned is believed. (This reads
//! the whole log: release and key-set logs are small. Receipt entries will
//! be checked by inclusion proofs instead.)

use crate::transport::get_ok;
use anyhow::{anyhow, bail, Context, Result};
use proto::transparency::{
    check_inclusion, split_bundle, verify_checkpoint, Checkpoint, Entry, HashStore, Measurement,
    RecordProof, ReleaseEntry, TileName,
};

/// A verified copy of a log at one checkpoint.
pub struct LogView {
    /// The signed checkpoint, as served.
    pub note: Vec<u8>,
    /// Its body.
    pub checkpoint: Checkpoint,
    entries: Vec<Vec<u8>>,
    hashes: HashStore,
}

/// The log's name in a verifier key (`<name>+<id>+<key>`).
pub fn origin_of(vkey: &str) -> Result<&str> {
    proto::transparency::log_origin(vkey).map_err(|e| anyhow!("--log-key: {e}"))
}

impl LogView {
    /// Reads the log at `url` (its prefix, e.g. `http://gw/v1/transparency`)
    /// and verifies it against `vkey`.
    pub async fn fetch(client: &reqwest::Client, url: &str, vkey: &str) -> Result<Self> {
        let url = url.trim_end_matches('/');
        let note = get_ok(client, &format!("{url}/checkpoint"), None)
            .await?
            .bytes()
            .await?
            .to_vec();
        let checkpoint = verify_checkpoint(&note, vkey, origin_of(vkey)?)
            .with_context(|| format!("the checkpoint at {url}/checkpoint"))?;
        let mut entries = Vec::new();
        for tile in TileName::entry_bundles(checkpoint.size()) {
            let at = format!("{url}/{}", tile.path());
            let bundle = get_ok(client, &at, None).await?.bytes().await?;
            let got = split_bundle(&bundle)
                .filter(|e| e.len() == tile.width as usize)
                .ok_or_else(|| anyhow!("{at}: not a bundle of {} entries", tile.width))?;
            entries.extend(got);
        }
        Self::from_parts(note, checkpoint, entries)
    }

    /// A view of `entries` under `checkpoint`, refused unless they hash to
    /// its root.
    pub fn from_parts(
        note: Vec<u8>,
        checkpoint: Checkpoint,
        entries: Vec<Vec<u8>>,
    ) -> Result<Self> {
        let mut hashes = HashStore::new();
        for e in &entries {
            hashes.append(e)?;
        }
        if hashes.size() != checkpoint.size() || hashes.root(hashes.size())? != *checkpoint.hash() {
            bail!(
                "the log's entries do not hash to its signed checkpoint ({} at size {}): \
                 a tampered or forked log",
                checkpoint.origin(),
                checkpoint.size()
            );
        }
        Ok(Self {
            note,
            checkpoint,
            entries,
            hashes,
        })
    }

    /// The first release entry for `measurement`, `manifest` and `layers`,
    /// with its index.
    pub fn find_release(
        &self,
        measurement: &Measurement,
        manifest: &proto::digest::Sha256Digest,
        layers: [u32; 2],
    ) -> Option<(u64, ReleaseEntry)> {
        let measurement = measurement.pinned_form();
        self.entries
            .iter()
            .enumerate()
            .find_map(|(i, e)| match Entry::from_bytes(e) {
                Ok(Entry::Release(r)) if r.is_release_of(&measurement, manifest, layers) => {
                    Some((i as u64, r))
                }
                _ => None,
            })
    }

    /// The inclusion proof of entry `index` in this checkpoint's tree,
    /// checked before it is returned.
    pub fn inclusion_proof(&self, index: u64) -> Result<RecordProof> {
        let size = self.checkpoint.size();
        let proof = self.hashes.prove_inclusion(size, index)?;
        let leaf = self
            .entries
            .get(index as usize)
            .ok_or_else(|| anyhow!("no entry {index}"))?;
        check_inclusion(&proof, size, *self.checkpoint.hash(), index, leaf)?;
        Ok(proof)
    }
}
