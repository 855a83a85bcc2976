//! Target `channel`: the attested stage channel against a hostile peer. The
//! input is everything the peer sends: as initiator (client hello, finish,
//! then records) to a stage that responds, or as responder (server hello
//! with its evidence, then records) to the gateway that initiates.
//!
//! Property: every byte stream ends the handshake or the channel with an
//! error or a clean close; nothing panics. The input drives the channel's
//! I/O-free core (`proto::channel::handshake` and `record`) directly, as
//! the tokio driver does with a socket's bytes: no runtime, no socket.

use proto::attestation::{mock_measurement, Measurement, MockProvider};
use proto::channel::handshake::{Initiator, Responder};
use proto::channel::messages::frame_len;
use proto::channel::record::{RecordOpener, HEADER_LEN};
use proto::channel::{ChannelError, ChannelLimits, LocalIdentity, PeerInfo};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The claims of the stage the fuzzer talks to (an entry stage holding
/// the `sealing` target's key).
pub fn claims() -> StageClaims {
    StageClaims {
        stage_index: 0,
        num_stages: 1,
        layer_start: 0,
        layer_end: 3,
        model_id: "all-MiniLM-L6-v2".into(),
        manifest_sha256: Sha256Digest::of(b"manifest"),
        receipt_key: receipt_signer().verifying_key().to_bytes(),
        hpke_keys: proto::sealing::KeyConfig::encode_list(&[crate::sealing::server_key().config()]),
        weights: None,
    }
}

/// The stage's receipt-signing key (it signs the seed bundle's key set).
pub fn receipt_signer() -> ed25519_dalek::SigningKey {
    ed25519_dalek::SigningKey::from_bytes(&[7; 32])
}

/// The stage's (mock) measurement.
pub fn measurement() -> Measurement {
    mock_measurement(
        &Sha256Digest::of(b"binary"),
        &Sha256Digest::of(b"manifest"),
        &Sha256Digest::of(b"policy"),
    )
}

/// A stage's identity (mock attestation).
pub fn stage() -> &'static LocalIdentity {
    static ID: OnceLock<LocalIdentity> = OnceLock::new();
    ID.get_or_init(|| {
        let provider = MockProvider::new("fuzz-stage", &measurement());
        LocalIdentity::stage(Arc::new(provider), claims())
    })
}

/// Small limits, so that records and messages of the corpus reach them.
pub fn limits() -> ChannelLimits {
    ChannelLimits {
        max_record: 1024,
        max_message: 8 * 1024,
        handshake_timeout: Duration::from_secs(5),
        ..ChannelLimits::default()
    }
}

/// Takes one handshake frame off the front of `input`.
fn take_frame<'a>(input: &mut &'a [u8]) -> Option<&'a [u8]> {
    let prefix: [u8; 4] = input.get(..4)?.try_into().ok()?;
    let len = frame_len(prefix).ok()?;
    let bytes = input.get(4..4 + len)?;
    *input = &input[4 + len..];
    Some(bytes)
}

/// Reads records off the front of `input` through `opener` until one
/// completes a message: `Ok(None)` at a clean end between messages, an
/// error for a truncated or refused record.
fn take_message(
    input: &mut &[u8],
    opener: &mut RecordOpener,
) -> Result<Option<Vec<u8>>, ChannelError> {
    loop {
        if input.is_empty() && !opener.mid_message() {
            return Ok(None);
        }
        let prefix: [u8; 4] = input
            .get(..4)
            .ok_or(ChannelError::Truncated)?
            .try_into()
            .expect("4 bytes");
        opener.begin_record();
        let len = opener.record_len(prefix)?;
        let header: [u8; HEADER_LEN] = input
            .get(..HEADER_LEN)
            .ok_or(ChannelError::Truncated)?
            .try_into()
            .expect("12 bytes");
        opener.check_sequence(&header)?;
        let body = input
            .get(HEADER_LEN..4 + len)
            .ok_or(ChannelError::Truncated)?;
        let body = body.to_vec();
        *input = &input[4 + len..];
        if let Some(msg) = opener.open(&header, body)? {
            return Ok(Some(msg));
        }
    }
}

/// Runs one input: the first byte picks our side (even: we respond).
pub fn run(data: &[u8]) {
    handshake(data);
}

/// [`run`], telling whether the handshake completed.
pub fn handshake(data: &[u8]) -> bool {
    let Some((side, mut input)) = crate::selector(data) else {
        return false;
    };
    let accept = |_: &PeerInfo| Ok(());
    let mut keys = if side % 2 == 0 {
        // We respond: the input is the initiator's hello, finish, records.
        let Some(m1) = take_frame(&mut input) else {
            return false;
        };
        let Ok((state, _m2)) = Responder::hello(stage(), m1) else {
            return false;
        };
        let Some(m3) = take_frame(&mut input) else {
            return false;
        };
        match state.finish(stage(), m3, limits(), &accept) {
            Ok((_verdict, Ok((keys, _peer)))) => keys,
            _ => return false,
        }
    } else {
        // We initiate: the input is the responder's hello, verdict, records.
        let host = LocalIdentity::host();
        let (state, _m1) = Initiator::start(&host);
        let Some(m2) = take_frame(&mut input) else {
            return false;
        };
        let Ok((_m3, mut pending)) = state.finish(&host, m2, limits(), &accept) else {
            return false;
        };
        let Ok(verdict) = take_message(&mut input, pending.opener()) else {
            return false;
        };
        match pending.verdict(verdict.as_deref()) {
            Ok((keys, _peer)) => keys,
            Err(_) => return false,
        }
    };
    while let Ok(Some(_)) = take_message(&mut input, &mut keys.recv) {}
    true
}
