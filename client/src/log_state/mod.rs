//! The latest checkpoint a client has seen of each transparency log, and
//! the rule that every later one be consistent with it (no split view).
//!
//! [`LogState::observe`] takes a signed checkpoint note (e.g. the one an
//! evidence bundle carries), verifies it against the log's key and compares
//! it with the checkpoint kept for that log: the same size must have the
//! same root; a different size needs an RFC 6962 consistency proof between
//! the two, which the client computes itself from the log's C2SP tiles
//! ([`TileSource`]: over HTTP, [`HttpTiles`]) and checks against both
//! signed roots. The larger of the two is kept. A log that showed this
//! client one history and now shows another (a fork) is refused.
//!
//! The state lives in memory, or in a JSON file (written to a temporary
//! file in the same folder, fsynced and renamed over the old one). A file
//! that is unreadable or malformed is an error, never silently reset.

use crate::transport::get_ok;
use anyhow::{anyhow, bail, Context, Result};
use proto::transparency::{
    check_consistency, log_origin, prove_consistency_from_tiles, verify_checkpoint, Hash, Tile,
    TileName, TileReader, TreeProof, TILE_HEIGHT,
};
use serde_json::json;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};

pub mod sans_io;
#[cfg(test)]
pub(crate) mod tests;

/// The version of the state file's format.
const STATE_VERSION: u64 = 1;

/// How many rounds of tile fetching a proof may need before giving up
/// (one is enough for `tlog_tiles` 0.2: it asks for all tiles at once).
const MAX_FETCH_ROUNDS: usize = 4;

/// One log's latest verified checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct SeenCheckpoint {
    /// The log's origin (its checkpoint's first line).
    pub origin: String,
    /// The tree size.
    pub size: u64,
    /// The tree's root hash.
    pub root: Hash,
    /// The signed checkpoint note, as the log served it.
    pub note: Vec<u8>,
    /// The largest tree beyond this checkpoint that the log signed outside
    /// a checkpoint (an inclusion receipt's) and this client accepted,
    /// proven to extend it: every later checkpoint must be consistent with
    /// it too, so that a tree shown for one receipt and never published is
    /// caught at the next attestation.
    pub ahead: Option<(u64, Hash)>,
}

/// What [`LogState::observe`] concluded about a checkpoint it accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observed {
    /// The first checkpoint seen of this log: kept.
    First {
        /// Its size.
        size: u64,
    },
    /// The same checkpoint (size and root) as the one kept.
    Same {
        /// Its size.
        size: u64,
    },
    /// A larger tree, proven to extend the one kept: now kept instead.
    Grew {
        /// The size kept before.
        from: u64,
        /// The new size.
        to: u64,
    },
    /// A smaller tree, proven to be a prefix of the one kept (which stays).
    Older {
        /// Its size.
        size: u64,
        /// The size kept.
        kept: u64,
    },
}

impl std::fmt::Display for Observed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Observed::First { size } => write!(f, "first checkpoint seen of this log (size {size}), kept"),
            Observed::Same { size } => write!(f, "the same checkpoint as the one kept (size {size})"),
            Observed::Grew { from, to } => write!(
                f,
                "size {to} proven consistent with the checkpoint kept at size {from} (RFC 6962 proof from the log's tiles); size {to} now kept"
            ),
            Observed::Older { size, kept } => write!(
                f,
                "an older checkpoint (size {size}), proven a prefix of the one kept at size {kept} (kept)"
            ),
        }
    }
}

/// What [`LogState::check_root`] found for a root signed outside a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootSeen {
    /// The tree is the kept checkpoint's, or proven a prefix of it.
    Covered {
        /// The tree's size.
        size: u64,
        /// The kept checkpoint's size.
        kept: u64,
    },
    /// A larger tree, proven to extend the kept checkpoint (whose
    /// cosignatures therefore do not cover it yet).
    Ahead {
        /// The tree's size.
        size: u64,
        /// The kept checkpoint's size.
        kept: u64,
    },
}

