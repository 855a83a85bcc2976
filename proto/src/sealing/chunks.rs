//! Chunk framing: `u32be(len) ‖ AEAD(ct)` chunks with a final (or trailer)
//! flag in the AAD, sealed and opened incrementally.

use super::cipher::{OpenCipher, SealCipher};
use super::error::SealError;
use super::headers::SealLimits;
use super::padding::{pad, unpad};
use super::{
    AAD_FINAL, AAD_NOT_FINAL, AAD_TRAILER, CHUNK_OVERHEAD, DEFAULT_MAX_CHUNK, LEN_PREFIX,
    PAD_BUCKET, TAG_LEN,
};

/// Streaming sealer: turns plaintext pieces into framed chunks.
///
/// [`ChunkSealer::seal`] splits its input into chunks of at most
/// `max_chunk` bytes; the call with `last = true` ends the body with a final
/// chunk (an empty one if `data` is empty). Nothing can be sealed afterwards
/// ([`SealError::Finished`]).
pub struct ChunkSealer {
    cipher: SealCipher,
    max_chunk: usize,
    pub(super) prefix: Vec<u8>,
    finished: bool,
}

impl ChunkSealer {
    pub(super) fn new(cipher: SealCipher) -> Self {
        Self {
            cipher,
            max_chunk: DEFAULT_MAX_CHUNK,
            prefix: Vec::new(),
            finished: false,
        }
    }

    /// Sets the largest plaintext per chunk, padding included (default
    /// [`DEFAULT_MAX_CHUNK`]; at least 2: one data byte and the padding's
    /// marker). The receiver's [`SealLimits::max_chunk`] must be at least
    /// this.
    pub fn set_max_chunk(&mut self, max_chunk: usize) {
        self.max_chunk = max_chunk.max(2);
    }

    /// Seals `data` as one or more chunks; with `last`, the final one is
    /// marked final. Returns the framed bytes to send. A non-final call with
    /// empty `data` produces no chunk.
    pub fn seal(&mut self, data: &[u8], last: bool) -> Result<Vec<u8>, SealError> {
        if self.finished {
            return Err(SealError::Finished);
        }
        // One byte of each chunk is the padding's marker at least.
        let room = self.max_chunk - 1;
        let pieces = data.len().div_ceil(room);
        let mut out = std::mem::take(&mut self.prefix);
        out.reserve(data.len() + (pieces + 1) * (CHUNK_OVERHEAD + PAD_BUCKET));
        let mut chunks: Vec<&[u8]> = data.chunks(room).collect();
        if last && chunks.is_empty() {
            chunks.push(&[]);
        }
        let n = chunks.len();
        for (i, piece) in chunks.into_iter().enumerate() {
            let aad = if last && i + 1 == n {
                &AAD_FINAL
            } else {
                &AAD_NOT_FINAL
            };
            let pt = pad(piece, self.max_chunk);
            let ct = match &mut self.cipher {
                SealCipher::Hpke(c) => c.seal(&pt, aad)?,
                SealCipher::Direct(c) => c.seal(&pt, aad)?,
            };
            out.extend_from_slice(&(ct.len() as u32).to_be_bytes());
            out.extend_from_slice(&ct);
        }
        if last {
            self.finished = true;
        }
        Ok(out)
    }

    /// Ends the body with an empty final chunk.
    pub fn finish(&mut self) -> Result<Vec<u8>, SealError> {
        self.seal(&[], true)
    }

    /// Ends the body with a trailer: one final chunk sealed with the trailer
    /// AAD (only responses use it). The trailer must fit in one chunk.
    pub(super) fn seal_trailer(&mut self, trailer: &[u8]) -> Result<Vec<u8>, SealError> {
        if self.finished {
            return Err(SealError::Finished);
        }
        if trailer.len() >= self.max_chunk {
            return Err(SealError::Malformed(format!(
                "trailer of {} bytes exceeds the chunk size {}",
                trailer.len(),
                self.max_chunk
            )));
        }
        let pt = pad(trailer, self.max_chunk);
        let ct = match &mut self.cipher {
            SealCipher::Hpke(c) => c.seal(&pt, &AAD_TRAILER)?,
            SealCipher::Direct(c) => c.seal(&pt, &AAD_TRAILER)?,
        };
        let mut out = std::mem::take(&mut self.prefix);
        out.extend_from_slice(&(ct.len() as u32).to_be_bytes());
        out.extend_from_slice(&ct);
        self.finished = true;
        Ok(out)
    }

