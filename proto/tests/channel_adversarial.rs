//! Adversarial tests of the attested stage channel, over real TCP sockets on
//! 127.0.0.1.
//!
//! Most tests put a hostile relay between the initiator and the responder.
//! The relay understands the channel's framing (every frame on the wire,
//! handshake message and record alike, is a big-endian `u32` length followed
//! by that many bytes; a record's bytes are `u64 sequence ‖ ciphertext`),
//! counts frames per direction, and hands each frame to a per-direction
//! tamper function that decides what is actually forwarded.
//!
//! Frame indices per direction:
//! - initiator → responder: 0 = ClientHello, 1 = Finish, records from 2
//!   (record `k` is frame `2 + k`);
//! - responder → initiator: 0 = ServerHello, 1 = the encrypted Outcome
//!   (record 0), then records from 1 (record `k` is frame `1 + k`).

mod channel_support;

use channel_support::{
    accept, at_frame, claims, direct, expect_failure, expect_message, expect_poisoned, flip,
    framed, handshake, host, initiate_as_host, limits, listener, msg, ok, pass, pattern, recording,
    recv, stage, Handshake, Out, Tamper, I2R_REC0, R2I_REC0, TAG, WAIT,
};
use proto::attestation::EvidenceFormat;
use proto::channel::{ChannelError, PeerInfo};
use proto::io::channel::{self, ChannelReceiver, ChannelSender};
use proto::io::transport::BoxStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tokio::net::TcpStream;
use tokio::time::timeout;

// ---------------------------------------------------------------------------
// 1. Happy path
// ---------------------------------------------------------------------------

#[tokio::test]
async fn host_and_stage_exchange_messages_through_a_counting_relay() {
    let small = limits(1024, 1 << 16, 1000);
    let i2r_log = Arc::new(Mutex::new(Vec::new()));
    let hs = handshake(
        &host().with_limits(small),
        &stage(1).with_limits(small),
        recording(i2r_log.clone()),
        pass(),
    )
    .await;
    let (mut itx, mut irx, ipeer) = ok(hs.init, "initiator");
    let (mut rtx, mut rrx, rpeer) = ok(hs.resp, "responder");

    // What each side learned about the other.
    assert!(rpeer.is_host());
    assert!(rpeer.claims.is_none() && rpeer.document.is_none());
    assert!(!ipeer.is_host());
    assert_eq!(ipeer.claims, Some(claims(1)));
    let doc = ipeer.document.as_ref().expect("verified document");
    assert_eq!(doc.format, EvidenceFormat::Mock);
    assert_eq!(doc.module_id, "stage-1");
    assert_eq!(
        doc.user_data,
        [b"channel\0".as_slice(), &proto::cbor::to_vec(&claims(1))].concat()
    );
    assert_eq!(doc.public_key.len(), 32);
    assert_eq!(doc.nonce.len(), 32);

    // Small messages both ways.
    itx.send(b"hello stage").await.unwrap();
    expect_message(&mut rrx, b"hello stage").await;
    rtx.send(b"hello host").await.unwrap();
    expect_message(&mut irx, b"hello host").await;

    // Empty messages both ways: one record each.
    let before = itx.records_sent();
    itx.send(b"").await.unwrap();
    assert_eq!(itx.records_sent() - before, 1);
    expect_message(&mut rrx, b"").await;
    rtx.send(b"").await.unwrap();
    expect_message(&mut irx, b"").await;

    // Larger than max_record: split into 4 records, reassembled exactly.
    let big = pattern(3 * 1024 + 17);
    let before = itx.records_sent();
    itx.send(&big).await.unwrap();
    assert_eq!(itx.records_sent() - before, 4);
    expect_message(&mut rrx, &big).await;

    // An exact multiple of max_record: 2 full records, no empty trailer.
    let even = pattern(2048);
    let before = itx.records_sent();
    itx.send(&even).await.unwrap();
    assert_eq!(itx.records_sent() - before, 2);
    expect_message(&mut rrx, &even).await;

    // Exactly max_record: one record.
    let before = rtx.records_sent();
    rtx.send(&pattern(1024)).await.unwrap();
    assert_eq!(rtx.records_sent() - before, 1);
    expect_message(&mut irx, &pattern(1024)).await;

    // The other direction, split too; then interleaved after it.
    let big2 = pattern(5000);
    rtx.send(&big2).await.unwrap();
    itx.send(b"after").await.unwrap();
    expect_message(&mut irx, &big2).await;
    expect_message(&mut rrx, b"after").await;

    // The relay saw 2 handshake frames + every record one way, and
    // ServerHello + every record (the Outcome included) the other way.
    assert_eq!(
        hs.counts.i2r.load(Ordering::SeqCst) as u64,
        2 + itx.records_sent()
    );
    assert_eq!(
        hs.counts.r2i.load(Ordering::SeqCst) as u64,
        1 + rtx.records_sent()
    );
    // Outcome, "hello host", "", one full record, 5000 bytes in 5 records.
    assert_eq!(rtx.records_sent(), 1 + 1 + 1 + 1 + 5);

    // Record layout on the wire: contiguous sequence numbers from 0, length
    // = 8 (seq) + 1 (flags) + chunk + 16 (tag), and no plaintext visible.
    let log = i2r_log.lock().unwrap().clone();
    let records = &log[I2R_REC0..];
    assert_eq!(records.len() as u64, itx.records_sent());
    for (k, r) in records.iter().enumerate() {
        assert_eq!(u64::from_be_bytes(r[..8].try_into().unwrap()), k as u64);
    }
    assert_eq!(records[0].len(), 8 + 1 + b"hello stage".len() + TAG);
    assert_eq!(records[1].len(), 8 + 1 + TAG);
    for r in &records[2..5] {
        assert_eq!(r.len(), 8 + 1 + 1024 + TAG);
    }
    assert_eq!(records[5].len(), 8 + 1 + 17 + TAG);
    assert!(!records[0].windows(5).any(|w| w == b"hello"));

    // A clean close between messages.
    itx.close().await;
    assert!(matches!(recv(&mut rrx).await, Ok(None)));
    rtx.close().await;
    assert!(matches!(recv(&mut irx).await, Ok(None)));
}

