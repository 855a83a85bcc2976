//! Adversarial tests of the attested stage channel's handshake, over real
//! TCP sockets on 127.0.0.1 through the hostile relay of
//! `channel_support` (frame indices as in `channel_adversarial.rs`):
//! tampered, dropped, replayed and reflected handshake messages, and the
//! policy checks on the peer's evidence and claims.

mod channel_support;

use channel_support::{
    accept, at_frame, attested_field, bytes32_field, dial, direct, err, expect_rejected, flip,
    flip_with, flipped_hello, handshake, host, initiate_as_host, listener, ok, pass, recording,
    spawn_relay, stage, HandshakeResult, Hello, Out, Peer, Tamper, R2I_REC0,
};
use proto::channel::{ChannelError, PeerInfo};
use proto::io::channel;
use std::sync::{Arc, Mutex};

// ---------------------------------------------------------------------------
// 3. Handshake tampering
// ---------------------------------------------------------------------------

/// Captures the handshake frames of an untampered host → stage(1) session.
async fn capture(initiator: &Peer<'_>) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let i2r = Arc::new(Mutex::new(Vec::new()));
    let r2i = Arc::new(Mutex::new(Vec::new()));
    let hs = handshake(
        initiator,
        &stage(1),
        recording(i2r.clone()),
        recording(r2i.clone()),
    )
    .await;
    ok(hs.init, "initiator");
    ok(hs.resp, "responder");
    let i2r = i2r.lock().unwrap().clone();
    let r2i = r2i.lock().unwrap().clone();
    (i2r, r2i)
}

/// Where a hello's ephemeral channel key is.
fn eph_pos(b: &[u8]) -> usize {
    bytes32_field(b, "eph")
}

/// Where a hello's challenge is.
fn challenge_pos(b: &[u8]) -> usize {
    bytes32_field(b, "challenge")
}

/// The initiator's handshake failed: the responder's Outcome did not
/// authenticate.
fn expect_unauthenticated(r: HandshakeResult) {
    assert!(matches!(
        err(r, "initiator"),
        ChannelError::Authentication(0)
    ));
}

/// A flipped hello field the host initiator must reject (`what` in its
/// error); the responder sees the connection end before Finish.
async fn initiator_rejects(hello: Hello, pos: fn(&[u8]) -> usize, what: &str) {
    let hs = flipped_hello(&host(), &stage(1), hello, pos).await;
    expect_rejected(hs.init, "initiator", what);
    assert!(matches!(err(hs.resp, "responder"), ChannelError::Truncated));
}

#[tokio::test]
async fn server_hello_with_flipped_key_is_rejected() {
    initiator_rejects(Hello::Server, eph_pos, "channel key").await;
}

#[tokio::test]
async fn server_hello_with_flipped_evidence_is_rejected() {
    // The last byte of the ServerHello is the last byte of the document's
    // signature.
    let hs = flipped_hello(&host(), &stage(1), Hello::Server, |b| b.len() - 1).await;
    expect_rejected(hs.init, "initiator", "signature");
    assert!(hs.resp.is_err());
}

#[tokio::test]
async fn server_hello_with_flipped_challenge_fails() {
    // A host initiator does not use the responder's challenge, but it is in
    // the transcript: the keys differ and the Outcome does not authenticate.
    let hs = flipped_hello(&host(), &stage(1), Hello::Server, challenge_pos).await;
    expect_unauthenticated(hs.init);

    // A stage initiator binds its evidence to the tampered challenge: the
    // responder rejects it (and its rejection does not authenticate either).
    let hs = flipped_hello(&stage(0), &stage(1), Hello::Server, challenge_pos).await;
    expect_unauthenticated(hs.init);
    expect_rejected(hs.resp, "responder", "challenge");
}

#[tokio::test]
async fn any_flipped_server_hello_byte_fails_the_handshake() {
    let (_, r2i) = capture(&host()).await;
    let len = r2i[0].len();
    for pos in (0..len).step_by(7).chain([len - 1]) {
        let hs = handshake(&host(), &stage(1), pass(), flip(0, pos, 0x01)).await;
        assert!(
            hs.init.is_err(),
            "ServerHello flip at byte {pos} of {len} accepted"
        );
    }
}

