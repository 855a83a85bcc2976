//! A file-backed append-only log in one directory:
//!
//! - `key`: the log's Ed25519 seed (32 bytes, created by [`Log::init`] with
//!   mode 0600); `origin`: the log's origin line;
//! - `entries`: every entry as a big-endian u16 length and its bytes,
//!   appended and fsynced before the checkpoint moves. The file is its own
//!   journal: a crash mid-append leaves at most a partial last record, which
//!   the next writer truncates away (the recoverable tail);
//! - `checkpoint`: the latest signed checkpoint, written to a temporary file,
//!   fsynced and renamed over the old one;
//! - `lock`: held (`flock`, exclusive) by whoever appends, so that several
//!   processes (gateways sharing the folder, `gateway log add-release`) can
//!   write one log: each catches up with the others' entries under the lock
//!   before it appends.
//!
//! The tree's stored hashes are recomputed from `entries` at open and kept
//! in memory (a [`HashStore`]); tiles and bundles are cut from them.
//! [`Log::refresh`] reads what other processes appended since.

use anyhow::{bail, Context, Result};
use proto::digest::Sha256Digest;
use proto::transparency::{
    add_cosignatures, join_bundle, note_text, sign_checkpoint, sign_inclusion_receipt,
    verifier_key, verify_checkpoint, Entry, EntryProof, Hash, HashStore, ReleaseProofs,
    StageReleaseProof, Tile, TILE_HEIGHT,
};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// An open log.
pub struct Log {
    dir: PathBuf,
    origin: String,
    key: ed25519_dalek::SigningKey,
    entries: Vec<Vec<u8>>,
    /// The first index of each entry's bytes (by digest).
    index: HashMap<[u8; 32], u64>,
    /// The indexes of the release entries, in order.
    releases: Vec<u64>,
    /// Bytes of `entries` read so far (whole records only).
    read_bytes: u64,
    hashes: HashStore,
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

/// The exclusive lock on a log's folder, released when dropped.
struct WriteLock(File);

impl WriteLock {
    fn take(dir: &Path) -> Result<Self> {
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(dir.join("lock"))
            .with_context(|| format!("opening {}/lock", dir.display()))?;
        f.lock()
            .with_context(|| format!("locking {}/lock", dir.display()))?;
        Ok(Self(f))
    }
}

impl Drop for WriteLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

/// Checks an origin: one line, no spaces or `+` (a signed-note key name).
pub fn check_origin(origin: &str) -> Result<()> {
    if origin.is_empty() || origin.contains(|c: char| c.is_whitespace() || c == '+') {
        bail!("a log origin is one word without spaces or '+', e.g. example.com/log");
    }
    Ok(())
}

impl Log {
    /// Creates a log in `dir` (made if missing; refused if it holds a key)
    /// with a fresh key, and signs the empty tree's checkpoint.
    pub fn init(dir: &Path, origin: &str) -> Result<Self> {
        check_origin(origin)?;
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
        let log = Self {
            dir: dir.to_path_buf(),
            origin: origin.to_string(),
            key,
            entries: Vec::new(),
            index: HashMap::new(),
            releases: Vec::new(),
            read_bytes: 0,
            hashes: HashStore::new(),
        };
        log.write_checkpoint()?;
        Ok(log)
    }

    /// Opens the log in `dir` and reads its entries.
    pub fn open(dir: &Path) -> Result<Self> {
        let seed: [u8; 32] = fs::read(dir.join("key"))
            .with_context(|| {
                format!(
                    "reading {}/key (no log there? `gateway log init`)",
                    dir.display()
                )
            })?
            .try_into()
            .map_err(|_| anyhow::anyhow!("the log key is not 32 bytes"))?;
        let origin = fs::read_to_string(dir.join("origin"))?
            .trim_end()
            .to_string();
        check_origin(&origin)?;
        let mut log = Self {
            dir: dir.to_path_buf(),
            origin,
            key: ed25519_dalek::SigningKey::from_bytes(&seed),
            entries: Vec::new(),
            index: HashMap::new(),
            releases: Vec::new(),
            read_bytes: 0,
            hashes: HashStore::new(),
        };
        log.refresh()?;
        log.check_stored_checkpoint()?;
        Ok(log)
    }

    /// Checks that the stored checkpoint is signed by this log's key and
    /// that the entries hash to its root: a log whose file was altered or
    /// cut is refused, not signed anew over the changed history.
    fn check_stored_checkpoint(&self) -> Result<()> {
        let note = self.stored_checkpoint()?;
        let cp = verify_checkpoint(&note, &self.vkey(), &self.origin)
            .with_context(|| format!("{}/checkpoint", self.dir.display()))?;
        if cp.size() > self.size() {
            bail!(
                "{}: the signed checkpoint covers {} entries, the entries file holds {}: entries were lost",
                self.dir.display(),
                cp.size(),
                self.size()
            );
        }
        if self.hashes.root(cp.size())? != *cp.hash() {
            bail!(
                "{}: the entries do not hash to the signed checkpoint (size {}): the log was altered",
                self.dir.display(),
                cp.size()
            );
        }
        Ok(())
    }

