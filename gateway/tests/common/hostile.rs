//! Playing the host against the real stage binaries (issue 29): host
//! channels the test opens itself, pipelines configured the way the gateway
//! configures them (or any other way a hostile host likes), clients that
//! seal with the client crate's own code, and the one invariant every
//! hostile-host test checks: no answer that a client's verifier
//! (`client::sealed`) accepts differs from what the model computes for that
//! client's own request.

use super::{
    cosine, model_dir, remote_stage_policies_for, smollm_dir, temp_dir, vectors, StageProc,
    StageSpec,
};
use client::sealed::{Attested, Sealed};
use proto::attestation::Evidence;
use proto::bundle::{EvidenceBundle, StageEvidence};
use proto::channel::{ChannelLimits, LocalIdentity, PeerInfo};
use proto::frames::{HostMessage, ResultMessage, SealedRequest, StageReply};
use proto::io::channel::ChannelSender;
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use proto::receipt::Sealing;
use proto::sealing::Aead;
use rand::RngCore;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Longest wait for an answer or a configuration the test expects.
pub const ANSWER: Duration = Duration::from_secs(60);
/// How long a stage may take to close a host channel it refuses.
pub const CLOSE: Duration = Duration::from_secs(5);
/// Cosine above which two embeddings count as the same text's.
pub const SAME: f64 = 0.9999;

/// A request id larger than every one handed out before (in this test
/// binary), so that ids on any host channel increase unless a test
/// chooses otherwise.
pub fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Hostile-host tests run one at a time: they time requests against busy
/// compute threads, and the machine has few cores.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE.lock().await
}

/// What a host channel yielded.
#[derive(Debug)]
pub enum Next {
    /// A reply.
    Reply(StageReply),
    /// The stage closed the channel (or it failed).
    Closed,
    /// Nothing within the wait.
    Quiet,
}

/// What a stage answers to a `Configure` it accepts.
pub struct Configured {
    /// Its boot evidence.
    pub boot: Evidence,
    /// The entry stage's signed HPKE key set.
    pub key_set: Option<Vec<u8>>,
}

/// One host channel to a stage, opened by the test (as any local process
/// can). A task reads the stage's replies into a queue, so waiting on them
/// with a deadline never cuts a record in half.
pub struct Host {
    tx: ChannelSender,
    replies: mpsc::UnboundedReceiver<StageReply>,
    reader: tokio::task::JoinHandle<()>,
    /// The stage's attested identity (its claims).
    pub peer: PeerInfo,
    closed: bool,
}

