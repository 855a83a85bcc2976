//! The key material that seals a response to one request's client.

use super::error::SealError;
use super::keys::Aead;
use super::KEY_LEN;
use serde::{Deserialize, Serialize};
use std::fmt;
use zeroize::Zeroize;

/// What the server side needs to seal a response to one request: the AEAD,
/// the request's encapsulated key and the secret exported from its HPKE
/// context. Serializable (CBOR byte strings) so that the entry stage can hand
/// it to the exit stage inside the attested channel. `Debug` does not print
/// the secret; the secret is zeroed on drop.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseKeyMaterial {
    pub(super) aead: Aead,
    #[serde(with = "serde_bytes")]
    pub(super) enc: [u8; KEY_LEN],
    #[serde(with = "serde_bytes")]
    pub(super) secret: Vec<u8>,
}

impl fmt::Debug for ResponseKeyMaterial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let enc = hex::encode(self.enc);
        // The secret opens the response: never printed.
        write!(
            f,
            "ResponseKeyMaterial {{ aead: {:?}, enc: {enc:?}, secret: \"<redacted>\" }}",
            self.aead
        )
    }
}

impl Drop for ResponseKeyMaterial {
    fn drop(&mut self) {
        self.secret.zeroize();
    }
}

impl zeroize::ZeroizeOnDrop for ResponseKeyMaterial {}

impl ResponseKeyMaterial {
    /// The AEAD the response is sealed with (the request's).
    pub fn aead(&self) -> Aead {
        self.aead
    }

    /// The request's encapsulated key.
    pub fn enc(&self) -> &[u8; KEY_LEN] {
        &self.enc
    }

    pub(super) fn check(&self) -> Result<(), SealError> {
        if self.secret.len() != self.aead.key_len() {
            return Err(SealError::Malformed(format!(
                "response secret is {} bytes, expected {}",
                self.secret.len(),
                self.aead.key_len()
            )));
        }
        Ok(())
    }
}

/// The client's copy of a request's response key material, used to open
/// the response. Serializable so that a CLI can keep it between sealing the
/// request and opening the response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClientResponseKey(pub(super) ResponseKeyMaterial);

/// Its material wipes its secret when dropped.
impl zeroize::ZeroizeOnDrop for ClientResponseKey {}

impl ClientResponseKey {
    /// The underlying material.
    pub fn material(&self) -> &ResponseKeyMaterial {
        &self.0
    }
}