    /// Reads the whole records other processes appended since the last
    /// read (a partial record, being written or torn, is left for later);
    /// returns how many.
    pub fn refresh(&mut self) -> Result<u64> {
        let mut f = File::open(self.dir.join("entries"))?;
        f.seek(SeekFrom::Start(self.read_bytes))?;
        let mut raw = Vec::new();
        f.read_to_end(&mut raw)?;
        let (mut at, before) = (0usize, self.size());
        while at + 2 <= raw.len() {
            let n = u16::from_be_bytes([raw[at], raw[at + 1]]) as usize;
            if at + 2 + n > raw.len() {
                break;
            }
            self.push_entry(raw[at + 2..at + 2 + n].to_vec())?;
            at += 2 + n;
        }
        self.read_bytes += at as u64;
        Ok(self.size() - before)
    }

    /// The log's origin.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The number of entries read.
    pub fn size(&self) -> u64 {
        self.hashes.size()
    }

    /// Entry `index`'s bytes.
    pub fn entry(&self, index: u64) -> Option<&[u8]> {
        self.entries
            .get(usize::try_from(index).ok()?)
            .map(Vec::as_slice)
    }

    /// The log's verifier key in signed-note `vkey` form.
    pub fn vkey(&self) -> String {
        verifier_key(&self.origin, &self.key.verifying_key())
    }

    /// Appends entries (each a leaf's bytes, at most 65535), under the
    /// folder's lock after reading what others appended: fsyncs them, then
    /// signs and stores the new checkpoint; returns the first new index.
    pub fn append(&mut self, leaves: &[Vec<u8>]) -> Result<u64> {
        let mut buf = Vec::new();
        for leaf in leaves {
            let n = u16::try_from(leaf.len()).context("an entry over 65535 bytes")?;
            buf.extend_from_slice(&n.to_be_bytes());
            buf.extend_from_slice(leaf);
        }
        let _lock = WriteLock::take(&self.dir)?;
        self.refresh()?;
        let mut f = OpenOptions::new()
            .write(true)
            .open(self.dir.join("entries"))?;
        // Under the lock nobody else is writing: bytes past the last whole
        // record are a crashed writer's torn tail.
        if f.metadata()?.len() != self.read_bytes {
            f.set_len(self.read_bytes)?;
        }
        f.seek(SeekFrom::Start(self.read_bytes))?;
        f.write_all(&buf)?;
        f.sync_all()?;
        let first = self.size();
        self.read_bytes += buf.len() as u64;
        for leaf in leaves {
            self.push_entry(leaf.clone())?;
        }
        self.write_checkpoint()?;
        Ok(first)
    }

    /// Takes a read or appended entry into the tree and the indexes.
    fn push_entry(&mut self, leaf: Vec<u8>) -> Result<()> {
        self.hashes.append(&leaf)?;
        let at = self.entries.len() as u64;
        self.index.entry(Sha256Digest::of(&leaf).0).or_insert(at);
        if matches!(Entry::from_bytes(&leaf), Ok(Entry::Release(_))) {
            self.releases.push(at);
        }
        self.entries.push(leaf);
        Ok(())
    }

    /// The index of the first entry with exactly these bytes.
    pub fn index_of(&self, leaf: &[u8]) -> Option<u64> {
        self.index.get(&Sha256Digest::of(leaf).0).copied()
    }

    /// Appends the entries of `leaves` that the log does not hold yet (the
    /// same bytes), in order; returns each one's index.
    pub fn append_missing(&mut self, leaves: &[Vec<u8>]) -> Result<Vec<u64>> {
        self.refresh()?;
        let mut out = Vec::with_capacity(leaves.len());
        let mut new = Vec::new();
        for leaf in leaves {
            match self.index_of(leaf) {
                Some(i) => out.push(i),
                None => {
                    out.push(u64::MAX);
                    new.push(leaf.clone());
                }
            }
        }
        if !new.is_empty() {
            self.append(&new)?;
            for (slot, leaf) in out.iter_mut().zip(leaves) {
                if *slot == u64::MAX {
                    *slot = self.index_of(leaf).expect("appended");
                }
            }
        }
        Ok(out)
    }

    /// A checkpoint signed now over the entries read.
    pub fn checkpoint(&self) -> Result<Vec<u8>> {
        let root = self.hashes.root(self.size())?;
        Ok(sign_checkpoint(&self.key, &self.origin, self.size(), root)?)
    }

    fn write_checkpoint(&self) -> Result<()> {
        self.write_note(&self.checkpoint()?)
    }