    /// Whether the final chunk was sealed.
    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum OpenState {
    Open,
    Done,
    Failed,
}

/// Streaming opener: feed it the sealed body in whatever pieces arrive; it
/// returns the plaintext chunks that became complete.
///
/// Any error poisons it (later calls return [`SealError::Poisoned`]).
/// [`ChunkOpener::finish`] must be called at the end of the body: it is
/// [`SealError::Truncated`] unless the final chunk arrived.
pub struct ChunkOpener {
    cipher: OpenCipher,
    limits: SealLimits,
    buf: Vec<u8>,
    pub(super) received: u64,
    state: OpenState,
    /// Whether a trailer may end the body (responses only).
    allow_trailer: bool,
    pub(super) trailer: Option<Vec<u8>>,
    /// The error of a call that also returned opened chunks, for the next call.
    deferred: Option<SealError>,
}

impl ChunkOpener {
    pub(super) fn new(cipher: OpenCipher, limits: SealLimits, allow_trailer: bool) -> Self {
        Self {
            cipher,
            limits,
            buf: Vec::new(),
            received: 0,
            state: OpenState::Open,
            allow_trailer,
            trailer: None,
            deferred: None,
        }
    }

    /// Feeds bytes; returns the plaintext of every chunk they completed.
    ///
    /// When a chunk fails after others in the same bytes opened, the opened
    /// (authentic) chunks are returned and the error comes from the next
    /// call (or [`Self::finish`]), so no genuine plaintext is lost.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let mut out = Vec::new();
        match self.feed_inner(data, &mut out) {
            Ok(()) => Ok(out),
            Err(e) => {
                self.state = OpenState::Failed;
                self.buf.clear();
                if out.is_empty() {
                    Err(e)
                } else {
                    self.deferred = Some(e);
                    Ok(out)
                }
            }
        }
    }

    fn feed_inner(&mut self, data: &[u8], out: &mut Vec<Vec<u8>>) -> Result<(), SealError> {
        match self.state {
            OpenState::Failed => return Err(SealError::Poisoned),
            OpenState::Done if !data.is_empty() => return Err(SealError::TrailingData),
            _ => {}
        }
        self.count(data.len())?;
        self.buf.extend_from_slice(data);
        let mut pos = 0;
        let limit = self.limits.max_chunk as u64 + TAG_LEN as u64;
        while self.state == OpenState::Open && self.buf.len() - pos >= LEN_PREFIX {
            let len = u32::from_be_bytes(self.buf[pos..pos + LEN_PREFIX].try_into().unwrap());
            if len as u64 > limit {
                return Err(SealError::ChunkTooLarge {
                    size: len as u64,
                    limit,
                });
            }
            let len = len as usize;
            if len < TAG_LEN {
                return Err(SealError::Malformed(
                    "chunk shorter than the AEAD tag".into(),
                ));
            }
            if self.buf.len() - pos < LEN_PREFIX + len {
                break;
            }
            let ct = &self.buf[pos + LEN_PREFIX..pos + LEN_PREFIX + len];
            if let Some(pt) = self.cipher.open(ct, &AAD_NOT_FINAL)? {
                out.push(unpad(pt)?);
            } else if let Some(pt) = self.cipher.open(ct, &AAD_FINAL)? {
                self.state = OpenState::Done;
                out.push(unpad(pt)?);
            } else if let Some(pt) = match self.allow_trailer {
                true => self.cipher.open(ct, &AAD_TRAILER)?,
                false => None,
            } {
                self.state = OpenState::Done;
                self.trailer = Some(unpad(pt)?);
            } else {
                return Err(SealError::Open);
            }
            pos += LEN_PREFIX + len;
        }
        self.buf.drain(..pos);
        if self.state == OpenState::Done && !self.buf.is_empty() {
            return Err(SealError::TrailingData);
        }
        Ok(())
    }

    pub(super) fn count(&mut self, n: usize) -> Result<(), SealError> {
        self.received = self.received.saturating_add(n as u64);
        if self.received > self.limits.max_body {
            return Err(SealError::MessageTooLarge {
                limit: self.limits.max_body,
            });
        }
        Ok(())
    }

    /// Whether the final chunk has been opened.
    pub fn is_complete(&self) -> bool {
        self.state == OpenState::Done
    }

    /// Ends the body: `Ok` only if the final chunk arrived and nothing
    /// followed it.
    pub fn finish(self) -> Result<(), SealError> {
        if let Some(e) = self.deferred {
            return Err(e);
        }
        match self.state {
            OpenState::Done => Ok(()),
            OpenState::Open => Err(SealError::Truncated),
            OpenState::Failed => Err(SealError::Poisoned),
        }
    }
}
