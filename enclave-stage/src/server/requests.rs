//! Requests from the host (entry stage): the key id, the opening of the
//! sealed body and its freshness, the model's admission (validation and
//! tokenization, which each model kind does its own way:
//! [`crate::model::ServedModel::admit`]), the replay guard and the
//! request's envelope, handed to the compute thread; errors after the body
//! opened are sealed to the client.

use super::admissions::{HandOver, Ticket};
use super::StageServer;
use crate::model::{Admission, OpenedRequest, Refusal};
use crate::work::failure;
use proto::digest::Sha256Digest;
use proto::frames::{Envelope, ErrorKind, PipelineError, SealedRequest};
use proto::openai::{ApiEndpoint, ApiError};
use proto::receipt::{OpenedKey, ReceiptId, Sealing};
use proto::sealing::{open_request_as, seal_response, ReplayGuard, ResponseKeyMaterial, SealError};
use rand::RngCore;
use std::sync::Arc;
use std::time::{Duration, Instant};

impl StageServer {
    /// Admits a request read off the host channel in a task of its own
    /// ([`Self::accept_request`]); a panic in it fails that request alone.
    pub(super) fn spawn_admission(self: Arc<Self>, req: SealedRequest, epoch: u64, ticket: Ticket) {
        let request_id = req.request_id;
        let this = self.clone();
        let admission = tokio::spawn(async move { this.accept_request(req, epoch, ticket).await });
        tokio::spawn(async move {
            if admission.await.is_err_and(|e| e.is_panic()) {
                tracing::error!(request_id, "a request's admission panicked; it fails");
                let api = ApiError::internal("the request could not be admitted");
                let error =
                    crate::work::sealed_error(None, &api, ErrorKind::Internal, api.message.clone());
                self.emit_in(
                    epoch,
                    failure(self.model.claims().is_exit(), request_id, error),
                )
                .await;
            }
        });
    }

    /// Opens a sealed request, has the model admit it (validation,
    /// tokenization: [`crate::model::ServedModel::admit`]), records it in
    /// the replay guard and hands its work to the compute thread, unless
    /// the host cancelled it meanwhile. Errors after the body is open are
    /// sealed to the client. `epoch` is the configuration epoch of the host
    /// channel it came on.
    pub(super) async fn accept_request(&self, req: SealedRequest, epoch: u64, ticket: Ticket) {
        let exit = self.model.claims().is_exit();
        let request_id = req.request_id;
        // One core's worth of work at a time per admission.
        let working = self.admissions.work().await;
        let (plaintext, key) = match self.open(&req) {
            Ok(v) => v,
            Err(e) => return self.emit_in(epoch, failure(exit, request_id, e)).await,
        };
        // The details (which may echo request content, e.g. a model name) go
        // only into the sealed body; the host sees the status and a generic line.
        let refused = |r: Refusal| PipelineError {
            kind: ErrorKind::BadInput,
            status: r.api.status,
            message: format!(
                "request rejected with status {} (details sealed to the client)",
                r.api.status
            ),
            retry_after_secs: r.retry_after_secs,
            sealed_body: seal_response(&key, &r.api.body_bytes()).ok(),
        };
        let endpoint = match ApiEndpoint::from_path(&req.endpoint) {
            Some(e) if self.model.serves(e) => e,
            _ => {
                let api = ApiError {
                    status: 404,
                    message: format!("This model does not serve {}.", req.endpoint),
                    kind: "invalid_request_error".into(),
                    param: None,
                    code: Some("unknown_url".into()),
                };
                return self
                    .emit_in(epoch, failure(exit, request_id, refused(api.into())))
                    .await;
            }
        };
        let opened = OpenedRequest {
            request_id,
            endpoint,
            plaintext: &plaintext,
        };
        let admission = match self.model.admit(opened).await {
            Ok(a) => a,
            Err(r) => {
                return self
                    .emit_in(epoch, failure(exit, request_id, refused(r)))
                    .await
            }
        };
        drop(working);
        if let Err(e) = self.record_replay(&req) {
            admission.release();
            return self.emit_in(epoch, failure(exit, request_id, e)).await;
        }
        let mut receipt_id = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut receipt_id);
        let env = envelope(req, receipt_id, &plaintext, key);
        let Admission { work, release } = admission;
        let handed = ticket.hand_over(|| self.gate.submit(epoch, work(env)));
        if !matches!(handed, HandOver::Done(true)) {
            if let Some(release) = release {
                release();
            }
        }
        match handed {
            HandOver::Done(true) => {}
            HandOver::Done(false) => tracing::info!("a request outlived its pipeline; dropped"),
            HandOver::Cancelled => {
                tracing::info!(
                    request_id,
                    "request cancelled by the client during admission"
                );
                self.emit_in(epoch, failure(exit, request_id, crate::work::cancelled()))
                    .await;
            }
        }
    }

    /// Queues an answer made outside the compute thread, unless the
    /// pipeline of configuration `epoch` was torn down since (its host
    /// channel is gone; a new owner never sees an old request's answer).
    async fn emit_in(&self, epoch: u64, o: crate::work::Output) {
        if self.gate.current() == epoch {
            self.gate.emit(o).await;
        }
    }

    /// Refuses a replay of a request that opened and validated (only such
    /// a request is remembered, so garbage cannot fill the guard). The
    /// partition it is remembered in follows the host's `sealing` label,
    /// which the stage cannot verify, so a replay is looked for in both:
    /// relabelling a client's request does not let it through again.
    pub(super) fn record_replay(&self, req: &SealedRequest) -> Result<(), PipelineError> {
        self.record_replay_of(&req.headers, req.sealing)
    }

    fn record_replay_of(
        &self,
        headers: &proto::sealing::SealedHeaders,
        sealing: Sealing,
    ) -> Result<(), PipelineError> {
        let enc = &headers.enc;
        let mut guards = self.replay.lock().expect("replay guard lock");
        let ReplayGuards { client, host } = &mut *guards;
        let (guard, other) = match sealing {
            Sealing::Enclave => (client, host),
            Sealing::Gateway | Sealing::Plain => (host, client),
        };
        let now = Instant::now();
        // Fresh at the moment it is recorded (validation took time since
        // `open`): the guard then outlasts every moment it is fresh.
        proto::sealing::check_fresh(headers, proto::sealing::unix_now())
            .map_err(|e| replay_refusal(e, Duration::ZERO))?;
        if other.contains(enc, now) {
            return Err(replay_refusal(SealError::Replay, Duration::ZERO));
        }
        guard
            .check_and_insert(enc, now)
            .map_err(|e| replay_refusal(e, guard.retry_after(now)))
    }

    /// Checks the key id, opens the body and checks its sealing time
    /// (replays are refused once it validated: [`Self::record_replay`]).
    pub(super) fn open(
        &self,
        req: &SealedRequest,
    ) -> Result<(Vec<u8>, ResponseKeyMaterial), PipelineError> {
        let sealing_error = |status: u16, message: String| PipelineError {
            kind: ErrorKind::Sealing,
            status,
            message,
            retry_after_secs: None,
            sealed_body: None,
        };
        // The sealing time below is judged by this stage's clock: refused
        // while that clock is off beyond the window (crate::clock).
        if let Some(why) = self.clock.refusal() {
            return Err(PipelineError {
                kind: ErrorKind::Internal,
                status: 503,
                message: why,
                retry_after_secs: Some(crate::clock::RECHECK.as_secs() as u32),
                sealed_body: None,
            });
        }
        let key = self
            .keys
            .hpke
            .as_ref()
            .and_then(|k| k.get(req.headers.key_id))
            .ok_or_else(|| PipelineError {
                kind: ErrorKind::UnknownKey,
                ..sealing_error(
                    400,
                    format!(
                        "{}; fetch the current keys from /.well-known/hpke-keys",
                        SealError::UnknownKeyId(req.headers.key_id)
                    ),
                )
            })?;
        let (plaintext, material) = open_request_as(&key, &req.headers, &req.body, req.sealer())
            .map_err(|e| sealing_error(400, format!("the sealed request cannot be opened: {e}")))?;
        // Its sealing time opened with it (bound in the HPKE info): an old
        // request is refused outright, so no replay outlives the guard.
        proto::sealing::check_fresh(&req.headers, proto::sealing::unix_now()).map_err(|e| {
            PipelineError {
                kind: ErrorKind::Stale,
                ..sealing_error(400, format!("the sealed request is refused: {e}"))
            }
        })?;
        Ok((plaintext, material))
    }
}