    fn write_note(&self, note: &[u8]) -> Result<()> {
        let tmp = self.dir.join("checkpoint.tmp");
        let mut f = File::create(&tmp)?;
        f.write_all(note)?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join("checkpoint"))?;
        sync_dir(&self.dir)
    }

    /// The RFC 6962 consistency proof from the tree of `old` entries to
    /// that of `size` (empty from 0 or to itself), for a witness.
    pub fn consistency_proof(&self, size: u64, old: u64) -> Result<Vec<Hash>> {
        if old == 0 || old == size {
            return Ok(Vec::new());
        }
        Ok(self.hashes.prove_consistency(size, old)?)
    }

    /// Adds witnesses' cosignature lines to the stored checkpoint if it
    /// still signs what `note` signs (another writer may have moved it on:
    /// then nothing is written and the answer is false).
    pub fn add_cosignatures(&self, note: &[u8], lines: &[String]) -> Result<bool> {
        let _lock = WriteLock::take(&self.dir)?;
        let stored = self.stored_checkpoint()?;
        if note_text(&stored).is_none() || note_text(&stored) != note_text(note) {
            return Ok(false);
        }
        self.write_note(&add_cosignatures(&stored, lines)?)?;
        Ok(true)
    }

    /// The stored checkpoint (what `GET /v1/transparency/checkpoint` serves).
    pub fn stored_checkpoint(&self) -> Result<Vec<u8>> {
        Ok(fs::read(self.dir.join("checkpoint"))?)
    }

    /// Proofs that each of `stages` (index, measurement in pinned form,
    /// layers), serving the model of manifest `manifest`, is a release
    /// entry of this log, and that `key_set` (an entry's bytes) is one,
    /// against the stored checkpoint; `None` when a stage is not logged
    /// (the bundle then carries no proofs), no key-set proof when the key
    /// set is not.
    pub fn release_proofs(
        &mut self,
        stages: &[(u32, &str, [u32; 2])],
        manifest: &proto::digest::Sha256Digest,
        key_set: Option<&[u8]>,
    ) -> Result<Option<ReleaseProofs>> {
        let note = self.stored_checkpoint()?;
        self.refresh()?;
        let size = verify_checkpoint(&note, &self.vkey(), &self.origin)?.size();
        let mut out = Vec::new();
        for &(stage, measurement, layers) in stages {
            let found = self
                .releases
                .iter()
                .map(|&i| i as usize)
                .take_while(|&i| i < size as usize)
                .find(|&i| {
                    matches!(Entry::from_bytes(&self.entries[i]), Ok(Entry::Release(r))
                        if r.is_release_of(measurement, manifest, layers))
                });
            let Some(index) = found else {
                return Ok(None);
            };
            let index = index as u64;
            out.push(StageReleaseProof {
                stage,
                index,
                entry: self.entries[index as usize].clone(),
                proof: self.path(size, index)?,
            });
        }
        let key_set = match key_set.and_then(|k| self.index_of(k)).filter(|&i| i < size) {
            Some(index) => Some(EntryProof {
                index,
                entry: self.entries[index as usize].clone(),
                proof: self.path(size, index)?,
            }),
            None => None,
        };
        Ok(Some(ReleaseProofs {
            checkpoint: note,
            stages: out,
            key_set,
        }))
    }

    /// An RFC 9942 COSE receipt of the inclusion of the entry `leaf` in
    /// the tree of the stored checkpoint; `None` while it is not in that
    /// tree.
    pub fn inclusion_receipt(&mut self, leaf: &[u8]) -> Result<Option<Vec<u8>>> {
        let note = self.stored_checkpoint()?;
        self.refresh()?;
        let cp = verify_checkpoint(&note, &self.vkey(), &self.origin)?;
        let Some(index) = self.index_of(leaf).filter(|&i| i < cp.size()) else {
            return Ok(None);
        };
        let path = self.hashes.prove_inclusion(cp.size(), index)?;
        Ok(Some(sign_inclusion_receipt(
            &self.key,
            &self.origin,
            cp.size(),
            index,
            &path,
            *cp.hash(),
        )))
    }

    /// Entry `index`'s inclusion proof in the tree of `size`, as carried.
    fn path(&self, size: u64, index: u64) -> Result<Vec<serde_bytes::ByteBuf>> {
        Ok(self
            .hashes
            .prove_inclusion(size, index)?
            .into_iter()
            .map(|h| serde_bytes::ByteBuf::from(h.0.to_vec()))
            .collect())
    }

