//! A file-backed append-only log in one directory:
//!
//! - `key`: the log's Ed25519 seed (32 bytes, created by [`Log::init`] with
//!   mode 0600); `origin`: the log's origin line;
//! - `entries`: every entry as a big-endian u16 length and its bytes,
//!   appended and fsynced before the checkpoint moves. The file is its own
//!   journal: a crash mid-append leaves at most a partial last record, which
//!   [`Log::open`] truncates away (the recoverable tail);
//! - `checkpoint`: the latest signed checkpoint, written to a temporary file,
//!   fsynced and renamed over the old one.
//!
//! The tree's stored hashes are recomputed from `entries` at open and kept
//! in memory (a [`HashStore`]); tiles and bundles are cut from them.

use anyhow::{bail, Context, Result};
use proto::transparency::{sign_checkpoint, verifier_key, HashStore, Tile, TILE_HEIGHT};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// An open log (one writer at a time).
pub struct Log {
    dir: PathBuf,
    origin: String,
    key: ed25519_dalek::SigningKey,
    entries: Vec<Vec<u8>>,
    hashes: HashStore,
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

impl Log {
    /// Creates a log in `dir` (made if missing; refused if it holds a key)
    /// with a fresh key, and signs the empty tree's checkpoint.
    pub fn init(dir: &Path, origin: &str) -> Result<Self> {
        if origin.is_empty() || origin.contains(['\n', ' ', '+']) {
            bail!("a log origin is one line without spaces or '+'");
        }
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let key = ed25519_dalek::SigningKey::generate(&mut rand::rngs::OsRng);
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dir.join("key"))
            .with_context(|| format!("{} already holds a log key", dir.display()))?;
        f.write_all(&key.to_bytes())?;
        f.sync_all()?;
        fs::write(dir.join("origin"), format!("{origin}\n"))?;
        File::create(dir.join("entries"))?.sync_all()?;
        sync_dir(dir)?;
        let log = Self::open(dir)?;
        log.write_checkpoint()?;
        Ok(log)
    }