#[tokio::test]
async fn stages_attest_each_other() {
    let want_stage_1 = |p: &PeerInfo| -> Result<(), String> {
        match &p.claims {
            Some(c) if c.stage_index == 1 => Ok(()),
            other => Err(format!("expected stage 1, got {other:?}")),
        }
    };
    let want_stage_0 = |p: &PeerInfo| -> Result<(), String> {
        match &p.claims {
            Some(c) if c.stage_index == 0 => Ok(()),
            other => Err(format!("expected stage 0, got {other:?}")),
        }
    };
    let small = limits(64, 1 << 16, 1000);
    let (i, r) = direct(
        &stage(0).with_check(&want_stage_1).with_limits(small),
        &stage(1).with_check(&want_stage_0).with_limits(small),
    )
    .await;
    let (mut itx, mut irx, ipeer) = ok(i, "initiator");
    let (mut rtx, mut rrx, rpeer) = ok(r, "responder");
    assert_eq!(ipeer.claims, Some(claims(1)));
    assert_eq!(rpeer.claims, Some(claims(0)));
    assert!(!ipeer.is_host() && !rpeer.is_host());
    assert_eq!(rpeer.document.as_ref().unwrap().module_id, "stage-0");
    assert_eq!(ipeer.document.as_ref().unwrap().module_id, "stage-1");
    // Each document binds the other's challenge: they differ per direction.
    assert_ne!(
        rpeer.document.as_ref().unwrap().nonce,
        ipeer.document.as_ref().unwrap().nonce
    );

    let a = pattern(300);
    itx.send(&a).await.unwrap();
    expect_message(&mut rrx, &a).await;
    rtx.send(b"activations back").await.unwrap();
    expect_message(&mut irx, b"activations back").await;
    itx.send(b"").await.unwrap();
    expect_message(&mut rrx, b"").await;
}