impl Host {
    /// Opens a host channel to the stage at `endpoint`.
    pub async fn open(endpoint: &str) -> Host {
        let ep: proto::io::transport::Endpoint = endpoint.parse().unwrap();
        let stream = proto::io::transport::connect(&ep).await.unwrap();
        let (tx, mut rx, peer) = proto::io::channel::initiate(
            stream,
            &LocalIdentity::host(),
            ChannelLimits::default(),
            &|_: &PeerInfo| Ok(()),
        )
        .await
        .unwrap();
        let (queue, replies) = mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Ok(Some(m)) = rx.recv_msg::<StageReply>().await {
                if queue.send(m).is_err() {
                    break;
                }
            }
        });
        Host {
            tx,
            replies,
            reader,
            peer,
            closed: false,
        }
    }

    /// Sends `m`; `false` if the channel is gone.
    pub async fn send(&mut self, m: &HostMessage) -> bool {
        self.tx.send_msg(m).await.is_ok()
    }

    /// The next reply within `wait`.
    pub async fn next(&mut self, wait: Duration) -> Next {
        if self.closed {
            return Next::Closed;
        }
        match tokio::time::timeout(wait, self.replies.recv()).await {
            Ok(Some(m)) => Next::Reply(m),
            Ok(None) => {
                self.closed = true;
                Next::Closed
            }
            Err(_) => Next::Quiet,
        }
    }

    /// Whether the stage has closed the channel (replies so far are dropped).
    pub fn poll_closed(&mut self) -> bool {
        loop {
            match self.replies.try_recv() {
                Ok(_) => continue,
                Err(mpsc::error::TryRecvError::Empty) => return self.closed,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.closed = true;
                    return true;
                }
            }
        }
    }

    /// Whether the stage closes the channel within `wait` (replies are dropped).
    pub async fn closed_within(&mut self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            if let Next::Closed = self.next(left).await {
                return true;
            }
        }
        self.poll_closed()
    }

    /// Sends `Configure` and waits for the stage's verdict.
    pub async fn configure(
        &mut self,
        next: Option<String>,
        feedback: Option<String>,
    ) -> Result<Configured, String> {
        let m = HostMessage::Configure {
            next,
            feedback,
            key_ids: None,
        };
        if !self.send(&m).await {
            return Err("the channel closed before Configure".into());
        }
        loop {
            match self.next(ANSWER).await {
                Next::Reply(StageReply::Configured {
                    boot_evidence,
                    key_set,
                    ..
                }) => {
                    return Ok(Configured {
                        boot: boot_evidence,
                        key_set: key_set.map(|k| k.into_vec()),
                    })
                }
                Next::Reply(StageReply::ConfigureFailed(why)) => return Err(why),
                Next::Reply(_) => continue,
                Next::Closed => return Err("the stage closed the channel on Configure".into()),
                Next::Quiet => return Err("no answer to Configure".into()),
            }
        }
    }

    /// Fresh evidence bound to `nonce`.
    pub async fn attest(&mut self, nonce: &[u8]) -> Evidence {
        let m = HostMessage::Attest {
            nonce: nonce.to_vec(),
        };
        assert!(self.send(&m).await, "host channel closed");
        loop {
            match self.next(ANSWER).await {
                Next::Reply(StageReply::Evidence { nonce: n, evidence }) if n == nonce => {
                    return evidence
                }
                Next::Reply(_) => continue,
                other => panic!("no evidence from the stage: {other:?}"),
            }
        }
    }

    /// Closes the channel (as a host that goes away).
    pub async fn close(mut self) {
        self.tx.shutdown().await;
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Opens a host channel to `endpoint` and configures the stage; retries
/// for a while when it is still owned by a host channel that was just
/// closed (the stage notices that asynchronously). Returns the channel and
/// the stage's verdict.
pub async fn configure_at(
    endpoint: &str,
    next: Option<String>,
    feedback: Option<String>,
) -> (Host, Result<Configured, String>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut h = Host::open(endpoint).await;
        match h.configure(next.clone(), feedback.clone()).await {
            Err(why) if why.contains("another host channel") && Instant::now() < deadline => {
                h.close().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            r => return (h, r),
        }
    }
}

/// Stage processes of one model, started by the test, and the policy a
/// client verifies their evidence with (their measurement pinned).
pub struct Rig {
    /// Test folder (stage logs).
    pub dir: PathBuf,
    model: PathBuf,
    generation: bool,
    layers: Vec<[u32; 2]>,
    stage_policy: PathBuf,
    policy: Policy,
    /// The stages, entry stage first.
    pub stages: Vec<StageProc>,
}

impl Rig {
    /// MiniLM embeddings stages on `layers`.
    pub fn embeddings(tag: &str, layers: &[[u32; 2]]) -> Rig {
        Self::start(tag, model_dir(), false, layers)
    }

    /// SmolLM2 generation stages on `layers` (30 layers in all).
    pub fn generation(tag: &str, layers: &[[u32; 2]]) -> Rig {
        Self::start(tag, smollm_dir(), true, layers)
    }

    fn start(tag: &str, model: PathBuf, generation: bool, layers: &[[u32; 2]]) -> Rig {
        let dir = temp_dir(tag);
        let (stage_policy, text) = remote_stage_policies_for(&model, &dir, layers);
        let mut rig = Rig {
            dir,
            model,
            generation,
            layers: layers.to_vec(),
            stage_policy,
            policy: Policy::from_toml(&text).unwrap(),
            stages: Vec::new(),
        };
        rig.stages = (0..layers.len() as u32)
            .map(|i| rig.extra_stage(i, &format!("stage{i}")))
            .collect();
        rig
    }

    /// Starts another process for stage `index` of the same build, model
    /// and policy (what a host can always do), logging to `dir/{log}.log`.
    pub fn extra_stage(&self, index: u32, log: &str) -> StageProc {
        self.extra_stage_with(index, log, &[])
    }

    /// [`Self::extra_stage`] with extra environment (fault switches).
    pub fn extra_stage_with(&self, index: u32, log: &str, env: &[(&str, &str)]) -> StageProc {
        let spec = StageSpec {
            model: &self.model,
            index,
            n: self.layers.len() as u32,
            layers: self.layers[index as usize],
            log,
            env,
        };
        StageProc::spawn(
            &spec,
            &self.stage_policy,
            &self.dir,
            "tcp://127.0.0.1:0",
            &[],
        )
    }

    /// Stage `i`'s endpoint.
    pub fn endpoint(&self, i: usize) -> String {
        self.stages[i].endpoint.clone()
    }

    /// Configures the stages as the gateway does (exit stage first; a
    /// generation exit stage of several stages gets the entry stage as
    /// feedback), fetches fresh evidence of every stage and verifies it
    /// with the client crate against the pinned policy.
    pub async fn pipeline(&self) -> Pipeline {
        self.pipeline_fed_by(None).await
    }

    /// [`Self::pipeline`], but a generation exit stage sends its sampled
    /// tokens to `feedback` (a host's choice) instead of to the entry stage.
    pub async fn pipeline_fed_by(&self, feedback: Option<String>) -> Pipeline {
        let n = self.stages.len();
        let mut hosts = Vec::new();
        let mut boots = Vec::new();
        let mut key_set = None;
        for i in (0..n).rev() {
            let next = (i + 1 < n).then(|| self.endpoint(i + 1));
            let feedback = (self.generation && n > 1 && i + 1 == n)
                .then(|| feedback.clone().unwrap_or_else(|| self.endpoint(0)));
            let (h, r) = configure_at(&self.endpoint(i), next, feedback).await;
            let c = r.unwrap_or_else(|why| panic!("stage {i} refused its configuration: {why}"));
            if i == 0 {
                key_set = c.key_set;
            }
            hosts.push(h);
            boots.push(c.boot);
        }
        hosts.reverse();
        boots.reverse();
        let mut nonce = vec![0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let mut stages = Vec::new();
        for (i, (h, boot)) in hosts.iter_mut().zip(boots).enumerate() {
            stages.push(StageEvidence {
                index: i as u32,
                claims: h.peer.claims.clone().expect("stages make claims"),
                boot_evidence: boot,
                evidence: h.attest(&nonce).await,
                key_set: (i == 0)
                    .then(|| key_set.clone().map(serde_bytes::ByteBuf::from))
                    .flatten(),
            });
        }
        let manifest = LoadedManifest::load(&self.model).unwrap();
        let bundle = EvidenceBundle {
            nonce: nonce.clone(),
            manifest: manifest.bytes,
            transparency: None,
            stages,
        };
        let attested = Attested::verify(bundle, &self.policy, &nonce)
            .unwrap_or_else(|e| panic!("the stages' evidence does not verify: {e:?}"));
        Pipeline {
            hosts,
            attested,
            model_id: manifest.manifest.model_id,
            generation: self.generation,
        }
    }
}

/// What the model computes for a client's own request, from a clean run.
#[derive(Clone, Debug)]
pub enum Want {
    /// The embedding of its one input.
    Vector(Vec<f32>),
    /// The greedy completion text.
    Text(String),
}

/// A client: its sealed request and what the model computes for it.
pub struct Client {
    /// What the test calls it (in failure messages).
    pub name: String,
    /// Sealed with `client::sealed`, to the verified entry key.
    pub sealed: Sealed,
    /// The right answer.
    pub want: Want,
}

/// A configured pipeline as its host holds it.
pub struct Pipeline {
    /// Host channels, entry stage first.
    pub hosts: Vec<Host>,
    /// The evidence clients verified (and check receipts against).
    pub attested: Attested,
    model_id: String,
    generation: bool,
}

impl Pipeline {
    /// The API path requests go to.
    pub fn endpoint(&self) -> &'static str {
        if self.generation {
            "/v1/completions"
        } else {
            "/v1/embeddings"
        }
    }

    /// A request body for `input` (embeddings: text or texts; generation:
    /// a prompt, greedy, 8 tokens).
    pub fn body(&self, input: Value) -> Value {
        if self.generation {
            json!({"model": self.model_id, "prompt": input, "max_tokens": 8, "temperature": 0})
        } else {
            json!({"model": self.model_id, "input": input})
        }
    }

    /// `body` sealed by a client to the verified entry key, with a fresh
    /// receipt nonce.
    pub fn seal(&self, body: &Value) -> Sealed {
        let mut nonce = vec![0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut nonce);
        let bytes = serde_json::to_vec(body).unwrap();
        Sealed::new(
            &self.attested.verified,
            Aead::Aes128Gcm,
            self.endpoint(),
            &bytes,
            &nonce,
        )
        .unwrap()
    }

    /// A client called `name` sending `input` whose right answer is `want`.
    pub fn client(&self, name: &str, input: &str, want: Want) -> Client {
        Client {
            name: name.into(),
            sealed: self.seal(&self.body(json!(input))),
            want,
        }
    }

    /// Sends `sealed` into the entry stage under `request_id`, labelled
    /// `sealing`; `false` if the entry's host channel is gone.
    pub async fn submit(&mut self, sealed: &Sealed, request_id: u64, sealing: Sealing) -> bool {
        let m = HostMessage::Request(request(sealed, request_id, sealing));
        self.hosts[0].send(&m).await
    }

    /// The result for request `id` on the exit stage's host channel (others
    /// are dropped), within `max`.
    pub async fn result_for(&mut self, id: u64, max: Duration) -> Option<ResultMessage> {
        let deadline = Instant::now() + max;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let r = self.collect(1, left).await;
            match r.into_iter().next() {
                Some(m) if request_id_of(&m) == id => return Some(m),
                Some(_) => continue,
                None => return None,
            }
        }
        None
    }

    /// Results on the exit stage's host channel until `want` have come,
    /// the exit channel closed, `max` passed, or a second after the entry
    /// stage closed its channel.
    pub async fn collect(&mut self, want: usize, max: Duration) -> Vec<ResultMessage> {
        let deadline = Instant::now() + max;
        let mut grace: Option<Instant> = None;
        let mut out = Vec::new();
        while out.len() < want {
            // (One stage: the entry is the exit, whose closing ends the loop.)
            if grace.is_none() && self.hosts.len() > 1 && self.hosts[0].poll_closed() {
                grace = Some(Instant::now() + Duration::from_secs(1));
            }
            let until = grace.map_or(deadline, |g| g.min(deadline));
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            let exit = self.hosts.last_mut().unwrap();
            match exit.next(left.min(Duration::from_millis(100))).await {
                Next::Reply(StageReply::Result(m)) => {
                    if matches!(
                        m,
                        ResultMessage::Response { .. } | ResultMessage::Failed { .. }
                    ) {
                        out.push(m);
                    }
                }
                Next::Reply(_) | Next::Quiet => {}
                Next::Closed => break,
            }
        }
        out
    }

    /// Every message of request `id`'s stream on the exit stage's host
    /// channel (start, data, end; or its failure) until it ends or `max`
    /// passes; other requests' messages are dropped.
    pub async fn stream_for(&mut self, id: u64, max: Duration) -> Vec<ResultMessage> {
        let deadline = Instant::now() + max;
        let mut out = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let exit = self.hosts.last_mut().unwrap();
            match exit.next(left.min(Duration::from_millis(100))).await {
                Next::Reply(StageReply::Result(m)) if request_id_of(&m) == id => {
                    let end = matches!(
                        m,
                        ResultMessage::StreamEnd { .. }
                            | ResultMessage::Failed { .. }
                            | ResultMessage::Response { .. }
                    );
                    out.push(m);
                    if end {
                        break;
                    }
                }
                Next::Reply(_) | Next::Quiet => {}
                Next::Closed => break,
            }
        }
        out
    }

    /// The answer to `sealed` sent under a fresh id, as its client accepts
    /// it (panics if none comes or the client's verifier refuses it).
    pub async fn answer(&mut self, sealed: &Sealed) -> Value {
        let id = fresh_id();
        assert!(
            self.submit(sealed, id, Sealing::Enclave).await,
            "entry closed"
        );
        let r = self.result_for(id, ANSWER).await;
        let r = r.unwrap_or_else(|| panic!("no answer to request {id} from the pipeline"));
        accept(&self.attested, sealed, &r)
            .unwrap_or_else(|why| panic!("the answer to request {id} was refused: {why}"))
    }

    /// Embeddings of `texts` from one clean request.
    pub async fn clean_vectors(&mut self, texts: &[&str]) -> Vec<Vec<f32>> {
        let s = self.seal(&self.body(json!(texts)));
        vectors(&self.answer(&s).await)
    }

    /// The greedy completion of `prompt` from a clean request.
    pub async fn clean_text(&mut self, prompt: &str) -> String {
        let s = self.seal(&self.body(json!(prompt)));
        completion_text(&self.answer(&s).await)
    }

    /// A clean request from a new client for `input` gets the right answer.
    pub async fn still_serves(&mut self, input: &str, want: &Want) {
        let c = self.client("new client", input, want.clone());
        let got = self.answer(&c.sealed).await;
        if let Err(why) = matches_want(&got, &c.want, &[]) {
            panic!("the pipeline no longer computes the right answer: {why}");
        }
    }

    /// Whether the entry stage closes its host channel within `wait`.
    pub async fn entry_closed(&mut self, wait: Duration) -> bool {
        self.hosts[0].closed_within(wait).await
    }

    /// Closes every host channel (the host goes away).
    pub async fn close(self) {
        for h in self.hosts {
            h.close().await;
        }
    }

    /// The invariant: every result is offered to every client (the host
    /// may hand any answer to anyone); each one a client's verifier
    /// accepts must be that client's right answer. Returns, per client,
    /// how many answers it accepted.
    pub fn check_invariant(&self, results: &[ResultMessage], clients: &[&Client]) -> Vec<usize> {
        let mut accepted = vec![0; clients.len()];
        for r in results {
            for (i, c) in clients.iter().enumerate() {
                let got = match accept(&self.attested, &c.sealed, r) {
                    Ok(got) => got,
                    Err(why) => {
                        if std::env::var_os("HOSTILE_DEBUG").is_some() {
                            eprintln!(
                                "{} refuses the result for {}: {why}",
                                c.name,
                                request_id_of(r)
                            );
                        }
                        continue;
                    }
                };
                accepted[i] += 1;
                // The other clients' answers, where they differ from this one's.
                let others: Vec<&Want> = clients
                    .iter()
                    .map(|o| &o.want)
                    .filter(|o| !same_want(o, &c.want))
                    .collect();
                if let Err(why) = matches_want(&got, &c.want, &others) {
                    panic!(
                        "issue 29: the {}'s verifier (client::sealed) accepted an answer \
                         (to request id {}) that is not the model's answer to its own request: {why}",
                        c.name,
                        request_id_of(r)
                    );
                }
            }
        }
        accepted
    }
}

