//! A hostile host driving a real entry stage (issue 29): the fuzzer's bytes
//! are a sequence of host moves on the stage's host channel, and the one
//! invariant of the hostile-host suite is checked on whatever comes back:
//! **no answer that a client's verifier accepts differs from the model's
//! answer to that client's own request.**
//!
//! The stage runs in this process (so the fuzzer sees its coverage): the
//! all-MiniLM-L6-v2 embedding model as one stage (entry and exit), mock
//! attestation, served on a loopback port by the stage crate's own
//! `StageServer`, loaded once per process. Each input opens a new host
//! channel, configures the stage, verifies its evidence with the client
//! crate as a client would, seals two victims' requests and an attacker's
//! with `client::sealed`, and then plays the moves:
//!
//! | byte `% 8` | move (the next byte is its argument `a`) |
//! | --- | --- |
//! | 0, 1 | submit victim `a & 1` under id `base + a % 16` |
//! | 2 | submit the attacker under id `base + a % 16` |
//! | 3 | submit victim `a & 1` labelled `plain` or `gateway` (`a & 2`; it does not open) |
//! | 4 | cancel id `base + a % 16` |
//! | 5 | a second `Configure` on the same channel |
//! | 6 | ask for evidence |
//! | 7 | wait `a % 8` ms (lets computations interleave with the moves) |
//!
//! Then it collects results until the stage is quiet or closes the channel,
//! and offers every result to every client's verifier (the host may hand
//! any answer to anyone). A result a verifier accepts must be that
//! client's own embedding (cosine ≥ 0.9999 to a clean run's); anything else
//! panics; so does a sealed answer or error whose chunks are not whole
//! padding buckets (issue 47: their sizes would tell the host about the
//! content). Without the model files (`scripts/setup.sh`) the target does
//! nothing.

use client::sealed::{Attested, Sealed};
use enclave_stage::keys::StageKeys;
use enclave_stage::model::{ComputeLimits, ComputeSetup};
use enclave_stage::provider::{self, AttestationKind};
use enclave_stage::role::StageSpec;
use enclave_stage::server::{StageServer, StageSetup};
use proto::bundle::{EvidenceBundle, StageEvidence};
use proto::channel::{ChannelLimits, LocalIdentity, PeerInfo};
use proto::digest::Sha256Digest;
use proto::frames::{HostMessage, ResultMessage, StageReply};
use proto::io::channel::ChannelSender;
use proto::io::transport::{Endpoint, Listener};
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use proto::receipt::Sealing;
use proto::sealing::Aead;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::mpsc;

/// The stage's own policy (neighbours: none; part of its mock measurement).
const STAGE_POLICY: &str =
    "allow_mock = true\ntrust_local_build = true\n[[stages]]\nindex = 0\nlayers = [0, 6]\n";
/// The victims' and the attacker's inputs.
const VICTIMS: [&str; 2] = [
    "The patient's biopsy came back benign.",
    "Transfer the remaining balance to the escrow account.",
];
const ATTACKER: &str = "Ignore that; the host wrote this sentence.";
/// Most moves taken from one input.
const MAX_MOVES: usize = 24;
/// Cosine above which two embeddings count as the same text's.
const SAME: f64 = 0.9999;
/// How long the stage may stay silent before the input's results are in.
const QUIET: Duration = Duration::from_millis(150);
/// Longest wait for anything the harness itself needs (configuration, evidence).
const ANSWER: Duration = Duration::from_secs(30);

/// The stage, started once per process, and the clean answers.
struct Rig {
    rt: tokio::runtime::Runtime,
    endpoint: String,
    policy: Policy,
    model_dir: PathBuf,
    /// The clean embeddings of VICTIMS[0], VICTIMS[1], ATTACKER.
    wants: Vec<Vec<f32>>,
}

static RIG: OnceLock<Option<Rig>> = OnceLock::new();
/// Request ids increase from input to input, as a gateway's do.
static NEXT_BASE: AtomicU64 = AtomicU64::new(1 << 20);

/// Runs one input.
pub fn run(data: &[u8]) {
    accepted(data);
}

/// Runs one input; returns how many answers the clients' verifiers
/// accepted (`None` without the model files), for the replay test to see
/// that the seeds reach the stage.
pub fn accepted(data: &[u8]) -> Option<usize> {
    let rig = RIG.get_or_init(start).as_ref()?;
    let base = NEXT_BASE.fetch_add(64, Ordering::Relaxed);
    Some(rig.rt.block_on(play(rig, data, base)))
}

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/all-minilm-l6-v2")
}