    /// Opens the log in `dir`, dropping a partial record a crash left at
    /// the end of `entries`.
    pub fn open(dir: &Path) -> Result<Self> {
        let seed: [u8; 32] = fs::read(dir.join("key"))
            .with_context(|| format!("reading {}/key", dir.display()))?
            .try_into()
            .map_err(|_| anyhow::anyhow!("the log key is not 32 bytes"))?;
        let origin = fs::read_to_string(dir.join("origin"))?
            .trim_end()
            .to_string();
        let raw = fs::read(dir.join("entries"))?;
        let (mut entries, mut at) = (Vec::new(), 0usize);
        while at + 2 <= raw.len() {
            let n = u16::from_be_bytes([raw[at], raw[at + 1]]) as usize;
            if at + 2 + n > raw.len() {
                break;
            }
            entries.push(raw[at + 2..at + 2 + n].to_vec());
            at += 2 + n;
        }
        if at != raw.len() {
            let f = OpenOptions::new().write(true).open(dir.join("entries"))?;
            f.set_len(at as u64)?;
            f.sync_all()?;
        }
        let mut hashes = HashStore::new();
        for e in &entries {
            hashes.append(e)?;
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            origin,
            key: ed25519_dalek::SigningKey::from_bytes(&seed),
            entries,
            hashes,
        })
    }

    /// The log's origin.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The number of entries.
    pub fn size(&self) -> u64 {
        self.hashes.size()
    }

    /// The log's verifier key in signed-note `vkey` form.
    pub fn vkey(&self) -> String {
        verifier_key(&self.origin, &self.key.verifying_key())
    }

    /// Appends entries (each a leaf's bytes, at most 65535), fsyncs them,
    /// then signs and stores the new checkpoint; returns the first index.
    pub fn append(&mut self, leaves: &[Vec<u8>]) -> Result<u64> {
        let first = self.size();
        let mut buf = Vec::new();
        for leaf in leaves {
            let n = u16::try_from(leaf.len()).context("an entry over 65535 bytes")?;
            buf.extend_from_slice(&n.to_be_bytes());
            buf.extend_from_slice(leaf);
        }
        let mut f = OpenOptions::new()
            .append(true)
            .open(self.dir.join("entries"))?;
        f.write_all(&buf)?;
        f.sync_all()?;
        for leaf in leaves {
            self.hashes.append(leaf)?;
            self.entries.push(leaf.clone());
        }
        self.write_checkpoint()?;
        Ok(first)
    }

    /// The latest checkpoint, signed now over the current tree.
    pub fn checkpoint(&self) -> Result<Vec<u8>> {
        let root = self.hashes.root(self.size())?;
        Ok(sign_checkpoint(&self.key, &self.origin, self.size(), root)?)
    }

    fn write_checkpoint(&self) -> Result<()> {
        let tmp = self.dir.join("checkpoint.tmp");
        let mut f = File::create(&tmp)?;
        f.write_all(&self.checkpoint()?)?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join("checkpoint"))?;
        sync_dir(&self.dir)
    }

    /// The stored checkpoint (what `GET /v1/transparency/checkpoint` serves).
    pub fn stored_checkpoint(dir: &Path) -> Result<Vec<u8>> {
        Ok(fs::read(dir.join("checkpoint"))?)
    }

    /// A hash tile at `level`, index `n`, `width` hashes (256 when full),
    /// if the tree holds it.
    pub fn hash_tile(&self, level: u8, n: u64, width: u32) -> Result<Option<Vec<u8>>> {
        if !self.in_tree(level, n, width) {
            return Ok(None);
        }
        let tile = Tile::new(TILE_HEIGHT, level, n, width, false);
        Ok(Some(tile.read_data(&self.hashes)?))
    }

    /// The entry bundle `n` of `width` entries: each entry as a big-endian
    /// u16 length and its bytes (C2SP tlog-tiles).
    pub fn entry_bundle(&self, n: u64, width: u32) -> Option<Vec<u8>> {
        if !self.in_tree(0, n, width) {
            return None;
        }
        let start = usize::try_from(n << TILE_HEIGHT).ok()?;
        let mut out = Vec::new();
        for e in &self.entries[start..start + width as usize] {
            out.extend_from_slice(&(e.len() as u16).to_be_bytes());
            out.extend_from_slice(e);
        }
        Some(out)
    }

    /// Whether tile `(level, n)` of `width` exists in the current tree:
    /// a full tile, or the partial right-hand tile of exactly that width.
    fn in_tree(&self, level: u8, n: u64, width: u32) -> bool {
        let shift = u32::from(TILE_HEIGHT) * u32::from(level);
        let Some(nodes) = self.size().checked_shr(shift) else {
            return false;
        };
        let full = nodes >> TILE_HEIGHT;
        let rest = nodes & 0xff;
        (1..=256).contains(&width)
            && ((n < full && width == 256) || (n == full && u64::from(width) == rest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::transparency::{verify_checkpoint, Checkpoint};

    #[test]
    fn appends_survive_reopen_and_a_torn_tail() {
        let dir = std::env::temp_dir().join(format!("tlog-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut log = Log::init(&dir, "test.example/log").unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = fs::metadata(dir.join("key")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let leaves: Vec<Vec<u8>> = (0..300u32).map(|i| i.to_be_bytes().to_vec()).collect();
        log.append(&leaves[..10]).unwrap();
        log.append(&leaves[10..]).unwrap();
        // A torn append: half a record at the end.
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.join("entries"))
            .unwrap();
        f.write_all(&[0, 9, 1, 2]).unwrap();
        drop(f);
        let mut log = Log::open(&dir).unwrap();
        assert_eq!(log.size(), 300);
        // The tail was cut: what is appended next reads back whole.
        log.append(&[b"next".to_vec()]).unwrap();
        let log = Log::open(&dir).unwrap();
        assert_eq!(log.size(), 301);
        assert_eq!(log.entries[300], b"next");
        let note = Log::stored_checkpoint(&dir).unwrap();
        let cp: Checkpoint = verify_checkpoint(&note, &log.vkey(), "test.example/log").unwrap();
        assert_eq!(cp.size(), 301);
        assert_eq!(log.hash_tile(0, 0, 256).unwrap().unwrap().len(), 256 * 32);
        assert_eq!(log.hash_tile(0, 1, 45).unwrap().unwrap().len(), 45 * 32);
        assert!(log.hash_tile(0, 1, 44).unwrap().is_none());
        assert!(log.hash_tile(1, 0, 1).unwrap().is_some());
        let bundle = log.entry_bundle(1, 45).unwrap();
        assert_eq!(&bundle[..6], &[0, 4, 0, 0, 1, 0]);
        assert_eq!(*cp.hash(), log.hashes.root(301).unwrap());
        fs::remove_dir_all(&dir).unwrap();
    }
}
