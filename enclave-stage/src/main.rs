//! `enclave-stage`: runs one pipeline stage. Prints `LISTENING <endpoint>`
//! on stdout once the model is loaded and the listener is bound.

use anyhow::{Context, Result};
use clap::Parser;
use enclave_stage::keys::{Rotation, StageKeys};
use enclave_stage::model::{ComputeLimits, ComputeSetup};
use enclave_stage::models::llama::WeightFormat;
use enclave_stage::provider::{self, AttestationKind};
use enclave_stage::role::{self, StageSpec};
use enclave_stage::server::{StageServer, StageSetup};
use proto::digest::Sha256Digest;
use proto::io::transport::{Endpoint, Listener};
use proto::policy::Policy;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "One attested pipeline stage (a layer range of a Candle model)"
)]
struct Args {
    /// Model folder with manifest.json.
    #[arg(long, env = "STAGE_MODEL_DIR")]
    model_dir: PathBuf,
    /// This stage's position (0 = entry stage).
    #[arg(long, default_value_t = 0)]
    stage_index: u32,
    /// Number of stages in the pipeline.
    #[arg(long, default_value_t = 1)]
    num_stages: u32,
    /// Layers to run, `START..END` (end exclusive); with `--stage-from-cid`
    /// one range per stage, comma-separated (`0..3,3..6`).
    #[arg(long)]
    layers: String,
    /// Take the stage index from this enclave's vsock CID: stage
    /// `CID - BASE` (one enclave image for every stage; overrides
    /// `--stage-index` and `--num-stages`).
    #[arg(long, value_name = "BASE")]
    stage_from_cid: Option<u32>,
    /// With `--stage-from-cid` and `--attestation mock` only: the CID to
    /// read the stage from where there is no vsock device (the enclave image
    /// run as a container, `scripts/test-enclave-image.sh`). Refused with
    /// `--attestation nitro`, where the CID is the enclave's own.
    #[arg(long, value_name = "CID", requires = "stage_from_cid")]
    mock_cid: Option<u32>,
    /// Endpoint to listen on (`tcp://127.0.0.1:0` picks a port;
    /// `vsock://any:9000` inside a Nitro enclave).
    #[arg(long, default_value = "tcp://127.0.0.1:0")]
    listen: String,
    /// Attestation provider: `mock` (development, proves nothing) or
    /// `nitro` (/dev/nsm; needs a build with the `nitro` feature).
    #[arg(long, default_value = "mock")]
    attestation: AttestationKind,
    /// Measurement policy used to verify neighbouring stages.
    #[arg(long)]
    policy: PathBuf,
    /// Compute threads (sets RAYON_NUM_THREADS for Candle); 0: one per CPU
    /// this process may run on (an enclave's image does not know how many
    /// CPUs `nitro-cli run-enclave --cpu-count` gives it).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Padded tokens per micro-batch.
    #[arg(long, default_value_t = 4096)]
    token_budget: usize,
    /// Rows per micro-batch.
    #[arg(long, default_value_t = 64)]
    max_batch: usize,
    /// Activation memory per micro-batch, MiB.
    #[arg(long, default_value_t = 192)]
    memory_budget_mib: usize,
    /// Most inputs one request may carry (entry stage).
    #[arg(long, default_value_t = 2048)]
    max_inputs: usize,
    /// Generation: KV-cache budget in tokens (give every stage of a pipeline
    /// the same number; the entry stage admits requests by it).
    #[arg(long, default_value_t = 16384)]
    kv_cache_tokens: usize,
    /// Generation: most sequences in one step.
    #[arg(long, default_value_t = 64)]
    max_step_seqs: usize,
    /// How the weights are held. Generation: `q4_1` (default: as the GGUF
    /// ships them), `q8_0` (re-quantized at load) or `f32` (dequantized;
    /// the reference). Embeddings: `bf16` (default) or `f32`.
    #[arg(long)]
    weights: Option<WeightFormat>,
    /// Generation: most requests waiting for KV room before new ones get 503.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Exit when standard input closes (set by a supervising gateway, so the
    /// stage never outlives it).
    #[arg(long)]
    exit_with_stdin: bool,
    /// Entry stage: make a new HPKE key every this many seconds (0: never).
    /// Each new key set is signed with the attested receipt key and sent to
    /// the gateway, which publishes it.
    #[arg(long, default_value_t = 0)]
    hpke_rotate_secs: u64,
    /// Entry stage: how long a replaced HPKE key is still accepted.
    #[arg(long, default_value_t = 3600)]
    hpke_overlap_secs: u64,
    /// Entry stage: the HPKE key ids to draw from, `LO-HI` within 1-127
    /// (a gateway gives each replica of a pipeline its own range, so that a
    /// key id names one replica).
    #[arg(long, default_value = "1-127", value_parser = enclave_stage::keys::parse_key_ids)]
    hpke_key_ids: std::ops::RangeInclusive<u8>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Before any thread exists: Candle reads these once.
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    std::env::set_var("CANDLE_NUM_THREADS", threads.to_string());
    proto::io::logging::init();
    let spec = match args.stage_from_cid {
        Some(base) => {
            let cid = match args.mock_cid {
                Some(_) if args.attestation != AttestationKind::Mock => {
                    anyhow::bail!("--mock-cid is for --attestation mock only: an enclave's CID is read from /dev/vsock")
                }
                Some(cid) => cid,
                None => proto::io::transport::local_cid()?,
            };
            let spec = role::from_cid(cid, base, &args.layers)?;
            tracing::info!(
                cid,
                stage = spec.stage_index,
                "stage index from the vsock CID"
            );
            spec
        }
        None => StageSpec {
            stage_index: args.stage_index,
            num_stages: args.num_stages,
            layers: role::parse_layers(&args.layers)?,
        },
    };
    // Before the model loads: a build without Nitro support says so at once.
    provider::ensure_supported(args.attestation)?;
    // The clock against the KVM PTP clock, logged now (crate::clock).
    let clock = Arc::new(enclave_stage::clock::ClockGuard::new(
        enclave_stage::clock::PTP_DEVICE,
    ));
    // The policy file is part of what this stage is (its mock measurement):
    // read once, parsed and hashed from the same bytes.
    let policy_text = std::fs::read_to_string(&args.policy)
        .with_context(|| format!("reading policy {}", args.policy.display()))?;
    let mut policy = Policy::from_toml(&policy_text)
        .map_err(|e| anyhow::anyhow!("policy {}: {e}", args.policy.display()))?;
    let policy_digest = Sha256Digest::of(policy_text.as_bytes());
    let mut loaded = enclave_stage::serving::load(&args.model_dir, &spec, args.weights)
        .context("stage refuses to start")?;
    let exe = std::env::current_exe()?;
    let binary =
        Sha256Digest::of_file(&exe).with_context(|| format!("hashing {}", exe.display()))?;
    let (manifest, _) = loaded.manifest_and_claims();
    let manifest_digest = manifest.digest;
    let model_id = manifest.manifest.model_id.clone();
    let provider::Selected {
        provider,
        measurement,
    } = provider::select(
        args.attestation,
        spec.stage_index,
        &binary,
        &manifest_digest,
        &policy_digest,
    )?;
    provider::apply_debug_rule(&mut policy, &measurement);
    let (_, claims) = loaded.manifest_and_claims();
    let rotation = (args.hpke_rotate_secs > 0).then(|| Rotation {
        every: Duration::from_secs(args.hpke_rotate_secs),
        overlap: Duration::from_secs(args.hpke_overlap_secs),
    });
    let keys = Arc::new(StageKeys::generate(
        claims,
        provider.as_ref(),
        rotation,
        args.hpke_key_ids.clone(),
    )?);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    enclave_stage::memory::trim_periodically(Duration::from_secs(5));
    let served = rt.block_on(async move {
        if let Some(hpke) = &keys.hpke {
            tokio::spawn(hpke.clone().run());
        }
        let (work_tx, work_rx) = std::sync::mpsc::channel();
        let (out_tx, out_rx) = tokio::sync::mpsc::channel(8);
        let limits = ComputeLimits {
            token_budget: args.token_budget,
            max_rows: args.max_batch,
            memory_budget: args.memory_budget_mib << 20,
            kv_cache_tokens: args.kv_cache_tokens,
            max_step_seqs: args.max_step_seqs,
            max_waiting: args.max_waiting,
            max_inputs: args.max_inputs,
        };
        let model = loaded
            .start(ComputeSetup {
                keys: keys.clone(),
                out: out_tx.clone(),
                work: work_rx,
                limits,
            })
            .context("stage refuses to start")?;
        let setup = StageSetup {
            model,
            keys,
            provider,
            policy,
            local_measurement: measurement,
            clock,
        };
        let server = StageServer::new(setup, work_tx, out_tx);
        let endpoint: Endpoint = args.listen.parse().map_err(anyhow::Error::msg)?;
        let listener = Listener::bind(&endpoint).await?;
        tokio::spawn(server.clone().write_outputs(out_rx));
        // Signal handlers first: a supervisor may signal as soon as it reads
        // LISTENING, and an unhandled SIGTERM would kill the stage silently.
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sigint = signal(SignalKind::interrupt())?;
        println!("LISTENING {}", listener.local_endpoint()?);
        use std::io::Write;
        std::io::stdout().flush()?;
        tracing::info!(
            stage = spec.stage_index,
            layers = ?spec.layers,
            model = %model_id,
            "stage ready"
        );
        if args.exit_with_stdin {
            tokio::spawn(async {
                use tokio::io::AsyncReadExt;
                let mut buf = [0u8; 64];
                let mut stdin = tokio::io::stdin();
                while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
                tracing::info!("supervisor closed stdin; exiting");
                std::process::exit(0);
            });
        }
        tokio::select! {
            _ = server.serve(listener) => {}
            _ = sigint.recv() => tracing::info!("interrupted; exiting"),
            _ = sigterm.recv() => tracing::info!("SIGTERM; exiting"),
        }
        Ok::<_, anyhow::Error>(())
    });
    // Without waiting for blocking tasks: the `--exit-with-stdin` reader
    // blocks until the supervisor closes stdin, which would keep a stage
    // told to stop by a signal alive.
    rt.shutdown_background();
    served
}
