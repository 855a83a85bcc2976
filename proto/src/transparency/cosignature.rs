//! Witness cosignatures: C2SP tlog-cosignature `cosignature/v1` (Ed25519,
//! signed-note key type 0x04). A witness signs
//! `cosignature/v1\ntime <T>\n` followed by the checkpoint's note text, and
//! the signature line carries the 8-byte big-endian `T` before the 64-byte
//! signature. A client that names witnesses counts the distinct ones whose
//! cosignature on a checkpoint verifies.
//!
//! `signed_note` parses and verifies notes; its `Signer`/`Verifier` traits
//! take our key type here (the crate implements only type 0x01).

use super::note_key::{parse_verifier_key, split_key};
use super::CheckpointError;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};
use signed_note::{key_id, Note, NoteError, Signer, Verifier, VerifierList};

/// The signed-note key type of an Ed25519 cosignature/v1 key.
const ALG_COSIGNATURE_V1: u8 = 0x04;

/// The message a cosignature at `time` signs over a note's text.
fn message(time: u64, text: &[u8]) -> Vec<u8> {
    let mut m = format!("cosignature/v1\ntime {time}\n").into_bytes();
    m.extend_from_slice(text);
    m
}

fn typed_key(key: &VerifyingKey) -> Vec<u8> {
    let mut k = vec![ALG_COSIGNATURE_V1];
    k.extend_from_slice(key.as_bytes());
    k
}

/// A witness's public key: checks its cosignatures.
#[derive(Clone, Debug)]
pub struct CosignatureVerifier {
    name: String,
    id: u32,
    key: VerifyingKey,
}

impl CosignatureVerifier {
    /// Parses a witness verifier key (`<name>+<id>+<base64(0x04 || key)>`).
    pub fn new(vkey: &str) -> Result<Self, CheckpointError> {
        let (name, id, key) = parse_verifier_key(vkey, ALG_COSIGNATURE_V1)
            .map_err(|why| CheckpointError::Key(format!("witness key {vkey:?}: {why}")))?;
        Ok(Self {
            name: name.to_string(),
            id,
            key,
        })
    }

    /// The witness's name.
    pub fn witness_name(&self) -> &str {
        &self.name
    }
}

impl Verifier for CosignatureVerifier {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_id(&self) -> u32 {
        self.id
    }

    fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        let Ok(sig) = <&[u8; 72]>::try_from(sig) else {
            return false;
        };
        let time = u64::from_be_bytes(sig[..8].try_into().expect("8 bytes"));
        let ed = ed25519_dalek::Signature::from_bytes(sig[8..].try_into().expect("64 bytes"));
        time <= i64::MAX as u64 && self.key.verify_strict(&message(time, msg), &ed).is_ok()
    }
}

/// A witness's private key, cosigning at a fixed time.
pub struct Cosigner {
    name: String,
    key: SigningKey,
    time: u64,
}

impl Cosigner {
    /// A cosigner named `name` whose signatures carry `time` (POSIX seconds).
    pub fn new(name: &str, key: SigningKey, time: u64) -> Result<Self, CheckpointError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(CheckpointError::Key(format!("witness name {name:?}")));
        }
        Ok(Self {
            name: name.to_string(),
            key,
            time,
        })
    }

    /// The witness's verifier key, for clients' policies.
    pub fn vkey(&self) -> String {
        let raw = typed_key(&self.key.verifying_key());
        format!(
            "{}+{:08x}+{}",
            self.name,
            key_id(&self.name, &raw),
            B64.encode(&raw)
        )
    }

    /// The signature line (`— <name> <base64>\n`) cosigning the checkpoint
    /// `note` (its text; its signatures are not looked at).
    pub fn cosign(&self, note: &[u8]) -> Result<String, CheckpointError> {
        let sig_err = |e: NoteError| CheckpointError::Signature(e.to_string());
        let text = Note::from_bytes(note).map_err(sig_err)?;
        let sig = self
            .sign(text.text())
            .map_err(|e| CheckpointError::Signature(e.to_string()))?;
        let line = signed_note::Signature::new(self.name.clone(), Signer::key_id(self), sig)
            .map_err(sig_err)?
            .to_bytes();
        Ok(String::from_utf8(line).expect("signature lines are UTF-8"))
    }
}

impl Signer for Cosigner {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_id(&self) -> u32 {
        key_id(&self.name, &typed_key(&self.key.verifying_key()))
    }

    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, ed25519_dalek::SignatureError> {
        let mut sig = self.time.to_be_bytes().to_vec();
        sig.extend_from_slice(&self.key.sign(&message(self.time, msg)).to_bytes());
        Ok(sig)
    }
}

/// One verified cosignature: the witness's name and the time it signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cosigned {
    /// The witness's name.
    pub witness: String,
    /// When it cosigned (POSIX seconds).
    pub time: u64,
}

