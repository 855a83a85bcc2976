//! The handshake and record layer run in memory, with no runtime and no
//! socket: the I/O-free core on its own.

use super::handshake::{Initiator, Keys, Responder};
use super::messages::{frame, frame_len, HANDSHAKE_MAX};
use super::record::{RecordOpener, HEADER_LEN};
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

/// Runs a whole handshake host → stage: both sides' keys when the stage
/// accepts the host, else the host's error on reading the verdict.
fn handshake(
    check: &(dyn Fn(&PeerInfo) -> Result<(), String> + Sync),
) -> Result<(Keys, Keys), ChannelError> {
    let (host, stage) = (LocalIdentity::host(), stage());
    let (initiator, m1) = Initiator::start(&host);
    let (responder, m2) = Responder::hello(&stage, &m1).unwrap();
    let (m3, mut pending) = initiator.finish(&host, &m2, limits(), &|_| Ok(())).unwrap();
    let (verdict, accepted) = responder.finish(&stage, &m3, limits(), check).unwrap();
    let got = open_all(pending.opener(), &verdict).unwrap();
    assert_eq!(got.len(), 1, "one verdict message");
    let (host_keys, peer) = pending.verdict(Some(&got[0]))?;
    assert!(!peer.is_host());
    let (stage_keys, host_peer) = accepted.expect("the host heard it was accepted");
    assert!(host_peer.is_host());
    Ok((host_keys, stage_keys))
}

/// Feeds sealed record bytes to an opener the way a reader would.
fn open_all(opener: &mut RecordOpener, bytes: &[u8]) -> Result<Vec<Vec<u8>>, ChannelError> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        opener.begin_record();
        let len = opener.record_len(rest[..4].try_into().unwrap())?;
        let header: [u8; HEADER_LEN] = rest[..HEADER_LEN].try_into().unwrap();
        opener.check_sequence(&header)?;
        let body = rest[HEADER_LEN..4 + len].to_vec();
        rest = &rest[4 + len..];
        out.extend(opener.open(&header, body)?);
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
    let (mut host, mut stage) = handshake(&|_| Ok(())).unwrap();
    let msg: Vec<u8> = (0..40).collect();
    let wire = seal_message(&mut host, &msg);
    assert_eq!(host.send.records_sealed(), 3, "40 bytes in 16-byte records");
    assert_eq!(open_all(&mut stage.recv, &wire).unwrap(), vec![msg]);
    assert!(!stage.recv.mid_message());
    let empty = seal_message(&mut host, &[]);
    assert_eq!(
        open_all(&mut stage.recv, &empty).unwrap(),
        vec![Vec::<u8>::new()]
    );
}

#[test]
fn records_out_of_order_tampered_or_oversized_are_refused() {
    let (mut host, mut stage) = handshake(&|_| Ok(())).unwrap();
    let first = host.send.seal(b"a", false).unwrap();
    let second = host.send.seal(b"b", true).unwrap();
    let mut reordered = second.clone();
    reordered.extend(&first);
    assert!(matches!(
        open_all(&mut stage.recv, &reordered),
        Err(ChannelError::OutOfSequence {
            expected: 0,
            got: 1
        })
    ));
    let (mut host, mut stage) = handshake(&|_| Ok(())).unwrap();
    let mut tampered = host.send.seal(b"abc", true).unwrap();
    *tampered.last_mut().unwrap() ^= 1;
    assert!(matches!(
        open_all(&mut stage.recv, &tampered),
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
fn a_rejected_initiator_learns_why_and_gets_no_keys() {
    let err = handshake(&|_| Err("not in policy".into())).err().unwrap();
    assert!(matches!(err, ChannelError::RejectedByPeer(_)), "{err}");
    assert!(err.to_string().contains("not in policy"), "{err}");
}

#[test]
fn keys_of_another_session_do_not_open_this_ones_records_and_errors_stick() {
    let (mut host, _) = handshake(&|_| Ok(())).unwrap();
    let (_, mut other) = handshake(&|_| Ok(())).unwrap();
    let wire = seal_message(&mut host, b"hello");
    assert!(matches!(
        open_all(&mut other.recv, &wire),
        Err(ChannelError::Authentication(0))
    ));
    // Poisoned: even a record of its own session is refused now.
    let (mut a, mut b) = handshake(&|_| Ok(())).unwrap();
    let good = seal_message(&mut a, b"x");
    let header: [u8; HEADER_LEN] = good[..HEADER_LEN].try_into().unwrap();
    assert!(
        b.recv
            .open(&header, good[HEADER_LEN..good.len() - 1].to_vec())
            .is_err(),
        "short body"
    );
    assert!(matches!(
        b.recv.open(&header, good[HEADER_LEN..].to_vec()),
        Err(ChannelError::Poisoned)
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