impl std::fmt::Display for RootSeen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RootSeen::Covered { size, kept } => write!(
                f,
                "the tree of size {size} is proven a prefix of the checkpoint kept at size {kept}"
            ),
            RootSeen::Ahead { size, kept } => write!(
                f,
                "the tree of size {size} is proven to extend the checkpoint kept at size {kept} (newer than it: not covered by that checkpoint's cosignatures yet; every later checkpoint must include it)"
            ),
        }
    }
}

/// Where the log's hash tiles come from (HTTP in use, memory in tests).
pub trait TileSource {
    /// The bytes of each tile, in order: `width` hashes of 32 bytes each.
    fn fetch(&self, tiles: &[TileName]) -> impl Future<Output = Result<Vec<Vec<u8>>>> + Send;
}

/// Tiles served under a log's URL (C2SP tlog-tiles paths, e.g.
/// `https://gw/v1/transparency/tile/0/000.p/7`).
pub struct HttpTiles {
    /// The HTTP client.
    pub client: reqwest::Client,
    /// The log's prefix, without a trailing slash.
    pub url: String,
}

impl TileSource for HttpTiles {
    async fn fetch(&self, tiles: &[TileName]) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::with_capacity(tiles.len());
        for t in tiles {
            let url = format!("{}/{}", self.url, t.path());
            let body = get_ok(&self.client, &url, None).await?.bytes().await?;
            out.push(body.to_vec());
        }
        Ok(out)
    }
}

/// A [`TileSource`] for when no log URL was given: any fetch fails, saying so.
pub struct NoTiles;

impl TileSource for NoTiles {
    async fn fetch(&self, _: &[TileName]) -> Result<Vec<Vec<u8>>> {
        bail!("a consistency proof needs the log's tiles, and no log URL was given (--log URL)")
    }
}

impl<T: TileSource + Sync> TileSource for Option<T> {
    async fn fetch(&self, tiles: &[TileName]) -> Result<Vec<Vec<u8>>> {
        match self {
            Some(t) => t.fetch(tiles).await,
            None => NoTiles.fetch(tiles).await,
        }
    }
}

impl HttpTiles {
    /// The tiles under `--log URL` where one was given.
    pub fn from_arg(url: Option<&str>, transport: &crate::Transport) -> Result<Option<Self>> {
        url.map(|url| {
            Ok(Self {
                client: crate::transport::http_client(
                    std::time::Duration::from_secs(60),
                    transport,
                )?,
                url: crate::transport::base_url(url, transport)?,
            })
        })
        .transpose()
    }
}

/// The latest verified checkpoint of each log (by origin), in memory or
/// kept in a state file.
#[derive(Debug, Default)]
pub struct LogState {
    logs: BTreeMap<String, SeenCheckpoint>,
    path: Option<PathBuf>,
}

impl LogState {
    /// An empty state kept in memory only.
    pub fn in_memory() -> Self {
        Self::default()
    }

    /// The state kept in `path`: empty when the file does not exist yet,
    /// an error when it cannot be read or is malformed.
    pub fn load(path: &Path) -> Result<Self> {
        let mut state = Self {
            logs: BTreeMap::new(),
            path: Some(path.to_path_buf()),
        };
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(state),
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        state.logs = parse_state(&bytes).with_context(|| {
            format!(
                "{}: not a log state file (fix or remove it; removing it forgets the checkpoints seen)",
                path.display()
            )
        })?;
        Ok(state)
    }

    /// The checkpoint kept for the log `origin`.
    pub fn latest(&self, origin: &str) -> Option<&SeenCheckpoint> {
        self.logs.get(origin)
    }

