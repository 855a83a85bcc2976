//! The attested stage channel over a tokio byte stream: drives the
//! I/O-free handshake ([`crate::channel::handshake`]) and record layer
//! ([`crate::channel::record`]) with reads and writes, under the
//! handshake timeout.

use super::transport::BoxStream;
use crate::channel::handshake::{Initiator, Keys, Responder};
use crate::channel::messages::{frame, frame_len};
use crate::channel::record::{RecordOpener, RecordSealer, HEADER_LEN};
use crate::channel::{ChannelError, ChannelLimits, LocalIdentity, PeerCheck, PeerInfo};
use crate::wipe::WipeOnDrop;
use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};

/// Sending half of an established channel.
pub struct ChannelSender {
    w: WriteHalf<BoxStream>,
    sealer: RecordSealer,
    poisoned: bool,
}

/// Receiving half of an established channel. `recv` is not cancel-safe:
/// drive it from one task.
pub struct ChannelReceiver {
    r: BufReader<ReadHalf<BoxStream>>,
    opener: RecordOpener,
    poisoned: bool,
}

impl ChannelSender {
    /// Sends one message (split into records as needed).
    ///
    /// Not cancel-safe, and fails closed when cancelled: the sender is
    /// poisoned before the first write and cleared only once the whole
    /// message is written, and each record's sequence number (its nonce) is
    /// spent when it is sealed, before its bytes are written. A send future
    /// dropped part-way therefore leaves a sender that refuses every later
    /// message ([`ChannelError::Poisoned`]) instead of one that reuses a
    /// nonce or splices a message onto a half-written one. Callers that may
    /// be cancelled (request handlers) go through a queued writer task
    /// instead ([`super::queue`], which builds on this one).
    pub async fn send(&mut self, msg: &[u8]) -> Result<(), ChannelError> {
        if self.poisoned {
            return Err(ChannelError::Poisoned);
        }
        self.poisoned = true;
        let r = self.send_inner(msg).await;
        self.poisoned = r.is_err();
        r
    }

    async fn send_inner(&mut self, msg: &[u8]) -> Result<(), ChannelError> {
        for (chunk, last) in self.sealer.chunks(msg)? {
            let record = self.sealer.seal(chunk, last)?;
            self.w.write_all(&record).await?;
        }
        self.w.flush().await?;
        Ok(())
    }

    /// Sends a CBOR-encoded value. The encoding (which may carry a response
    /// key or a digest salt) is wiped once sent, or when a cancelled send
    /// drops it.
    pub async fn send_msg<T: Serialize>(&mut self, value: &T) -> Result<(), ChannelError> {
        let bytes = WipeOnDrop(crate::cbor::to_vec(value));
        self.send(&bytes).await
    }

    /// Records sent so far.
    pub fn records_sent(&self) -> u64 {
        self.sealer.records_sealed()
    }

    /// Closes the sending direction.
    pub async fn close(mut self) {
        self.shutdown().await;
    }

    /// Closes the sending direction of a sender others may still hold
    /// (their later sends fail).
    pub async fn shutdown(&mut self) {
        let _ = self.w.shutdown().await;
    }
}

impl ChannelReceiver {
    /// Receives one message; `Ok(None)` on a clean close between messages.
    pub async fn recv(&mut self) -> Result<Option<Vec<u8>>, ChannelError> {
        if self.poisoned {
            return Err(ChannelError::Poisoned);
        }
        let r = self.recv_inner().await;
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    async fn recv_inner(&mut self) -> Result<Option<Vec<u8>>, ChannelError> {
        read_message(&mut self.r, &mut self.opener).await
    }

    /// Receives and decodes a CBOR value; `Ok(None)` on a clean close. The
    /// received plaintext is wiped once decoded.
    pub async fn recv_msg<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ChannelError> {
        match self.recv().await? {
            None => Ok(None),
            Some(bytes) => {
                let bytes = WipeOnDrop(bytes);
                crate::cbor::from_slice(&bytes).map(Some).map_err(|e| {
                    self.poisoned = true;
                    ChannelError::Malformed(e)
                })
            }
        }
    }
}

/// Reads records through `opener` until one completes a message; `Ok(None)`
/// on a clean close between messages.
async fn read_message(
    r: &mut BufReader<ReadHalf<BoxStream>>,
    opener: &mut RecordOpener,
) -> Result<Option<Vec<u8>>, ChannelError> {
    loop {
        let mut header = [0u8; HEADER_LEN];
        // Only an end of stream before the first byte of a message is a
        // clean close; one anywhere after it, even inside the length
        // prefix, is a truncation.
        let mut filled = 0;
        while filled < 4 {
            match r.read(&mut header[filled..4]).await? {
                0 if filled == 0 && !opener.mid_message() => return Ok(None),
                0 => return Err(ChannelError::Truncated),
                n => filled += n,
            }
        }
        opener.begin_record();
        let len = opener.record_len(header[..4].try_into().expect("4 bytes"))?;
        read_exact_or_truncated(r, &mut header[4..]).await?;
        opener.check_sequence(&header)?;
        let mut body = vec![0u8; len - 8];
        read_exact_or_truncated(r, &mut body).await?;
        if let Some(msg) = opener.open(&header, body)? {
            return Ok(Some(msg));
        }
    }
}

async fn read_exact_or_truncated<R: AsyncReadExt + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> Result<(), ChannelError> {
    r.read_exact(buf).await.map(|_| ()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ChannelError::Truncated
        } else {
            e.into()
        }
    })
}

