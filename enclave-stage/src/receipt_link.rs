//! A stage's part of a request's receipt, one piece of code for embeddings
//! and generation alike (`docs/receipts.md`):
//!
//! - [`link`]: this stage's statement about the request: what it received
//!   (the entry stage: the request itself) and sent, its evidence, its layer
//!   range, the digest of the previous stage's signed link, and, from the
//!   entry stage only, which HPKE key it opened (what lets a client check
//!   the receipt's `sealing`);
//! - [`pass_on`]: a stage before the exit stage signs its link and passes
//!   the chain on;
//! - [`sign_exit_receipt`]: the exit stage puts its link, the chain and the
//!   digest of the exact response bytes under one signature;
//! - [`client_trailer`]: what the exit stage seals after the response for the
//!   client: the receipt and the salt of its digests.
//!
//! Stages compute plain SHA-256 digests of what they received and sent;
//! every digest is salted with the request's secret salt
//! ([`proto::receipt::salted_digest`]) just before it is signed, so that
//! whoever holds the receipt without the salt cannot confirm a guess of the
//! request, the response or the activations.

use crate::keys::StageKeys;
use proto::claims::StageClaims;
use proto::digest::Sha256Digest;
use proto::frames::{ActivationMessage, Envelope, StageTiming};
use proto::receipt::{
    link_digest, salted_digest, sign_link, sign_receipt, Link, ReceiptBody, ReceiptTrailer,
    ReceiptVersion,
};

/// This stage's link for the request in `env`. `received_rows` gives the
/// digest of the rows this stage received (not asked of the entry stage,
/// which received the request itself); `sent` is what it sent on (the exit
/// stage replaces it with the response digest in [`sign_exit_receipt`]).
pub fn link<E>(
    claims: &StageClaims,
    keys: &StageKeys,
    env: &Envelope,
    upstream: &[Vec<u8>],
    received_rows: impl FnOnce() -> Result<Sha256Digest, E>,
    sent: Sha256Digest,
) -> Result<Link, E> {
    let received = if claims.is_entry() {
        env.request_digest
    } else {
        received_rows()?
    };
    Ok(Link {
        receipt_id: env.receipt_id,
        stage_index: claims.stage_index,
        layers: [claims.layer_start, claims.layer_end],
        evidence_digest: keys.evidence_digest,
        received_digest: received,
        sent_digest: sent,
        prev_link_digest: upstream.last().map(|l| link_digest(l)),
        opened: claims.is_entry().then_some(env.opened),
    })
}

/// A stage before the exit stage: the chain so far plus this stage's link,
/// signed, for the next stage.
pub fn pass_on(
    keys: &StageKeys,
    env: &Envelope,
    link: &Link,
    mut upstream: Vec<Vec<u8>>,
    timings: Vec<StageTiming>,
) -> ActivationMessage {
    upstream.push(sign_link(&keys.receipt, &salted(env, link)));
    ActivationMessage::Links {
        request_id: env.request_id,
        links: upstream
            .into_iter()
            .map(serde_bytes::ByteBuf::from)
            .collect(),
        timings,
    }
}

/// The exit stage: the receipt over the exact `response` bytes (for a
/// stream: every byte of the event stream), with this stage's `link` (its
/// sent digest set to the response's) and the `upstream` signed links
/// inside, under one signature.
pub fn sign_exit_receipt(
    claims: &StageClaims,
    keys: &StageKeys,
    env: &Envelope,
    mut link: Link,
    upstream: Vec<Vec<u8>>,
    response: &[u8],
    issued_at_ms: u64,
) -> Vec<u8> {
    let response_digest = Sha256Digest::of(response);
    link.sent_digest = response_digest;
    let salt = &env.digest_salt;
    sign_receipt(
        &keys.receipt,
        &ReceiptBody {
            version: ReceiptVersion::CURRENT,
            receipt_id: env.receipt_id,
            issued_at_ms,
            endpoint: env.endpoint.clone(),
            model_id: claims.model_id.clone(),
            manifest_digest: claims.manifest_sha256,
            request_digest: salted_digest(salt, &env.request_digest),
            response_digest: salted_digest(salt, &response_digest),
            client_nonce: env.client_nonce.clone(),
            sequence: keys.next_sequence(),
            mock: keys.mock,
            sealing: env.sealing,
            // The exit stage's link rides in the receipt, under its
            // signature: one Ed25519 signature per request fewer.
            chain: upstream,
            exit_link: salted(env, &link),
        },
    )
}

/// `link` with its received and sent digests salted for the receipt.
fn salted(env: &Envelope, link: &Link) -> Link {
    Link {
        received_digest: salted_digest(&env.digest_salt, &link.received_digest),
        sent_digest: salted_digest(&env.digest_salt, &link.sent_digest),
        ..link.clone()
    }
}

/// The trailer the exit stage seals after the response body for the
/// client: the `receipt` and the salt of its digests.
pub fn client_trailer(env: &Envelope, receipt: &[u8]) -> Vec<u8> {
    ReceiptTrailer {
        receipt: receipt.to_vec(),
        digest_salt: Some(env.digest_salt),
    }
    .encode()
}