/// An empty message must reach the peer even when the transport buffers
/// writes (the send path has to flush for it like for any other message).
#[tokio::test]
async fn empty_message_is_flushed_on_a_buffered_transport() {
    let (l, addr) = listener().await;
    let responder = stage(1);
    let (i, r) = tokio::join!(
        async {
            let s = TcpStream::connect(addr).await.unwrap();
            let buffered = Box::new(tokio::io::BufStream::new(s)) as BoxStream;
            initiate_as_host(buffered).await
        },
        async {
            let s = accept(&l).await;
            channel::respond(s, &responder.id, responder.limits, responder.check).await
        }
    );
    let (mut itx, _irx, _) = ok(i, "initiator");
    let (_rtx, mut rrx, _) = ok(r, "responder");
    itx.send(b"").await.unwrap();
    match timeout(WAIT, rrx.recv()).await {
        Ok(Ok(Some(m))) => assert!(m.is_empty()),
        Ok(other) => panic!("expected the empty message, got {other:?}"),
        Err(_) => panic!("empty message was never flushed to the transport"),
    }
    itx.send(b"x").await.unwrap();
    expect_message(&mut rrx, b"x").await;
}

// ---------------------------------------------------------------------------
// 2. Record tampering by the relay (initiator → responder)
// ---------------------------------------------------------------------------

/// Host → stage channel through a relay applying `i2r`; the initiator sends
/// `n` one-record messages (`msg(0..n)`, records 0..n).
async fn tampered(i2r: Tamper, n: usize) -> (ChannelSender, ChannelReceiver) {
    let hs = handshake(&host(), &stage(1), i2r, pass()).await;
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, rrx, _) = ok(hs.resp, "responder");
    for k in 0..n {
        itx.send(&msg(k)).await.expect("send");
    }
    (itx, rrx)
}

/// After the error, later (valid) records from the sender are not delivered.
async fn nothing_more(mut itx: ChannelSender, rrx: &mut ChannelReceiver, from: usize) {
    for k in from..from + 2 {
        itx.send(&msg(k)).await.expect("send after tampering");
    }
    expect_poisoned(rrx).await;
}

/// `sent` messages through `tamper`: the first `delivered` arrive, then the
/// receiver fails with `want`, and nothing arrives after it.
async fn fails_after(tamper: Tamper, sent: usize, delivered: usize, want: ChannelError) {
    let (itx, mut rrx) = tampered(tamper, sent).await;
    for k in 0..delivered {
        expect_message(&mut rrx, &msg(k)).await;
    }
    expect_failure(&mut rrx, want).await;
    nothing_more(itx, &mut rrx, sent).await;
}

/// [`fails_after`] with record `got` arriving where `expected` was due.
async fn out_of_sequence(
    tamper: Tamper,
    sent: usize,
    delivered: usize,
    (expected, got): (u64, u64),
) {
    let want = ChannelError::OutOfSequence { expected, got };
    fails_after(tamper, sent, delivered, want).await;
}

#[tokio::test]
async fn dropped_record_is_out_of_sequence() {
    let drop_rec1 = at_frame(I2R_REC0 + 1, |_| vec![]);
    out_of_sequence(drop_rec1, 4, 1, (1, 2)).await;
}

#[tokio::test]
async fn duplicated_record_is_out_of_sequence() {
    let dup_rec1 = at_frame(I2R_REC0 + 1, |b| vec![Out::Frame(b.clone()), Out::Frame(b)]);
    out_of_sequence(dup_rec1, 3, 2, (2, 1)).await;
}

#[tokio::test]
async fn reordered_records_are_out_of_sequence() {
    let mut held = None;
    let swap: Tamper = Box::new(move |i, b| {
        if i == I2R_REC0 + 1 {
            held = Some(b);
            vec![]
        } else if i == I2R_REC0 + 2 {
            vec![Out::Frame(b), Out::Frame(held.take().expect("held record"))]
        } else {
            vec![Out::Frame(b)]
        }
    });
    out_of_sequence(swap, 4, 1, (1, 2)).await;
}

