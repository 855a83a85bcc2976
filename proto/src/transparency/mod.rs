//! The transparency log's formats: typed entries (deterministic CBOR),
//! C2SP tlog-checkpoint signed notes (Ed25519), and RFC 6962 inclusion and
//! consistency checks over the C2SP tlog-tiles tree, witnesses' C2SP
//! tlog-cosignature `cosignature/v1` signatures and the tlog-witness
//! protocol's bodies.
//!
//! The tree, tiles and notes come from the `tlog_tiles` and `signed_note`
//! crates; this module only fixes what goes in a leaf and thin wrappers.

mod checkpoint;
mod cose_receipt;
mod cosignature;
mod entry;
mod note_key;
mod paths;
mod proof;
mod release_proof;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod witness_tests;
mod witness_wire;

pub use checkpoint::{
    sign_checkpoint, signer_key, verifier_key, verify_checkpoint, CheckpointError,
};
pub use cose_receipt::{
    root_from_inclusion, sign_inclusion_receipt, verify_inclusion_receipt, verify_receipt_logged,
    ProvenInclusion,
};
pub use cosignature::{
    add_cosignatures, cosigner_key, note_text, parse_cosigner_key, verify_cosignatures,
    witness_answer, CosignatureVerifier, Cosigned, Cosigner,
};
pub use entry::{Entry, KeySetEntry, Measurement, ReceiptEntry, ReleaseEntry};
pub use paths::{join_bundle, split_bundle, TileName};
pub use proof::{
    check_consistency, check_inclusion, prove_consistency_from_tiles, prove_inclusion_from_tiles,
    HashStore, TILE_HEIGHT,
};
pub use release_proof::{
    check_quorum, log_origin, EntryProof, ReleaseProofs, StageReleaseProof, VerifiedStage,
};
pub use tlog_tiles::{
    Checkpoint, Error as TlogError, Hash, RecordProof, Tile, TileReader, TreeProof,
};
pub use witness_wire::{
    parse_decimal, AddCheckpoint, ADD_CHECKPOINT_PATH, MAX_PROOF_LINES, SIZE_CONTENT_TYPE,
};
