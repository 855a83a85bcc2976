//! The `gateway` command: `gateway serve` reads `config/gateway.toml`,
//! starts (or connects to) the attested stages, verifies them against the
//! policy and serves the OpenAI-compatible API; the client verbs are the
//! `client` crate's ([`client::run`]). This module is the command line and
//! the small commands; starting and serving is [`startup`].

mod startup;

use crate::config::{GatewayConfig, Launch};
use crate::{auth, config, host_proxy, metrics, plan, telemetry, tls};
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Confidential inference gateway (OpenAI-compatible API over attested stages)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once at start
enum Command {
    /// Start the stages (local launch) or connect to them, verify them, and serve the API.
    Serve(ServeArgs),
    /// Print the SHA-256 (hex) of an API token read from stdin, for `[[auth.keys]] sha256`.
    HashKey,
    /// Load and validate the config (and the policy, model manifest and TLS
    /// files it names) without starting anything; exit 0 when it is valid.
    CheckConfig(CheckConfigArgs),
    /// Print the mock measurement (`mock:<hex>`) of a stage binary serving a
    /// model, computed from the files, for a policy's `[[stages]] measurements`
    /// (e.g. of the binary copied into a container image).
    Measure(MeasureArgs),
    /// Print how many stages a GGUF needs for a stage memory, and the
    /// layers, weights, KV cache and total of each (`serve --model
    /// --stage-memory` uses the same plan).
    Plan(PlanArgs),
    /// Relay bytes between endpoints (vsock <-> TCP) on a Nitro parent
    /// instance; one `--route LISTEN=TARGET` per relay. Sees ciphertext only.
    HostProxy(host_proxy::HostProxyArgs),
    /// The transparency log: make one, print its verifier key, log an
    /// image's release from its build record, print its checkpoint or entries.
    #[command(subcommand)]
    Log(crate::transparency::cli::LogCommand),
    /// A transparency-log witness (C2SP tlog-witness): cosigns a log's
    /// checkpoints only when they extend what it saw before.
    #[command(subcommand)]
    Witness(crate::transparency::witness::WitnessCommand),
    #[command(flatten)]
    Client(client::ClientCommand),
}

#[derive(clap::Args, Debug, Default)]
pub(crate) struct ServeArgs {
    /// Config file.
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
    /// Override `server.listen`.
    #[arg(long)]
    listen: Option<String>,
    /// Serve this GGUF as the generation model (chat and completions)
    /// instead of the config's `[completions]` model: its manifest and a
    /// development policy are written under `data/models/`.
    #[arg(long, value_name = "FILE.gguf")]
    model: Option<PathBuf>,
    /// With `--model`: how many stages to split its layers across (evenly).
    /// Default: as `gateway plan` splits it for `--stage-memory` (or the
    /// config's `[completions] stage_memory`), or 2.
    #[arg(long, requires = "model", conflicts_with = "stage_memory")]
    stages: Option<usize>,
    /// With `--model`: each stage's memory (e.g. `1GiB`); the layers are
    /// split as `gateway plan` splits them, for the completions KV budget.
    #[arg(long, requires = "model")]
    stage_memory: Option<String>,
    /// Serve this sentence-transformers folder (a BERT-family encoder with
    /// `model.safetensors` and `tokenizer.json`) as the embeddings model
    /// instead of the config's `[pipeline]` model; its manifest and a
    /// development policy are written under `data/models/`.
    #[arg(long, value_name = "DIR")]
    embedding_model: Option<PathBuf>,
    /// With `--embedding-model`: how many stages to split its layers across
    /// (evenly); default 2 (1 for a one-layer model).
    #[arg(long, requires = "embedding_model")]
    embedding_stages: Option<usize>,
    /// With `--model` or `--embedding-model`: where their manifests and
    /// policies are written (a folder per model).
    #[arg(long, default_value = "data/models")]
    model_cache: PathBuf,
}

