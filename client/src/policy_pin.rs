//! `gateway policy pin`: writes a measurement policy that pins what a
//! gateway's stages report right now, for development only.
//!
//! That is trust on first use: the policy says "the stages are whatever this
//! server said they were", so the verb refuses to run without
//! `--trust-on-first-use` and prints a warning every time. A policy worth
//! its name pins measurements from a reproducible build of the stage image,
//! obtained out of band (docs/curl.md, docs/deploy-nitro.md).
//!
//! For each model it fetches `GET /v1/attestation` with a fresh random
//! nonce, reads each stage's measurement (mock digest or Nitro PCRs), layers
//! and the manifest digest from the evidence, writes them as a policy, and
//! verifies the same evidence against the written policy (signatures, nonce
//! and key bindings, layers, manifest) before it writes the file.

use crate::bundle::fetch_bundle;
use crate::log_view::LogView;
use crate::transport::{base_url, http_client, random_nonce, runtime};
use crate::verify::verify_evidence;
use crate::{EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use proto::attestation::{AnyVerifier, Measurement};
use proto::bundle::{EvidenceBundle, LegacyEvidence};
use proto::evidence::EvidenceVerifier;
use proto::policy::{LogPolicy, NitroPcrPolicy, Policy, StagePolicy};
use proto::report::CheckStatus;
use proto::transparency::{check_quorum, CosignatureVerifier};
use std::path::PathBuf;
use std::time::Duration;

/// `gateway policy …`
#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Write a policy pinning the measurements a gateway's stages report
    /// now (trust on first use: development only; needs
    /// --trust-on-first-use).
    Pin(PinArgs),
    /// Write a policy from the build record of an enclave image you built
    /// yourself (`scripts/build-eif.sh`'s build-record.json): its PCRs, or
    /// with --mock its mock measurement, and its layers and manifest.
    FromBuild(crate::policy_build::FromBuildArgs),
}

/// `gateway policy pin`
#[derive(Args, Debug)]
pub struct PinArgs {
    /// The gateway, e.g. http://127.0.0.1:8080.
    #[arg(long)]
    pub gateway: String,
    /// The model whose pipeline to pin (an id from `GET /v1/models`).
    #[arg(long, required_unless_present = "all", conflicts_with = "all")]
    pub model: Option<String>,
    /// Pin every model the gateway lists: --out is then a folder, with
    /// one `<model id>.toml` per model.
    #[arg(long)]
    pub all: bool,
    /// Say that you accept trusting whatever the server reports now (the
    /// policy then proves nothing about the code; for development only).
    #[arg(long, conflicts_with = "log_key")]
    pub trust_on_first_use: bool,
    /// Pin only measurements the transparency log holds under this
    /// verifier key (`gateway log vkey`): each stage's measurement, layers
    /// and manifest must be a release entry of the log, whose entries must
    /// hash to a checkpoint signed by this key.
    #[arg(long, value_name = "VKEY")]
    pub log_key: Option<String>,
    /// With --log-key: the log's URL prefix (a mirror, say); default
    /// `<gateway>/v1/transparency`.
    #[arg(long, requires = "log_key", value_name = "URL")]
    pub log: Option<String>,
    /// With --log-key: a witness's verifier key (`gateway witness vkey`);
    /// repeat for each witness. The log's checkpoint must then carry their
    /// cosignatures (C2SP tlog-cosignature) at each use.
    #[arg(long = "witness", requires = "log_key", value_name = "VKEY")]
    pub witnesses: Vec<String>,
    /// With --witness: how many distinct witnesses must cosign (default:
    /// all of them).
    #[arg(long, requires = "witnesses", value_name = "N")]
    pub witness_quorum: Option<u32>,
    /// With --log-key: require every receipt to be proven logged (an RFC
    /// 9942 inclusion receipt from `GET /v1/receipts/{id}/inclusion`; the
    /// gateway must run with `[transparency] log_receipts = true`).
    #[arg(long, requires = "log_key")]
    pub receipts_logged: bool,
    /// The policy file to write (with --all: the folder).
    #[arg(long)]
    pub out: PathBuf,
    /// How to reach the gateway.
    #[command(flatten)]
    pub transport: crate::Transport,
}

/// The warning printed by every run.
pub const TOFU_WARNING: &str = "TRUST ON FIRST USE: this policy pins whatever measurements the \
     server reported just now. It proves nothing about the code the stages run: a host that \
     lies now is trusted from now on. For development only; in production pin measurements \
     from a reproducible build of the stage image, obtained out of band.";