/// Whether two right answers are the same (same text, or same vector).
fn same_want(a: &Want, b: &Want) -> bool {
    match (a, b) {
        (Want::Vector(a), Want::Vector(b)) => cosine(a, b) > SAME,
        (Want::Text(a), Want::Text(b)) => a == b,
        _ => false,
    }
}

/// The sealed request a host sends for `sealed`.
pub fn request(sealed: &Sealed, request_id: u64, sealing: Sealing) -> SealedRequest {
    sealed.stage_request(request_id, sealing)
}

/// What the client makes of result `r`: its opened JSON when it opens with
/// the client's key and its receipt passes every check of `client::sealed`
/// (request, response, nonce, sealing, endpoint, every stage's link
/// against the verified evidence); otherwise why not.
pub fn accept(attested: &Attested, sealed: &Sealed, r: &ResultMessage) -> Result<Value, String> {
    let ResultMessage::Response { status, body, .. } = r else {
        return Err(format!("not a response: {r:?}"));
    };
    let plain = sealed
        .accept(attested, *status, body)
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&plain).map_err(|e| e.to_string())
}

/// The text of a completion's only choice.
pub fn completion_text(v: &Value) -> String {
    let choices = v["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 1, "{v}");
    choices[0]["text"].as_str().expect("text").to_string()
}

/// Whether `got` is the answer `want` (and, for a wrong one, which of the
/// `others` it looks like).
pub fn matches_want(got: &Value, want: &Want, others: &[&Want]) -> Result<(), String> {
    match want {
        Want::Vector(w) => {
            let vs = vectors(got);
            let [v] = vs.as_slice() else {
                return Err(format!("{} vectors for one input", vs.len()));
            };
            let own = cosine(v, w);
            let to_others: Vec<f64> = others
                .iter()
                .filter_map(|o| match o {
                    Want::Vector(o) => Some(cosine(v, o)),
                    Want::Text(_) => None,
                })
                .collect();
            if own > SAME && to_others.iter().all(|c| *c < SAME) {
                Ok(())
            } else {
                Err(format!(
                    "cosine {own:.5} to its own text's vector, {to_others:.5?} to the other clients' texts'"
                ))
            }
        }
        Want::Text(w) => {
            let t = completion_text(got);
            if &t == w {
                Ok(())
            } else {
                Err(format!(
                    "text {t:?}, the model's text for its prompt is {w:?}"
                ))
            }
        }
    }
}

/// `n` long, distinct inputs: a request that keeps an embeddings compute
/// thread busy for a while, so that requests sent right after it queue up.
pub fn busy_inputs(n: usize) -> Value {
    let words = "ledger harbor violet quantum marble cactus orbit lantern velvet canyon";
    json!((0..n)
        .map(|i| format!("{i} {}", words.repeat(12)))
        .collect::<Vec<_>>())
}

/// The request id a result is for.
pub fn request_id_of(r: &ResultMessage) -> u64 {
    match r {
        ResultMessage::Response { request_id, .. }
        | ResultMessage::Failed { request_id, .. }
        | ResultMessage::StreamStart { request_id, .. }
        | ResultMessage::StreamData { request_id, .. }
        | ResultMessage::StreamEnd { request_id, .. } => *request_id,
    }
}