    /// Checks `note`, a checkpoint signed by the log whose verifier key is
    /// `vkey`, against the one kept for that log (a consistency proof from
    /// `tiles` when the sizes differ), keeps the larger and saves the state
    /// (when it has a file). An error refuses the checkpoint: not signed by
    /// the key, a split view (the log forked), or no proof could be made.
    pub async fn observe<T: TileSource>(
        &mut self,
        vkey: &str,
        note: &[u8],
        tiles: &T,
    ) -> Result<Observed> {
        let origin = log_origin(vkey).map_err(|e| anyhow!(e))?;
        let cp = verify_checkpoint(note, vkey, origin).context("the log's checkpoint")?;
        let mut new = SeenCheckpoint {
            origin: origin.to_string(),
            size: cp.size(),
            root: *cp.hash(),
            note: note.to_vec(),
            ahead: None,
        };
        let Some(old) = self.verified_kept(vkey, origin)? else {
            let size = new.size;
            self.keep(new)?;
            return Ok(Observed::First { size });
        };
        match new.size.cmp(&old.size) {
            std::cmp::Ordering::Equal if new.root == old.root => {
                return Ok(Observed::Same { size: new.size })
            }
            _ => consistent(origin, (old.size, old.root), (new.size, new.root), tiles).await?,
        }
        // A tree accepted beyond the kept checkpoint (an inclusion
        // receipt's) must be in this history too; once covered it is dropped.
        if let Some((size, root)) = old.ahead {
            consistent(origin, (size, root), (new.size, new.root), tiles)
                .await
                .context("a tree an inclusion receipt showed this client earlier")?;
            new.ahead = (size > new.size).then_some((size, root));
        }
        if new.size < old.size {
            return Ok(Observed::Older {
                size: new.size,
                kept: old.size,
            });
        }
        let from = old.size;
        let to = new.size;
        self.keep(new)?;
        Ok(Observed::Grew { from, to })
    }

    /// Checks a tree of `size` with `root` that the log whose verifier key
    /// is `vkey` signed outside a checkpoint (an RFC 9942 inclusion
    /// receipt's) against the checkpoint kept and the largest such tree
    /// accepted before (a consistency proof from `tiles`), and remembers it
    /// when it is the largest yet, so that every later checkpoint must
    /// include it (saved with the state). Hold the state across the call:
    /// two trees checked at once must also be checked against each other.
    pub async fn check_root<T: TileSource>(
        &mut self,
        vkey: &str,
        size: u64,
        root: Hash,
        tiles: &T,
    ) -> Result<RootSeen> {
        let origin = log_origin(vkey).map_err(|e| anyhow!(e))?;
        let Some(kept) = self.verified_kept(vkey, origin)?.cloned() else {
            bail!("no checkpoint of log {origin} is kept to check the tree against (attest first)");
        };
        consistent(origin, (kept.size, kept.root), (size, root), tiles).await?;
        if let Some(ahead) = kept.ahead {
            consistent(origin, ahead, (size, root), tiles)
                .await
                .context("a tree an inclusion receipt showed this client earlier")?;
        }
        if size <= kept.size {
            return Ok(RootSeen::Covered {
                size,
                kept: kept.size,
            });
        }
        if kept.ahead.is_none_or(|(s, _)| size > s) {
            self.keep(SeenCheckpoint {
                ahead: Some((size, root)),
                ..kept.clone()
            })?;
        }
        Ok(RootSeen::Ahead {
            size,
            kept: kept.size,
        })
    }

    /// The checkpoint kept for `origin`, re-verified against `vkey`: a
    /// state file is not trusted beyond what the log signed.
    fn verified_kept(&self, vkey: &str, origin: &str) -> Result<Option<&SeenCheckpoint>> {
        let Some(old) = self.logs.get(origin) else {
            return Ok(None);
        };
        let kept = verify_checkpoint(&old.note, vkey, origin).with_context(|| {
            format!("the checkpoint kept for {origin} is not signed by this log key (another key under the same name?)")
        })?;
        if (kept.size(), *kept.hash()) != (old.size, old.root) {
            bail!("the state kept for {origin} does not match its own signed checkpoint");
        }
        Ok(Some(old))
    }

    /// Keeps `seen` as its log's latest and saves (the state in memory
    /// changes only once the file is written).
    fn keep(&mut self, seen: SeenCheckpoint) -> Result<()> {
        let mut logs = self.logs.clone();
        logs.insert(seen.origin.clone(), seen);
        if let Some(path) = &self.path {
            write_atomically(path, &state_bytes(&logs)?)?;
        }
        self.logs = logs;
        Ok(())
    }
}

