//! Checkpoints: C2SP tlog-checkpoint bodies in C2SP signed notes, signed
//! with the log's Ed25519 key (key name = the log's origin).

use base64::Engine as _;
use signed_note::{Note, StandardSigner, StandardVerifier, VerifierList};
use tlog_tiles::{Checkpoint, Hash};

/// Why a checkpoint was refused or could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The verifier or signer key string is malformed.
    #[error("bad log key: {0}")]
    Key(String),
    /// The note is malformed or carries no valid signature by the log key.
    #[error("checkpoint signature: {0}")]
    Signature(String),
    /// The signed text is not a C2SP checkpoint.
    #[error("malformed checkpoint body")]
    Body,
    /// The checkpoint names another log.
    #[error("checkpoint origin {got:?}, expected {want:?}")]
    Origin {
        /// The origin the checkpoint names.
        got: String,
        /// The origin the caller expects.
        want: String,
    },
}

/// The signed-note signer key (`PRIVATE+KEY+<name>+<id>+<base64>`) for an
/// Ed25519 key named `origin`.
pub fn signer_key(origin: &str, key: &ed25519_dalek::SigningKey) -> String {
    let vkey = verifier_key(origin, &key.verifying_key());
    let id = vkey.split('+').nth(1).expect("vkey has an id");
    let mut raw = vec![super::note_key::ALG_ED25519];
    raw.extend_from_slice(&key.to_bytes());
    let b64 = base64::engine::general_purpose::STANDARD.encode(&raw);
    raw.iter_mut().for_each(|b| *b = 0);
    format!("PRIVATE+KEY+{origin}+{id}+{b64}")
}

/// The signed-note verifier key (`<name>+<id>+<base64>`) for `origin`.
pub fn verifier_key(origin: &str, key: &ed25519_dalek::VerifyingKey) -> String {
    signed_note::new_ed25519_verifier_key(origin, key)
}

/// Signs the checkpoint `origin`, `size`, `root` as a signed note (text).
pub fn sign_checkpoint(
    key: &ed25519_dalek::SigningKey,
    origin: &str,
    size: u64,
    root: Hash,
) -> Result<Vec<u8>, CheckpointError> {
    let body = Checkpoint::new(origin, size, root, "").map_err(|_| CheckpointError::Body)?;
    let signer = StandardSigner::new(&signer_key(origin, key))
        .map_err(|e| CheckpointError::Key(e.to_string()))?;
    let mut note =
        Note::new(&body.to_bytes(), &[]).map_err(|e| CheckpointError::Signature(e.to_string()))?;
    note.add_sigs(&[&signer])
        .map_err(|e| CheckpointError::Signature(e.to_string()))?;
    Ok(note.to_bytes())
}

/// Verifies a signed checkpoint against the log's verifier key `vkey` and
/// returns its body; the origin must be `origin` (the key's name).
pub fn verify_checkpoint(
    note: &[u8],
    vkey: &str,
    origin: &str,
) -> Result<Checkpoint, CheckpointError> {
    let verifier = StandardVerifier::new(vkey).map_err(|e| CheckpointError::Key(e.to_string()))?;
    let note = Note::from_bytes(note).map_err(|e| CheckpointError::Signature(e.to_string()))?;
    note.verify(&VerifierList::new(vec![Box::new(verifier)]))
        .map_err(|e| CheckpointError::Signature(e.to_string()))?;
    let body = Checkpoint::from_bytes(note.text()).map_err(|_| CheckpointError::Body)?;
    if body.origin() != origin {
        return Err(CheckpointError::Origin {
            got: body.origin().to_string(),
            want: origin.to_string(),
        });
    }
    Ok(body)
}
