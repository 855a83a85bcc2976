//! Shared by the channel's adversarial tests (`channel_adversarial.rs`,
//! `channel_handshake_adversarial.rs`): identities and limits, the hostile
//! relay, handshakes over real TCP, and receiving helpers.
#![allow(dead_code, unused_imports)]

pub use proto::attestation::{mock_measurement, MockProvider};
pub use proto::channel::{ChannelError, ChannelLimits, LocalIdentity, PeerCheck, PeerInfo};
pub use proto::digest::Sha256Digest;
pub use proto::frames::StageClaims;
pub use proto::io::channel::{self, ChannelReceiver, ChannelSender};
pub use proto::io::transport::BoxStream;
pub use std::net::SocketAddr;
pub use std::sync::atomic::{AtomicUsize, Ordering};
pub use std::sync::{Arc, Mutex};
pub use std::time::Duration;
pub use tokio::io::{AsyncReadExt, AsyncWriteExt};
pub use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
pub use tokio::net::{TcpListener, TcpStream};
pub use tokio::time::timeout;

/// Index of the first record frame in the initiator → responder direction.
pub const I2R_REC0: usize = 2;
/// Index of the Outcome record (record 0) in the responder → initiator direction.
pub const R2I_REC0: usize = 1;
/// Upper bound for any single wait; tests normally finish far sooner.
pub const WAIT: Duration = Duration::from_secs(3);
/// AEAD tag length.
pub const TAG: usize = 16;

pub type Established = (ChannelSender, ChannelReceiver, PeerInfo);
pub type HandshakeResult = Result<Established, ChannelError>;

// ---------------------------------------------------------------------------
// Identities, limits, checks
// ---------------------------------------------------------------------------

pub fn claims(index: u32) -> StageClaims {
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

pub fn stage_identity(index: u32) -> LocalIdentity {
    let measurement = mock_measurement(
        &Sha256Digest::of(b"stage binary"),
        &Sha256Digest::of(b"test manifest"),
        &Sha256Digest::of(b"test policy"),
    );
    LocalIdentity::stage(
        Arc::new(MockProvider::new(format!("stage-{index}"), &measurement)),
        claims(index),
    )
}

pub fn limits(max_record: usize, max_message: usize, max_records: u64) -> ChannelLimits {
    ChannelLimits {
        max_record,
        max_message,
        max_records,
        handshake_timeout: WAIT,
    }
}

pub fn default_limits() -> ChannelLimits {
    ChannelLimits {
        handshake_timeout: WAIT,
        ..ChannelLimits::default()
    }
}

pub fn accept_all(_: &PeerInfo) -> Result<(), String> {
    Ok(())
}

/// One end of a channel: who it is, its limits and its check of the peer.
pub struct Peer<'a> {
    pub id: LocalIdentity,
    pub limits: ChannelLimits,
    pub check: PeerCheck<'a>,
}

pub fn host() -> Peer<'static> {
    Peer {
        id: LocalIdentity::host(),
        limits: default_limits(),
        check: &accept_all,
    }
}

pub fn stage(index: u32) -> Peer<'static> {
    Peer {
        id: stage_identity(index),
        limits: default_limits(),
        check: &accept_all,
    }
}

