//! The handshake and record layer run in memory, with no runtime and no
//! socket: the I/O-free core on its own.

use super::handshake::{read_verdict, verdict_message, Initiator, Keys, Responder};
use super::messages::{frame, frame_len, HANDSHAKE_MAX};
use super::record::HEADER_LEN;
use super::{ChannelError, ChannelLimits, LocalIdentity, PeerInfo};
use crate::attestation::{mock_measurement, MockProvider};
use crate::digest::Sha256Digest;
use crate::frames::StageClaims;
use std::sync::Arc;

fn stage() -> LocalIdentity {
    let measurement = mock_measurement(
        &Sha256Digest::of(b"binary"),
        &Sha256Digest::of(b"manifest"),
        &Sha256Digest::of(b"policy"),
    );
    let claims = StageClaims {
        stage_index: 0,
        num_stages: 1,
        layer_start: 0,
        layer_end: 1,
        model_id: "m".into(),
        manifest_sha256: Sha256Digest::of(b"manifest"),
        receipt_key: [7; 32],
        hpke_keys: Vec::new(),
        weights: None,
    };
    LocalIdentity::stage(Arc::new(MockProvider::new("s", &measurement)), claims)
}

fn limits() -> ChannelLimits {
    ChannelLimits {
        max_record: 16,
        max_message: 64,
        ..ChannelLimits::default()
    }
}

/// Runs a whole handshake host → stage; returns both sides' keys.
fn handshake(
    check: &(dyn Fn(&PeerInfo) -> Result<(), String> + Sync),
) -> (Keys, Keys, Result<PeerInfo, ChannelError>) {
    let (host, stage) = (LocalIdentity::host(), stage());
    let (initiator, m1) = Initiator::start(&host);
    let (responder, m2) = Responder::hello(&stage, &m1).unwrap();
    let (m3, host_keys, peer) = initiator.finish(&host, &m2, limits(), &|_| Ok(())).unwrap();
    assert!(!peer.is_host());
    let (stage_keys, verdict) = responder.finish(&stage, &m3, limits(), check).unwrap();
    if let Ok(peer) = &verdict {
        assert!(peer.is_host());
    }
    (host_keys, stage_keys, verdict)
}

/// Feeds sealed record bytes to an opener the way a reader would.
fn open_all(keys: &mut Keys, bytes: &[u8]) -> Result<Vec<Vec<u8>>, ChannelError> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        keys.recv.begin_record();
        let len = keys.recv.record_len(rest[..4].try_into().unwrap())?;
        let header: [u8; HEADER_LEN] = rest[..HEADER_LEN].try_into().unwrap();
        keys.recv.check_sequence(&header)?;
        let body = rest[HEADER_LEN..4 + len].to_vec();
        rest = &rest[4 + len..];
        out.extend(keys.recv.open(&header, body)?);
    }
    Ok(out)
}

fn seal_message(keys: &mut Keys, msg: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let chunks: Vec<_> = keys.send.chunks(msg).unwrap().collect();
    for (chunk, last) in chunks {
        out.extend(keys.send.seal(chunk, last).unwrap());
    }
    out
}

#[test]
fn messages_cross_in_memory_in_records() {
    let (mut host, mut stage, _) = handshake(&|_| Ok(()));
    let accepted = verdict_message(&Ok(PeerInfo {
        evidence: None,
        document: None,
        claims: None,
    }));
    let bytes = seal_message(&mut stage, &accepted);
    let got = open_all(&mut host, &bytes).unwrap();
    read_verdict(got.first().map(|m| m.as_slice())).unwrap();
    let msg: Vec<u8> = (0..40).collect();
    let wire = seal_message(&mut host, &msg);
    assert_eq!(host.send.records_sealed(), 3, "40 bytes in 16-byte records");
    assert_eq!(open_all(&mut stage, &wire).unwrap(), vec![msg]);
    assert!(!stage.recv.mid_message());
    let empty = seal_message(&mut host, &[]);
    assert_eq!(
        open_all(&mut stage, &empty).unwrap(),
        vec![Vec::<u8>::new()]
    );
}

#[test]
fn records_out_of_order_tampered_or_oversized_are_refused() {
    let (mut host, mut stage, _) = handshake(&|_| Ok(()));
    let first = host.send.seal(b"a", false).unwrap();
    let second = host.send.seal(b"b", true).unwrap();
    let mut reordered = second.clone();
    reordered.extend(&first);
    assert!(matches!(
        open_all(&mut stage, &reordered),
        Err(ChannelError::OutOfSequence {
            expected: 0,
            got: 1
        })
    ));
    let (mut host, mut stage, _) = handshake(&|_| Ok(()));
    let mut tampered = host.send.seal(b"abc", true).unwrap();
    *tampered.last_mut().unwrap() ^= 1;
    assert!(matches!(
        open_all(&mut stage, &tampered),
        Err(ChannelError::Authentication(0))
    ));
    assert!(matches!(
        host.send.chunks(&[0; 65]).map(|_| ()),
        Err(ChannelError::MessageTooLarge {
            size: 65,
            limit: 64
        })
    ));
    assert!(matches!(
        stage.recv.record_len(u32::MAX.to_be_bytes()),
        Err(ChannelError::RecordTooLarge { .. })
    ));
}

#[test]
fn a_rejected_initiator_learns_why_and_a_wrong_key_cannot_open() {
    let (mut host, mut stage, verdict) = handshake(&|_| Err("not in policy".into()));
    assert!(verdict.is_err());
    let wire = seal_message(&mut stage, &verdict_message(&verdict));
    let got = open_all(&mut host, &wire).unwrap();
    let err = read_verdict(got.first().map(|m| m.as_slice())).unwrap_err();
    assert!(err.to_string().contains("not in policy"), "{err}");
    // Keys of another session do not open this one's records.
    let (mut other, _, _) = handshake(&|_| Ok(()));
    let wire = seal_message(&mut host, b"hello");
    assert!(matches!(
        open_all(&mut other, &wire),
        Err(ChannelError::Authentication(0))
    ));
}

#[test]
fn handshake_frames_are_bounded() {
    let framed = frame(b"abc");
    assert_eq!(frame_len(framed[..4].try_into().unwrap()).unwrap(), 3);
    assert!(frame_len(((HANDSHAKE_MAX + 1) as u32).to_be_bytes()).is_err());
    let (host, stage) = (LocalIdentity::host(), stage());
    assert!(matches!(
        Responder::hello(&stage, b"\xff garbage"),
        Err(ChannelError::Handshake(_))
    ));
    let (initiator, _) = Initiator::start(&host);
    assert!(initiator.finish(&host, b"", limits(), &|_| Ok(())).is_err());
}