#[tokio::test]
async fn replayed_record_is_out_of_sequence() {
    let mut saved = None;
    let replay: Tamper = Box::new(move |i, b| {
        if i == I2R_REC0 {
            saved = Some(b.clone());
        }
        if i == I2R_REC0 + 2 {
            vec![
                Out::Frame(b),
                Out::Frame(saved.clone().expect("saved record")),
            ]
        } else {
            vec![Out::Frame(b)]
        }
    });
    out_of_sequence(replay, 4, 3, (3, 0)).await;
}

#[tokio::test]
async fn flipped_ciphertext_byte_fails_authentication() {
    let len = 8 + 1 + msg(1).len() + TAG;
    // The (encrypted) flag byte, a payload byte, the last tag byte.
    for pos in [8, 8 + 5, len - 1] {
        let (itx, mut rrx) = tampered(flip(I2R_REC0 + 1, pos, 0x01), 3).await;
        expect_message(&mut rrx, &msg(0)).await;
        match recv(&mut rrx).await {
            Err(ChannelError::Authentication(1)) => {}
            other => panic!("flip at {pos}: expected Authentication(1), got {other:?}"),
        }
        nothing_more(itx, &mut rrx, 3).await;
    }
}

#[tokio::test]
async fn flipped_sequence_byte_is_out_of_sequence() {
    // Low byte: 1 ^ 4 = 5.
    out_of_sequence(flip(I2R_REC0 + 1, 7, 0x04), 3, 1, (1, 5)).await;

    // High byte.
    let (itx, mut rrx) = tampered(flip(I2R_REC0 + 1, 0, 0x80), 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence { expected: 1, got }) => assert_eq!(got, 1 | 1 << 63),
        other => panic!("expected OutOfSequence, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 3).await;
}

#[tokio::test]
async fn resized_record_fails_authentication() {
    // One byte appended (and the length prefix grown to match).
    let grow = at_frame(I2R_REC0 + 1, |mut b| {
        b.push(0);
        vec![Out::Frame(b)]
    });
    fails_after(grow, 3, 1, ChannelError::Authentication(1)).await;

    // One byte cut off the end (and the length prefix shrunk to match).
    let shrink = at_frame(I2R_REC0 + 1, |mut b| {
        b.pop();
        vec![Out::Frame(b)]
    });
    fails_after(shrink, 3, 1, ChannelError::Authentication(1)).await;
}

/// A record from the other direction, carrying the right sequence number,
/// does not authenticate: each direction has its own key.
#[tokio::test]
async fn reflected_record_fails_authentication() {
    let r2i_log: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let from_r2i = r2i_log.clone();
    let reflect = at_frame(I2R_REC0 + 1, move |_| {
        let log = from_r2i.lock().unwrap();
        // The responder's record 1 (frame R2I_REC0 + 1).
        vec![Out::Frame(log[R2I_REC0 + 1].clone())]
    });
    let hs = handshake(&host(), &stage(1), reflect, recording(r2i_log.clone())).await;
    let (mut itx, mut irx, _) = ok(hs.init, "initiator");
    let (mut rtx, mut rrx, _) = ok(hs.resp, "responder");
    rtx.send(&msg(100)).await.unwrap();
    expect_message(&mut irx, &msg(100)).await;
    itx.send(&msg(0)).await.unwrap();
    itx.send(&msg(1)).await.unwrap();
    expect_message(&mut rrx, &msg(0)).await;
    expect_failure(&mut rrx, ChannelError::Authentication(1)).await;
    nothing_more(itx, &mut rrx, 2).await;
}

/// A record from another session, at the right sequence number, does not
/// authenticate: every session has fresh keys.
#[tokio::test]
async fn record_from_another_session_fails_authentication() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (itx, mut rrx) = tampered(recording(log.clone()), 2).await;
    expect_message(&mut rrx, &msg(0)).await;
    expect_message(&mut rrx, &msg(1)).await;
    drop(itx);
    let old_rec1 = log.lock().unwrap()[I2R_REC0 + 1].clone();
    assert_eq!(u64::from_be_bytes(old_rec1[..8].try_into().unwrap()), 1);

    let splice = at_frame(I2R_REC0 + 1, move |_| vec![Out::Frame(old_rec1.clone())]);
    fails_after(splice, 3, 1, ChannelError::Authentication(1)).await;
}

