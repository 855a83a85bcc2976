//! `gateway witness`: a C2SP tlog-witness. It keeps, per log it is told to
//! watch, the latest checkpoint it cosigned, and cosigns (C2SP
//! tlog-cosignature) a new one only when it is signed by that log's key and
//! proven an append-only extension of it. A fork — the same size with
//! another root, or a proof that does not verify — is refused and logged,
//! so a log cannot show one client a view the witnesses did not see.
//!
//! Run by someone other than the log's operator (an auditor, a customer):
//! a witness run by the operator proves nothing. State: one file per log
//! (`<hex(origin)>.checkpoint`, written to a temporary file, fsynced and
//! renamed) in a folder the witness locks for its lifetime.

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use clap::{Args, Subcommand};
use proto::transparency::{
    check_consistency, cosigner_key, log_origin, parse_cosigner_key, verify_checkpoint,
    AddCheckpoint, Checkpoint, Cosigner, ADD_CHECKPOINT_PATH, SIZE_CONTENT_TYPE,
};
use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// `gateway witness …`
#[derive(Subcommand, Debug)]
pub enum WitnessCommand {
    /// Make a witness key (Ed25519, mode 0600) and print its verifier key.
    Init {
        /// The witness's name, e.g. `witness.example.com/w1`.
        #[arg(long)]
        name: String,
        /// The key file to write (refused if it exists).
        #[arg(long)]
        key: PathBuf,
    },
    /// Print the witness's verifier key (for clients' `--witness`).
    Vkey {
        /// The witness's key file.
        #[arg(long)]
        key: PathBuf,
    },
    /// Serve `POST /add-checkpoint` (C2SP tlog-witness).
    Serve(ServeArgs),
}

/// `gateway witness serve`
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The witness's key file (`gateway witness init`).
    #[arg(long)]
    key: PathBuf,
    /// The folder holding the latest cosigned checkpoint of each log.
    #[arg(long)]
    state: PathBuf,
    /// A log to witness: its verifier key (`gateway log vkey`); repeat.
    #[arg(long = "log", value_name = "VKEY", required = true)]
    logs: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:9600")]
    listen: String,
}

/// Runs `gateway witness …`; returns the exit code.
pub fn run(cmd: WitnessCommand) -> Result<i32> {
    match cmd {
        WitnessCommand::Init { name, key } => {
            let sk = ed25519_dalek::SigningKey::generate(&mut rand::rngs::OsRng);
            let text = cosigner_key(&name, &sk);
            let cosigner = Cosigner::new(&name, sk, 0)?;
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&key)
                .with_context(|| format!("creating {} (it must not exist)", key.display()))?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            println!("{}", cosigner.vkey());
        }
        WitnessCommand::Vkey { key } => println!("{}", load_key(&key, 0)?.vkey()),
        WitnessCommand::Serve(a) => {
            let rt = tokio::runtime::Runtime::new()?;
            rt.block_on(serve(a))?;
        }
    }
    Ok(0)
}

fn read_key(path: &Path) -> Result<(String, ed25519_dalek::SigningKey)> {
    let text = fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_cosigner_key(&text).with_context(|| path.display().to_string())
}

fn load_key(path: &Path, time: u64) -> Result<Cosigner> {
    let (name, key) = read_key(path)?;
    Ok(Cosigner::new(&name, key, time)?)
}

/// What the witness holds: its key file, the logs it watches and their
/// latest cosigned checkpoints (one lock: check and persist are atomic).
struct Witness {
    /// The witness's name and key, read once at start.
    key: (String, ed25519_dalek::SigningKey),
    logs: HashMap<String, String>,
    dir: PathBuf,
    latest: Mutex<HashMap<String, Checkpoint>>,
    _lock: File,
}

fn state_file(dir: &Path, origin: &str) -> PathBuf {
    dir.join(format!("{}.checkpoint", hex::encode(origin)))
}

impl Witness {
    fn open(a: &ServeArgs) -> Result<Self> {
        let key = read_key(&a.key)?;
        fs::create_dir_all(&a.state)?;
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(a.state.join("lock"))?;
        if lock.try_lock().is_err() {
            bail!("{} is in use by another witness", a.state.display());
        }
        let (mut logs, mut latest) = (HashMap::new(), HashMap::new());
        for vkey in &a.logs {
            let origin = log_origin(vkey).map_err(anyhow::Error::msg)?.to_string();
            let path = state_file(&a.state, &origin);
            if path.exists() {
                let note = fs::read(&path)?;
                let cp = verify_checkpoint(&note, vkey, &origin)
                    .with_context(|| format!("{}: not a checkpoint of {origin}", path.display()))?;
                latest.insert(origin.clone(), cp);
            }
            logs.insert(origin, vkey.clone());
        }
        Ok(Self {
            key,
            logs,
            dir: a.state.clone(),
            latest: Mutex::new(latest),
            _lock: lock,
        })
    }