/// Requires the log `origin`'s tree `new` (size, root) to be consistent
/// with the tree `old` it showed before: equal when the sizes are, else the
/// smaller a prefix of the larger by an RFC 6962 proof read from the larger
/// tree's tiles. A failed proof is a split view (a forked log); tiles that
/// cannot be fetched are a plain error.
async fn consistent<T: TileSource>(
    origin: &str,
    old: (u64, Hash),
    new: (u64, Hash),
    tiles: &T,
) -> Result<()> {
    let split = |why: String| {
        anyhow!(
            "split view: log {origin} showed this client a tree of size {} with root {} and now one of size {} with root {}: {why} (a forked log)",
            old.0,
            hex::encode(old.1 .0),
            new.0,
            hex::encode(new.1 .0)
        )
    };
    let (small, large) = match new.0.cmp(&old.0) {
        std::cmp::Ordering::Equal if new.1 == old.1 => return Ok(()),
        std::cmp::Ordering::Equal => return Err(split("same size, different roots".into())),
        std::cmp::Ordering::Less => (new, old),
        std::cmp::Ordering::Greater => (old, new),
    };
    if small.0 == 0 {
        return Ok(());
    }
    let proof = match prove_from_tiles(tiles, large.0, large.1, small.0).await {
        Ok(p) => p,
        Err(ProofError::Fetch(e)) => {
            return Err(e.context(format!(
                "cannot check that log {origin} at size {} is consistent with the tree of size {} seen before: fetching its tiles",
                new.0, old.0
            )))
        }
        Err(ProofError::Tiles(why)) => {
            return Err(split(format!(
                "the log's tiles at size {} yield no consistency proof from size {} ({why})",
                large.0, small.0
            )))
        }
    };
    check_consistency(&proof, large.0, large.1, small.0, small.1).map_err(|_| {
        split(format!(
            "the tree of size {} is not a prefix of the tree of size {}",
            small.0, large.0
        ))
    })
}

/// Reads a consistency proof from `old_size` to `size` out of the tiles of
/// the tree of `size` with `root`, in rounds: the proof is run with the
/// tiles fetched so far; the tiles it asked for and lacked are fetched;
/// again, until it has them all.
async fn prove_from_tiles<T: TileSource>(
    source: &T,
    size: u64,
    root: Hash,
    old_size: u64,
) -> Result<TreeProof, ProofError> {
    let mut have: HashMap<Tile, Vec<u8>> = HashMap::new();
    for _ in 0..MAX_FETCH_ROUNDS {
        let missing = {
            let reader = Fetched {
                have: &have,
                missing: RefCell::new(Vec::new()),
            };
            match prove_consistency_from_tiles(&reader, size, root, old_size) {
                Ok(proof) => return Ok(proof),
                Err(e) => {
                    let missing = reader.missing.into_inner();
                    if missing.is_empty() {
                        return Err(ProofError::Tiles(e.to_string()));
                    }
                    missing
                }
            }
        };
        let names: Vec<TileName> = missing
            .iter()
            .map(|t| TileName {
                level: Some(t.level()),
                index: t.level_index(),
                width: t.width(),
            })
            .collect();
        let data = source.fetch(&names).await.map_err(ProofError::Fetch)?;
        if data.len() != names.len() {
            let e = anyhow!("asked for {} tiles, got {}", names.len(), data.len());
            return Err(ProofError::Fetch(e));
        }
        for ((tile, name), bytes) in missing.into_iter().zip(&names).zip(data) {
            if bytes.len() != name.width as usize * 32 {
                return Err(ProofError::Fetch(anyhow!(
                    "tile {} is {} bytes, not {} hashes of 32",
                    name.path(),
                    bytes.len(),
                    name.width
                )));
            }
            have.insert(tile, bytes);
        }
    }
    Err(ProofError::Tiles(format!(
        "still lacking tiles after {MAX_FETCH_ROUNDS} rounds of fetching"
    )))
}

/// Why no consistency proof was read from tiles.
enum ProofError {
    /// The tiles could not be fetched (or were not tiles).
    Fetch(anyhow::Error),
    /// The tiles, fetched, yield no proof (e.g. they do not hash to the
    /// signed root).
    Tiles(String),
}

/// A tile reader over the tiles fetched so far; it records the tiles it
/// lacks (and then fails) so that they can be fetched.
struct Fetched<'a> {
    have: &'a HashMap<Tile, Vec<u8>>,
    missing: RefCell<Vec<Tile>>,
}