#[derive(clap::Args, Debug)]
struct PlanArgs {
    /// The GGUF file.
    #[arg(long, value_name = "FILE.gguf")]
    model: PathBuf,
    /// Each stage's memory, e.g. `1GiB`, `800MiB`, `2GB`: the fewest
    /// stages that fit.
    #[arg(
        long,
        required_unless_present_any = ["stages", "layers"],
        conflicts_with_all = ["stages", "layers"]
    )]
    stage_memory: Option<String>,
    /// Instead: the cost of each stage of an even split into N stages (the
    /// split `serve --model --stages N` runs).
    #[arg(long, conflicts_with = "layers")]
    stages: Option<usize>,
    /// Instead: the cost of each stage of this split, e.g. `0..15,15..30`
    /// (contiguous from layer 0 to the last; `scripts/run-nitro.sh` sizes
    /// its enclaves with it).
    #[arg(long, value_name = "A..B,B..C")]
    layers: Option<String>,
    /// KV-cache budget per stage in tokens (`[completions] kv_cache_tokens`).
    #[arg(long, default_value_t = 8192)]
    kv_tokens: u64,
    /// How the stages hold the weights (`[completions] weights`).
    #[arg(long, default_value = "q4_1")]
    weights: proto::frames::WeightFormat,
    /// Allowance per stage besides weights and KV cache.
    #[arg(long, default_value = "100MiB")]
    overhead: String,
    /// Print the plan as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args, Debug)]
struct CheckConfigArgs {
    /// Config file.
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
}

#[derive(clap::Args, Debug)]
struct MeasureArgs {
    /// The `enclave-stage` binary.
    #[arg(long)]
    stage_binary: PathBuf,
    /// Model folder; its `manifest.json` is measured.
    #[arg(long)]
    model_dir: PathBuf,
    /// The policy file the stage is started with (`--policy`): it is part
    /// of the measurement.
    #[arg(long)]
    stage_policy: PathBuf,
}

/// Parses the command line and runs the verb: `serve` (the default), a
/// client verb, `hash-key`, `measure` or `check-config`.
pub fn run() -> Result<()> {
    let cli = Cli::parse();
    // `serve` reads its config first: traces need their exporter in the subscriber.
    // A config that does not load is left to `serve` to report.
    let serve_config = match &cli.command {
        Some(Command::Serve(a)) => Some(a.config.as_path()),
        None => Some(std::path::Path::new("config/gateway.toml")),
        _ => None,
    };
    telemetry::init_logging(
        serve_config
            .and_then(|p| config::GatewayConfig::load(p).ok())
            .map(|c| c.telemetry),
    );
    let args = match cli.command {
        Some(Command::Serve(a)) => a,
        Some(Command::Client(c)) => std::process::exit(client::run(c)),
        Some(Command::HashKey) => return hash_key(),
        Some(Command::CheckConfig(a)) => std::process::exit(check_config(&a.config)),
        Some(Command::Measure(a)) => return measure(&a),
        Some(Command::Plan(a)) => return print_plan(&a),
        Some(Command::HostProxy(a)) => return host_proxy::main(a),
        Some(Command::Log(c)) => return crate::transparency::cli::run(c),
        Some(Command::Witness(c)) => std::process::exit(crate::transparency::witness::run(c)?),
        None => ServeArgs {
            config: "config/gateway.toml".into(),
            ..ServeArgs::default()
        },
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(startup::serve(args))
}

/// `gateway hash-key`: one token on stdin (a trailing newline is ignored).
fn hash_key() -> Result<()> {
    use std::io::Read;
    let mut token = String::new();
    std::io::stdin()
        .read_to_string(&mut token)
        .context("reading the token from stdin")?;
    let token = token.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        anyhow::bail!("no token on stdin");
    }
    println!("{}", hex::encode(auth::digest(token.as_bytes())));
    Ok(())
}

/// `gateway measure`: the measurement a mock stage running this binary with
/// this model and this policy file reports, from the files themselves
/// (nothing is run).
fn measure(a: &MeasureArgs) -> Result<()> {
    let manifest = LoadedManifest::load(&a.model_dir)
        .with_context(|| format!("--model-dir {}", a.model_dir.display()))?;
    let binary = proto::digest::Sha256Digest::of_file(&a.stage_binary)
        .with_context(|| format!("--stage-binary {}", a.stage_binary.display()))?;
    let policy = proto::digest::Sha256Digest::of_file(&a.stage_policy)
        .with_context(|| format!("--stage-policy {}", a.stage_policy.display()))?;
    let m = proto::attestation::mock_measurement(&binary, &manifest.digest, &policy);
    println!("{}", m.pinned_form());
    Ok(())
}

