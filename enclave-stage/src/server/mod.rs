//! The stage's network side: accepts attested channels from the gateway
//! (host) and from the previous stage, dials and attests the next stage when
//! configured, and moves messages between the channels and the compute thread.

use crate::keys::StageKeys;
use crate::model::StageModel;
use crate::work::{Output, Work};
use proto::attestation::{attest_claims, AttestationProvider, EvidencePurpose, Measurement};
use proto::channel::{ChannelLimits, LocalIdentity, PeerInfo};
use proto::frames::{ActivationMessage, FeedbackMessage, HostMessage, StageClaims, StageReply};
use proto::io::channel::{self, ChannelReceiver, ChannelSender};
use proto::io::queue::QueuedSender;
use proto::io::transport::{self, Endpoint, Listener};
use proto::policy::Policy;
use proto::sealing::ReplayGuard;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, Mutex};

mod admissions;
mod requests;
mod work_gate;

use work_gate::WorkGate;
#[cfg(test)]
mod tests;

use admissions::Admissions;
use requests::ReplayGuards;

/// How long an encapsulated key is remembered to refuse replays: every time
/// at which its request is still fresh (older ones are refused for their
/// sealing time, `proto::sealing::check_fresh`).
const REPLAY_WINDOW: Duration = proto::sealing::REPLAY_WINDOW;
/// Most encapsulated keys remembered at once for requests clients sealed
/// to the enclave key.
const REPLAY_CAPACITY: usize = 1 << 20;
/// Most remembered for requests the host says it sealed (plain and
/// gateway-key clients): a partition of its own, so that host-sealed traffic
/// cannot fill the room meant for catching replays of clients' sealed
/// requests. The label is the host's word, so a replay is looked for in
/// both partitions: relabelling a client's request does not let it through.
const HOST_SEALED_REPLAY_CAPACITY: usize = 1 << 19;
/// Longest nonce accepted in an attestation request.
const MAX_NONCE: usize = 64;

/// What a stage serves with, besides its queues.
pub struct StageSetup {
    /// The loaded model.
    pub model: StageModel,
    /// The stage's keys and boot evidence.
    pub keys: Arc<StageKeys>,
    /// Attestation provider (mock or Nitro).
    pub provider: Arc<dyn AttestationProvider>,
    /// Policy for neighbouring stages.
    pub policy: Policy,
    /// This binary's own measurement (for `trust_local_build`).
    pub local_measurement: Measurement,
    /// The clock check: a stage whose clock is off beyond the sealed-request
    /// window refuses configuration and sealed requests.
    pub clock: Arc<crate::clock::ClockGuard>,
}

/// A channel's writer task ([`proto::io::queue`]): sends are cancel-safe.
type SharedSender = QueuedSender;

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
    model: StageModel,
    keys: Arc<StageKeys>,
    provider: Arc<dyn AttestationProvider>,
    policy: Policy,
    local_measurement: Measurement,
    clock: Arc<crate::clock::ClockGuard>,
    replay: std::sync::Mutex<ReplayGuards>,
    limits: ChannelLimits,
    /// The compute thread's input, gated by configuration epoch (bumped
    /// when the owner's host channel closes), and its output queue.
    gate: WorkGate,
    sink: Mutex<Option<Sink>>,
    /// Generation exit stage: the attested channel back to the entry stage.
    feedback: Mutex<Option<SharedSender>>,
    next_sink: AtomicU64,
    /// The host channel (session number) whose `Configure` set this stage
    /// up, while it is open: no other channel may reconfigure the stage
    /// (and so take its output) until it closes.
    owner: std::sync::Mutex<Option<u64>>,
    next_session: AtomicU64,
    /// The epochs in which an upstream session, and a feedback session, was
    /// accepted: one of each per epoch ([`Self::claim_session`]), so that
    /// every request id, row and token this stage holds comes from one
    /// attested peer, and a second instance of a neighbour that the host
    /// starts cannot inject into (or reuse the ids of) the first one's requests.
    sessions: std::sync::Mutex<[Option<u64>; 2]>,
    /// Entry stage: the requests being admitted, each a task of its own.
    admissions: Admissions,
}