    /// The C2SP add-checkpoint decision: cosignature lines, or the status
    /// and body of the refusal.
    fn add_checkpoint(&self, body: &[u8]) -> Result<String, (StatusCode, String)> {
        let bad = |why: String| (StatusCode::BAD_REQUEST, why);
        let req = AddCheckpoint::parse(body).map_err(bad)?;
        let origin = std::str::from_utf8(&req.checkpoint)
            .ok()
            .and_then(|t| t.split('\n').next())
            .unwrap_or_default();
        let Some(vkey) = self.logs.get(origin) else {
            return Err((StatusCode::NOT_FOUND, "unknown log\n".into()));
        };
        let cp = verify_checkpoint(&req.checkpoint, vkey, origin)
            .map_err(|e| (StatusCode::FORBIDDEN, format!("{e}\n")))?;
        if req.old_size > cp.size() {
            return Err(bad("the old size is larger than the checkpoint's".into()));
        }
        let mut latest = self.latest.lock().unwrap();
        let had = latest.get(origin);
        let had_size = had.map_or(0, |c| c.size());
        if req.old_size != had_size {
            return Err((StatusCode::CONFLICT, format!("{had_size}\n")));
        }
        if let Some(had) = had {
            let fork = |why: &str| {
                tracing::error!(
                    log = origin,
                    size = cp.size(),
                    seen_size = had.size(),
                    "FORK: {why}: refused"
                );
                (StatusCode::CONFLICT, format!("{why}\n"))
            };
            if had.size() == cp.size() && had.hash() != cp.hash() {
                return Err(fork("another root at the size already cosigned"));
            }
            if had.size() < cp.size()
                && check_consistency(&req.proof, cp.size(), *cp.hash(), had.size(), *had.hash())
                    .is_err()
            {
                tracing::error!(
                    log = origin,
                    size = cp.size(),
                    seen_size = had.size(),
                    "the consistency proof does not verify: refused"
                );
                return Err((
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "the consistency proof does not verify\n".into(),
                ));
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let internal = |e: anyhow::Error| {
            tracing::error!(error = %format!("{e:#}"), "witness state not written");
            (StatusCode::INTERNAL_SERVER_ERROR, "internal error\n".into())
        };
        let line = Cosigner::new(&self.key.0, self.key.1.clone(), now)
            .and_then(|k| k.cosign(&req.checkpoint))
            .map_err(anyhow::Error::from)
            .map_err(internal)?;
        persist(&state_file(&self.dir, origin), &req.checkpoint).map_err(internal)?;
        tracing::info!(log = origin, size = cp.size(), "cosigned");
        latest.insert(origin.to_string(), cp);
        Ok(line)
    }
}

fn persist(path: &Path, note: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(note)?;
    f.sync_all()?;
    fs::rename(&tmp, path)?;
    File::open(path.parent().expect("a folder"))?.sync_all()?;
    Ok(())
}

async fn add_checkpoint(State(w): State<Arc<Witness>>, body: Bytes) -> Response {
    let out = tokio::task::spawn_blocking(move || w.add_checkpoint(&body)).await;
    match out {
        Ok(Ok(lines)) => (StatusCode::OK, lines).into_response(),
        Ok(Err((StatusCode::CONFLICT, size)))
            if proto::transparency::parse_decimal(size.trim_end()).is_some() =>
        {
            (
                StatusCode::CONFLICT,
                [(header::CONTENT_TYPE, SIZE_CONTENT_TYPE)],
                size,
            )
                .into_response()
        }
        Ok(Err((code, why))) => (code, why).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn serve(a: ServeArgs) -> Result<()> {
    let w = Arc::new(Witness::open(&a)?);
    let vkey = load_key(&a.key, 0)?.vkey();
    let app = Router::new()
        .route(ADD_CHECKPOINT_PATH, post(add_checkpoint))
        .layer(DefaultBodyLimit::max(64 * 1024))
        .with_state(w);
    let listener = tokio::net::TcpListener::bind(&a.listen)
        .await
        .with_context(|| format!("listening on {}", a.listen))?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, vkey, logs = a.logs.len(), "witness serving");
    println!("WITNESS LISTENING {addr}");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