/// The two partitions of the replay guard.
pub(super) struct ReplayGuards {
    /// Requests clients sealed to the enclave key.
    pub(super) client: ReplayGuard,
    /// Requests the host says it sealed.
    pub(super) host: ReplayGuard,
}

/// The answer to a request the replay guard refused: a replay is a 400; a
/// full guard is a 503 with `Retry-After` (when its oldest entry leaves the
/// window), so clients retry instead of failing.
pub(super) fn replay_refusal(e: SealError, retry_after: Duration) -> PipelineError {
    let (status, retry_after_secs) = match e {
        SealError::ReplayCacheFull => (503, Some(retry_after.as_secs().max(1) as u32)),
        _ => (400, None),
    };
    PipelineError {
        kind: match e {
            SealError::Stale { .. } => ErrorKind::Stale,
            _ => ErrorKind::Sealing,
        },
        status,
        message: match retry_after_secs {
            Some(s) => format!("refused: {e}; retry in {s} s"),
            None => format!("refused: {e}"),
        },
        retry_after_secs,
        sealed_body: None,
    }
}

/// The envelope of an opened request: its ids, the digest of its exact
/// plaintext, the client's nonce, how and with which key it was sealed, and
/// the key that seals the answer.
pub(super) fn envelope(
    req: SealedRequest,
    receipt_id: ReceiptId,
    plaintext: &[u8],
    response_key: ResponseKeyMaterial,
) -> Envelope {
    Envelope {
        request_id: req.request_id,
        receipt_id,
        endpoint: req.endpoint,
        request_digest: Sha256Digest::of(plaintext),
        digest_salt: {
            let mut salt = [0u8; 32];
            rand::rngs::OsRng.fill_bytes(&mut salt);
            salt
        },
        client_nonce: req.client_nonce,
        sealing: req.sealing,
        opened: OpenedKey::of(req.headers.key_id, &req.headers.enc),
        response_key,
        trace: req.trace,
    }
}