/// Which peer session a stage takes one of per configuration epoch.
#[derive(Clone, Copy, Debug)]
enum PeerSession {
    /// From the previous stage.
    Upstream = 0,
    /// From the exit stage back to a generation entry stage.
    Feedback = 1,
}

impl StageServer {
    /// A server for `engine`; `work` feeds the compute thread, `out` is its output queue.
    pub fn new(
        setup: StageSetup,
        work: std::sync::mpsc::Sender<Work>,
        out: mpsc::Sender<Output>,
    ) -> Arc<Self> {
        let stage_index = setup.model.claims().stage_index;
        Arc::new(Self {
            model: setup.model,
            keys: setup.keys,
            provider: setup.provider,
            policy: setup.policy,
            local_measurement: setup.local_measurement,
            clock: setup.clock,
            replay: std::sync::Mutex::new(ReplayGuards {
                client: ReplayGuard::new(REPLAY_WINDOW, REPLAY_CAPACITY),
                host: ReplayGuard::new(
                    REPLAY_WINDOW,
                    crate::fault::Fault::from_env()
                        .host_replay_capacity(stage_index)
                        .unwrap_or(HOST_SEALED_REPLAY_CAPACITY),
                ),
            }),
            limits: ChannelLimits::default(),
            gate: WorkGate::new(work, out),
            sink: Mutex::new(None),
            feedback: Mutex::new(None),
            next_sink: AtomicU64::new(1),
            owner: std::sync::Mutex::new(None),
            next_session: AtomicU64::new(1),
            sessions: std::sync::Mutex::new([None; 2]),
            admissions: Admissions::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            ),
        })
    }

    fn identity(&self) -> LocalIdentity {
        LocalIdentity::stage(self.provider.clone(), self.model.claims().clone())
    }

    fn claims(&self) -> &StageClaims {
        self.model.claims()
    }

    /// Whether a peer is the exit stage dialling this entry stage to send
    /// sampled tokens back (generation pipelines of two or more stages).
    fn is_feedback_peer(&self, peer: &PeerInfo) -> bool {
        let me = self.claims();
        self.model.has_feedback()
            && me.is_entry()
            && me.num_stages > 1
            && peer
                .claims
                .as_ref()
                .is_some_and(|c| c.stage_index + 1 == me.num_stages)
    }

    /// Checks an attested peer: policy, that it is stage `want_index`, same
    /// pipeline and manifest (the feedback loop's ends, and neighbours).
    fn check_peer_at(&self, peer: &PeerInfo, want_index: u32) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&peer.document, &peer.claims) else {
            return Err("peer presented no evidence".into());
        };
        self.policy
            .check(doc, c, Some(&self.local_measurement))
            .map_err(|e| e.to_string())?;
        let me = self.claims();
        if c.stage_index != want_index {
            return Err(format!(
                "peer is stage {}, expected stage {want_index}",
                c.stage_index
            ));
        }
        if c.num_stages != me.num_stages || c.manifest_sha256 != me.manifest_sha256 {
            return Err("peer serves a different pipeline or model manifest".into());
        }
        Ok(())
    }

    /// Checks an attested peer against the policy and that it is our
    /// neighbour at `offset` (-1 upstream, +1 downstream) serving the same model.
    fn check_neighbour(&self, peer: &PeerInfo, offset: i64) -> Result<(), String> {
        let me = self.claims();
        let want = u32::try_from(me.stage_index as i64 + offset)
            .map_err(|_| "the first stage has no upstream neighbour".to_string())?;
        self.check_peer_at(peer, want)?;
        let c = peer.claims.as_ref().expect("checked by check_peer_at");
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
        // The epoch a stage peer's session was accepted in (set by `check`).
        let claimed = std::sync::Mutex::new(None);
        let check = |p: &PeerInfo| {
            let session = if p.is_host() {
                return Ok(());
            } else if self.is_feedback_peer(p) {
                self.check_peer_at(p, self.claims().num_stages - 1)?;
                PeerSession::Feedback
            } else {
                self.check_neighbour(p, -1)?;
                PeerSession::Upstream
            };
            *claimed.lock().unwrap() = Some(self.claim_session(session)?);
            Ok(())
        };
        let (tx, rx, peer) =
            match channel::respond(stream, &self.identity(), self.limits, &check).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(peer = %addr, error = %e, "handshake failed");
                    return;
                }
            };
        let epoch = claimed.into_inner().unwrap();
        match (peer.is_host(), epoch, &peer.claims) {
            (true, _, _) => {
                tracing::info!(peer = %addr, "host channel open");
                self.host_session(QueuedSender::spawn(tx), rx).await;
            }
            (false, Some(epoch), _) if self.is_feedback_peer(&peer) => {
                tracing::info!(peer = %addr, "feedback channel from the exit stage open (attested)");
                self.feedback_session(rx, epoch).await;
            }
            (false, Some(epoch), Some(c)) => {
                tracing::info!(peer = %addr, "upstream stage channel open (attested)");
                self.upstream_session(rx, epoch, c.receipt_key).await;
            }
            _ => tracing::warn!(peer = %addr, "stage peer without an accepted session; closed"),
        }
    }

    /// Takes this epoch's one `session` of its kind, or says why not: an
    /// upstream session only once the stage is configured (the gateway
    /// configures the exit stage first, so each stage's neighbour dials a
    /// configured stage), a feedback session at any time (the exit stage
    /// dials it while being configured, before the entry stage is). Both
    /// are given again only after the host channel that configured the
    /// stage closed (a new epoch, every request dropped).
    fn claim_session(&self, session: PeerSession) -> Result<u64, String> {
        let epoch = self.gate.current();
        if matches!(session, PeerSession::Upstream) && self.owner.lock().unwrap().is_none() {
            return Err("this stage is not configured; it takes no upstream stage yet".into());
        }
        let mut sessions = self.sessions.lock().unwrap();
        let slot = &mut sessions[session as usize];
        if *slot == Some(epoch) {
            return Err(format!(
                "this stage already has its {session:?} session of this configuration; \
                 it takes another only after its host reconfigures it"
            ));
        }
        *slot = Some(epoch);
        Ok(epoch)
    }

    /// The host channel that configured the stage closed: its pipeline is
    /// gone. Every request of it is dropped in the compute thread (freeing
    /// trackers, sequences and KV cache), and the channels it set up (to
    /// the next stage, and the exit stage's feedback channel) are closed,
    /// so the stages beside this one drop theirs too.
    async fn tear_down(&self) {
        self.gate.reset();
        let sink = self.sink.lock().await.take();
        let feedback = self.feedback.lock().await.take();
        // Not awaited here: a writer stuck on a dead peer delays its
        // shutdown (which waits for what was queued before it).
        tokio::spawn(async move {
            if let Some(s) = sink {
                s.tx.shutdown().await;
            }
            if let Some(f) = feedback {
                f.shutdown().await;
            }
        });
        tracing::info!("pipeline torn down: its requests are dropped and its channels closed");
    }

    /// Makes host channel `session` the stage's owner, unless another
    /// open host channel already is.
    fn claim_ownership(&self, session: u64) -> Result<(), String> {
        let mut owner = self.owner.lock().unwrap();
        match *owner {
            Some(o) if o != session => Err(
                "this stage is configured by another host channel that is still open; \
                 only that channel may reconfigure it"
                    .into(),
            ),
            _ => {
                *owner = Some(session);
                Ok(())
            }
        }
    }

    async fn host_session(self: &Arc<Self>, tx: SharedSender, mut rx: ChannelReceiver) {
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        // Releases the stage if this session unwinds (a panic): otherwise
        // the stage would stay owned by a channel that no longer exists and
        // refuse every new configuration until restarted.
        let mut guard = OwnerGuard {
            server: Some(self.clone()),
            session,
        };
        // Set once this channel configured the stage: only then may it
        // send requests and cancellations.
        let mut my_epoch: Option<u64> = None;
        // The entry stage's rotated key sets, sent to the host that
        // configured it as they change.
        let mut key_pusher: Option<tokio::task::JoinHandle<()>> = None;
        // Request ids must increase on the channel that configured the
        // stage (one per epoch), so an id names one request in every stage
        // for as long as the pipeline lives: the host cannot make two
        // requests share an id and so one context, rows or answer.
        let mut last_request: Option<u64> = None;
        loop {
            let msg = match rx.recv_msg::<HostMessage>().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "host channel error");
                    break;
                }
            };
            let reply = match msg {
                HostMessage::Configure {
                    next,
                    feedback,
                    key_ids,
                } => {
                    // A clock beyond the sealed-request window: no pipeline
                    // forms (the gateway's /readyz names the skew).
                    let configured = match self.clock.refusal() {
                        Some(why) => Err(why),
                        None => self.claim_ownership(session),
                    };
                    let configured = match configured {
                        Ok(()) => self.configure(next, feedback, &tx).await,
                        Err(e) => Err(e),
                    };
                    let configured = configured.and_then(|()| match (key_ids, &self.keys.hpke) {
                        (Some([lo, hi]), Some(hpke)) => {
                            let ids = crate::keys::parse_key_ids(&format!("{lo}-{hi}"))?;
                            hpke.confine(ids);
                            Ok(())
                        }
                        _ => Ok(()),
                    });
                    match configured {
                        Ok(()) => {
                            my_epoch = Some(self.gate.current());
                            if let Some(hpke) = &self.keys.hpke {
                                if key_pusher.is_none() {
                                    key_pusher = Some(push_key_sets(hpke.subscribe(), tx.clone()));
                                }
                            }
                            Some(StageReply::Configured {
                                boot_evidence: self.keys.boot_evidence.clone(),
                                key_set: self
                                    .keys
                                    .hpke
                                    .as_ref()
                                    .map(|k| serde_bytes::ByteBuf::from(k.signed())),
                                clock: Some(self.clock.describe()),
                            })
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "configuration failed");
                            Some(StageReply::ConfigureFailed(e))
                        }
                    }
                }
                HostMessage::Cancel { request_id } => {
                    if !self.model.claims().is_entry() {
                        tracing::warn!("cancellation sent to a non-entry stage; closing");
                        break;
                    }
                    let Some(epoch) = my_epoch else {
                        tracing::warn!("cancellation from a host channel that did not configure the stage; closing");
                        break;
                    };
                    self.admissions.cancel(epoch, request_id, || {
                        self.gate.submit(epoch, [Work::Cancel { request_id }]);
                    });
                    None
                }
                HostMessage::Request(req) => {
                    if !self.model.claims().is_entry() {
                        tracing::warn!("request sent to a non-entry stage; closing");
                        break;
                    }
                    let Some(epoch) = my_epoch else {
                        tracing::warn!(
                            "request from a host channel that did not configure the stage; closing"
                        );
                        break;
                    };
                    if last_request.is_some_and(|last| req.request_id <= last) {
                        tracing::warn!(
                            request_id = req.request_id,
                            last = last_request,
                            "request id not above the previous one (a reused id would \
                             merge two requests); closing the host channel"
                        );
                        break;
                    }
                    last_request = Some(req.request_id);
                    // Admitted by a task of its own (the loop reads on), in
                    // the room `enter` waits for.
                    let ticket = self.admissions.enter(epoch, req.request_id).await;
                    self.clone().spawn_admission(req, epoch, ticket);
                    None
                }
                HostMessage::Stats => {
                    crate::fault::Fault::from_env()
                        .panic_once_in_session(self.claims().stage_index);
                    Some(StageReply::Stats(crate::stats::STATS.snapshot()))
                }
                HostMessage::Attest { nonce } => {
                    if nonce.len() > MAX_NONCE {
                        tracing::warn!("attestation nonce too long; closing");
                        break;
                    }
                    match attest_claims(
                        self.provider.as_ref(),
                        &self.claims().receipt_key,
                        EvidencePurpose::Attestation,
                        self.claims(),
                        &nonce,
                    ) {
                        Ok(evidence) => Some(StageReply::Evidence { nonce, evidence }),
                        Err(e) => {
                            tracing::error!(error = %e, "attestation failed");
                            break;
                        }
                    }
                }
            };
            if let Some(reply) = reply {
                if tx.send_msg(&reply).await.is_err() {
                    break;
                }
            }
        }
        guard.server = None;
        if let Some(p) = key_pusher {
            p.abort();
        }
        let owned = {
            let mut owner = self.owner.lock().unwrap();
            let owned = *owner == Some(session);
            if owned {
                *owner = None;
            }
            owned
        };
        if owned {
            tracing::info!("the host channel that configured this stage closed");
            self.tear_down().await;
        }
    }

    /// Connects to another stage and runs the attested channel handshake
    /// as initiator; `check` judges the peer's evidence and claims.
    async fn dial(
        &self,
        ep: &Endpoint,
        what: &str,
        check: proto::channel::PeerCheck<'_>,
    ) -> Result<(ChannelSender, ChannelReceiver), String> {
        let stream = transport::connect(ep)
            .await
            .map_err(|e| format!("connecting to {what} at {ep}: {e}"))?;
        let (tx, rx, _peer) = channel::initiate(stream, &self.identity(), self.limits, check)
            .await
            .map_err(|e| format!("{what} at {ep}: {e}"))?;
        Ok((tx, rx))
    }

    /// Sets the output sink: the next stage, or (exit stage) this host channel.
    async fn configure(
        self: &Arc<Self>,
        next: Option<String>,
        feedback: Option<String>,
        host_tx: &SharedSender,
    ) -> Result<(), String> {
        let id = self.next_sink.fetch_add(1, Ordering::Relaxed);
        let exit_with_feedback = self.model.has_feedback()
            && self.model.claims().is_exit()
            && !self.model.claims().is_entry();
        match &feedback {
            Some(ep) if exit_with_feedback => {
                let ep: Endpoint = ep.parse()?;
                let check = |p: &PeerInfo| self.check_peer_at(p, 0);
                let (tx, _rx) = self.dial(&ep, "the entry stage", &check).await?;
                *self.feedback.lock().await = Some(QueuedSender::spawn(tx));
                tracing::info!(entry = %ep, "connected and attested the entry stage for feedback");
            }
            None if exit_with_feedback => {
                return Err(
                    "a generation exit stage needs the entry stage's endpoint (feedback)".into(),
                )
            }
            None => {}
            Some(_) => return Err("only a generation exit stage takes a feedback endpoint".into()),
        }
        match (next, self.model.claims().is_exit()) {
            (None, true) => {
                *self.sink.lock().await = Some(Sink {
                    id,
                    tx: host_tx.clone(),
                    host: None,
                });
                tracing::info!("configured as exit stage: output goes to the gateway");
                Ok(())
            }
            (Some(ep), false) => {
                let ep: Endpoint = ep.parse()?;
                let check = |p: &PeerInfo| self.check_neighbour(p, 1);
                let (tx, rx) = self.dial(&ep, "next stage", &check).await?;
                let tx = QueuedSender::spawn(tx);
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
                Ok(())
            }
            (None, false) => Err("this stage is not the exit stage; it needs a next stage".into()),
            (Some(_), true) => Err("the exit stage has no next stage".into()),
        }
    }

    /// Entry stage of a generation pipeline: sampled tokens from the exit
    /// stage, accepted in configuration `epoch` and taken only while it lasts.
    async fn feedback_session(&self, mut rx: ChannelReceiver, epoch: u64) {
        while let Some(m) = received(rx.recv_msg::<FeedbackMessage>().await, "feedback") {
            if !self.gate.submit(epoch, [Work::Feedback(m)]) {
                tracing::info!("feedback channel of a torn-down pipeline; closing it");
                return;
            }
        }
    }

    /// Activations and links from the previous stage (whose receipt key is
    /// `signer`), accepted in configuration `epoch` and taken only while it lasts.
    async fn upstream_session(&self, mut rx: ChannelReceiver, epoch: u64, signer: [u8; 32]) {
        loop {
            let Some(m) = received(rx.recv_msg::<ActivationMessage>().await, "upstream") else {
                return;
            };
            let work = match m {
                ActivationMessage::Begin(ctx) => Work::Begin(ctx),
                m @ (ActivationMessage::BeginGeneration(_) | ActivationMessage::Step(_)) => {
                    Work::Activation(m)
                }
                ActivationMessage::Batch(b) => Work::Batch(b),
                ActivationMessage::Links {
                    request_id,
                    links,
                    timings,
                } => Work::Links {
                    request_id,
                    links: links.into_iter().map(|l| l.into_vec()).collect(),
                    timings,
                    signer,
                },
                ActivationMessage::Failed { request_id, error } => {
                    Work::Failed { request_id, error }
                }
            };
            if !self.gate.submit(epoch, [work]) {
                tracing::info!("upstream channel of a torn-down pipeline; closing it");
                return;
            }
        }
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
            let _ = host.send_msg(&StageReply::DownstreamLost(reason)).await;
        }
    }

    /// Sends compute output to the current sink, forever.
    pub async fn write_outputs(self: Arc<Self>, mut rx: mpsc::Receiver<Output>) {
        while let Some(o) = rx.recv().await {
            let bytes = match o {
                Output::Activation(m) => proto::cbor::to_vec(&m),
                Output::Result(m) => proto::cbor::to_vec(&StageReply::Result(m)),
                Output::Feedback(m) => {
                    let fb = self.feedback.lock().await.clone();
                    match fb {
                        Some(tx) => {
                            if let Err(e) = tx.send_msg(&m).await {
                                tracing::warn!(error = %e, "feedback channel to the entry stage failed");
                                *self.feedback.lock().await = None;
                            }
                        }
                        None => tracing::warn!("no feedback channel; dropping sampled tokens"),
                    }
                    continue;
                }
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
            let r = tx.send(bytes).await;
            if let Err(e) = r {
                self.downstream_lost(id, format!("sending downstream failed: {e}"))
                    .await;
            }
        }
    }
}

