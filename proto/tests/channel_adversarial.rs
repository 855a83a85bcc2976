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

use proto::attestation::{mock_measurement, EvidenceFormat, MockProvider};
use proto::channel::{
    self, ChannelError, ChannelLimits, ChannelReceiver, ChannelSender, LocalIdentity, PeerCheck,
    PeerInfo,
};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use proto::transport::BoxStream;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// Index of the first record frame in the initiator → responder direction.
const I2R_REC0: usize = 2;
/// Index of the Outcome record (record 0) in the responder → initiator direction.
const R2I_REC0: usize = 1;
/// Upper bound for any single wait; tests normally finish far sooner.
const WAIT: Duration = Duration::from_secs(3);
/// AEAD tag length.
const TAG: usize = 16;

type Established = (ChannelSender, ChannelReceiver, PeerInfo);
type HandshakeResult = Result<Established, ChannelError>;

// ---------------------------------------------------------------------------
// Identities, limits, checks
// ---------------------------------------------------------------------------

fn claims(index: u32) -> StageClaims {
    StageClaims {
        stage_index: index,
        num_stages: 6,
        layer_start: index * 4,
        layer_end: index * 4 + 4,
        model_id: "test-model".into(),
        manifest_sha256: Sha256Digest::of(b"test manifest"),
        receipt_key: [7; 32],
        hpke_keys: Vec::new(),
        weights: None,
    }
}

fn stage_identity(index: u32) -> LocalIdentity {
    let measurement = mock_measurement(
        &Sha256Digest::of(b"stage binary"),
        &Sha256Digest::of(b"test manifest"),
    );
    LocalIdentity::stage(
        Arc::new(MockProvider::new(format!("stage-{index}"), &measurement)),
        claims(index),
    )
}

fn limits(max_record: usize, max_message: usize, max_records: u64) -> ChannelLimits {
    ChannelLimits {
        max_record,
        max_message,
        max_records,
        handshake_timeout: WAIT,
    }
}

fn default_limits() -> ChannelLimits {
    ChannelLimits {
        handshake_timeout: WAIT,
        ..ChannelLimits::default()
    }
}

fn accept_all(_: &PeerInfo) -> Result<(), String> {
    Ok(())
}

/// One end of a channel: who it is, its limits and its check of the peer.
struct Peer<'a> {
    id: LocalIdentity,
    limits: ChannelLimits,
    check: PeerCheck<'a>,
}

fn host() -> Peer<'static> {
    Peer {
        id: LocalIdentity::host(),
        limits: default_limits(),
        check: &accept_all,
    }
}

fn stage(index: u32) -> Peer<'static> {
    Peer {
        id: stage_identity(index),
        limits: default_limits(),
        check: &accept_all,
    }
}

impl<'a> Peer<'a> {
    fn with_limits(mut self, limits: ChannelLimits) -> Self {
        self.limits = limits;
        self
    }

    fn with_check<'b>(self, check: PeerCheck<'b>) -> Peer<'b> {
        Peer {
            id: self.id,
            limits: self.limits,
            check,
        }
    }
}

// ---------------------------------------------------------------------------
// The hostile relay
// ---------------------------------------------------------------------------

/// What the relay writes in place of one frame it read.
enum Out {
    /// A frame with this body (the relay writes the length prefix).
    Frame(Vec<u8>),
    /// These raw bytes, as they are.
    Raw(Vec<u8>),
    /// Close this direction (FIN) and stop relaying it.
    Close,
}

/// Decides, per frame (index in its direction, body), what is forwarded.
type Tamper = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Out> + Send>;

fn pass() -> Tamper {
    Box::new(|_, body| vec![Out::Frame(body)])
}

/// Tamper only frame `at`; forward every other frame unchanged.
fn at_frame(at: usize, mut f: impl FnMut(Vec<u8>) -> Vec<Out> + Send + 'static) -> Tamper {
    Box::new(move |i, body| {
        if i == at {
            f(body)
        } else {
            vec![Out::Frame(body)]
        }
    })
}

/// Flip `mask` into byte `pos` of frame `at`.
fn flip(at: usize, pos: usize, mask: u8) -> Tamper {
    at_frame(at, move |mut body| {
        body[pos] ^= mask;
        vec![Out::Frame(body)]
    })
}

