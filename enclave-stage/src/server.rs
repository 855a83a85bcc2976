//! The stage's network side: accepts attested channels from the gateway
//! (host) and from the previous stage, dials and attests the next stage when
//! configured, and moves messages between the channels and the compute thread.

use crate::batcher::Seq;
use crate::compute::{failure, Output, Work};
use crate::engine::Engine;
use proto::attestation::{AttestationProvider, Measurement};
use proto::channel::{
    self, ChannelLimits, ChannelReceiver, ChannelSender, LocalIdentity, PeerInfo,
};
use proto::frames::{
    ActivationMessage, BatchItem, ConfigureOutcome, ErrorKind, HostMessage, PipelineError,
    StageClaims,
};
use proto::policy::Policy;
use proto::transport::{self, Endpoint, Listener};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, Mutex};

type SharedSender = Arc<Mutex<ChannelSender>>;

/// Requests with at most this many bytes of text are tokenized inline.
const INLINE_TOKENIZE_BYTES: usize = 2048;

/// Where this stage's output currently goes.
struct Sink {
    id: u64,
    tx: SharedSender,
    /// The host channel that configured a next-stage sink; told when the
    /// next stage is lost so the gateway rebuilds the pipeline instead of
    /// waiting on outputs that can no longer arrive.
    host: Option<SharedSender>,
}

/// Everything the connection handlers share.
pub struct StageServer {
    engine: Arc<Engine>,
    provider: Arc<dyn AttestationProvider>,
    policy: Policy,
    local_measurement: Measurement,
    limits: ChannelLimits,
    work: std::sync::mpsc::Sender<Work>,
    out: mpsc::Sender<Output>,
    sink: Mutex<Option<Sink>>,
    next_sink: AtomicU64,
    max_inputs: usize,
}

