//! The gateway-wide cap on requests in flight (`server.max_in_flight`).
//!
//! Connections are capped (`server.max_connections`) and so are HTTP/2
//! streams per connection, but their product is tens of thousands of
//! requests, each of which may hold a body of up to `max_body_bytes`. This
//! cap bounds what the whole gateway works on at once: a model request
//! (`POST` on a keyed route, after its API key passed) that finds every
//! permit taken gets 503 `server_overloaded` with `Retry-After: 1` at once,
//! before its body is read. A request that is refused (any 4xx answer) gives
//! its permit back at once; an answer holds it until its body has been sent
//! or dropped, **or** for at most `max_hold` (the longest route deadline)
//! after it began, so a client that never reads its answer (an HTTP/2
//! window of zero) cannot keep a permit. Requests without a valid key never
//! take one, and `GET`s (health, readiness, metrics, keys, evidence,
//! receipts) are not counted, so an overloaded gateway still answers its
//! probes; `/v1/attestation` has its own limits.

use crate::openai_error::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The permits of `server.max_in_flight`, and how long an answer may hold one.
pub struct InFlightCap {
    permits: Arc<Semaphore>,
    max: usize,
    max_hold: Duration,
}

impl InFlightCap {
    /// A cap of `max` requests in flight (at least 1), each answer holding
    /// its permit for at most `max_hold`.
    pub fn new(max: usize, max_hold: Duration) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
            max_hold,
        })
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

/// Middleware (on the keyed routes, inside the API-key check): 503
/// `server_overloaded` for a `POST` when `max_in_flight` requests are
/// already in flight; otherwise runs it holding a permit, given back at
/// once on a refusal (4xx), else when its response body ends or `max_hold`
/// has passed.
pub async fn limit(State(cap): State<Arc<InFlightCap>>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let Ok(permit) = cap.permits.clone().try_acquire_owned() else {
        tracing::info!(max = cap.max, "requests in flight at the gateway's cap");
        return ApiError::overloaded(cap.max).into_response();
    };
    let response = next.run(req).await;
    if response.status().is_client_error() {
        // A refusal did no work; its permit is dropped here.
        return response;
    }
    hold_until_body_ends(response, Lease::new(permit, cap.max_hold))
}

/// A permit that is given back when dropped or when its time is up,
/// whichever comes first.
struct Lease {
    permit: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
    timer: tokio::task::AbortHandle,
}

impl Lease {
    fn new(permit: OwnedSemaphorePermit, max_hold: Duration) -> Self {
        let permit = Arc::new(Mutex::new(Some(permit)));
        let held = permit.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(max_hold).await;
            held.lock().unwrap_or_else(|e| e.into_inner()).take();
        })
        .abort_handle();
        Self { permit, timer }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.timer.abort();
        self.permit.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

/// `response` with `guard` kept alive until its body has been sent or
/// dropped (a stream counts until it ends or its client goes away).
pub fn hold_until_body_ends<G: Send + Sync + 'static>(response: Response, guard: G) -> Response {
    response.map(|body| {
        Body::new(http_body_util::BodyExt::map_frame(body, move |frame| {
            let _held = &guard;
            frame
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use axum::Router;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    /// A router whose first POST answers with a body that stays open until
    /// the test sends its end through the returned channel; later POSTs
    /// answer at once.
    fn app(cap: Arc<InFlightCap>) -> (Router, tokio::sync::mpsc::Sender<()>) {
        use futures_util::StreamExt as _;
        let (tx, rx) = tokio::sync::mpsc::channel::<()>(1);
        let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
        let work = move || {
            let rx = rx.lock().unwrap().take();
            async move {
                let Some(mut rx) = rx else {
                    return Body::from("quick");
                };
                let first = futures_util::stream::once(async { Ok::<_, std::io::Error>("first") });
                let last = futures_util::stream::once(async move {
                    rx.recv().await;
                    Ok("last")
                });
                Body::from_stream(first.chain(last))
            }
        };
        let router = Router::new()
            .route("/work", post(work))
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/refused",
                post(|| async { ApiError::invalid(None, "no").into_response() }),
            )
            .layer(axum::middleware::from_fn_with_state(cap, limit));
        (router, tx)
    }

    fn post_req() -> Request {
        Request::post("/work").body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn past_the_cap_a_post_gets_503_until_a_stream_ends() {
        use futures_util::StreamExt as _;
        let cap = InFlightCap::new(1, Duration::from_secs(60));
        let (router, end) = app(cap.clone());
        // The first request's response streams and holds the only permit.
        let first = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(first.status(), 200);
        assert_eq!(cap.in_flight(), 1);
        let second = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(second.status(), 503);
        assert_eq!(second.headers()["retry-after"], "1");
        let body = second.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "server_overloaded");
        assert_eq!(v["error"]["type"], "server_error");
        // GETs are not counted: probes are answered.
        let health = router
            .clone()
            .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        // The stream ends: its permit comes back with its body.
        end.send(()).await.unwrap();
        let mut stream = first.into_body().into_data_stream();
        while stream.next().await.is_some() {}
        drop(stream);
        assert_eq!(cap.in_flight(), 0);
        let third = router.oneshot(post_req()).await.unwrap();
        assert_eq!(third.status(), 200);
    }

    #[tokio::test]
    async fn a_dropped_response_gives_its_permit_back() {
        let cap = InFlightCap::new(1, Duration::from_secs(60));
        let (router, _end) = app(cap.clone());
        let first = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(cap.in_flight(), 1);
        // The client goes away before the stream ends.
        drop(first);
        assert_eq!(cap.in_flight(), 0);
        assert_eq!(router.oneshot(post_req()).await.unwrap().status(), 200);
    }

    #[tokio::test]
    async fn a_refusal_gives_its_permit_back_at_once() {
        let cap = InFlightCap::new(1, Duration::from_secs(60));
        let (router, _end) = app(cap.clone());
        let r = router
            .clone()
            .oneshot(Request::post("/refused").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        // Its body is not even read yet, and the permit is back.
        assert_eq!(cap.in_flight(), 0);
        drop(r);
    }

    #[tokio::test]
    async fn an_answer_nobody_reads_holds_its_permit_for_max_hold_only() {
        let cap = InFlightCap::new(1, Duration::from_millis(200));
        let (router, _end) = app(cap.clone());
        // The answer streams and its client never reads or drops it.
        let stalled = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(cap.in_flight(), 1);
        assert_eq!(
            router.clone().oneshot(post_req()).await.unwrap().status(),
            503
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(cap.in_flight(), 0, "the permit outlived max_hold");
        assert_eq!(router.oneshot(post_req()).await.unwrap().status(), 200);
        drop(stalled);
    }
}