/// Flip `mask` into the byte at `pos(body)` of frame `at`.
fn flip_with(at: usize, pos: fn(&[u8]) -> usize, mask: u8) -> Tamper {
    at_frame(at, move |mut body| {
        let p = pos(&body);
        body[p] ^= mask;
        vec![Out::Frame(body)]
    })
}

/// Forward everything, keeping a copy of every frame.
fn recording(log: Arc<Mutex<Vec<Vec<u8>>>>) -> Tamper {
    Box::new(move |_, body| {
        log.lock().unwrap().push(body.clone());
        vec![Out::Frame(body)]
    })
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

#[derive(Clone, Default)]
struct Counts {
    i2r: Arc<AtomicUsize>,
    r2i: Arc<AtomicUsize>,
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut tamper: Tamper,
    count: Arc<AtomicUsize>,
) {
    let mut index = 0;
    loop {
        let mut len = [0u8; 4];
        if from.read_exact(&mut len).await.is_err() {
            break;
        }
        let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
        if from.read_exact(&mut body).await.is_err() {
            break;
        }
        count.fetch_add(1, Ordering::SeqCst);
        for out in tamper(index, body) {
            let written = match out {
                Out::Frame(body) => to.write_all(&framed(&body)).await,
                Out::Raw(bytes) => to.write_all(&bytes).await,
                Out::Close => {
                    let _ = to.shutdown().await;
                    return;
                }
            };
            if written.is_err() {
                return;
            }
        }
        index += 1;
    }
    let _ = to.shutdown().await;
}

/// Starts a relay for one connection to `upstream`; returns where to dial it.
async fn spawn_relay(upstream: SocketAddr, i2r: Tamper, r2i: Tamper) -> (SocketAddr, Counts) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
    let addr = listener.local_addr().expect("relay address");
    let counts = Counts::default();
    let c = counts.clone();
    tokio::spawn(async move {
        let (client, _) = listener.accept().await.expect("relay accept");
        let server = TcpStream::connect(upstream).await.expect("relay connect");
        client.set_nodelay(true).expect("nodelay");
        server.set_nodelay(true).expect("nodelay");
        let (client_r, client_w) = client.into_split();
        let (server_r, server_w) = server.into_split();
        tokio::spawn(pump(client_r, server_w, i2r, c.i2r));
        tokio::spawn(pump(server_r, client_w, r2i, c.r2i));
    });
    (addr, counts)
}

// ---------------------------------------------------------------------------
// Handshakes
// ---------------------------------------------------------------------------

async fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("address");
    (l, addr)
}

async fn dial(addr: SocketAddr) -> BoxStream {
    let s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    Box::new(s) as BoxStream
}

async fn accept(l: &TcpListener) -> BoxStream {
    let (s, _) = l.accept().await.expect("accept");
    s.set_nodelay(true).expect("nodelay");
    Box::new(s) as BoxStream
}

struct Handshake {
    init: HandshakeResult,
    resp: HandshakeResult,
    counts: Counts,
}

/// Runs both sides of a handshake through a relay applying `i2r` / `r2i`.
async fn handshake(
    initiator: &Peer<'_>,
    responder: &Peer<'_>,
    i2r: Tamper,
    r2i: Tamper,
) -> Handshake {
    let (l, addr) = listener().await;
    let (relay, counts) = spawn_relay(addr, i2r, r2i).await;
    let (init, resp) = tokio::join!(
        async {
            let s = dial(relay).await;
            channel::initiate(s, &initiator.id, initiator.limits, initiator.check).await
        },
        async {
            let s = accept(&l).await;
            channel::respond(s, &responder.id, responder.limits, responder.check).await
        }
    );
    Handshake { init, resp, counts }
}

/// Runs both sides of a handshake over a direct TCP connection.
async fn direct(initiator: &Peer<'_>, responder: &Peer<'_>) -> (HandshakeResult, HandshakeResult) {
    let (l, addr) = listener().await;
    tokio::join!(
        async {
            let s = dial(addr).await;
            channel::initiate(s, &initiator.id, initiator.limits, initiator.check).await
        },
        async {
            let s = accept(&l).await;
            channel::respond(s, &responder.id, responder.limits, responder.check).await
        }
    )
}

