//! Getting an evidence bundle: from a file, or from a gateway's
//! `GET /v1/attestation` (CBOR, or the JSON form).

use crate::io::read_input;
use crate::transport::{get_ok, percent_encode};
use anyhow::{anyhow, Context, Result};
use base64::Engine as _;
use proto::bundle::EvidenceBundle;
use std::path::Path;

/// Decodes an evidence bundle from what `GET /v1/attestation` returns:
/// the CBOR bundle (`Accept: application/cbor`), or the JSON form (its
/// `bundle_cbor` field, base64, is what is verified; the rest of the JSON is
/// for people and is ignored).
pub fn decode_bundle(bytes: &[u8]) -> Result<EvidenceBundle> {
    let text_start = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if text_start == Some(&b'{') {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).context("the evidence is not valid JSON")?;
        let b64 = v["bundle_cbor"].as_str().ok_or_else(|| {
            anyhow!("the JSON evidence has no `bundle_cbor` field (is it from /v1/attestation?)")
        })?;
        let cbor = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(b64.trim()))
            .context("`bundle_cbor` is not base64")?;
        return proto::cbor::from_slice(&cbor)
            .map_err(|e| anyhow!("`bundle_cbor` is not an evidence bundle: {e}"));
    }
    proto::cbor::from_slice(bytes).map_err(|e| anyhow!("not an evidence bundle (CBOR): {e}"))
}

/// Reads an evidence bundle file (CBOR or the JSON from `/v1/attestation`).
pub fn load_bundle(path: &Path) -> Result<EvidenceBundle> {
    decode_bundle(&read_input(path)?).with_context(|| format!("evidence {}", path.display()))
}

/// Fetches the evidence bundle for `nonce` from a gateway (CBOR): the
/// pipeline serving `model`, or the default one.
pub async fn fetch_bundle(
    client: &reqwest::Client,
    base: &str,
    nonce: &[u8],
    model: Option<&str>,
) -> Result<EvidenceBundle> {
    let mut url = format!("{base}/v1/attestation?nonce={}", hex::encode(nonce));
    if let Some(m) = model {
        url += &format!("&model={}", percent_encode(m));
    }
    let r = get_ok(client, &url, Some("application/cbor")).await?;
    let body = r.bytes().await.with_context(|| format!("GET {url}"))?;
    decode_bundle(&body).with_context(|| format!("GET {url}"))
}