impl TileReader for Fetched<'_> {
    fn height(&self) -> u8 {
        TILE_HEIGHT
    }

    fn read_tiles(&self, tiles: &[Tile]) -> Result<Vec<Vec<u8>>, proto::transparency::TlogError> {
        let lacking: Vec<Tile> = tiles
            .iter()
            .filter(|t| !self.have.contains_key(t))
            .copied()
            .collect();
        if !lacking.is_empty() {
            let mut missing = self.missing.borrow_mut();
            for t in lacking {
                if !missing.contains(&t) {
                    missing.push(t);
                }
            }
            return Err(proto::transparency::TlogError::InvalidInput(
                "tiles not fetched yet".into(),
            ));
        }
        Ok(tiles.iter().map(|t| self.have[t].clone()).collect())
    }

    fn save_tiles(&self, _: &[Tile], _: &[Vec<u8>]) {}
}

/// The state file's JSON.
fn state_bytes(logs: &BTreeMap<String, SeenCheckpoint>) -> Result<Vec<u8>> {
    let logs = logs
        .values()
        .map(|s| {
            Ok(json!({
                "origin": s.origin,
                "size": s.size,
                "root": hex::encode(s.root.0),
                "checkpoint": std::str::from_utf8(&s.note).context("a checkpoint note is not UTF-8")?,
                "ahead": s.ahead.map(|(size, root)| json!({"size": size, "root": hex::encode(root.0)})),
            }))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut out = serde_json::to_vec_pretty(&json!({"version": STATE_VERSION, "logs": logs}))?;
    out.push(b'\n');
    Ok(out)
}

/// Parses the state file's JSON (every field required, one entry per log).
fn parse_state(bytes: &[u8]) -> Result<BTreeMap<String, SeenCheckpoint>> {
    let v: serde_json::Value = serde_json::from_slice(bytes).context("not JSON")?;
    if v["version"].as_u64() != Some(STATE_VERSION) {
        bail!("expected \"version\": {STATE_VERSION}");
    }
    let mut logs = BTreeMap::new();
    for (i, l) in v["logs"]
        .as_array()
        .ok_or_else(|| anyhow!("no \"logs\" list"))?
        .iter()
        .enumerate()
    {
        let field = |name: &str| {
            l.get(name)
                .ok_or_else(|| anyhow!("logs[{i}] has no \"{name}\""))
        };
        let origin = field("origin")?
            .as_str()
            .ok_or_else(|| anyhow!("logs[{i}].origin is not text"))?;
        let size = field("size")?
            .as_u64()
            .ok_or_else(|| anyhow!("logs[{i}].size is not a number"))?;
        let root = hex::decode(field("root")?.as_str().unwrap_or_default())
            .ok()
            .and_then(|r| <[u8; 32]>::try_from(r).ok())
            .ok_or_else(|| anyhow!("logs[{i}].root is not 32 bytes of hex"))?;
        let note = field("checkpoint")?
            .as_str()
            .ok_or_else(|| anyhow!("logs[{i}].checkpoint is not text"))?;
        let ahead = match l.get("ahead") {
            None | Some(serde_json::Value::Null) => None,
            Some(a) => {
                let size = a["size"].as_u64();
                let root = hex::decode(a["root"].as_str().unwrap_or_default())
                    .ok()
                    .and_then(|r| <[u8; 32]>::try_from(r).ok());
                match (size, root) {
                    (Some(s), Some(r)) => Some((s, Hash(r))),
                    _ => bail!("logs[{i}].ahead is not {{size, root}}"),
                }
            }
        };
        let seen = SeenCheckpoint {
            origin: origin.to_string(),
            size,
            root: Hash(root),
            note: note.as_bytes().to_vec(),
            ahead,
        };
        if logs.insert(origin.to_string(), seen).is_some() {
            bail!("log {origin} appears twice");
        }
    }
    Ok(logs)
}

/// Writes `data` to a temporary file beside `path`, fsyncs it, renames it
/// over `path` and fsyncs the folder.
fn write_atomically(path: &Path, data: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| anyhow!("{}: not a file name", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write()
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            anyhow!(e)
        })
        .with_context(|| format!("writing {}", path.display()))
}
