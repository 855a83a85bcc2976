//! The log checks for callers that do their own I/O (the Python package,
//! whose HTTP is httpx): a step runs a check with the tiles the caller has
//! fetched so far ([`TileCache`]) and either finishes or names the tile
//! paths still needed; the caller fetches them and runs the step again.

use super::TileSource;
use anyhow::{bail, Result};
use proto::transparency::TileName;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

/// How many steps a caller runs before giving up (a consistency proof
/// needs one round of tiles with `tlog_tiles` 0.2; the spare rounds are
/// for a log that serves tiles in pieces).
pub const MAX_STEPS: usize = 4;

/// The tiles a caller fetched (by path under the log's prefix, e.g.
/// `tile/0/000.p/7`), and the paths a step asked for and lacked.
#[derive(Debug, Default)]
pub struct TileCache {
    have: HashMap<String, Vec<u8>>,
    missing: Mutex<Vec<String>>,
}

impl TileCache {
    /// A cache holding `have`.
    pub fn new(have: HashMap<String, Vec<u8>>) -> Self {
        Self {
            have,
            missing: Mutex::new(Vec::new()),
        }
    }
}

impl TileSource for TileCache {
    async fn fetch(&self, tiles: &[TileName]) -> Result<Vec<Vec<u8>>> {
        let paths: Vec<String> = tiles.iter().map(TileName::path).collect();
        let lacking: Vec<String> = paths
            .iter()
            .filter(|p| !self.have.contains_key(*p))
            .cloned()
            .collect();
        if !lacking.is_empty() {
            self.missing.lock().expect("lock").extend(lacking);
            bail!("tiles not fetched yet");
        }
        Ok(paths.iter().map(|p| self.have[p].clone()).collect())
    }
}

/// What one step came to.
#[derive(Debug)]
pub enum Step<T> {
    /// The check finished.
    Done(T),
    /// It needs these tile paths first.
    Need(Vec<String>),
}

/// Runs `check` (which reads tiles from `cache` only, so never waits on
/// I/O) to its end: done, an error, or the tiles it lacked.
pub fn step<T>(cache: &TileCache, check: impl Future<Output = Result<T>>) -> Result<Step<T>> {
    let out = tokio::runtime::Builder::new_current_thread()
        .build()?
        .block_on(check);
    let missing = std::mem::take(&mut *cache.missing.lock().expect("lock"));
    match out {
        Ok(v) => Ok(Step::Done(v)),
        Err(_) if !missing.is_empty() => Ok(Step::Need(missing)),
        Err(e) => Err(e),
    }
}