/// Runs `gateway policy …`; returns the exit code.
pub fn run(cmd: PolicyCommand) -> Result<i32> {
    match cmd {
        PolicyCommand::Pin(a) => run_pin(a),
        PolicyCommand::FromBuild(a) => crate::policy_build::run(a),
    }
}

fn run_pin(a: PinArgs) -> Result<i32> {
    if !a.trust_on_first_use && a.log_key.is_none() {
        bail!(
            "refusing to pin: a policy made from what the server reports trusts that server \
             on first use; pass --log-key VKEY to pin only what its transparency log holds, or \
             --trust-on-first-use to say you accept that (development only)"
        );
    }
    for w in &a.witnesses {
        CosignatureVerifier::new(w).map_err(|e| anyhow!("--witness: {e}"))?;
    }
    let log_policy = a.log_key.clone().map(|log_key| LogPolicy {
        witnesses: a.witnesses.clone(),
        witness_quorum: a.witness_quorum,
        receipts_logged: a.receipts_logged,
        ..LogPolicy::new(log_key)
    });
    if let Some(lp) = &log_policy {
        if lp.quorum() > lp.witnesses.len() {
            bail!(
                "--witness-quorum {} with {} --witness keys",
                lp.quorum(),
                lp.witnesses.len()
            );
        }
    }
    let base = base_url(&a.gateway, &a.transport)?;
    let client = http_client(Duration::from_secs(60), &a.transport)?;
    let rt = runtime()?;
    let log = match &a.log_key {
        Some(vkey) => {
            let url = a
                .log
                .clone()
                .unwrap_or_else(|| format!("{base}/v1/transparency"));
            let view = rt
                .block_on(LogView::fetch(&client, &url, vkey))
                .context("reading the transparency log")?;
            let witnessed = match check_quorum(&view.note, log_policy.as_ref().expect("log key")) {
                Ok(w) => w,
                Err(e) => {
                    eprintln!("the log at {url}: {e}: nothing written");
                    return Ok(EXIT_FAILED);
                }
            };
            eprintln!(
                "transparency log {}: {} entries, checkpoint verified with the given key{witnessed}",
                view.checkpoint.origin(),
                view.checkpoint.size()
            );
            Some(view)
        }
        None => {
            eprintln!("WARNING: {TOFU_WARNING}");
            None
        }
    };
    let models = match &a.model {
        Some(m) => vec![m.clone()],
        None => {
            let ids = rt.block_on(crate::proxy::upstream_models(&client, &base))?;
            if ids.is_empty() {
                bail!("{base}/v1/models lists no model");
            }
            std::fs::create_dir_all(&a.out)
                .with_context(|| format!("creating {}", a.out.display()))?;
            ids
        }
    };
    for model in &models {
        let nonce = random_nonce(32);
        let bundle = rt.block_on(fetch_bundle(&client, &base, &nonce, Some(model)))?;
        let mut policy = pinned_policy(&bundle).with_context(|| format!("model {model}"))?;
        let logged = match &log {
            Some(view) => match logged_entries(&bundle, view) {
                Ok(at) => Some(at),
                Err(e) => {
                    eprintln!("model {model}: {e:#}: nothing written");
                    return Ok(EXIT_FAILED);
                }
            },
            None => None,
        };
        if logged.is_some() {
            // Each use then requires the bundle's proofs under this key
            // (checked just below on this very bundle).
            policy.transparency = log_policy.clone();
        }
        let out = verify_evidence(&bundle, &policy, Some(&nonce), None, LegacyEvidence::Refuse);
        if !out.ok() {
            for l in out.lines.iter().filter(|l| l.status == CheckStatus::Fail) {
                eprintln!("{l}");
            }
            eprintln!("model {model}: the evidence does not verify even against its own measurements: nothing written");
            return Ok(EXIT_FAILED);
        }
        let path = if a.all {
            a.out.join(format!("{}.toml", file_stem(model)))
        } else {
            a.out.clone()
        };
        let header = match (&logged, &log) {
            (Some(at), Some(view)) => format!(
                "# Model {model}: pinned by `gateway policy pin --log-key` from {base}: each\n\
                 # stage's measurement is release entry {at:?} of transparency log\n\
                 # {} at checkpoint size {}.\n",
                view.checkpoint.origin(),
                view.checkpoint.size()
            ),
            _ => format!(
                "# Model {model}: pinned by `gateway policy pin --trust-on-first-use` from what\n\
                 # {base} reported. TRUST ON FIRST USE: development only.\n"
            ),
        };
        crate::policy_file::write_policy(&path, &policy, &header)?;
        let kind = if policy.allow_mock { "mock" } else { "Nitro" };
        println!(
            "pinned {model}: {} stage(s), {kind} evidence, manifest {} -> {}",
            policy.stages.len(),
            policy.manifest_sha256.as_deref().unwrap_or("-"),
            path.display()
        );
    }
    if log.is_none() {
        eprintln!("WARNING: TRUST ON FIRST USE (development only): see above.");
    }
    Ok(EXIT_OK)
}

