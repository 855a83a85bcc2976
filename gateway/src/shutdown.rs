//! Graceful shutdown on SIGTERM or SIGINT (Ctrl-C).
//!
//! 1. The signal starts the drain: the listener is closed (new connections
//!    are refused), idle keep-alive connections are closed, HTTP/2 clients
//!    get GOAWAY, and a request that still arrives on an open connection
//!    gets 503 `shutting_down`.
//! 2. Requests in flight run on for up to `server.shutdown_grace_secs`.
//! 3. At that deadline the ones still running are cancelled: each gets 503
//!    `shutting_down` (OpenAI's error shape, `Retry-After: 1`), and its
//!    pending pipeline entry is dropped.
//! 4. Then the stage channels are closed and local stages stopped (see
//!    `main.rs`); the process exits 0.

use crate::openai_error::ApiError;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The shutdown state shared by the server, the middleware and `main`.
pub struct Shutdown {
    grace: Duration,
    draining: CancellationToken,
    expired: CancellationToken,
}

impl Shutdown {
    /// Not shutting down yet; in-flight requests will get `grace` once it starts.
    pub fn new(grace: Duration) -> Arc<Self> {
        Arc::new(Self {
            grace,
            draining: CancellationToken::new(),
            expired: CancellationToken::new(),
        })
    }

    /// Starts the drain (once; later calls do nothing) and the grace timer.
    pub fn begin(&self) {
        if self.draining.is_cancelled() {
            return;
        }
        tracing::info!(
            grace_secs = self.grace.as_secs_f64(),
            "shutting down: no new connections; requests in flight may finish within the grace period"
        );
        self.draining.cancel();
        let expired = self.expired.clone();
        let grace = self.grace;
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            expired.cancel();
        });
    }

    /// Whether the drain has started.
    pub fn is_draining(&self) -> bool {
        self.draining.is_cancelled()
    }

    /// Resolves when the drain starts.
    pub async fn draining(&self) {
        self.draining.cancelled().await
    }

    /// Resolves when the grace period is over (requests still running are
    /// being cancelled).
    pub async fn expired(&self) {
        self.expired.cancelled().await
    }

    /// Registers the SIGINT and SIGTERM handlers now (so an early signal is
    /// a clean shutdown, not the default kill) and returns a future that
    /// starts the drain on the first of them and then resolves: the
    /// server's graceful-shutdown signal.
    pub fn on_signal(self: &Arc<Self>) -> std::io::Result<impl Future<Output = ()> + Send> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let this = self.clone();
        Ok(async move {
            tokio::select! {
                _ = sigint.recv() => tracing::info!("SIGINT received"),
                _ = sigterm.recv() => tracing::info!("SIGTERM received"),
                _ = this.draining() => {}
            }
            this.begin();
        })
    }
}

/// The answer to a request refused or cancelled by the shutdown.
fn shutting_down() -> Response {
    let mut r = ApiError::shutting_down().into_response();
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// Middleware over every route: refuses requests that arrive during the
/// drain and cancels, at the deadline, those still running.
pub async fn guard(State(sd): State<Arc<Shutdown>>, req: Request, next: Next) -> Response {
    if sd.is_draining() {
        return shutting_down();
    }
    tokio::select! {
        biased;
        resp = next.run(req) => resp,
        _ = sd.expired() => {
            tracing::warn!("request cancelled at the shutdown deadline");
            shutting_down()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drain_then_expire_after_the_grace_period() {
        let sd = Shutdown::new(Duration::ZERO);
        assert!(!sd.is_draining());
        assert!(!sd.expired.is_cancelled());
        sd.begin();
        sd.begin();
        assert!(sd.is_draining());
        tokio::time::timeout(Duration::from_secs(60), sd.expired())
            .await
            .expect("the grace period ends");
    }
}
