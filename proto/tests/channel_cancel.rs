//! Cancelled sends on the attested stage channel (crypto review, issue 34
//! finding 1), over real TCP sockets on 127.0.0.1: a send dropped part-way
//! (its peer reads slowly, the message is large) must never leave a spent
//! nonce or half a message for the next send, and the queued writer
//! ([`proto::io::queue`]) that cancellable callers use must stay usable,
//! delivering every message that was queued whole and in order.

mod channel_support;

use channel_support::{direct, expect_message, host, ok, pattern, recv, stage, WAIT};
use proto::channel::ChannelError;
use proto::io::queue::QueuedSender;
use std::time::Duration;

/// A message far larger than loopback's socket buffers, so that its send
/// blocks until the peer reads.
const BIG: usize = 48 << 20;

/// A send cancelled mid-write poisons the sender: the next message is
/// refused (it would otherwise go out under the nonce of the record in
/// flight, or be spliced onto the half-written one), and the peer never
/// authenticates anything after the partial message.
#[tokio::test]
async fn a_send_cancelled_mid_write_poisons_the_sender() {
    let (init, resp) = direct(&host(), &stage(1)).await;
    let (mut tx, irx, _) = ok(init, "initiator");
    let (_rtx, mut rx, _) = ok(resp, "responder");
    let big = pattern(BIG);
    let cancelled = tokio::time::timeout(Duration::from_millis(200), tx.send(&big)).await;
    assert!(
        cancelled.is_err(),
        "the send finished before it could be cancelled"
    );
    let records = tx.records_sent();
    assert!(records > 0, "nothing was written before the cancellation");
    // (Bounded: a sender that took it would block on the full socket.)
    match tokio::time::timeout(WAIT, tx.send(b"after the cancelled send")).await {
        Ok(Err(ChannelError::Poisoned)) => {}
        other => panic!("a sender cancelled mid-message took another message: {other:?}"),
    }
    assert_eq!(tx.records_sent(), records, "a refused send spent a nonce");
    drop((tx, irx));
    // The peer reads the partial message's records, then the end of the
    // stream inside a message: never a second message, never a forgery.
    match tokio::time::timeout(Duration::from_secs(20), rx.recv()).await {
        Ok(Err(ChannelError::Authentication(seq))) => {
            panic!("record {seq} failed authentication: a nonce was reused")
        }
        Ok(Err(_)) => {}
        Ok(Ok(m)) => panic!("the peer received a message: {:?}", m.map(|m| m.len())),
        Err(_) => panic!("the peer saw neither a message nor the broken stream"),
    }
}

/// Queued sends are cancel-safe: of many large messages whose enqueueing
/// is cut short at random points, exactly those that were queued arrive,
/// whole and in order, and the channel goes on working.
#[tokio::test]
async fn queued_sends_survive_cancellation() {
    let (init, resp) = direct(&host(), &stage(1)).await;
    let (tx, _irx, _) = ok(init, "initiator");
    let (_rtx, mut rx, _) = ok(resp, "responder");
    let q = QueuedSender::spawn(tx);
    let message = |i: u32| {
        let mut m = pattern(1 << 20);
        m[..4].copy_from_slice(&i.to_be_bytes());
        m
    };
    // The reader starts late, so the queue fills and later sends wait for
    // room, where the timeout cancels them.
    let mut queued = Vec::new();
    for i in 0..200u32 {
        let wait = Duration::from_micros(50 * u64::from(i % 7));
        if let Ok(r) = tokio::time::timeout(wait, q.send(message(i))).await {
            r.expect("the writer is alive");
            queued.push(i);
        }
    }
    assert!(queued.len() < 200, "no send was cancelled");
    // Queued behind the rest: it waits for room until the reader below runs.
    let end = tokio::spawn({
        let q = q.clone();
        async move { q.send(b"end".to_vec()).await }
    });
    for &i in &queued {
        let got = match tokio::time::timeout(Duration::from_secs(20), rx.recv()).await {
            Ok(Ok(Some(m))) => m,
            other => panic!("message {i}: {other:?}"),
        };
        assert!(
            got == message(i),
            "message {i} arrived changed or out of order"
        );
    }
    expect_message(&mut rx, b"end").await;
    end.await.unwrap().unwrap();
    q.send(b"still open".to_vec()).await.unwrap();
    expect_message(&mut rx, b"still open").await;
    q.shutdown().await;
    assert!(matches!(recv(&mut rx).await, Ok(None)), "a clean end");
}