#[tokio::test]
async fn client_hello_with_flipped_key_fails() {
    let hs = flipped_hello(&host(), &stage(1), Hello::Client, eph_pos).await;
    // The responder derived its keys from the wrong key: its Outcome does
    // not authenticate at the initiator.
    expect_unauthenticated(hs.init);
}

#[tokio::test]
async fn client_hello_with_flipped_challenge_fails() {
    // The responder's evidence is bound to the tampered challenge.
    initiator_rejects(Hello::Client, challenge_pos, "challenge").await;
}

#[tokio::test]
async fn client_hello_with_flipped_attestation_flag_fails() {
    // Host says "not attested"; flipped to "attested" with no evidence.
    let hs = flipped_hello(&host(), &stage(1), Hello::Client, attested_field).await;
    expect_unauthenticated(hs.init);
    expect_rejected(hs.resp, "responder", "disagree");
}

#[tokio::test]
async fn any_flipped_client_hello_or_finish_byte_fails_the_handshake() {
    let (i2r, _) = capture(&host()).await;
    for frame in [0usize, 1] {
        let len = i2r[frame].len();
        for pos in 0..len {
            let hs = handshake(&host(), &stage(1), flip(frame, pos, 0x01), pass()).await;
            assert!(
                hs.init.is_err(),
                "flip at byte {pos} of {len} in frame {frame} accepted"
            );
        }
    }
}

#[tokio::test]
async fn finish_with_flipped_evidence_is_rejected() {
    // The last byte of a stage's Finish is the last signature byte.
    let hs = handshake(
        &stage(0),
        &stage(1),
        flip_with(1, |b| b.len() - 1, 0x01),
        pass(),
    )
    .await;
    expect_rejected(hs.resp, "responder", "signature");
    expect_unauthenticated(hs.init);
}

/// Stripping a stage initiator's attestation (so that it looks like the
/// host) changes the transcript: the initiator cannot be fooled into a
/// channel whose responder thinks it talks to the host.
#[tokio::test]
async fn stripped_initiator_attestation_fails() {
    let strip: Tamper = Box::new(|i, mut b| {
        match i {
            0 => {
                let at = attested_field(&b);
                assert_eq!(b[at], 0xf5, "stage initiator says attested");
                b[at] = 0xf4;
            }
            1 => {
                // Finish { evidence: None }
                b = vec![0xa1, 0x68];
                b.extend_from_slice(b"evidence");
                b.push(0xf6);
            }
            _ => {}
        }
        vec![Out::Frame(b)]
    });
    let hs = handshake(&stage(0), &stage(1), strip, pass()).await;
    expect_unauthenticated(hs.init);
}

#[tokio::test]
async fn replayed_server_hello_is_rejected() {
    let (_, r2i) = capture(&host()).await;
    let old = r2i[0].clone();
    let hs = handshake(
        &host(),
        &stage(1),
        pass(),
        at_frame(0, move |_| vec![Out::Frame(old.clone())]),
    )
    .await;
    match err(hs.init, "initiator") {
        ChannelError::PeerRejected(m) => {
            assert!(m.contains("challenge") && m.contains("replayed"), "{m}")
        }
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    assert!(matches!(err(hs.resp, "responder"), ChannelError::Truncated));
}

/// A stage initiator's ClientHello and Finish replayed into a new session:
/// the old evidence is bound to the old responder challenge.
#[tokio::test]
async fn replayed_client_hello_and_finish_are_rejected() {
    let (i2r, _) = capture(&stage(0)).await;
    let (old_hello, old_finish) = (i2r[0].clone(), i2r[1].clone());
    let replay: Tamper = Box::new(move |i, b| match i {
        0 => vec![
            Out::Frame(old_hello.clone()),
            Out::Frame(old_finish.clone()),
        ],
        1 => vec![],
        _ => vec![Out::Frame(b)],
    });
    let hs = handshake(&stage(0), &stage(1), replay, pass()).await;
    expect_rejected(hs.resp, "responder", "challenge");
    // The live initiator sees evidence bound to the replayed challenge.
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::PeerRejected(_)
    ));
}