/// Loads the model and serves it as one stage on a loopback port, then
/// computes the clean answers through it.
fn start() -> Option<Rig> {
    let model_dir = model_dir();
    if !model_dir.join("manifest.json").exists() {
        eprintln!(
            "host_channel: no {} (scripts/setup.sh); skipped",
            model_dir.display()
        );
        return None;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let spec = StageSpec {
        stage_index: 0,
        num_stages: 1,
        layers: 0..6,
    };
    let mut loaded =
        enclave_stage::serving::load(&model_dir, &spec, None).expect("the model loads");
    let (manifest, _) = loaded.manifest_and_claims();
    let manifest_digest = manifest.digest;
    let selected = provider::select(
        AttestationKind::Mock,
        0,
        &Sha256Digest::of(b"fuzz host_channel stage"),
        &manifest_digest,
        &Sha256Digest::of(STAGE_POLICY.as_bytes()),
    )
    .expect("mock provider");
    let (_, claims) = loaded.manifest_and_claims();
    let keys = Arc::new(
        StageKeys::generate(claims, selected.provider.as_ref(), None, 1..=127).expect("keys"),
    );
    let policy = Policy::from_toml(&format!(
        "allow_mock = true\nmanifest_sha256 = \"{}\"\n[[stages]]\nindex = 0\nlayers = [0, 6]\nmeasurements = [\"{}\"]\n",
        manifest_digest.hex(),
        selected.measurement.pinned_form()
    ))
    .expect("client policy");
    let endpoint = rt.block_on(async {
        let (work_tx, work_rx) = std::sync::mpsc::channel();
        let (out_tx, out_rx) = mpsc::channel(8);
        let model = loaded
            .start(ComputeSetup {
                keys: keys.clone(),
                out: out_tx.clone(),
                work: work_rx,
                limits: ComputeLimits {
                    token_budget: 4096,
                    max_rows: 64,
                    memory_budget: 192 << 20,
                    kv_cache_tokens: 1024,
                    max_step_seqs: 8,
                    max_waiting: 8,
                    max_inputs: 16,
                },
            })
            .expect("compute thread");
        let server = StageServer::new(
            StageSetup {
                model,
                keys,
                provider: selected.provider,
                policy: Policy::from_toml(STAGE_POLICY).expect("stage policy"),
                local_measurement: selected.measurement,
                clock: std::sync::Arc::new(enclave_stage::clock::ClockGuard::new(
                    enclave_stage::clock::PTP_DEVICE,
                )),
            },
            work_tx,
            out_tx,
        );
        let listener = Listener::bind(&Endpoint::Tcp("127.0.0.1:0".into()))
            .await
            .expect("loopback port");
        let endpoint = listener.local_endpoint().expect("its address").to_string();
        tokio::spawn(server.clone().write_outputs(out_rx));
        tokio::spawn(server.serve(listener));
        endpoint
    });
    let mut rig = Rig {
        rt,
        endpoint,
        policy,
        model_dir,
        wants: Vec::new(),
    };
    rig.wants = rig.rt.block_on(clean_answers(&rig));
    Some(rig)
}

/// The embeddings of the victims' and the attacker's inputs, from one clean
/// request each.
async fn clean_answers(rig: &Rig) -> Vec<Vec<f32>> {
    let mut host = Host::configured(rig).await.expect("a clean configuration");
    let mut out = Vec::new();
    for (i, text) in VICTIMS.iter().chain([&ATTACKER]).enumerate() {
        let sealed = host.seal(text);
        let id = NEXT_BASE.fetch_add(1, Ordering::Relaxed);
        assert!(host.send(&request(&sealed, id, Sealing::Enclave)).await);
        let results = host.collect(Duration::from_secs(30), 1).await;
        let got = results
            .iter()
            .find_map(|r| accept(&host.attested, &sealed, r).ok())
            .unwrap_or_else(|| panic!("no clean answer for input {i}"));
        out.push(embedding(&got).expect("one embedding"));
    }
    host.tx.shutdown().await;
    out
}

/// One host channel, configured, with the evidence a client verified.
struct Host {
    tx: ChannelSender,
    replies: mpsc::UnboundedReceiver<StageReply>,
    reader: tokio::task::JoinHandle<()>,
    attested: Attested,
}

impl Host {
    /// Opens a host channel, configures the stage as the only stage, and
    /// verifies its evidence as a client would. Waits while the stage still
    /// belongs to the previous input's channel (it notices a close
    /// asynchronously).
    async fn configured(rig: &Rig) -> Option<Host> {
        for _ in 0..200 {
            let ep: Endpoint = rig.endpoint.parse().ok()?;
            let stream = proto::io::transport::connect(&ep).await.ok()?;
            let (mut tx, mut rx, peer): (_, _, PeerInfo) = proto::io::channel::initiate(
                stream,
                &LocalIdentity::host(),
                ChannelLimits::default(),
                &|_: &PeerInfo| Ok(()),
            )
            .await
            .ok()?;
            let configure = HostMessage::Configure {
                next: None,
                feedback: None,
                key_ids: None,
            };
            tx.send_msg(&configure).await.ok()?;
            let (boot, key_set) = loop {
                match tokio::time::timeout(ANSWER, rx.recv_msg::<StageReply>()).await {
                    Ok(Ok(Some(StageReply::Configured {
                        boot_evidence,
                        key_set,
                        ..
                    }))) => break (Some(boot_evidence), key_set),
                    Ok(Ok(Some(StageReply::ConfigureFailed(_)))) => break (None, None),
                    Ok(Ok(Some(_))) => continue,
                    _ => return None,
                }
            };
            let Some(boot) = boot else {
                tx.shutdown().await;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let nonce = NEXT_BASE
                .fetch_add(1, Ordering::Relaxed)
                .to_be_bytes()
                .to_vec();
            let attest = HostMessage::Attest {
                nonce: nonce.clone(),
            };
            tx.send_msg(&attest).await.ok()?;
            let evidence = loop {
                match tokio::time::timeout(ANSWER, rx.recv_msg::<StageReply>()).await {
                    Ok(Ok(Some(StageReply::Evidence { nonce: n, evidence }))) if n == nonce => {
                        break evidence
                    }
                    Ok(Ok(Some(_))) => continue,
                    _ => return None,
                }
            };
            let bundle = EvidenceBundle {
                nonce: nonce.clone(),
                manifest: LoadedManifest::load(&rig.model_dir).ok()?.bytes,
                transparency: None,
                stages: vec![StageEvidence {
                    index: 0,
                    claims: peer.claims.clone()?,
                    boot_evidence: boot,
                    evidence,
                    key_set,
                }],
            };
            let attested = Attested::verify(bundle, &rig.policy, &nonce)
                .expect("the stage's own evidence verifies");
            let (queue, replies) = mpsc::unbounded_channel();
            let reader = tokio::spawn(async move {
                while let Ok(Some(m)) = rx.recv_msg::<StageReply>().await {
                    if queue.send(m).is_err() {
                        break;
                    }
                }
            });
            let host = Host {
                tx,
                replies,
                reader,
                attested,
            };
            return Some(host);
        }
        None
    }

    /// `text` sealed by a client to the verified entry key.
    fn seal(&self, text: &str) -> Sealed {
        let body =
            serde_json::to_vec(&json!({"model": "all-MiniLM-L6-v2", "input": text})).expect("json");
        let nonce = NEXT_BASE.fetch_add(1, Ordering::Relaxed).to_be_bytes();
        Sealed::new(
            &self.attested.verified,
            Aead::Aes128Gcm,
            "/v1/embeddings",
            &body,
            &nonce,
        )
        .expect("sealing")
    }

    async fn send(&mut self, m: &HostMessage) -> bool {
        self.tx.send_msg(m).await.is_ok()
    }

    /// Results until `want` came, the stage was quiet for `quiet`, or it
    /// closed the channel.
    async fn collect(&mut self, quiet: Duration, want: usize) -> Vec<ResultMessage> {
        let mut out = Vec::new();
        while out.len() < want {
            match tokio::time::timeout(quiet, self.replies.recv()).await {
                Ok(Some(StageReply::Result(
                    m @ (ResultMessage::Response { .. } | ResultMessage::Failed { .. }),
                ))) => out.push(m),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        out
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// The sealed request a host sends for `sealed`.
fn request(sealed: &Sealed, request_id: u64, sealing: Sealing) -> HostMessage {
    HostMessage::Request(sealed.stage_request(request_id, sealing))
}

/// What the client makes of `r` (`Sealed::accept`), as JSON.
fn accept(attested: &Attested, sealed: &Sealed, r: &ResultMessage) -> Result<Value, String> {
    let ResultMessage::Response { status, body, .. } = r else {
        return Err("not a response".into());
    };
    let plain = sealed
        .accept(attested, *status, body)
        .map_err(|e| e.to_string())?;
    serde_json::from_slice(&plain).map_err(|e| e.to_string())
}

/// Whether every chunk of a sealed response body (after its `nonce`
/// bytes) carries a whole number of padding buckets.
fn chunks_are_bucketed(body: &[u8], nonce: usize) -> bool {
    let Some(mut rest) = body.get(nonce..) else {
        return false;
    };
    while !rest.is_empty() {
        let Some(len) = rest.get(..4) else {
            return false;
        };
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let padded = len.checked_sub(proto::sealing::TAG_LEN);
        if !padded.is_some_and(|p| p > 0 && p.is_multiple_of(proto::sealing::PAD_BUCKET)) {
            return false;
        }
        let Some(next) = rest.get(4 + len..) else {
            return false;
        };
        rest = next;
    }
    true
}

/// The one embedding of an embeddings answer.
fn embedding(v: &Value) -> Option<Vec<f32>> {
    let data = v["data"].as_array()?;
    if data.len() != 1 {
        return None;
    }
    data[0]["embedding"]
        .as_array()?
        .iter()
        .map(|x| x.as_f64().map(|f| f as f32))
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

/// Plays one input's moves and checks the invariant on every result;
/// returns how many answers were accepted.
async fn play(rig: &Rig, data: &[u8], base: u64) -> usize {
    let Some(mut host) = Host::configured(rig).await else {
        return 0;
    };
    let clients = [
        host.seal(VICTIMS[0]),
        host.seal(VICTIMS[1]),
        host.seal(ATTACKER),
    ];
    let mut results = Vec::new();
    for pair in data.chunks(2).take(MAX_MOVES) {
        let (op, a) = (pair[0] % 8, pair.get(1).copied().unwrap_or(0));
        let id = base + u64::from(a % 16);
        let sent = match op {
            0 | 1 => {
                host.send(&request(&clients[usize::from(a & 1)], id, Sealing::Enclave))
                    .await
            }
            2 => host.send(&request(&clients[2], id, Sealing::Enclave)).await,
            3 => {
                let label = if a & 2 == 0 {
                    Sealing::Plain
                } else {
                    Sealing::Gateway
                };
                host.send(&request(&clients[usize::from(a & 1)], id, label))
                    .await
            }
            4 => host.send(&HostMessage::Cancel { request_id: id }).await,
            5 => {
                let configure = HostMessage::Configure {
                    next: None,
                    feedback: None,
                    key_ids: None,
                };
                host.send(&configure).await
            }
            6 => host.send(&HostMessage::Attest { nonce: vec![a] }).await,
            _ => {
                tokio::time::sleep(Duration::from_millis(u64::from(a % 8))).await;
                true
            }
        };
        if !sent {
            break;
        }
    }
    results.extend(host.collect(QUIET, usize::MAX).await);
    // What the host sees of a sealed answer or error is its chunks' sizes
    // to their bucket only (issue 47).
    for r in &results {
        let sealed = match r {
            ResultMessage::Response { body, .. } => Some(body),
            ResultMessage::Failed { error, .. } => error.sealed_body.as_ref(),
            _ => None,
        };
        if let Some(body) = sealed {
            assert!(
                chunks_are_bucketed(body, Aead::Aes128Gcm.response_nonce_len()),
                "issue 47: a sealed body whose chunks are not whole buckets: {} bytes",
                body.len()
            );
        }
    }
    // The invariant: every result is offered to every client.
    let mut accepted = 0;
    for r in &results {
        for (c, want) in clients.iter().zip(&rig.wants) {
            let Ok(got) = accept(&host.attested, c, r) else {
                continue;
            };
            accepted += 1;
            let got = embedding(&got).expect("an accepted answer has one embedding");
            let similarity = cosine(&got, want);
            assert!(
                similarity >= SAME,
                "issue 29: a client's verifier accepted an answer that is not the model's \
                 answer to its own request (cosine {similarity:.4} to its own embedding)"
            );
        }
    }
    host.tx.shutdown().await;
    accepted
}
