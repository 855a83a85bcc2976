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
    link_digest, salted_digest, sign_link, sign_receipt, verify_link, Link, ReceiptBody,
    ReceiptTrailer, ReceiptVersion,
};

/// This stage's link for the request in `env`. `received_rows` gives the
/// digest of the rows this stage received (not asked of the entry stage,
/// which received the request itself), which must match what the previous
/// stage's link says it sent ([`check_previous`]; `upstream_signer` is the
/// receipt key of the attested stage the links came from, and a mismatch
/// is turned into the caller's error by `refuse`); `sent` is what it sent
/// on (the exit stage replaces it with the response digest in
/// [`sign_exit_receipt`]).
#[allow(clippy::too_many_arguments)]
pub fn link<E>(
    claims: &StageClaims,
    keys: &StageKeys,
    env: &Envelope,
    upstream: &[Vec<u8>],
    upstream_signer: Option<&[u8; 32]>,
    received_rows: impl FnOnce() -> Result<Sha256Digest, E>,
    sent: Sha256Digest,
    refuse: impl FnOnce(String) -> E,
) -> Result<Link, E> {
    let received = if claims.is_entry() {
        env.request_digest
    } else {
        let received = received_rows()?;
        check_previous(claims, env, upstream, upstream_signer, &received).map_err(refuse)?;
        received
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

/// Before a stage after the entry signs its link: the earlier stages'
/// links are one per stage, and the previous stage's (the last) is signed by
/// the attested stage the links came from (`signer`), names this request
/// and the stage and layers just before this one, and says it sent exactly
/// what this stage `received`. A mismatch means rows or steps were
/// swapped, injected, reordered or dropped on the way: the request fails
/// and nothing is signed.
pub fn check_previous(
    claims: &StageClaims,
    env: &Envelope,
    upstream: &[Vec<u8>],
    signer: Option<&[u8; 32]>,
    received: &Sha256Digest,
) -> Result<(), String> {
    if upstream.len() != claims.stage_index as usize {
        return Err(format!(
            "{} earlier links for stage {}",
            upstream.len(),
            claims.stage_index
        ));
    }
    let (Some(last), Some(signer)) = (upstream.last(), signer) else {
        return Err("no link from an attested previous stage".into());
    };
    let prev = verify_link(last, signer).map_err(|e| format!("the previous stage's link: {e}"))?;
    if prev.receipt_id != env.receipt_id {
        return Err("the previous stage's link is for another request".into());
    }
    if prev.stage_index + 1 != claims.stage_index || prev.layers[1] != claims.layer_start {
        return Err("the previous link is not from the stage before this one".into());
    }
    if prev.sent_digest != salted_digest(&env.digest_salt, received) {
        return Err(
            "what this stage received differs from what the previous stage says it sent".into(),
        );
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use proto::attestation::{mock_measurement, MockProvider};
    use proto::receipt::{OpenedKey, Sealing};
    use proto::sealing::{open_request, seal_request, Aead, ServerKey};

    /// Stage `index` of a two-stage pipeline, with its keys.
    fn stage(index: u32) -> (StageClaims, StageKeys) {
        let mut claims = StageClaims {
            stage_index: index,
            num_stages: 2,
            layer_start: 3 * index,
            layer_end: 3 * index + 3,
            model_id: "m".into(),
            manifest_sha256: Sha256Digest([1; 32]),
            receipt_key: [0; 32],
            hpke_keys: Vec::new(),
            weights: None,
        };
        let d = Sha256Digest([2; 32]);
        let provider = MockProvider::new("stage", &mock_measurement(&d, &d, &d));
        let keys = StageKeys::generate(&mut claims, &provider, None, 1..=127).unwrap();
        (claims, keys)
    }

    fn envelope(receipt_id: u8) -> Envelope {
        let server = ServerKey::derive(5, b"test");
        let (headers, body, _) = seal_request(&server.config(), Aead::Aes128Gcm, b"{}").unwrap();
        let (_, response_key) = open_request(&server, &headers, &body).unwrap();
        Envelope {
            request_id: 1,
            receipt_id: [receipt_id; 16],
            endpoint: "/v1/embeddings".into(),
            request_digest: Sha256Digest::of(b"{}"),
            digest_salt: [9; 32],
            client_nonce: None,
            sealing: Sealing::Enclave,
            opened: OpenedKey::of(5, &headers.enc),
            response_key,
            trace: None,
        }
    }

    /// Stage 0's signed chain for `env`, having sent `sent`.
    fn chain_of_stage0(env: &Envelope, sent: Sha256Digest) -> (Vec<Vec<u8>>, [u8; 32]) {
        let (c0, k0) = stage(0);
        let no_rows = || Ok::<_, String>(Sha256Digest([0; 32]));
        let mut l = link(&c0, &k0, env, &[], None, no_rows, sent, |e| e).unwrap();
        l.sent_digest = sent;
        let ActivationMessage::Links { links, .. } = pass_on(&k0, env, &l, Vec::new(), Vec::new())
        else {
            unreachable!()
        };
        (
            links.into_iter().map(|l| l.into_vec()).collect(),
            c0.receipt_key,
        )
    }

    #[test]
    fn a_stage_signs_only_what_the_previous_stage_says_it_sent() {
        let env = envelope(7);
        let rows = Sha256Digest::of(b"rows as stage 0 sent them");
        let (chain, signer) = chain_of_stage0(&env, rows);
        let (c1, _) = stage(1);
        assert_eq!(
            check_previous(&c1, &env, &chain, Some(&signer), &rows),
            Ok(())
        );

        // Other rows than were sent (swapped, injected, dropped, reordered).
        let other = Sha256Digest::of(b"rows of another request");
        let e = check_previous(&c1, &env, &chain, Some(&signer), &other).unwrap_err();
        assert!(
            e.contains("differs from what the previous stage says it sent"),
            "{e}"
        );
        // The chain of another request (same rows, other receipt id).
        let e = check_previous(&c1, &envelope(8), &chain, Some(&signer), &rows).unwrap_err();
        assert!(
            e.contains("another request") || e.contains("differs"),
            "{e}"
        );
        // Links not signed by the attested stage they came from.
        let e = check_previous(&c1, &env, &chain, Some(&[3; 32]), &rows).unwrap_err();
        assert!(e.contains("not signed by the expected stage key"), "{e}");
        let e = check_previous(&c1, &env, &chain, None, &rows).unwrap_err();
        assert!(e.contains("no link"), "{e}");
        // No chain, or one link too many.
        assert!(check_previous(&c1, &env, &[], Some(&signer), &rows).is_err());
        let twice = [chain.clone(), chain.clone()].concat();
        assert!(check_previous(&c1, &env, &twice, Some(&signer), &rows).is_err());
    }

    #[test]
    fn the_link_is_refused_not_signed_on_a_mismatch() {
        let env = envelope(7);
        let (chain, signer) = chain_of_stage0(&env, Sha256Digest::of(b"sent"));
        let (c1, k1) = stage(1);
        let received = || Ok::<_, String>(Sha256Digest::of(b"received something else"));
        let r = link(
            &c1,
            &k1,
            &env,
            &chain,
            Some(&signer),
            received,
            Sha256Digest([0; 32]),
            |why| format!("refused: {why}"),
        );
        assert!(r.unwrap_err().starts_with("refused: "));
    }
}
