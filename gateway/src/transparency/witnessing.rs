//! The log's side of C2SP tlog-witness: the stored checkpoint is offered
//! to each configured witness that has not cosigned it, with a consistency
//! proof from the size the witness last cosigned (learnt from its `409`
//! answer when not known), and the cosignatures it returns are checked and
//! added to the stored checkpoint, so that `GET /v1/transparency/checkpoint`
//! and the evidence bundle's proofs carry them.
//!
//! At start one round runs before the API is served; then one runs every
//! `witness_interval_secs`. A witness that is down or refuses is logged and
//! asked again next round: clients whose policy needs its cosignature
//! refuse the bundle meanwhile.

use super::releases::WitnessConfig;
use super::store::Log;
use anyhow::{anyhow, bail, Context, Result};
use proto::transparency::{
    parse_decimal, verify_checkpoint, verify_cosignatures, witness_answer, AddCheckpoint,
    ADD_CHECKPOINT_PATH, SIZE_CONTENT_TYPE,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One witness and the size it last cosigned, as far as this process knows.
struct Target {
    url: String,
    vkey: String,
    known: AtomicU64,
}

/// The witnesses of one log.
pub struct Witnessing {
    log: Arc<Mutex<Log>>,
    http: reqwest::Client,
    targets: Vec<Target>,
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await?
}

impl Witnessing {
    /// The witnesses in `witnesses` (checked by the config's validation).
    pub fn new(log: Arc<Mutex<Log>>, witnesses: &[WitnessConfig]) -> Result<Self> {
        Ok(Self {
            log,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()?,
            targets: witnesses
                .iter()
                .map(|w| Target {
                    url: w.url.trim_end_matches('/').to_string(),
                    vkey: w.vkey.clone(),
                    known: AtomicU64::new(0),
                })
                .collect(),
        })
    }

    /// Offers the stored checkpoint to every witness that has not cosigned
    /// it; returns how many cosign it now.
    pub async fn round(&self) -> usize {
        let mut n = 0;
        for t in &self.targets {
            match self.submit(t).await {
                Ok(()) => n += 1,
                Err(e) => {
                    tracing::warn!(witness = %t.url, error = %format!("{e:#}"), "no cosignature")
                }
            }
        }
        n
    }

    /// A round every `every`, forever.
    pub async fn run(self: Arc<Self>, every: Duration) {
        loop {
            tokio::time::sleep(every).await;
            self.round().await;
        }
    }

    async fn submit(&self, t: &Target) -> Result<()> {
        let log = self.log.clone();
        let (note, size) = blocking(move || {
            let mut log = log.lock().unwrap();
            let note = log.stored_checkpoint()?;
            log.refresh()?;
            let size = verify_checkpoint(&note, &log.vkey(), log.origin())?.size();
            Ok((note, size))
        })
        .await?;
        if !verify_cosignatures(&note, std::slice::from_ref(&t.vkey))?.is_empty() {
            return Ok(());
        }
        let mut old = t.known.load(Ordering::Relaxed).min(size);
        // At most: a guess, the witness's size from its 409, then the retry.
        for _ in 0..3 {
            let log = self.log.clone();
            let proof = blocking(move || log.lock().unwrap().consistency_proof(size, old)).await?;
            let body = AddCheckpoint {
                old_size: old,
                proof,
                checkpoint: note.clone(),
            };
            let resp = self
                .http
                .post(format!("{}{ADD_CHECKPOINT_PATH}", t.url))
                .body(body.to_bytes())
                .send()
                .await
                .with_context(|| format!("posting to {}", t.url))?;
            let status = resp.status();
            let is_size = resp
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .is_some_and(|v| v.as_bytes().starts_with(SIZE_CONTENT_TYPE.as_bytes()));
            let text = resp.text().await.unwrap_or_default();
            if status == reqwest::StatusCode::CONFLICT && is_size {
                let seen = parse_decimal(text.trim_end())
                    .ok_or_else(|| anyhow!("a 409 whose body is not a size: {text:?}"))?;
                if seen > size {
                    bail!(
                        "the witness has cosigned size {seen} of this log, which holds {size}: \
                         a rolled-back or forked log"
                    );
                }
                old = seen;
                continue;
            }
            if !status.is_success() {
                bail!("the witness answered {status}: {}", text.trim_end());
            }
            let lines = witness_answer(&note, &t.vkey, &text)?;
            t.known.store(size, Ordering::Relaxed);
            let log = self.log.clone();
            let stored =
                blocking(move || log.lock().unwrap().add_cosignatures(&note, &lines)).await?;
            tracing::info!(witness = %t.url, size, stored, "checkpoint cosigned");
            return Ok(());
        }
        bail!("the witness kept answering 409")
    }
}