/// `gateway plan`: the stages a GGUF needs, as a table or JSON.
fn print_plan(a: &PlanArgs) -> Result<()> {
    let ct = crate::own_model::read_header(&a.model).context("--model")?;
    let costs = plan::ModelCosts::of(&ct, a.weights)?;
    let overhead = plan::parse_bytes(&a.overhead).context("--overhead")?;
    let (stages, limit) = match (&a.stage_memory, a.stages) {
        (Some(m), _) => {
            let memory = plan::parse_bytes(m).context("--stage-memory")?;
            (
                costs.plan(memory, a.kv_tokens, overhead)?,
                format!("of at most {}", plan::human(memory)),
            )
        }
        (None, n) => {
            let (split, how) = match (&a.layers, n) {
                (Some(list), _) => (
                    plan::parse_layers(list, costs.layers.len() as u32).context("--layers")?,
                    "split as given",
                ),
                (None, n) => {
                    let n = n.context("--stage-memory, --stages or --layers")?;
                    (
                        crate::own_model::split_layers(costs.layers.len() as u32, n)
                            .context("--stages")?,
                        "split evenly by layers",
                    )
                }
            };
            let stages = split
                .iter()
                .map(|l| costs.stage(l[0] as usize..l[1] as usize, a.kv_tokens, overhead))
                .collect::<Vec<_>>();
            (stages, how.to_string())
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&stages)?);
    } else {
        println!(
            "{}: {} stages {limit} ({} weights, {} KV tokens per stage, {} overhead each)",
            a.model.display(),
            stages.len(),
            a.weights,
            a.kv_tokens,
            plan::human(overhead)
        );
        print!("{}", plan::table(&stages));
    }
    Ok(())
}

/// `gateway check-config`: `OK …` with a summary on stdout and exit 0, or
/// the error (naming the bad key) on stderr and exit 1.
fn check_config(path: &std::path::Path) -> i32 {
    match check_config_summary(path) {
        Ok((summary, effective)) => {
            println!("OK {}: {summary}", path.display());
            println!("# effective configuration (file, environment overrides, defaults):");
            print!("{effective}");
            0
        }
        Err(e) => {
            eprintln!("config error: {e:#}");
            1
        }
    }
}

fn check_config_summary(path: &std::path::Path) -> Result<(String, String)> {
    let cfg = GatewayConfig::load(path)?;
    let scheme = match &cfg.server.tls {
        Some(t) => {
            tls::load_pair(&t.cert, &t.key)
                .map_err(|e| cfg.attribute(e))
                .with_context(|| format!("config {}", path.display()))?;
            "https"
        }
        None => "http",
    };
    let metrics = std::sync::Arc::new(metrics::Metrics::default());
    let env_keys = std::env::var(auth::ENV_KEYS).ok();
    let keys = auth::ApiKeys::from_config(&cfg.auth, env_keys.as_deref(), metrics)
        .with_context(|| format!("config {}", path.display()))?;
    let policy = Policy::load(&cfg.pipeline.policy).map_err(|e| {
        anyhow::anyhow!(
            "config {}: {}: {e}",
            path.display(),
            cfg.key("pipeline.policy")
        )
    })?;
    let manifest = LoadedManifest::load(&cfg.pipeline.model_dir).map_err(|e| {
        anyhow::anyhow!(
            "config {}: {}: {}: {e}",
            path.display(),
            cfg.key("pipeline.model_dir"),
            cfg.pipeline.model_dir.display()
        )
    })?;
    if cfg.pipeline.launch == Launch::Local {
        let bin = cfg.stage_binary()?;
        if !bin.exists() {
            anyhow::bail!(
                "config {}: {}: {} does not exist",
                path.display(),
                cfg.key("pipeline.stage_binary"),
                bin.display()
            );
        }
    }
    let auth = if keys.enabled() {
        format!("auth on ({} keys)", keys.len())
    } else {
        "auth off".to_string()
    };
    let summary = format!(
        "{scheme}://{}, model {}, {} stages ({}), {auth}, policy {}{}",
        cfg.server.listen,
        manifest.manifest.model_id,
        cfg.pipeline.stages.len(),
        match cfg.pipeline.launch {
            Launch::Local => "local",
            Launch::Remote => "remote",
        },
        cfg.pipeline.policy.display(),
        match (policy.allow_mock, policy.allow_debug) {
            (true, true) => " (MOCK attestation allowed) (Nitro DEBUG-mode enclaves allowed)",
            (true, false) => " (MOCK attestation allowed)",
            (false, true) => " (Nitro DEBUG-mode enclaves allowed)",
            (false, false) => "",
        },
    );
    Ok((summary, cfg.effective_toml()))
}
