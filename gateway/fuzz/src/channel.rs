//! Target `channel`: the attested stage channel against a hostile peer. The
//! input is everything the peer sends: as initiator (client hello, finish,
//! then records) to a stage that responds, or as responder (server hello
//! with its evidence, then records) to the gateway that initiates.
//!
//! Property: every byte stream ends the handshake or the channel with an
//! error or a clean close, within the handshake timeout; nothing panics.

use proto::attestation::{mock_measurement, Measurement, MockProvider};
use proto::channel::{ChannelLimits, LocalIdentity, PeerInfo};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use proto::io::channel::{initiate, respond};
use proto::io::transport::BoxStream;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    })
}

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

/// A stream that reads `input` and discards what is written to it.
fn peer(input: &[u8]) -> BoxStream {
    Box::new(tokio::io::join(
        std::io::Cursor::new(input.to_vec()),
        tokio::io::sink(),
    ))
}

/// Runs one input: the first byte picks our side (even: we respond).
pub fn run(data: &[u8]) {
    handshake(data);
}

/// [`run`], telling whether the handshake completed.
pub fn handshake(data: &[u8]) -> bool {
    let Some((side, input)) = crate::selector(data) else {
        return false;
    };
    let accept = |_: &PeerInfo| Ok(());
    runtime().block_on(async {
        let host = LocalIdentity::host();
        let channel = if side % 2 == 0 {
            respond(peer(input), stage(), limits(), &accept).await
        } else {
            initiate(peer(input), &host, limits(), &accept).await
        };
        match channel {
            Ok((_tx, mut rx, _peer)) => {
                while let Ok(Some(_)) = rx.recv().await {}
                true
            }
            Err(_) => false,
        }
    })
}