#[tokio::test]
async fn flipped_outcome_fails_authentication() {
    let hs = handshake(&host(), &stage(1), pass(), flip(R2I_REC0, 10, 0x01)).await;
    expect_unauthenticated(hs.init);
}

/// The Outcome cannot be skipped: the next record is out of sequence.
#[tokio::test]
async fn dropped_outcome_is_out_of_sequence() {
    let (l, addr) = listener().await;
    let (relay, _) = spawn_relay(addr, pass(), at_frame(R2I_REC0, |_| vec![])).await;
    let responder = stage(1);
    let (i, r) = tokio::join!(async { initiate_as_host(dial(relay).await).await }, async {
        let s = accept(&l).await;
        let (mut tx, rx, p) =
            channel::respond(s, &responder.id, responder.limits, responder.check).await?;
        tx.send(b"first data").await?;
        Ok::<_, ChannelError>((tx, rx, p))
    });
    ok(r, "responder");
    match err(i, "initiator") {
        ChannelError::OutOfSequence {
            expected: 0,
            got: 1,
        } => {}
        other => panic!("expected OutOfSequence 0/1, got {other:?}"),
    }
}

/// An `Accepted` Outcome from another session cannot overturn a rejection.
#[tokio::test]
async fn spliced_accepted_outcome_does_not_overturn_a_rejection() {
    let (_, r2i) = capture(&host()).await;
    let accepted = r2i[R2I_REC0].clone();
    let no_hosts = |p: &PeerInfo| -> Result<(), String> {
        if p.is_host() {
            Err("hosts may not dial here".into())
        } else {
            Ok(())
        }
    };
    let hs = handshake(
        &host(),
        &stage(1).with_check(&no_hosts),
        pass(),
        at_frame(R2I_REC0, move |_| vec![Out::Frame(accepted.clone())]),
    )
    .await;
    expect_unauthenticated(hs.init);
    assert!(matches!(
        err(hs.resp, "responder"),
        ChannelError::PeerRejected(_)
    ));
}

// ---------------------------------------------------------------------------
// 4. Policy checks
// ---------------------------------------------------------------------------

#[tokio::test]
async fn initiator_check_rejecting_the_responder_fails_initiate() {
    let want_stage_2 = |p: &PeerInfo| -> Result<(), String> {
        match &p.claims {
            Some(c) if c.stage_index == 2 => Ok(()),
            Some(c) => Err(format!("wrong stage index {}", c.stage_index)),
            None => Err("no claims".into()),
        }
    };
    let (i, r) = direct(&host().with_check(&want_stage_2), &stage(1)).await;
    expect_rejected(i, "initiator", "wrong stage index 1");
    // The initiator hung up before Finish.
    assert!(matches!(err(r, "responder"), ChannelError::Truncated));
}

#[tokio::test]
async fn responder_check_rejecting_a_stage_initiator_is_reported_to_it() {
    let want_stage_0 = |p: &PeerInfo| -> Result<(), String> {
        match &p.claims {
            Some(c) if c.stage_index == 0 => Ok(()),
            Some(c) => Err(format!(
                "expected stage 0 upstream, got stage {}",
                c.stage_index
            )),
            None => Err("host may not dial a middle stage".into()),
        }
    };
    let (i, r) = direct(&stage(5), &stage(1).with_check(&want_stage_0)).await;
    match err(i, "initiator") {
        ChannelError::RejectedByPeer(m) => {
            assert!(m.contains("expected stage 0 upstream, got stage 5"), "{m}")
        }
        other => panic!("expected RejectedByPeer, got {other:?}"),
    }
    expect_rejected(r, "responder", "got stage 5");

    // The same check rejects the host.
    let (i, _) = direct(&host(), &stage(1).with_check(&want_stage_0)).await;
    match err(i, "initiator") {
        ChannelError::RejectedByPeer(m) => assert!(m.contains("host may not dial"), "{m}"),
        other => panic!("expected RejectedByPeer, got {other:?}"),
    }

    // And accepts stage 0.
    let (i, r) = direct(&stage(0), &stage(1).with_check(&want_stage_0)).await;
    ok(i, "initiator");
    ok(r, "responder");
}