/// The index of the log's release entry for each stage of `bundle` (its
/// measurement, layers and manifest), each proven included in the view's
/// checkpoint; an error naming the first stage the log does not hold.
pub fn logged_entries(bundle: &EvidenceBundle, view: &LogView) -> Result<Vec<u64>> {
    let verifier = AnyVerifier::default();
    let mut at = Vec::new();
    for s in &bundle.stages {
        let doc = verifier
            .verify(&s.evidence)
            .map_err(|e| anyhow!("stage {}: its evidence does not verify: {e}", s.index))?;
        let m = proto::transparency::Measurement::of_evidence(&doc.measurement)
            .ok_or_else(|| anyhow!("stage {}: its PCRs are incomplete", s.index))?;
        let layers = [s.claims.layer_start, s.claims.layer_end];
        let Some((i, _)) = view.find_release(&m, &s.claims.manifest_sha256, layers) else {
            bail!(
                "stage {}: measurement {} (layers {}..{}, manifest {}) is not a release in \
                 transparency log {} at size {}",
                s.index,
                m.pinned_form(),
                layers[0],
                layers[1],
                s.claims.manifest_sha256.hex(),
                view.checkpoint.origin(),
                view.checkpoint.size()
            );
        };
        view.inclusion_proof(i)?;
        at.push(i);
    }
    Ok(at)
}

/// The policy that accepts exactly the stages of `bundle`: each stage's
/// measurement and layers, the manifest's digest, mock evidence only if the
/// stages' is mock.
pub fn pinned_policy(bundle: &EvidenceBundle) -> Result<Policy> {
    let verifier = AnyVerifier::default();
    let mut stages = Vec::new();
    let mut mock = false;
    let mut manifest = None;
    for s in &bundle.stages {
        let doc = verifier
            .verify(&s.evidence)
            .map_err(|e| anyhow!("stage {}: its evidence does not verify: {e}", s.index))?;
        let mut stage = StagePolicy {
            index: s.index,
            layers: [s.claims.layer_start, s.claims.layer_end],
            measurements: Vec::new(),
            nitro: Vec::new(),
        };
        match &doc.measurement {
            Measurement::Mock(_) => {
                mock = true;
                stage.measurements.push(doc.measurement.pinned_form());
            }
            Measurement::Nitro(pcrs) => {
                let pcr = |i: u8| pcrs.get(i).map(hex::encode);
                stage.nitro.push(NitroPcrPolicy {
                    pcr0: pcr(0).ok_or_else(|| anyhow!("stage {}: no PCR0", s.index))?,
                    pcr1: pcr(1).ok_or_else(|| anyhow!("stage {}: no PCR1", s.index))?,
                    pcr2: pcr(2).ok_or_else(|| anyhow!("stage {}: no PCR2", s.index))?,
                    pcr3: None,
                    pcr4: None,
                    pcr8: pcr(8).filter(|v| v.bytes().any(|b| b != b'0')),
                });
            }
        }
        let digest = s.claims.manifest_sha256.hex();
        if manifest.get_or_insert_with(|| digest.clone()) != &digest {
            bail!("the stages claim different model manifests");
        }
        stages.push(stage);
    }
    if stages.is_empty() {
        bail!("the evidence has no stage");
    }
    Ok(Policy {
        allow_mock: mock,
        trust_local_build: false,
        allow_debug: false,
        transparency: None,
        trust_same_image: false,
        manifest_sha256: manifest,
        stages,
    })
}

/// A model id as a file name: characters other than `[A-Za-z0-9._-]` as `_`.
fn file_stem(model: &str) -> String {
    model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}