async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    bytes: &[u8],
) -> Result<(), ChannelError> {
    w.write_all(&frame(bytes)).await?;
    w.flush().await?;
    Ok(())
}

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<Vec<u8>, ChannelError> {
    let mut prefix = [0u8; 4];
    read_exact_or_truncated(r, &mut prefix).await?;
    let mut buf = vec![0u8; frame_len(prefix)?];
    read_exact_or_truncated(r, &mut buf).await?;
    Ok(buf)
}

/// The stream's halves, reading through a buffer.
fn split(stream: BoxStream) -> (BufReader<ReadHalf<BoxStream>>, WriteHalf<BoxStream>) {
    let (r, w) = tokio::io::split(stream);
    (BufReader::with_capacity(256 * 1024, r), w)
}

fn halves(
    r: BufReader<ReadHalf<BoxStream>>,
    w: WriteHalf<BoxStream>,
    keys: Keys,
) -> (ChannelSender, ChannelReceiver) {
    (
        ChannelSender {
            w,
            sealer: keys.send,
            poisoned: false,
        },
        ChannelReceiver {
            r,
            opener: keys.recv,
            poisoned: false,
        },
    )
}

async fn with_timeout<T>(
    limits: &ChannelLimits,
    fut: impl std::future::Future<Output = Result<T, ChannelError>>,
) -> Result<T, ChannelError> {
    tokio::time::timeout(limits.handshake_timeout, fut)
        .await
        .map_err(|_| ChannelError::Handshake("timed out".into()))?
}

/// Runs the initiator side of the handshake (the gateway, or a stage dialing
/// the next stage). `check` decides whether the responder is acceptable.
pub async fn initiate(
    stream: BoxStream,
    local: &LocalIdentity,
    limits: ChannelLimits,
    check: PeerCheck<'_>,
) -> Result<(ChannelSender, ChannelReceiver, PeerInfo), ChannelError> {
    with_timeout(&limits, async move {
        let mut stream = stream;
        let (state, m1) = Initiator::start(local);
        write_frame(&mut stream, &m1).await?;
        let m2 = read_frame(&mut stream).await?;
        let (m3, mut pending) = state.finish(local, &m2, limits, check)?;
        write_frame(&mut stream, &m3).await?;
        let (mut r, w) = split(stream);
        let verdict = read_message(&mut r, pending.opener())
            .await?
            .map(WipeOnDrop);
        let (keys, peer) = pending.verdict(verdict.as_ref().map(|v| v.as_slice()))?;
        let (tx, rx) = halves(r, w, keys);
        Ok((tx, rx, peer))
    })
    .await
}

/// Runs the responder side (a stage accepting a connection). `check` decides
/// whether the initiator is acceptable; a rejection is reported to it.
pub async fn respond(
    stream: BoxStream,
    local: &LocalIdentity,
    limits: ChannelLimits,
    check: PeerCheck<'_>,
) -> Result<(ChannelSender, ChannelReceiver, PeerInfo), ChannelError> {
    with_timeout(&limits, async move {
        let mut stream = stream;
        let m1 = read_frame(&mut stream).await?;
        let (state, m2) = Responder::hello(local, &m1)?;
        write_frame(&mut stream, &m2).await?;
        let m3 = read_frame(&mut stream).await?;
        let (records, verdict) = state.finish(local, &m3, limits, check)?;
        let sent = async {
            stream.write_all(&records).await?;
            stream.flush().await
        }
        .await;
        let (keys, peer) = verdict?;
        sent?;
        let (r, w) = split(stream);
        let (tx, rx) = halves(r, w, keys);
        Ok((tx, rx, peer))
    })
    .await
}