    /// A hash tile at `level`, index `n`, `width` hashes (256 when full),
    /// if the entries read hold it.
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
        let entries = &self.entries[start..start + width as usize];
        Some(join_bundle(entries.iter().map(Vec::as_slice)))
    }

    /// Whether tile `(level, n)` of `width` is in the tree read so far:
    /// the tree has that level's first `n * 256 + width` nodes. Partial
    /// tiles of every width up to that stay served (C2SP: a log MUST serve
    /// the partial tiles of every tree size it made a checkpoint for), and
    /// never change, since the tree only grows.
    fn in_tree(&self, level: u8, n: u64, width: u32) -> bool {
        let shift = u32::from(TILE_HEIGHT) * u32::from(level);
        let Some(nodes) = self.size().checked_shr(shift) else {
            return false;
        };
        (1..=256).contains(&width)
            && n.checked_mul(256)
                .and_then(|s| s.checked_add(u64::from(width)))
                .is_some_and(|end| end <= nodes)
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
        let note = log.stored_checkpoint().unwrap();
        let cp: Checkpoint = verify_checkpoint(&note, &log.vkey(), "test.example/log").unwrap();
        assert_eq!(cp.size(), 301);
        assert_eq!(log.hash_tile(0, 0, 256).unwrap().unwrap().len(), 256 * 32);
        assert_eq!(log.hash_tile(0, 1, 45).unwrap().unwrap().len(), 45 * 32);
        // An older tree's partial tile stays served (it is a prefix).
        let older = log.hash_tile(0, 1, 44).unwrap().unwrap();
        assert_eq!(
            older[..],
            log.hash_tile(0, 1, 45).unwrap().unwrap()[..44 * 32]
        );
        assert!(log.hash_tile(0, 1, 46).unwrap().is_none());
        assert!(log.hash_tile(0, 2, 1).unwrap().is_none());
        assert!(log.hash_tile(1, 0, 1).unwrap().is_some());
        let bundle = log.entry_bundle(1, 45).unwrap();
        assert_eq!(&bundle[..6], &[0, 4, 0, 0, 1, 0]);
        assert_eq!(*cp.hash(), log.hashes.root(301).unwrap());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writers_in_several_processes_share_one_log() {
        let dir = std::env::temp_dir().join(format!("tlog-share-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut a = Log::init(&dir, "test.example/shared").unwrap();
        let mut b = Log::open(&dir).unwrap();
        a.append(&[b"a1".to_vec()]).unwrap();
        // b catches up under the lock before it appends: nothing is lost.
        assert_eq!(b.append(&[b"b1".to_vec()]).unwrap(), 1);
        assert_eq!(a.size(), 1);
        assert_eq!(a.refresh().unwrap(), 1);
        assert_eq!(a.entry(1), Some(&b"b1"[..]));
        let cp = verify_checkpoint(
            &a.stored_checkpoint().unwrap(),
            &a.vkey(),
            "test.example/shared",
        )
        .unwrap();
        assert_eq!((cp.size(), *cp.hash()), (2, a.hashes.root(2).unwrap()));
        // The same entry twice is logged once.
        assert_eq!(
            a.append_missing(&[b"b1".to_vec(), b"c".to_vec()]).unwrap(),
            vec![1, 2]
        );
        assert_eq!(b.append_missing(&[b"c".to_vec()]).unwrap(), vec![2]);
        // Threads with a handle each (a lock per open file, as processes).
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    let mut log = Log::open(&dir).unwrap();
                    for i in 0..25u8 {
                        log.append(&[vec![t, i]]).unwrap();
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let log = Log::open(&dir).unwrap();
        assert_eq!(log.size(), 103);
        let mut seen: Vec<_> = (3..103).map(|i| log.entry(i).unwrap().to_vec()).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 100);
        let cp = verify_checkpoint(
            &log.stored_checkpoint().unwrap(),
            &log.vkey(),
            "test.example/shared",
        )
        .unwrap();
        assert_eq!(
            (cp.size(), *cp.hash()),
            (103, log.hashes.root(103).unwrap())
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_altered_or_cut_log_is_refused_at_open() {
        let dir = std::env::temp_dir().join(format!("tlog-alter-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut log = Log::init(&dir, "test.example/altered").unwrap();
        log.append(&[b"first".to_vec(), b"second".to_vec()])
            .unwrap();
        let path = dir.join("entries");
        let good = fs::read(&path).unwrap();
        let mut altered = good.clone();
        altered[3] ^= 1; // a byte of "first"
        fs::write(&path, &altered).unwrap();
        let e = Log::open(&dir).err().expect("an altered entry is refused");
        assert!(format!("{e:#}").contains("the log was altered"), "{e:#}");
        fs::write(&path, &good[..good.len() - 8]).unwrap();
        let e = Log::open(&dir).err().expect("a lost entry is refused");
        assert!(format!("{e:#}").contains("entries were lost"), "{e:#}");
        fs::write(&path, &good).unwrap();
        assert_eq!(Log::open(&dir).unwrap().size(), 2);
        fs::remove_dir_all(&dir).unwrap();
    }
}