impl StageServer {
    /// A server for `engine`; `work` feeds the compute thread, `out` is its output queue.
    pub fn new(
        engine: Arc<Engine>,
        provider: Arc<dyn AttestationProvider>,
        policy: Policy,
        local_measurement: Measurement,
        work: std::sync::mpsc::Sender<Work>,
        out: mpsc::Sender<Output>,
        max_inputs: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            engine,
            provider,
            policy,
            local_measurement,
            limits: ChannelLimits::default(),
            work,
            out,
            sink: Mutex::new(None),
            next_sink: AtomicU64::new(1),
            max_inputs,
        })
    }

    fn identity(&self) -> LocalIdentity {
        LocalIdentity::stage(self.provider.clone(), self.engine.claims.clone())
    }

    fn claims(&self) -> &StageClaims {
        &self.engine.claims
    }

    /// Checks an attested peer against the policy and that it is our
    /// neighbour at `offset` (-1 upstream, +1 downstream) serving the same model.
    fn check_neighbour(&self, peer: &PeerInfo, offset: i64) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&peer.document, &peer.claims) else {
            return Err("peer presented no evidence".into());
        };
        self.policy
            .check(doc, c, Some(&self.local_measurement))
            .map_err(|e| e.to_string())?;
        let me = self.claims();
        let want = me.stage_index as i64 + offset;
        if c.stage_index as i64 != want {
            return Err(format!(
                "peer is stage {}, expected stage {want}",
                c.stage_index
            ));
        }
        if c.num_stages != me.num_stages || c.manifest_sha256 != me.manifest_sha256 {
            return Err("peer serves a different pipeline or model manifest".into());
        }
        let adjacent = if offset < 0 {
            c.layer_end == me.layer_start
        } else {
            c.layer_start == me.layer_end
        };
        if !adjacent {
            return Err(format!(
                "peer layers [{}, {}) are not adjacent to ours [{}, {})",
                c.layer_start, c.layer_end, me.layer_start, me.layer_end
            ));
        }
        Ok(())
    }

    /// Accepts connections forever.
    pub async fn serve(self: Arc<Self>, listener: Listener) {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let this = self.clone();
                    tokio::spawn(async move { this.handle(stream, peer).await });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn handle(self: Arc<Self>, stream: transport::BoxStream, addr: String) {
        let check = |p: &PeerInfo| {
            if p.is_host() {
                Ok(())
            } else {
                self.check_neighbour(p, -1)
            }
        };
        let (tx, rx, peer) =
            match channel::respond(stream, &self.identity(), self.limits, &check).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(peer = %addr, error = %e, "handshake failed");
                    return;
                }
            };
        if peer.is_host() {
            tracing::info!(peer = %addr, "host channel open");
            self.host_session(Arc::new(Mutex::new(tx)), rx).await;
        } else {
            tracing::info!(peer = %addr, "upstream stage channel open (attested)");
            self.upstream_session(rx).await;
        }
    }

    async fn host_session(self: &Arc<Self>, tx: SharedSender, mut rx: ChannelReceiver) {
        let mut my_sink: Option<u64> = None;
        loop {
            let msg = match rx.recv_msg::<HostMessage>().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "host channel error");
                    break;
                }
            };
            match msg {
                HostMessage::Configure { next } => {
                    let outcome = match self.configure(next, &tx).await {
                        Ok(id) => {
                            if id.is_some() {
                                my_sink = id;
                            }
                            ConfigureOutcome::Configured
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "configuration failed");
                            ConfigureOutcome::Failed(e)
                        }
                    };
                    if tx.lock().await.send_msg(&outcome).await.is_err() {
                        break;
                    }
                }
                HostMessage::Embed(req) => {
                    if !self.engine.is_entry() {
                        tracing::warn!("embed request sent to a non-entry stage; closing");
                        break;
                    }
                    self.accept_request(req.request_id, req.inputs).await;
                }
            }
        }
        let mut sink = self.sink.lock().await;
        if sink.as_ref().map(|s| s.id) == my_sink && my_sink.is_some() {
            tracing::warn!("the gateway channel that received our output closed");
            *sink = None;
        }
    }

    /// Sets the output sink: the next stage, or (exit stage) this host channel.
    async fn configure(
        self: &Arc<Self>,
        next: Option<String>,
        host_tx: &SharedSender,
    ) -> Result<Option<u64>, String> {
        let id = self.next_sink.fetch_add(1, Ordering::Relaxed);
        match (next, self.engine.is_exit()) {
            (None, true) => {
                *self.sink.lock().await = Some(Sink {
                    id,
                    tx: host_tx.clone(),
                    host: None,
                });
                tracing::info!("configured as exit stage: output goes to the gateway");
                Ok(Some(id))
            }
            (Some(ep), false) => {
                let ep: Endpoint = ep.parse()?;
                let stream = transport::connect(&ep)
                    .await
                    .map_err(|e| format!("connecting to next stage at {ep}: {e}"))?;
                let check = |p: &PeerInfo| self.check_neighbour(p, 1);
                let (tx, rx, _peer) =
                    channel::initiate(stream, &self.identity(), self.limits, &check)
                        .await
                        .map_err(|e| format!("next stage at {ep}: {e}"))?;
                let tx = Arc::new(Mutex::new(tx));
                *self.sink.lock().await = Some(Sink {
                    id,
                    tx,
                    host: Some(host_tx.clone()),
                });
                let this = self.clone();
                let next = ep.to_string();
                tokio::spawn(async move {
                    let mut rx = rx;
                    let r = rx.recv().await.map(|m| m.map(|b| b.len()));
                    this.downstream_lost(
                        id,
                        format!("next stage at {next} closed its channel ({r:?})"),
                    )
                    .await;
                });
                tracing::info!(next = %ep, "connected and attested the next stage");
                Ok(None)
            }
            (None, false) => Err("this stage is not the exit stage; it needs a next stage".into()),
            (Some(_), true) => Err("the exit stage has no next stage".into()),
        }
    }

    async fn accept_request(&self, request_id: u64, inputs: Vec<String>) {
        let exit = self.engine.is_exit();
        if inputs.is_empty() || inputs.len() > self.max_inputs {
            let e = bad_input(format!("a request carries 1 to {} inputs", self.max_inputs));
            return self.emit(failure(exit, request_id, e)).await;
        }
        let total_bytes: usize = inputs.iter().map(|t| t.len()).sum();
        let engine = self.engine.clone();
        let tokenize = move || {
            inputs
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let ids = engine.tokenize(t).map_err(|e| format!("input {i}: {e}"))?;
                    Ok(Seq {
                        item: BatchItem {
                            request_id,
                            index: i as u32,
                            tokens: ids.len() as u32,
                        },
                        ids,
                    })
                })
                .collect::<Result<Vec<_>, String>>()
        };
        // Small inputs tokenize in microseconds: do it here rather than pay a
        // thread hand-off; large ones go to the blocking pool.
        let tokenized = if total_bytes <= INLINE_TOKENIZE_BYTES {
            Ok(tokenize())
        } else {
            tokio::task::spawn_blocking(tokenize).await
        };
        match tokenized {
            Ok(Ok(seqs)) => {
                if self.work.send(Work::Seqs(seqs)).is_err() {
                    tracing::error!("compute thread is gone");
                }
            }
            Ok(Err(e)) => self.emit(failure(exit, request_id, bad_input(e))).await,
            Err(e) => {
                let err = PipelineError {
                    kind: ErrorKind::Internal,
                    message: format!("tokenizer task failed: {e}"),
                };
                self.emit(failure(exit, request_id, err)).await
            }
        }
    }

    async fn upstream_session(&self, mut rx: ChannelReceiver) {
        loop {
            match rx.recv_msg::<ActivationMessage>().await {
                Ok(Some(ActivationMessage::Batch(b))) => {
                    if self.work.send(Work::Batch(b)).is_err() {
                        tracing::error!("compute thread is gone");
                        return;
                    }
                }
                Ok(Some(ActivationMessage::Failed { request_id, error })) => {
                    self.emit(failure(self.engine.is_exit(), request_id, error))
                        .await
                }
                Ok(None) => {
                    tracing::info!("upstream stage closed the channel");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "upstream channel error");
                    return;
                }
            }
        }
    }

    async fn emit(&self, o: Output) {
        let _ = self.out.send(o).await;
    }

    /// Drops sink `id` (if still current) and tells the host that set it up.
    async fn downstream_lost(&self, id: u64, reason: String) {
        let sink = {
            let mut s = self.sink.lock().await;
            if s.as_ref().map(|s| s.id) != Some(id) {
                return;
            }
            s.take()
        };
        tracing::warn!(reason = %reason, "downstream lost");
        if let Some(host) = sink.and_then(|s| s.host) {
            let _ = host
                .lock()
                .await
                .send_msg(&ConfigureOutcome::Failed(reason))
                .await;
        }
    }

    /// Sends compute output to the current sink, forever.
    pub async fn write_outputs(self: Arc<Self>, mut rx: mpsc::Receiver<Output>) {
        while let Some(o) = rx.recv().await {
            let bytes = match &o {
                Output::Activation(m) => proto::cbor::to_vec(m),
                Output::Result(m) => proto::cbor::to_vec(m),
            };
            let sink = self
                .sink
                .lock()
                .await
                .as_ref()
                .map(|s| (s.id, s.tx.clone()));
            let Some((id, tx)) = sink else {
                tracing::warn!("no downstream configured; dropping a micro-batch output");
                continue;
            };
            let r = tx.lock().await.send(&bytes).await;
            if let Err(e) = r {
                self.downstream_lost(id, format!("sending downstream failed: {e}"))
                    .await;
            }
        }
    }
}

fn bad_input(message: String) -> PipelineError {
    PipelineError {
        kind: ErrorKind::BadInput,
        message,
    }
}