fn ok(r: HandshakeResult, side: &str) -> Established {
    match r {
        Ok(e) => e,
        Err(e) => panic!("{side} handshake failed: {e:?}"),
    }
}

fn err(r: HandshakeResult, side: &str) -> ChannelError {
    match r {
        Ok(_) => panic!("{side} handshake unexpectedly succeeded"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------
// Receiving
// ---------------------------------------------------------------------------

async fn recv(rx: &mut ChannelReceiver) -> Result<Option<Vec<u8>>, ChannelError> {
    timeout(WAIT, rx.recv()).await.expect("recv timed out")
}

async fn expect_message(rx: &mut ChannelReceiver, want: &[u8]) {
    match recv(rx).await {
        Ok(Some(got)) => {
            assert_eq!(got.len(), want.len(), "message length");
            assert!(got == want, "message content differs");
        }
        other => panic!("expected a message of {} bytes, got {other:?}", want.len()),
    }
}

async fn expect_poisoned(rx: &mut ChannelReceiver) {
    for _ in 0..3 {
        match recv(rx).await {
            Err(ChannelError::Poisoned) => {}
            other => panic!("expected Poisoned, got {other:?}"),
        }
    }
}

fn msg(k: usize) -> Vec<u8> {
    format!("message number {k} on the stage channel").into_bytes()
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
}

/// Offset of the value of a 32-byte byte-string field `key` in a CBOR map.
fn bytes32_field(body: &[u8], key: &str) -> usize {
    let mut pat = vec![0x60 | key.len() as u8];
    pat.extend_from_slice(key.as_bytes());
    pat.extend_from_slice(&[0x58, 0x20]);
    let at = body
        .windows(pat.len())
        .position(|w| w == pat.as_slice())
        .unwrap_or_else(|| panic!("field {key} not found"));
    at + pat.len()
}

/// Offset of the value of the boolean field `attested` in the ClientHello.
fn attested_field(body: &[u8]) -> usize {
    let pat = b"\x68attested";
    let at = body
        .windows(pat.len())
        .position(|w| w == pat)
        .expect("attested field");
    at + pat.len()
}

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
    assert_eq!(doc.user_data, proto::cbor::to_vec(&claims(1)));
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
            channel::initiate(
                buffered,
                &LocalIdentity::host(),
                default_limits(),
                &accept_all,
            )
            .await
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

#[tokio::test]
async fn dropped_record_is_out_of_sequence() {
    let drop_rec1 = at_frame(I2R_REC0 + 1, |_| vec![]);
    let (itx, mut rrx) = tampered(drop_rec1, 4).await;
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence {
            expected: 1,
            got: 2,
        }) => {}
        other => panic!("expected OutOfSequence 1/2, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 4).await;
}

#[tokio::test]
async fn duplicated_record_is_out_of_sequence() {
    let dup_rec1 = at_frame(I2R_REC0 + 1, |b| vec![Out::Frame(b.clone()), Out::Frame(b)]);
    let (itx, mut rrx) = tampered(dup_rec1, 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    expect_message(&mut rrx, &msg(1)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence {
            expected: 2,
            got: 1,
        }) => {}
        other => panic!("expected OutOfSequence 2/1, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 3).await;
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
    let (itx, mut rrx) = tampered(swap, 4).await;
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence {
            expected: 1,
            got: 2,
        }) => {}
        other => panic!("expected OutOfSequence 1/2, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 4).await;
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
    let (itx, mut rrx) = tampered(replay, 4).await;
    for k in 0..3 {
        expect_message(&mut rrx, &msg(k)).await;
    }
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence {
            expected: 3,
            got: 0,
        }) => {}
        other => panic!("expected OutOfSequence 3/0, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 4).await;
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
    let (itx, mut rrx) = tampered(flip(I2R_REC0 + 1, 7, 0x04), 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::OutOfSequence {
            expected: 1,
            got: 5,
        }) => {}
        other => panic!("expected OutOfSequence 1/5, got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 3).await;

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
    let (itx, mut rrx) = tampered(grow, 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    assert!(matches!(
        recv(&mut rrx).await,
        Err(ChannelError::Authentication(1))
    ));
    nothing_more(itx, &mut rrx, 3).await;

    // One byte cut off the end (and the length prefix shrunk to match).
    let shrink = at_frame(I2R_REC0 + 1, |mut b| {
        b.pop();
        vec![Out::Frame(b)]
    });
    let (itx, mut rrx) = tampered(shrink, 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    assert!(matches!(
        recv(&mut rrx).await,
        Err(ChannelError::Authentication(1))
    ));
    nothing_more(itx, &mut rrx, 3).await;
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
    match recv(&mut rrx).await {
        Err(ChannelError::Authentication(1)) => {}
        other => panic!("expected Authentication(1), got {other:?}"),
    }
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
    let (itx, mut rrx) = tampered(splice, 3).await;
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::Authentication(1)) => {}
        other => panic!("expected Authentication(1), got {other:?}"),
    }
    nothing_more(itx, &mut rrx, 3).await;
}

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

#[tokio::test]
async fn server_hello_with_flipped_key_is_rejected() {
    let hs = handshake(
        &host(),
        &stage(1),
        pass(),
        flip_with(0, |b| bytes32_field(b, "eph"), 0x01),
    )
    .await;
    match err(hs.init, "initiator") {
        ChannelError::PeerRejected(m) => assert!(m.contains("channel key"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    // The initiator hung up before Finish.
    assert!(matches!(err(hs.resp, "responder"), ChannelError::Truncated));
}

#[tokio::test]
async fn server_hello_with_flipped_evidence_is_rejected() {
    // The last byte of the ServerHello is the last byte of the document's
    // signature.
    let hs = handshake(
        &host(),
        &stage(1),
        pass(),
        flip_with(0, |b| b.len() - 1, 0x01),
    )
    .await;
    match err(hs.init, "initiator") {
        ChannelError::PeerRejected(m) => assert!(m.contains("signature"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    assert!(hs.resp.is_err());
}

#[tokio::test]
async fn server_hello_with_flipped_challenge_fails() {
    // A host initiator does not use the responder's challenge, but it is in
    // the transcript: the keys differ and the Outcome does not authenticate.
    let hs = handshake(
        &host(),
        &stage(1),
        pass(),
        flip_with(0, |b| bytes32_field(b, "challenge"), 0x01),
    )
    .await;
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));

    // A stage initiator binds its evidence to the tampered challenge: the
    // responder rejects it (and its rejection does not authenticate either).
    let hs = handshake(
        &stage(0),
        &stage(1),
        pass(),
        flip_with(0, |b| bytes32_field(b, "challenge"), 0x01),
    )
    .await;
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
    match err(hs.resp, "responder") {
        ChannelError::PeerRejected(m) => assert!(m.contains("challenge"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
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
    let hs = handshake(
        &host(),
        &stage(1),
        flip_with(0, |b| bytes32_field(b, "eph"), 0x01),
        pass(),
    )
    .await;
    // The responder derived its keys from the wrong key: its Outcome does
    // not authenticate at the initiator.
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
}

#[tokio::test]
async fn client_hello_with_flipped_challenge_fails() {
    let hs = handshake(
        &host(),
        &stage(1),
        flip_with(0, |b| bytes32_field(b, "challenge"), 0x01),
        pass(),
    )
    .await;
    // The responder's evidence is bound to the tampered challenge.
    match err(hs.init, "initiator") {
        ChannelError::PeerRejected(m) => assert!(m.contains("challenge"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    assert!(matches!(err(hs.resp, "responder"), ChannelError::Truncated));
}

#[tokio::test]
async fn client_hello_with_flipped_attestation_flag_fails() {
    // Host says "not attested"; flipped to "attested" with no evidence.
    let hs = handshake(
        &host(),
        &stage(1),
        flip_with(0, attested_field, 0x01),
        pass(),
    )
    .await;
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
    match err(hs.resp, "responder") {
        ChannelError::PeerRejected(m) => assert!(m.contains("disagree"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
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
    match err(hs.resp, "responder") {
        ChannelError::PeerRejected(m) => assert!(m.contains("signature"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
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
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
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
    match err(hs.resp, "responder") {
        ChannelError::PeerRejected(m) => assert!(m.contains("challenge"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
    // The live initiator sees evidence bound to the replayed challenge.
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::PeerRejected(_)
    ));
}

#[tokio::test]
async fn flipped_outcome_fails_authentication() {
    let hs = handshake(&host(), &stage(1), pass(), flip(R2I_REC0, 10, 0x01)).await;
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
}

/// The Outcome cannot be skipped: the next record is out of sequence.
#[tokio::test]
async fn dropped_outcome_is_out_of_sequence() {
    let (l, addr) = listener().await;
    let (relay, _) = spawn_relay(addr, pass(), at_frame(R2I_REC0, |_| vec![])).await;
    let responder = stage(1);
    let (i, r) = tokio::join!(
        async {
            channel::initiate(
                dial(relay).await,
                &LocalIdentity::host(),
                default_limits(),
                &accept_all,
            )
            .await
        },
        async {
            let s = accept(&l).await;
            let (mut tx, rx, p) =
                channel::respond(s, &responder.id, responder.limits, responder.check).await?;
            tx.send(b"first data").await?;
            Ok::<_, ChannelError>((tx, rx, p))
        }
    );
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
    assert!(matches!(
        err(hs.init, "initiator"),
        ChannelError::Authentication(0)
    ));
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
    match err(i, "initiator") {
        ChannelError::PeerRejected(m) => assert!(m.contains("wrong stage index 1"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
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
    match err(r, "responder") {
        ChannelError::PeerRejected(m) => assert!(m.contains("got stage 5"), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }

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
    match recv(&mut rrx).await {
        Err(ChannelError::MessageTooLarge {
            size: 128,
            limit: 100,
        }) => {}
        other => panic!("expected MessageTooLarge 128/100, got {other:?}"),
    }
    expect_poisoned(&mut rrx).await;

    // In one record, too.
    let (i, r) = direct(&host(), &stage(1).with_limits(limits(1024, 100, 1000))).await;
    let (mut itx, _, _) = ok(i, "initiator");
    let (_, mut rrx, _) = ok(r, "responder");
    itx.send(&pattern(101)).await.unwrap();
    match recv(&mut rrx).await {
        Err(ChannelError::MessageTooLarge {
            size: 101,
            limit: 100,
        }) => {}
        other => panic!("expected MessageTooLarge 101/100, got {other:?}"),
    }
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
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, mut rrx, _) = ok(hs.resp, "responder");
    itx.send(&msg(0)).await.unwrap();
    itx.send(&pattern(600)).await.unwrap();
    expect_message(&mut rrx, &msg(0)).await;
    assert!(matches!(recv(&mut rrx).await, Err(ChannelError::Truncated)));
    expect_poisoned(&mut rrx).await;
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
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, mut rrx, _) = ok(hs.resp, "responder");
    itx.send(&msg(0)).await.unwrap();
    itx.send(&pattern(200)).await.unwrap();
    expect_message(&mut rrx, &msg(0)).await;
    assert!(matches!(recv(&mut rrx).await, Err(ChannelError::Truncated)));
    expect_poisoned(&mut rrx).await;
}

#[tokio::test]
async fn peer_closing_inside_a_length_prefix_is_truncation() {
    let cut = at_frame(I2R_REC0 + 1, |b| {
        vec![Out::Raw(framed(&b)[..2].to_vec()), Out::Close]
    });
    let hs = handshake(&host(), &stage(1), cut, pass()).await;
    let (mut itx, _, _) = ok(hs.init, "initiator");
    let (_, mut rrx, _) = ok(hs.resp, "responder");
    itx.send(&msg(0)).await.unwrap();
    itx.send(&msg(1)).await.unwrap();
    expect_message(&mut rrx, &msg(0)).await;
    match recv(&mut rrx).await {
        Err(ChannelError::Truncated) => {}
        other => panic!("expected Truncated, got {other:?}"),
    }
    expect_poisoned(&mut rrx).await;
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