/// The cosignatures on `note` by the witnesses `vkeys` (duplicates counted
/// once) that verify. A signature line under a listed key that does not
/// verify is an error: it is forged or altered, not merely absent.
pub fn verify_cosignatures(
    note: &[u8],
    vkeys: &[String],
) -> Result<Vec<Cosigned>, CheckpointError> {
    let mut verifiers: Vec<CosignatureVerifier> = Vec::new();
    for v in vkeys {
        let v = CosignatureVerifier::new(v)?;
        if !verifiers.iter().any(|w| w.name == v.name && w.id == v.id) {
            verifiers.push(v);
        }
    }
    let list = VerifierList::new(
        verifiers
            .into_iter()
            .map(|v| Box::new(v) as Box<dyn Verifier>)
            .collect(),
    );
    let note = Note::from_bytes(note).map_err(|e| CheckpointError::Signature(e.to_string()))?;
    match note.verify(&list) {
        Ok((verified, _)) => Ok(verified
            .iter()
            .map(|s| Cosigned {
                witness: s.name().to_string(),
                time: u64::from_be_bytes(s.signature()[..8].try_into().expect("verified")),
            })
            .collect()),
        Err(NoteError::UnverifiedNote) => Ok(Vec::new()),
        Err(NoteError::InvalidSignature { name, .. }) => Err(CheckpointError::Signature(format!(
            "witness {name}'s cosignature does not verify"
        ))),
        Err(e) => Err(CheckpointError::Signature(e.to_string())),
    }
}

/// A signed note's text (its lines before the signatures), to tell whether
/// two notes sign the same checkpoint.
pub fn note_text(note: &[u8]) -> Option<&[u8]> {
    let at = note.windows(2).rposition(|w| w == b"\n\n")?;
    Some(&note[..=at])
}

/// Adds cosignature lines (`— <name> <base64>\n`, as a witness returns
/// them) to a signed note, replacing any earlier line by the same key.
pub fn add_cosignatures(note: &[u8], lines: &[String]) -> Result<Vec<u8>, CheckpointError> {
    let text = std::str::from_utf8(note).map_err(|_| CheckpointError::Body)?;
    let (body, sigs) = text.rsplit_once("\n\n").ok_or(CheckpointError::Body)?;
    let key_of = |l: &str| -> Option<(String, [u8; 4])> {
        let sig = signed_note::Signature::from_bytes(l.trim_end_matches('\n').as_bytes()).ok()?;
        Some((sig.name().to_string(), sig.id().to_be_bytes()))
    };
    let mut kept: Vec<String> = sigs.lines().map(|l| format!("{l}\n")).collect();
    for line in lines {
        let key = key_of(line)
            .ok_or_else(|| CheckpointError::Signature(format!("not a signature line: {line:?}")))?;
        kept.retain(|l| key_of(l).as_ref() != Some(&key));
        kept.push(format!("{}\n", line.trim_end_matches('\n')));
    }
    let out = format!("{body}\n\n{}", kept.concat()).into_bytes();
    Note::from_bytes(&out).map_err(|e| CheckpointError::Signature(e.to_string()))?;
    Ok(out)
}

/// The lines of a witness's `add-checkpoint` answer that cosign `note`
/// under the witness key `vkey`, checked; lines by other keys are ignored
/// (as C2SP tlog-witness says). An answer with none that verifies is an
/// error.
pub fn witness_answer(
    note: &[u8],
    vkey: &str,
    answer: &str,
) -> Result<Vec<String>, CheckpointError> {
    let v = CosignatureVerifier::new(vkey)?;
    let mine: Vec<String> = answer
        .lines()
        .filter(|l| {
            signed_note::Signature::from_bytes(l.as_bytes())
                .is_ok_and(|s| s.name() == v.name && s.id() == v.id)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let with = add_cosignatures(note, &mine)?;
    if mine.is_empty() || verify_cosignatures(&with, &[vkey.to_string()])?.is_empty() {
        return Err(CheckpointError::Signature(format!(
            "the answer holds no cosignature by {}",
            v.name
        )));
    }
    Ok(mine)
}

/// Parses a witness key file: `PRIVATE+KEY+<name>+<id>+<base64(0x04 ||
/// seed)>`, as [`cosigner_key`] writes it.
pub fn parse_cosigner_key(s: &str) -> Result<(String, SigningKey), CheckpointError> {
    let bad = || CheckpointError::Key("not a witness signer key".into());
    let rest = s.trim().strip_prefix("PRIVATE+KEY+").ok_or_else(bad)?;
    let (name, id, raw) = split_key(rest).ok_or_else(bad)?;
    if raw.len() != 33 || raw[0] != ALG_COSIGNATURE_V1 {
        return Err(bad());
    }
    let key = SigningKey::from_bytes(raw[1..].try_into().expect("32 bytes"));
    if key_id(name, &typed_key(&key.verifying_key())) != id {
        return Err(bad());
    }
    Ok((name.to_string(), key))
}

/// A witness key file's text for `name` and `key`.
pub fn cosigner_key(name: &str, key: &SigningKey) -> String {
    let mut raw = vec![ALG_COSIGNATURE_V1];
    raw.extend_from_slice(&key.to_bytes());
    let id = key_id(name, &typed_key(&key.verifying_key()));
    let out = format!("PRIVATE+KEY+{name}+{id:08x}+{}\n", B64.encode(&raw));
    raw.iter_mut().for_each(|b| *b = 0);
    out
}