/// Sends every new signed HPKE key set to the host on `tx`, until the host
/// channel fails or the task is aborted.
fn push_key_sets(
    mut sets: tokio::sync::watch::Receiver<Vec<u8>>,
    tx: SharedSender,
) -> tokio::task::JoinHandle<()> {
    sets.mark_unchanged();
    tokio::spawn(async move {
        while sets.changed().await.is_ok() {
            let set = serde_bytes::ByteBuf::from(sets.borrow_and_update().clone());
            if tx.send_msg(&StageReply::KeySet(set)).await.is_err() {
                break;
            }
        }
    })
}

/// A channel's next message, or `None` once the `channel` (e.g. "upstream")
/// was closed or failed, which is logged.
fn received<T>(r: Result<Option<T>, proto::channel::ChannelError>, channel: &str) -> Option<T> {
    match r {
        Ok(m @ Some(_)) => m,
        Ok(None) => {
            tracing::info!(channel, "the peer closed the channel");
            None
        }
        Err(e) => {
            tracing::warn!(channel, error = %e, "channel error");
            None
        }
    }
}

/// Armed while a host session runs: dropped armed (the session unwound from
/// a panic), it tears the pipeline down and then releases the stage's
/// ownership, if the session held it, so that a host can configure the stage
/// again. A session that ends normally disarms it and does the same itself.
struct OwnerGuard {
    server: Option<Arc<StageServer>>,
    session: u64,
}

impl Drop for OwnerGuard {
    fn drop(&mut self) {
        let Some(server) = self.server.take() else {
            return;
        };
        let session = self.session;
        if *server.owner.lock().unwrap_or_else(|e| e.into_inner()) != Some(session) {
            return;
        }
        tracing::error!("the host session that configured this stage panicked; tearing down");
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Ownership is released only after the teardown, so a new
        // configuration cannot race the old pipeline's channels.
        rt.spawn(async move {
            server.tear_down().await;
            let mut owner = server.owner.lock().unwrap_or_else(|e| e.into_inner());
            if *owner == Some(session) {
                *owner = None;
            }
        });
    }
}
