//! A sealed event stream opened piece by piece: whole events go out as they
//! open, the `[DONE]` event waits for the receipt over the whole stream.

use super::sse::{ends_with_error_event, forwardable};
use super::{unopenable, Refused};
use proto::receipt::ReceiptTrailer;
use proto::sealing::{ClientResponseKey, ResponseOpener, SealLimits};

/// Opens a sealed stream; [`StreamOpen::feed`] returns what may go out.
pub struct StreamOpen {
    opener: ResponseOpener,
    /// Every plaintext byte so far: the receipt binds all of it.
    all: Vec<u8>,
    /// How much of `all` went out; whether it stopped at `[DONE]`.
    forwarded: usize,
    at_done: bool,
}

/// How a stream ended: all its plaintext, what is still to go out, and the
/// receipt to verify (none only when a stage ended it with an error event).
#[derive(Debug)]
pub struct StreamEnd {
    /// The whole event stream (what the receipt covers).
    pub all: Vec<u8>,
    /// The part not handed out yet (`[DONE]`, once the receipt verified).
    pub rest: Vec<u8>,
    /// The receipt trailer; `None` for a stream a stage ended with an error.
    pub receipt: Option<ReceiptTrailer>,
}

impl StreamOpen {
    pub(super) fn new(key: &ClientResponseKey) -> Self {
        Self {
            opener: ResponseOpener::new(key, SealLimits::default()),
            all: Vec::new(),
            forwarded: 0,
            at_done: false,
        }
    }

    /// Opens one piece of the sealed stream; returns the whole events that
    /// may go out now (never any part of `[DONE]`, however the sealed chunks
    /// split it).
    pub fn feed(&mut self, piece: &[u8]) -> Result<Vec<u8>, Refused> {
        for part in self.opener.feed(piece).map_err(unopenable)? {
            self.all.extend_from_slice(&part);
        }
        if self.at_done {
            return Ok(Vec::new());
        }
        let (upto, done) = forwardable(&self.all, self.forwarded);
        self.at_done = done;
        let out = self.all[self.forwarded..upto].to_vec();
        self.forwarded = upto;
        Ok(out)
    }

    /// Whether the sealed stream's last chunk arrived.
    pub fn is_complete(&self) -> bool {
        self.opener.is_complete()
    }

    /// Ends the stream: it must be complete and carry a receipt, unless a
    /// stage ended it with an error event (never after a `[DONE]`). The
    /// receipt is not verified here: that needs the evidence
    /// ([`super::Sealed::verify`]).
    pub fn finish(self) -> Result<StreamEnd, Refused> {
        let trailer = self
            .opener
            .trailer()
            .map(ReceiptTrailer::decode)
            .transpose();
        self.opener.finish().map_err(unopenable)?;
        let receipt = trailer.map_err(|e| {
            Refused::new(
                "receipt_verification_failed",
                format!(
                    "The stream's sealed receipt trailer is malformed ({e}); [DONE] was withheld."
                ),
            )
        })?;
        if receipt.is_none() && (self.at_done || !ends_with_error_event(&self.all)) {
            return Err(Refused::new(
                "receipt_verification_failed",
                "The upstream stream ended without its receipt or an error event; \
                 [DONE] was withheld.",
            ));
        }
        let rest = self.all[self.forwarded..].to_vec();
        Ok(StreamEnd {
            all: self.all,
            rest,
            receipt,
        })
    }
}
