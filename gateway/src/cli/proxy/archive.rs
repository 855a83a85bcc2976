//! `--archive DIR`: every verified exchange written out for offline audit.

use super::*;

/// Writes one verified exchange to `dir/<receipt id>/` (via a temporary
/// folder renamed into place, so that a folder is never half-written).
pub(super) fn archive(
    dir: &Path,
    id: &[u8; 16],
    x: &Exchange,
    trusted: &Trusted,
    receipt: &[u8],
    response: &[u8],
) -> Result<()> {
    let name = hex::encode(id);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let (nonce, evidence) = (hex::encode(&x.nonce), proto::cbor::to_vec(&trusted.bundle));
    let evidence_nonce = hex::encode(&trusted.nonce);
    let files: [(&str, &[u8]); 6] = [
        ("request.json", &x.request),
        ("response", response),
        ("receipt.cbor", receipt),
        ("nonce.hex", nonce.as_bytes()),
        ("evidence.cbor", &evidence),
        ("evidence-nonce.hex", evidence_nonce.as_bytes()),
    ];
    for (f, bytes) in files {
        std::fs::write(tmp.join(f), bytes).with_context(|| format!("writing {f}"))?;
    }
    std::fs::rename(&tmp, dir.join(&name)).with_context(|| format!("renaming {}", tmp.display()))
}
