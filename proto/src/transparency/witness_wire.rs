//! The C2SP tlog-witness protocol's bodies: an `add-checkpoint` request
//! (`old <size>`, up to 63 consistency-proof hashes in base64, an empty
//! line, then the signed checkpoint) and a `409 Conflict`'s size.

use super::Hash;
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;

/// The path, under a witness's submission prefix, checkpoints are posted to.
pub const ADD_CHECKPOINT_PATH: &str = "/add-checkpoint";
/// The content type of a `409 Conflict`'s body: the witness's latest size.
pub const SIZE_CONTENT_TYPE: &str = "text/x.tlog.size";
/// The most proof lines a request may carry.
pub const MAX_PROOF_LINES: usize = 63;

/// An `add-checkpoint` request.
#[derive(Clone, Debug, PartialEq)]
pub struct AddCheckpoint {
    /// The size of the checkpoint the witness last cosigned (as the log
    /// believes it), 0 for none.
    pub old_size: u64,
    /// The RFC 6962 consistency proof from `old_size` to the checkpoint.
    pub proof: Vec<Hash>,
    /// The signed checkpoint (a note with the log's signature).
    pub checkpoint: Vec<u8>,
}

/// A decimal with no leading zeroes (`0` alone for zero).
pub fn parse_decimal(s: &str) -> Option<u64> {
    let ok =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    ok.then(|| s.parse().ok()).flatten()
}

impl AddCheckpoint {
    /// The request body.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("old {}\n", self.old_size);
        for h in &self.proof {
            out += &B64.encode(h.0);
            out.push('\n');
        }
        out.push('\n');
        let mut out = out.into_bytes();
        out.extend_from_slice(&self.checkpoint);
        out
    }

    /// Parses a request body; the error says what is malformed.
    pub fn parse(body: &[u8]) -> Result<Self, String> {
        let mut rest = body;
        let mut line = || -> Result<&str, String> {
            let at = rest
                .iter()
                .position(|&b| b == b'\n')
                .ok_or("a line without a newline")?;
            let l = std::str::from_utf8(&rest[..at]).map_err(|_| "a line is not UTF-8")?;
            rest = &rest[at + 1..];
            Ok(l)
        };
        let old = line()?;
        let old_size = old
            .strip_prefix("old ")
            .and_then(parse_decimal)
            .ok_or("the first line is not `old <size>`")?;
        let mut proof = Vec::new();
        loop {
            let l = line()?;
            if l.is_empty() {
                break;
            }
            if proof.len() == MAX_PROOF_LINES {
                return Err(format!("more than {MAX_PROOF_LINES} proof lines"));
            }
            let h = B64
                .decode(l)
                .ok()
                .and_then(|h| <[u8; 32]>::try_from(h).ok())
                .ok_or("a proof line is not a base64 SHA-256 hash")?;
            proof.push(Hash(h));
        }
        if old_size == 0 && !proof.is_empty() {
            return Err("a proof from size 0".into());
        }
        Ok(Self {
            old_size,
            proof,
            checkpoint: rest.to_vec(),
        })
    }
}