// ---------------------------------------------------------------------------
// 5. Limits
// ---------------------------------------------------------------------------

#[tokio::test]
async fn sender_refuses_a_message_over_max_message() {
    let (i, r) = direct(&host().with_limits(limits(1024, 100, 1000)), &stage(1)).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&pattern(100)).await.unwrap();
    match itx.send(&pattern(101)).await {
        Err(ChannelError::MessageTooLarge {
            size: 101,
            limit: 100,
        }) => {}
        other => panic!("expected MessageTooLarge, got {other:?}"),
    }
    assert!(matches!(itx.send(b"x").await, Err(ChannelError::Poisoned)));
    expect_message(&mut rrx, &pattern(100)).await;
    // Nothing of the refused message was sent.
    assert_eq!(itx.records_sent(), 1);
}

#[tokio::test]
async fn receiver_refuses_a_record_over_its_max_record() {
    let (i, r) = direct(
        &host().with_limits(limits(1024, 1 << 16, 1000)),
        &stage(1).with_limits(limits(64, 1 << 16, 1000)),
    )
    .await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&pattern(64)).await.unwrap();
    itx.send(&pattern(200)).await.unwrap();
    expect_message(&mut rrx, &pattern(64)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::RecordTooLarge { size, limit }) => {
            assert_eq!(size, 8 + 1 + 200 + TAG);
            assert_eq!(limit, 8 + 1 + 64 + TAG);
        }
        other => panic!("expected RecordTooLarge, got {other:?}"),
    }
    expect_poisoned(&mut rrx).await;
}

#[tokio::test]
async fn receiver_refuses_a_message_over_its_max_message() {
    let too_large = |size| ChannelError::MessageTooLarge { size, limit: 100 };
    let (i, r) = direct(
        &host().with_limits(limits(64, 1 << 16, 1000)),
        &stage(1).with_limits(limits(1024, 100, 1000)),
    )
    .await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&pattern(100)).await.unwrap(); // 64 + 36: at the limit
    itx.send(&pattern(150)).await.unwrap(); // 64 + 64 + 22: over it
    expect_message(&mut rrx, &pattern(100)).await;
    expect_failure(&mut rrx, too_large(128)).await;
    expect_poisoned(&mut rrx).await;

    // In one record, too.
    let (i, r) = direct(&host(), &stage(1).with_limits(limits(1024, 100, 1000))).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&pattern(101)).await.unwrap();
    expect_failure(&mut rrx, too_large(101)).await;
    expect_poisoned(&mut rrx).await;
}

