//! Inclusion and consistency proofs: thin wrappers over `tlog_tiles`, and
//! an in-memory store of the tree's hashes in tlog's stored-hash order.

use tlog_tiles::{
    check_record, check_tree, prove_record, prove_tree, record_hash, stored_hash_index,
    stored_hashes, tree_hash, Hash, HashReader, RecordProof, TileHashReader, TileReader, TreeProof,
};

/// The tile height C2SP tlog-tiles fixes (256 hashes per full tile).
pub const TILE_HEIGHT: u8 = 8;

/// Checks that `leaf` (an entry's bytes) is record `index` of the tree of
/// `size` with root `root`.
pub fn check_inclusion(
    proof: &RecordProof,
    size: u64,
    root: Hash,
    index: u64,
    leaf: &[u8],
) -> Result<(), tlog_tiles::Error> {
    check_record(proof, size, root, index, record_hash(leaf))
}

/// Checks that the tree of `old_size` with `old_root` is a prefix of the
/// tree of `new_size` with `new_root`.
pub fn check_consistency(
    proof: &TreeProof,
    new_size: u64,
    new_root: Hash,
    old_size: u64,
    old_root: Hash,
) -> Result<(), tlog_tiles::Error> {
    check_tree(proof, new_size, new_root, old_size, old_root)
}

/// An inclusion proof for record `index`, read from tiles (checked against
/// `root` as `tlog_tiles` does, which is not every tile: always check the
/// proof with [`check_inclusion`]).
pub fn prove_inclusion_from_tiles<R: TileReader>(
    tiles: &R,
    size: u64,
    root: Hash,
    index: u64,
) -> Result<RecordProof, tlog_tiles::Error> {
    prove_record(size, index, &TileHashReader::new(size, root, tiles))
}

/// A consistency proof from `old_size` to `size`, read from tiles (check it
/// with [`check_consistency`], as for [`prove_inclusion_from_tiles`]).
pub fn prove_consistency_from_tiles<R: TileReader>(
    tiles: &R,
    size: u64,
    root: Hash,
    old_size: u64,
) -> Result<TreeProof, tlog_tiles::Error> {
    prove_tree(size, old_size, &TileHashReader::new(size, root, tiles))
}

/// Every stored hash of a tree, in `stored_hash_index` order: the state an
/// append-only log keeps (and from which its tiles are cut).
#[derive(Clone, Debug, Default)]
pub struct HashStore {
    hashes: Vec<Hash>,
    size: u64,
}

impl HashStore {
    /// An empty tree.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number of records.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// All stored hashes, in order.
    pub fn hashes(&self) -> &[Hash] {
        &self.hashes
    }

    /// Appends a record (its bytes) and returns the stored hashes it added.
    pub fn append(&mut self, leaf: &[u8]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        let new = stored_hashes(self.size, leaf, self)?;
        debug_assert_eq!(self.hashes.len() as u64, stored_hash_index(0, self.size));
        self.hashes.extend_from_slice(&new);
        self.size += 1;
        Ok(new)
    }

    /// The root of the tree's first `size` records.
    pub fn root(&self, size: u64) -> Result<Hash, tlog_tiles::Error> {
        tree_hash(size, self)
    }

    /// The inclusion proof of record `index` in the tree of its first
    /// `size` records.
    pub fn prove_inclusion(&self, size: u64, index: u64) -> Result<RecordProof, tlog_tiles::Error> {
        prove_record(size, index, self)
    }

    /// The consistency proof from the tree of `old_size` records to that of
    /// `size`.
    pub fn prove_consistency(
        &self,
        size: u64,
        old_size: u64,
    ) -> Result<TreeProof, tlog_tiles::Error> {
        prove_tree(size, old_size, self)
    }
}

impl HashReader for HashStore {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|&i| {
                self.hashes
                    .get(usize::try_from(i).map_err(|_| tlog_tiles::Error::IndexesNotInTree)?)
                    .copied()
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}
