//! The transparency log's formats: typed entries (deterministic CBOR),
//! C2SP tlog-checkpoint signed notes (Ed25519), and RFC 6962 inclusion and
//! consistency checks over the C2SP tlog-tiles tree.
//!
//! The tree, tiles and notes come from the `tlog_tiles` and `signed_note`
//! crates; this module only fixes what goes in a leaf and thin wrappers.

mod checkpoint;
mod entry;
mod paths;
mod proof;
mod release_proof;
#[cfg(test)]
mod tests;

pub use checkpoint::{
    sign_checkpoint, signer_key, verifier_key, verify_checkpoint, CheckpointError,
};
pub use entry::{Entry, KeySetEntry, Measurement, ReceiptEntry, ReleaseEntry};
pub use paths::{join_bundle, split_bundle, TileName};
pub use proof::{
    check_consistency, check_inclusion, prove_consistency_from_tiles, prove_inclusion_from_tiles,
    HashStore, TILE_HEIGHT,
};
pub use release_proof::{log_origin, ReleaseProofs, StageReleaseProof, VerifiedStage};
pub use tlog_tiles::{Checkpoint, Hash, RecordProof, Tile, TileReader, TreeProof};
