//! An archive of verified exchanges for offline audit (`gateway proxy
//! --archive`, the Python package's `archive=`), readable by its owner only
//! (folders 0700, files 0600).

use super::{Attested, RequestRecord};
use anyhow::{Context, Result};
use proto::receipt::ReceiptTrailer;
use std::path::Path;

/// Writes one verified exchange to `dir/<receipt id>/` (via a temporary
/// folder renamed into place, so that a folder is never half-written):
/// request, response, receipt, digest salt, nonce, and the evidence with its
/// nonce, and the receipt's RFC 9942 inclusion receipt where the policy
/// required one (`inclusion.cose`) — what `gateway verify receipt` needs to
/// check it again.
pub fn archive(
    dir: &Path,
    id: &[u8; 16],
    req: &RequestRecord<'_>,
    attested: &Attested,
    receipt: &ReceiptTrailer,
    inclusion: Option<&[u8]>,
    response: &[u8],
) -> Result<()> {
    let name = hex::encode(id);
    let tmp = dir.join(format!(".{name}.tmp"));
    // The exchange is plaintext: owner-only folders and files.
    crate::io::create_private_dir(&tmp)?;
    let (nonce, evidence) = (
        hex::encode(req.nonce),
        proto::cbor::to_vec(&attested.bundle),
    );
    let evidence_nonce = hex::encode(&attested.nonce);
    let salt = receipt.digest_salt.map(hex::encode).unwrap_or_default();
    let files: [(&str, &[u8]); 7] = [
        ("request.json", req.body),
        ("response", response),
        ("receipt.cbor", &receipt.receipt),
        ("digest-salt.hex", salt.as_bytes()),
        ("nonce.hex", nonce.as_bytes()),
        ("evidence.cbor", &evidence),
        ("evidence-nonce.hex", evidence_nonce.as_bytes()),
    ];
    let inclusion = inclusion.map(|b| ("inclusion.cose", b));
    for (f, bytes) in files.into_iter().chain(inclusion) {
        crate::io::write_private(&tmp.join(f), bytes)?;
    }
    std::fs::rename(&tmp, dir.join(&name)).with_context(|| format!("renaming {}", tmp.display()))
}
