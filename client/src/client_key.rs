//! The client key file that `gateway seal --key-out` writes and `gateway
//! open` and `gateway verify receipt --client-key` read: what opens the
//! response, and which HPKE key and encapsulated key the request was sealed
//! with (checked against what the receipt's entry stage says it opened).
//! `gateway open` adds the salt of the receipt's digests, which comes only
//! inside the sealed response.

use anyhow::{anyhow, bail, Context, Result};
use proto::receipt::{DigestSalt, OpenedKey, ReceiptVersion, SealedTo};
use proto::sealing::{Aead, ClientResponseKey, KeyConfig};
use serde_json::json;
use std::path::Path;

/// The `kind` field of a client key file.
pub const CLIENT_KEY_KIND: &str = "gateway-client-response-key";

/// The command-line name of an AEAD.
pub fn aead_name(a: Aead) -> &'static str {
    match a {
        Aead::Aes128Gcm => "aes128gcm",
        Aead::ChaCha20Poly1305 => "chacha20poly1305",
    }
}

/// What `gateway seal` keeps for `gateway open` (and for the receipt check).
#[derive(Debug)]
pub struct ClientKeyFile {
    /// Opens the response.
    pub key: ClientResponseKey,
    /// The key id sealed to.
    pub key_id: u8,
    /// The receipt nonce sent, if any.
    pub receipt_nonce: Option<Vec<u8>>,
    /// SHA-256 of the plaintext request.
    pub request_sha256: String,
    /// The salt of the receipt's digests, once `gateway open` found it in
    /// the sealed response.
    pub digest_salt: Option<DigestSalt>,
}

impl ClientKeyFile {
    /// The JSON form:
    /// `{"kind", "version": 1, "aead", "key_id", "enc" (hex, the
    /// encapsulated key), "secret" (hex, the exported response secret),
    /// "receipt_nonce" (hex or null), "request_sha256" (hex),
    /// "digest_salt" (hex or null)}`.
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let m = self.key.material();
        let raw = serde_json::to_value(&self.key)?;
        let bytes = |field: &str| -> Result<String> {
            let v: Vec<u8> = serde_json::from_value(raw[field].clone())
                .with_context(|| format!("client key field {field}"))?;
            Ok(hex::encode(v))
        };
        Ok(json!({
            "kind": CLIENT_KEY_KIND,
            "version": 1,
            "aead": aead_name(m.aead()),
            "key_id": self.key_id,
            "enc": hex::encode(m.enc()),
            "secret": bytes("secret")?,
            "receipt_nonce": self.receipt_nonce.as_ref().map(hex::encode),
            "request_sha256": self.request_sha256,
            "digest_salt": self.digest_salt.map(hex::encode),
        }))
    }

    /// Parses the JSON form.
    pub fn from_json(v: &serde_json::Value) -> Result<Self> {
        if v["kind"] != CLIENT_KEY_KIND || v["version"] != 1 {
            bail!("not a client key file written by `gateway seal` (kind {CLIENT_KEY_KIND:?}, version 1)");
        }
        let hex_field = |f: &str| -> Result<Vec<u8>> {
            let s = v[f]
                .as_str()
                .ok_or_else(|| anyhow!("client key file: `{f}` missing"))?;
            hex::decode(s).map_err(|e| anyhow!("client key file: `{f}` is not hex: {e}"))
        };
        let aead = match v["aead"].as_str() {
            Some("aes128gcm") => Aead::Aes128Gcm,
            Some("chacha20poly1305") => Aead::ChaCha20Poly1305,
            other => bail!("client key file: unknown aead {other:?}"),
        };
        let raw = json!({
            "aead": serde_json::to_value(aead)?,
            "enc": hex_field("enc")?,
            "secret": hex_field("secret")?,
        });
        let key: ClientResponseKey =
            serde_json::from_value(raw).context("client key file: bad key material")?;
        Ok(Self {
            key,
            key_id: v["key_id"]
                .as_u64()
                .and_then(|k| u8::try_from(k).ok())
                .ok_or_else(|| anyhow!("client key file: `key_id` missing or not 0..=255"))?,
            receipt_nonce: match &v["receipt_nonce"] {
                serde_json::Value::String(s) => Some(
                    hex::decode(s).map_err(|e| anyhow!("client key file: receipt_nonce: {e}"))?,
                ),
                _ => None,
            },
            request_sha256: v["request_sha256"].as_str().unwrap_or_default().to_string(),
            digest_salt: match &v["digest_salt"] {
                serde_json::Value::String(s) => Some(
                    hex::decode(s)
                        .ok()
                        .and_then(|b| DigestSalt::try_from(b.as_slice()).ok())
                        .ok_or_else(|| {
                            anyhow!("client key file: digest_salt is not 32 bytes of hex")
                        })?,
                ),
                _ => None,
            },
        })
    }
}

impl ClientKeyFile {
    /// Reads and parses a key file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = crate::io::read_input(path)?;
        let v: serde_json::Value = serde_json::from_slice(&text)
            .with_context(|| format!("{}: not JSON", path.display()))?;
        Self::from_json(&v).with_context(|| format!("client key {}", path.display()))
    }

    /// Writes the key file (mode 0600), replacing `path` whole: written
    /// beside it, then renamed over it.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(&self.to_json()?)?;
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let tmp = path.with_file_name(format!(".{name}.tmp"));
        crate::io::write_private(&tmp, text.as_bytes())?;
        std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
    }

    /// The key the request was sealed to, as a receipt verifier input.
    pub fn sealed_to(&self) -> SealedTo<'_> {
        SealedTo {
            key_id: self.key_id,
            enc: self.key.material().enc(),
        }
    }

    /// Checks, without the evidence, that a receipt's entry stage says it
    /// opened this request's encapsulated key (`gateway open`); `gateway
    /// verify receipt --client-key` proves the same against the evidence.
    /// `Ok(false)` for a v2 receipt, which does not say.
    pub fn check_opened(&self, receipt: &[u8]) -> Result<bool> {
        let (body, _) = proto::receipt::parse_unverified(receipt)
            .map_err(|e| anyhow!("the receipt does not parse: {e}"))?;
        if body.version == ReceiptVersion::V2 {
            return Ok(false);
        }
        let link = body
            .entry_link_unverified()
            .map_err(|e| anyhow!("the receipt's entry link does not parse: {e}"))?;
        let mine = OpenedKey::of(self.key_id, self.key.material().enc());
        match link.opened {
            Some(o) if o == mine => Ok(true),
            Some(o) => bail!(
                "the enclave's entry stage opened {o}, not the key this request was sealed to \
                 (key id {}): the host opened the request and re-sealed it",
                self.key_id
            ),
            None => bail!("the receipt's entry link does not say which key it opened"),
        }
    }
}

/// Picks the key to seal to.
pub(crate) fn pick_key(keys: &[KeyConfig], key_id: Option<u8>, aead: Aead) -> Result<KeyConfig> {
    let found = keys
        .iter()
        .find(|k| key_id.is_none_or(|id| k.key_id == id) && k.supports(aead));
    found.cloned().ok_or_else(|| match key_id {
        Some(id) => anyhow!(
            "no key with id {id} that supports {} (keys: {:?})",
            aead_name(aead),
            keys.iter().map(|k| k.key_id).collect::<Vec<_>>()
        ),
        None => anyhow!("no key supports {}", aead_name(aead)),
    })
}
