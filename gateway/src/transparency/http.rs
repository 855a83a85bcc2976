//! The log over HTTP, read-only, as C2SP tlog-tiles lays it out under
//! `/v1/transparency/`: `checkpoint` (the signed note), `tile/<L>/<N>[.p/<W>]`
//! (hash tiles) and `tile/entries/<N>[.p/<W>]` (entry bundles). Tiles never
//! change once they exist, so they are served as immutable; the checkpoint
//! is not cached. Anyone may mirror these paths: they are outside the API
//! key check.
//!
//! The folder may be written by other processes (`gateway log add-release`,
//! other gateways): the checkpoint is read from disk on each request and the
//! entries read up to it before it is served, and a tile not held yet is
//! looked for again after reading what was appended since.

use super::store::Log;
use crate::openai_error::ApiError;
use axum::extract::{Path, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use proto::transparency::TileName;
use std::sync::{Arc, Mutex};

/// The URL path prefix of the log.
pub const PREFIX: &str = "/v1/transparency";

/// The routes, over the log in `log` (shared with whoever appends in this
/// process).
pub fn routes<S: Clone + Send + Sync + 'static>(log: Arc<Mutex<Log>>) -> Router<S> {
    Router::new()
        .route(&format!("{PREFIX}/checkpoint"), get(checkpoint))
        .route(&format!("{PREFIX}/tile/{{*path}}"), get(tile))
        .with_state(log)
}

fn internal(e: anyhow::Error) -> Response {
    tracing::error!(error = %format!("{e:#}"), "transparency log read failed");
    ApiError::internal("the transparency log could not be read").into_response()
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> Result<T, Response> {
    match tokio::task::spawn_blocking(f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(internal(e)),
        Err(e) => Err(internal(anyhow::anyhow!("{e}"))),
    }
}

async fn checkpoint(State(log): State<Arc<Mutex<Log>>>) -> Response {
    let note = blocking(move || {
        let mut log = log.lock().unwrap();
        // Read the note first: its entries were synced before it was
        // written, so reading them after it finds every one it covers.
        let note = log.stored_checkpoint()?;
        log.refresh()?;
        Ok(note)
    })
    .await;
    match note {
        Ok(note) => (
            [
                (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            note,
        )
            .into_response(),
        Err(r) => r,
    }
}

async fn tile(State(log): State<Arc<Mutex<Log>>>, Path(path): Path<String>) -> Response {
    let Some(name) = TileName::parse(&path) else {
        return not_found(&path);
    };
    let data = blocking(move || {
        let mut log = log.lock().unwrap();
        let cut = |log: &Log| match name.level {
            None => Ok(log.entry_bundle(name.index, name.width)),
            Some(l) => log.hash_tile(l, name.index, name.width),
        };
        if let Some(d) = cut(&log)? {
            return Ok(Some(d));
        }
        log.refresh()?;
        cut(&log)
    })
    .await;
    match data {
        Ok(Some(d)) => (
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/octet-stream"),
                ),
                (
                    header::CACHE_CONTROL,
                    HeaderValue::from_static("public, max-age=31536000, immutable"),
                ),
            ],
            d,
        )
            .into_response(),
        Ok(None) => not_found(&path),
        Err(r) => r,
    }
}

/// 404: no such tile in the tree (yet), or not a tile path.
fn not_found(path: &str) -> Response {
    ApiError::unknown_route("GET", &format!("{PREFIX}/tile/{path}")).into_response()
}