#[tokio::test]
async fn record_budget_is_enforced() {
    // Sender side, initiator → responder: records 0, 1, 2, then the limit.
    let (i, r) = direct(&host().with_limits(limits(1024, 1 << 16, 3)), &stage(1)).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    for k in 0..3 {
        itx.send(&msg(k)).await.unwrap();
    }
    assert_eq!(itx.records_sent(), 3);
    assert!(matches!(
        itx.send(&msg(3)).await,
        Err(ChannelError::RecordLimit(3))
    ));
    assert!(matches!(
        itx.send(&msg(3)).await,
        Err(ChannelError::Poisoned)
    ));
    for k in 0..3 {
        expect_message(&mut rrx, &msg(k)).await;
    }

    // Responder → initiator: the Outcome used record 0, two are left.
    let (i, r) = direct(&host(), &stage(1).with_limits(limits(1024, 1 << 16, 3))).await;
    let (_, mut irx, _) = ok(i, "initiator");
    let (mut rtx, _, _) = ok(r, "responder");
    assert_eq!(rtx.records_sent(), 1);
    rtx.send(&msg(0)).await.unwrap();
    rtx.send(&msg(1)).await.unwrap();
    assert!(matches!(
        rtx.send(&msg(2)).await,
        Err(ChannelError::RecordLimit(3))
    ));
    expect_message(&mut irx, &msg(0)).await;
    expect_message(&mut irx, &msg(1)).await;

    // Receiver side: a sender with a larger budget is cut off at 3 records.
    let (i, r) = direct(&host(), &stage(1).with_limits(limits(1024, 1 << 16, 3))).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    for k in 0..4 {
        itx.send(&msg(k)).await.unwrap();
    }
    for k in 0..3 {
        expect_message(&mut rrx, &msg(k)).await;
    }
    assert!(matches!(
        recv(&mut rrx).await,
        Err(ChannelError::RecordLimit(3))
    ));
    expect_poisoned(&mut rrx).await;
}

// ---------------------------------------------------------------------------
// 6. Truncation and clean close
// ---------------------------------------------------------------------------

#[tokio::test]
async fn peer_closing_mid_record_is_truncation() {
    let half = at_frame(I2R_REC0 + 1, |b| {
        let raw = framed(&b);
        vec![Out::Raw(raw[..raw.len() / 2].to_vec()), Out::Close]
    });
    let hs = handshake(&host(), &stage(1), half, pass()).await;
    truncated_after_first(hs, &pattern(600)).await;
}

#[tokio::test]
async fn peer_closing_between_records_of_a_message_is_truncation() {
    // Message 1 is 4 records (frames 3..=6); close after its first.
    let cut = at_frame(I2R_REC0 + 2, |_| vec![Out::Close]);
    let hs = handshake(
        &host().with_limits(limits(64, 1 << 16, 1000)),
        &stage(1),
        cut,
        pass(),
    )
    .await;
    truncated_after_first(hs, &pattern(200)).await;
}

#[tokio::test]
async fn peer_closing_inside_a_length_prefix_is_truncation() {
    let cut = at_frame(I2R_REC0 + 1, |b| {
        vec![Out::Raw(framed(&b)[..2].to_vec()), Out::Close]
    });
    let hs = handshake(&host(), &stage(1), cut, pass()).await;
    truncated_after_first(hs, &msg(1)).await;
}

#[tokio::test]
async fn clean_close_between_messages_is_end_of_stream() {
    // Direct.
    let (i, r) = direct(&host(), &stage(1)).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&msg(0)).await.unwrap();
    itx.close().await;
    expect_message(&mut rrx, &msg(0)).await;
    assert!(matches!(recv(&mut rrx).await, Ok(None)));

    // Through the relay, which passes the close on after the last record.
    let hs = handshake(&host(), &stage(1), pass(), pass()).await;
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, mut rrx, _) = ok(hs.resp, "responder");
    itx.send(&pattern(3000)).await.unwrap();
    itx.close().await;
    expect_message(&mut rrx, &pattern(3000)).await;
    assert!(matches!(recv(&mut rrx).await, Ok(None)));
    assert_eq!(hs.counts.i2r.load(Ordering::SeqCst), I2R_REC0 + 1);
}

/// Sends `msg(0)` then `second` over `hs`, whose relay cuts the stream: the
/// first arrives whole, the second ends the channel as truncated, and it
/// stays poisoned.
async fn truncated_after_first(hs: Handshake, second: &[u8]) {
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, mut rrx, _) = ok(hs.resp, "responder");
    itx.send(&msg(0)).await.unwrap();
    itx.send(second).await.unwrap();
    expect_message(&mut rrx, &msg(0)).await;
    expect_failure(&mut rrx, ChannelError::Truncated).await;
    expect_poisoned(&mut rrx).await;
}