impl<'a> Peer<'a> {
    pub fn with_limits(mut self, limits: ChannelLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn with_check<'b>(self, check: PeerCheck<'b>) -> Peer<'b> {
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
pub enum Out {
    /// A frame with this body (the relay writes the length prefix).
    Frame(Vec<u8>),
    /// These raw bytes, as they are.
    Raw(Vec<u8>),
    /// Close this direction (FIN) and stop relaying it.
    Close,
}

/// Decides, per frame (index in its direction, body), what is forwarded.
pub type Tamper = Box<dyn FnMut(usize, Vec<u8>) -> Vec<Out> + Send>;

pub fn pass() -> Tamper {
    Box::new(|_, body| vec![Out::Frame(body)])
}

/// Tamper only frame `at`; forward every other frame unchanged.
pub fn at_frame(at: usize, mut f: impl FnMut(Vec<u8>) -> Vec<Out> + Send + 'static) -> Tamper {
    Box::new(move |i, body| {
        if i == at {
            f(body)
        } else {
            vec![Out::Frame(body)]
        }
    })
}

/// Flip `mask` into byte `pos` of frame `at`.
pub fn flip(at: usize, pos: usize, mask: u8) -> Tamper {
    at_frame(at, move |mut body| {
        body[pos] ^= mask;
        vec![Out::Frame(body)]
    })
}

/// Flip `mask` into the byte at `pos(body)` of frame `at`.
pub fn flip_with(at: usize, pos: fn(&[u8]) -> usize, mask: u8) -> Tamper {
    at_frame(at, move |mut body| {
        let p = pos(&body);
        body[p] ^= mask;
        vec![Out::Frame(body)]
    })
}

/// Forward everything, keeping a copy of every frame.
pub fn recording(log: Arc<Mutex<Vec<Vec<u8>>>>) -> Tamper {
    Box::new(move |_, body| {
        log.lock().unwrap().push(body.clone());
        vec![Out::Frame(body)]
    })
}

pub fn framed(body: &[u8]) -> Vec<u8> {
    let mut out = (body.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

#[derive(Clone, Default)]
pub struct Counts {
    pub i2r: Arc<AtomicUsize>,
    pub r2i: Arc<AtomicUsize>,
}

pub async fn pump(
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
pub async fn spawn_relay(upstream: SocketAddr, i2r: Tamper, r2i: Tamper) -> (SocketAddr, Counts) {
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

pub async fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("address");
    (l, addr)
}

pub async fn dial(addr: SocketAddr) -> BoxStream {
    let s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    Box::new(s) as BoxStream
}

/// The host's side of a handshake over `stream`: default limits, any peer.
pub async fn initiate_as_host(
    stream: BoxStream,
) -> Result<(ChannelSender, ChannelReceiver, PeerInfo), ChannelError> {
    channel::initiate(
        stream,
        &LocalIdentity::host(),
        default_limits(),
        &accept_all,
    )
    .await
}

pub async fn accept(l: &TcpListener) -> BoxStream {
    let (s, _) = l.accept().await.expect("accept");
    s.set_nodelay(true).expect("nodelay");
    Box::new(s) as BoxStream
}

pub struct Handshake {
    pub init: HandshakeResult,
    pub resp: HandshakeResult,
    pub counts: Counts,
}

/// Runs both sides of a handshake through a relay applying `i2r` / `r2i`.
pub async fn handshake(
    initiator: &Peer<'_>,
    responder: &Peer<'_>,
    i2r: Tamper,
    r2i: Tamper,
) -> Handshake {
    let (l, addr) = listener().await;
    let (relay, counts) = spawn_relay(addr, i2r, r2i).await;
    let (init, resp) = both_sides(initiator, responder, &l, relay).await;
    Handshake { init, resp, counts }
}

/// Runs both sides of a handshake over a direct TCP connection.
pub async fn direct(
    initiator: &Peer<'_>,
    responder: &Peer<'_>,
) -> (HandshakeResult, HandshakeResult) {
    let (l, addr) = listener().await;
    both_sides(initiator, responder, &l, addr).await
}

/// Both sides of a handshake at once: the initiator dials `to`, the
/// responder accepts on `l`.
async fn both_sides(
    initiator: &Peer<'_>,
    responder: &Peer<'_>,
    l: &TcpListener,
    to: SocketAddr,
) -> (HandshakeResult, HandshakeResult) {
    tokio::join!(
        async {
            let s = dial(to).await;
            channel::initiate(s, &initiator.id, initiator.limits, initiator.check).await
        },
        async {
            let s = accept(l).await;
            channel::respond(s, &responder.id, responder.limits, responder.check).await
        }
    )
}

pub fn ok(r: HandshakeResult, side: &str) -> Established {
    match r {
        Ok(e) => e,
        Err(e) => panic!("{side} handshake failed: {e:?}"),
    }
}

pub fn err(r: HandshakeResult, side: &str) -> ChannelError {
    match r {
        Ok(_) => panic!("{side} handshake unexpectedly succeeded"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------
// Receiving
// ---------------------------------------------------------------------------

pub async fn recv(rx: &mut ChannelReceiver) -> Result<Option<Vec<u8>>, ChannelError> {
    timeout(WAIT, rx.recv()).await.expect("recv timed out")
}

pub async fn expect_message(rx: &mut ChannelReceiver, want: &[u8]) {
    match recv(rx).await {
        Ok(Some(got)) => {
            assert_eq!(got.len(), want.len(), "message length");
            assert!(got == want, "message content differs");
        }
        other => panic!("expected a message of {} bytes, got {other:?}", want.len()),
    }
}

pub async fn expect_poisoned(rx: &mut ChannelReceiver) {
    for _ in 0..3 {
        match recv(rx).await {
            Err(ChannelError::Poisoned) => {}
            other => panic!("expected Poisoned, got {other:?}"),
        }
    }
}

pub fn msg(k: usize) -> Vec<u8> {
    format!("message number {k} on the stage channel").into_bytes()
}

pub fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 251) as u8).collect()
}

/// Offset of the value of a 32-byte byte-string field `key` in a CBOR map.
pub fn bytes32_field(body: &[u8], key: &str) -> usize {
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
pub fn attested_field(body: &[u8]) -> usize {
    let pat = b"\x68attested";
    let at = body
        .windows(pat.len())
        .position(|w| w == pat)
        .expect("attested field");
    at + pat.len()
}

/// The next receive fails with `want` (compared by its `Debug` form).
pub async fn expect_failure(rx: &mut ChannelReceiver, want: ChannelError) {
    match recv(rx).await {
        Err(e) if format!("{e:?}") == format!("{want:?}") => {}
        other => panic!("expected {want:?}, got {other:?}"),
    }
}

/// The next receive fails as out of sequence: record `got` where `expected` was due.
pub async fn expect_out_of_sequence(rx: &mut ChannelReceiver, expected: u64, got: u64) {
    expect_failure(rx, ChannelError::OutOfSequence { expected, got }).await;
}

/// Which hello of the handshake a test tampers with.
pub enum Hello {
    /// The initiator's first frame.
    Client,
    /// The responder's first frame.
    Server,
}

/// A handshake with one bit flipped in `hello`, at the byte `pos` picks.
pub async fn flipped_hello(
    initiator: &Peer<'_>,
    responder: &Peer<'_>,
    hello: Hello,
    pos: fn(&[u8]) -> usize,
) -> Handshake {
    let tamper = flip_with(0, pos, 0x01);
    match hello {
        Hello::Client => handshake(initiator, responder, tamper, pass()).await,
        Hello::Server => handshake(initiator, responder, pass(), tamper).await,
    }
}

/// `side`'s handshake failed because its peer was rejected, for a reason
/// that mentions `needle`.
pub fn expect_rejected(r: HandshakeResult, side: &str, needle: &str) {
    match err(r, side) {
        ChannelError::PeerRejected(m) => assert!(m.contains(needle), "{m}"),
        other => panic!("expected PeerRejected, got {other:?}"),
    }
}
