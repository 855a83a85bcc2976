//! Binding the tokens the exit stage feeds back to their own request.
//!
//! A generation pipeline's exit stage sends every sampled token back to the
//! entry stage, which makes it the sequence's next input. The host chooses
//! which attested exit stage holds the entry stage's feedback session, and
//! it may run a second pipeline of the same build. Without a binding, such
//! a host cross-wires two pipelines, feeds a token of its choice into a
//! victim's request, and learns from the exit stage's check (fail or
//! continue) whether its guess was the victim's token: an equality oracle.
//!
//! So the entry stage draws a [`FeedbackKey`] per request and hands it to
//! the later stages inside the attested channel (in the request's
//! `GenerationContext`); the exit stage tags every token it feeds back with
//! an HMAC-SHA256 under that key over the request, choice, position, token
//! and end flag; the entry stage checks the tag **before** it feeds the
//! token and fails the request on a mismatch, whatever the token. A foreign
//! pipeline's exit stage holds another key, so the victim's outcome no
//! longer depends on whether the host's guess was right.

use hmac::{Hmac, Mac};
use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use zeroize::{Zeroize, ZeroizeOnDrop};

/// Bytes of a feedback tag (HMAC-SHA256 truncated, as RFC 2104 §5 allows).
pub const FEEDBACK_TAG_LEN: usize = 16;

/// A feedback tag.
pub type FeedbackTag = [u8; FEEDBACK_TAG_LEN];

const LABEL: &[u8] = b"feedback-tag/v1";

/// A request's feedback key: 32 random bytes drawn by the entry stage,
/// known only to the stages of that request's pipeline; wiped on drop.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize, Zeroize, ZeroizeOnDrop)]
pub struct FeedbackKey([u8; 32]);

impl std::fmt::Debug for FeedbackKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FeedbackKey(..)")
    }
}

/// What a tag binds: one sampled token of one sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FedToken {
    /// The request (as the host numbered it in this configuration).
    pub request_id: u64,
    /// The choice.
    pub choice: u32,
    /// Tokens of the sequence cached once the step that sampled it ran
    /// (the sampled token's own position).
    pub pos: u32,
    /// The token id.
    pub token: u32,
    /// Whether the choice ended with it.
    pub finished: bool,
}

impl FeedbackKey {
    /// A fresh key from the operating system's generator.
    pub fn random() -> Self {
        let mut k = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut k);
        Self(k)
    }

    fn mac(&self, t: &FedToken) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key");
        m.update(LABEL);
        m.update(&t.request_id.to_be_bytes());
        m.update(&t.choice.to_be_bytes());
        m.update(&t.pos.to_be_bytes());
        m.update(&t.token.to_be_bytes());
        m.update(&[t.finished as u8]);
        m
    }

    /// The tag of `t` under this key.
    pub fn tag(&self, t: &FedToken) -> FeedbackTag {
        let full = self.mac(t).finalize().into_bytes();
        let mut out = [0u8; FEEDBACK_TAG_LEN];
        out.copy_from_slice(&full[..FEEDBACK_TAG_LEN]);
        out
    }

    /// Whether `tag` is `t`'s tag under this key (compared in constant time).
    pub fn verify(&self, t: &FedToken, tag: &FeedbackTag) -> bool {
        self.mac(t).verify_truncated_left(tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token() -> FedToken {
        FedToken {
            request_id: 7,
            choice: 1,
            pos: 12,
            token: 42,
            finished: false,
        }
    }

    #[test]
    fn a_tag_verifies_under_its_key_only_and_binds_every_field() {
        let k = FeedbackKey::random();
        let t = token();
        let tag = k.tag(&t);
        assert!(k.verify(&t, &tag));
        assert!(
            !FeedbackKey::random().verify(&t, &tag),
            "another request's key"
        );
        let changed = [
            FedToken { request_id: 8, ..t },
            FedToken { choice: 0, ..t },
            FedToken { pos: 13, ..t },
            FedToken { token: 43, ..t },
            FedToken {
                finished: true,
                ..t
            },
        ];
        for c in changed {
            assert!(!k.verify(&c, &tag), "{c:?} verified under {t:?}'s tag");
        }
        let mut flipped = tag;
        flipped[15] ^= 1;
        assert!(!k.verify(&t, &flipped));
    }

    #[test]
    fn the_key_is_not_printed_and_is_wiped_on_drop() {
        let k = FeedbackKey([0xAB; 32]);
        assert_eq!(format!("{k:?}"), "FeedbackKey(..)");
        fn wiped<T: ZeroizeOnDrop>(_: &T) {}
        wiped(&k);
    }
}
