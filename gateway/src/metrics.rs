//! Prometheus metrics, served at `GET /metrics` in the text exposition
//! format (version 0.0.4).
//!
//! Hand-written rather than the `prometheus` crate: the set is small and
//! fixed, the exposition format is a few lines of text, and this keeps the
//! dependency tree (and what an auditor of the host must read) smaller.
//! Counters are atomics or small mutex-guarded maps keyed by labels taken
//! only from route templates, status codes and fixed enums, so request
//! content, API keys and tokens can never become label values. The unit
//! tests below check the format.

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use proto::receipt::Sealing;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Latency histogram bucket bounds, seconds.
pub(crate) const BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// A pipeline's readiness and connection counters, as the pipeline reports
/// them at a scrape (plain data: this module knows nothing of pipelines).
#[derive(Clone, Copy, Debug, Default)]
pub struct PipelineHealth {
    /// Every stage connected and verified against the policy.
    pub ready: bool,
    /// Stages in the pipeline.
    pub stage_count: usize,
    /// Times the pipeline was re-established after breaking.
    pub reconnects: u64,
    /// Stage connection attempts refused by the policy.
    pub attestation_failures: u64,
}

/// Why the auth middleware refused a request.
#[derive(Clone, Copy, Debug)]
pub enum AuthRejection {
    /// No bearer token.
    Missing,
    /// A token that matches no key.
    Invalid,
    /// Over the key's requests per minute.
    RateLimited,
    /// Over the key's concurrent requests.
    Concurrency,
}

impl AuthRejection {
    const ALL: [AuthRejection; 4] = [
        Self::Missing,
        Self::Invalid,
        Self::RateLimited,
        Self::Concurrency,
    ];
    fn label(self) -> &'static str {
        match self {
            Self::Missing => "missing_key",
            Self::Invalid => "invalid_key",
            Self::RateLimited => "rate_limited",
            Self::Concurrency => "concurrency_limited",
        }
    }
}

/// Why a streamed answer ended before its last event reached the client.
#[derive(Clone, Copy, Debug)]
pub enum StreamCut {
    /// The client closed the connection.
    ClientGone,
    /// The client stopped reading for the route's deadline.
    ClientStalled,
    /// The pipeline broke, went silent or answered out of order.
    Pipeline,
}

impl StreamCut {
    const ALL: [StreamCut; 3] = [Self::ClientGone, Self::ClientStalled, Self::Pipeline];
    fn label(self) -> &'static str {
        match self {
            Self::ClientGone => "client_gone",
            Self::ClientStalled => "client_stopped_reading",
            Self::Pipeline => "pipeline",
        }
    }
}

/// A histogram over [`BUCKETS`] (cumulative counts per bound).
#[derive(Default)]
pub(crate) struct Histogram {
    pub(crate) counts: [u64; BUCKETS.len()],
    pub(crate) count: u64,
    pub(crate) sum: f64,
}

impl Histogram {
    /// Adds one observation.
    pub(crate) fn observe(&mut self, v: f64) {
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += v;
    }
}

/// The gateway's metrics.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    latency: Mutex<BTreeMap<String, Histogram>>,
    in_flight: AtomicI64,
    receipts: AtomicU64,
    receipts_not_stored: AtomicU64,
    sealing: [AtomicU64; 3],
    auth_rejections: [AtomicU64; 4],
    streams_cut: [AtomicU64; 3],
}

/// Decrements the in-flight gauge when a request ends (or is cancelled).
struct InFlight<'a>(&'a AtomicI64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn sealing_index(s: Sealing) -> usize {
    match s {
        Sealing::Plain => 0,
        Sealing::Enclave => 1,
        Sealing::Gateway => 2,
    }
}

/// A family's `# HELP` and `# TYPE` lines.
pub(crate) fn family(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// A family with one unlabelled sample: `(name, kind)`, help, value.
fn scalar(o: &mut String, (name, kind): (&str, &str), help: &str, value: impl std::fmt::Display) {
    family(o, name, kind, help);
    let _ = writeln!(o, "{name} {value}");
}

const SEALING_LABELS: [&str; 3] = ["plain", "enclave", "gateway"];

impl Metrics {
    /// Records one finished request.
    pub fn observe(&self, endpoint: &str, status: u16, seconds: f64) {
        *self
            .requests
            .lock()
            .unwrap()
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
        self.latency
            .lock()
            .unwrap()
            .entry(endpoint.to_string())
            .or_default()
            .observe(seconds);
    }

    /// A receipt was issued.
    pub fn receipt_issued(&self) {
        self.receipts.fetch_add(1, Ordering::Relaxed);
    }

    /// A receipt could not be written to the receipt store.
    pub fn receipt_not_stored(&self) {
        self.receipts_not_stored.fetch_add(1, Ordering::Relaxed);
    }

    /// An embeddings request arrived with this sealing.
    pub fn sealing(&self, s: Sealing) {
        self.sealing[sealing_index(s)].fetch_add(1, Ordering::Relaxed);
    }

    /// The auth middleware refused a request.
    pub fn auth_rejected(&self, why: AuthRejection) {
        self.auth_rejections[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A streamed answer was cut short (its sequences are cancelled in
    /// every stage).
    pub fn stream_cut(&self, why: StreamCut) {
        self.streams_cut[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// The exposition text; `pipeline` (the default pipeline's health) adds
    /// its readiness and connection counters.
    pub fn render(&self, pipeline: Option<&PipelineHealth>) -> String {
        let mut o = String::new();
        family(
            &mut o,
            "gateway_http_requests_total",
            "counter",
            "HTTP requests by route template and status code.",
        );
        for ((ep, status), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(
                o,
                "gateway_http_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                escape(ep)
            );
        }
        family(
            &mut o,
            "gateway_http_request_duration_seconds",
            "histogram",
            "Time from request arrival to response headers, by route template.",
        );
        for (ep, h) in self.latency.lock().unwrap().iter() {
            let ep = escape(ep);
            for (b, c) in BUCKETS.iter().zip(h.counts) {
                let _ = writeln!(
                    o,
                    "gateway_http_request_duration_seconds_bucket{{endpoint=\"{ep}\",le=\"{b}\"}} {c}"
                );
            }
            let _ = writeln!(
                o,
                "gateway_http_request_duration_seconds_bucket{{endpoint=\"{ep}\",le=\"+Inf\"}} {}\n\
                 gateway_http_request_duration_seconds_sum{{endpoint=\"{ep}\"}} {}\n\
                 gateway_http_request_duration_seconds_count{{endpoint=\"{ep}\"}} {}",
                h.count, h.sum, h.count
            );
        }
        scalar(
            &mut o,
            ("gateway_http_requests_in_flight", "gauge"),
            "HTTP requests being handled now (including those waiting for the pipeline).",
            self.in_flight.load(Ordering::Relaxed),
        );
        family(
            &mut o,
            "gateway_embeddings_requests_by_sealing_total",
            "counter",
            "Model requests (embeddings, completions, chat; the name is historical) by how the body arrived: plain (gateway seals), enclave (sealed by the client to the entry stage), gateway (sealed to the gateway key).",
        );
        for (i, l) in SEALING_LABELS.iter().enumerate() {
            let _ = writeln!(
                o,
                "gateway_embeddings_requests_by_sealing_total{{sealing=\"{l}\"}} {}",
                self.sealing[i].load(Ordering::Relaxed)
            );
        }
        scalar(
            &mut o,
            ("gateway_receipts_issued_total", "counter"),
            "Signed receipts returned to clients.",
            self.receipts.load(Ordering::Relaxed),
        );
        scalar(
            &mut o,
            ("gateway_receipts_not_stored_total", "counter"),
            "Receipts the receipt store failed to keep (the client still got them; GET /v1/receipts/{id} will not find them).",
            self.receipts_not_stored.load(Ordering::Relaxed),
        );
        let by_reason = |o: &mut String,
                         name: &str,
                         help: &str,
                         rows: &mut dyn Iterator<Item = (&str, u64)>| {
            family(o, name, "counter", help);
            for (reason, n) in rows {
                let _ = writeln!(o, "{name}{{reason=\"{reason}\"}} {n}");
            }
        };
        by_reason(
            &mut o,
            "gateway_auth_rejections_total",
            "Requests refused by the API-key middleware, by reason.",
            &mut AuthRejection::ALL.into_iter().map(|r| {
                (
                    r.label(),
                    self.auth_rejections[r as usize].load(Ordering::Relaxed),
                )
            }),
        );
        by_reason(
            &mut o,
            "gateway_streams_cut_total",
            "Streamed answers that ended before their last event, by reason (their work is cancelled in every stage).",
            &mut StreamCut::ALL
                .into_iter()
                .map(|r| (r.label(), self.streams_cut[r as usize].load(Ordering::Relaxed))),
        );
        if let Some(p) = pipeline {
            let up = p.ready;
            family(
                &mut o,
                "gateway_pipeline_ready",
                "gauge",
                "1 when every stage is connected and verified against the policy, else 0.",
            );
            let _ = writeln!(o, "gateway_pipeline_ready {}", u8::from(up));
            family(
                &mut o,
                "gateway_stage_up",
                "gauge",
                "Per stage: 1 when connected over a verified attested channel, else 0.",
            );
            for i in 0..p.stage_count {
                let _ = writeln!(o, "gateway_stage_up{{stage=\"{i}\"}} {}", u8::from(up));
            }
            family(
                &mut o,
                "gateway_pipeline_reconnects_total",
                "counter",
                "Times the pipeline was re-established after breaking.",
            );
            let _ = writeln!(o, "gateway_pipeline_reconnects_total {}", p.reconnects);
            family(
                &mut o,
                "gateway_attestation_failures_total",
                "counter",
                "Stage connection attempts refused because evidence or claims failed the policy.",
            );
            let _ = writeln!(
                o,
                "gateway_attestation_failures_total {}",
                p.attestation_failures
            );
        }
        o
    }
}

/// Escapes a label value (backslash, quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Middleware over every route: counts requests by route template (never
/// the raw path, which can carry ids) and status, and times them.
pub async fn track(State(m): State<std::sync::Arc<Metrics>>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let started = Instant::now();
    m.in_flight.fetch_add(1, Ordering::Relaxed);
    let _guard = InFlight(&m.in_flight);
    let resp = next.run(req).await;
    m.observe(
        &endpoint,
        resp.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_format() {
        let m = Metrics::default();
        m.observe("/v1/models", 200, 0.003);
        m.observe("/v1/models", 200, 2.0);
        m.observe("/v1/models", 401, 0.0001);
        m.receipt_issued();
        m.sealing(Sealing::Gateway);
        m.auth_rejected(AuthRejection::RateLimited);
        let t = m.render(None);
        for line in [
            "# TYPE gateway_http_requests_total counter",
            "gateway_http_requests_total{endpoint=\"/v1/models\",status=\"200\"} 2",
            "gateway_http_requests_total{endpoint=\"/v1/models\",status=\"401\"} 1",
            "# TYPE gateway_http_request_duration_seconds histogram",
            "gateway_http_request_duration_seconds_bucket{endpoint=\"/v1/models\",le=\"0.001\"} 1",
            "gateway_http_request_duration_seconds_bucket{endpoint=\"/v1/models\",le=\"0.005\"} 2",
            "gateway_http_request_duration_seconds_bucket{endpoint=\"/v1/models\",le=\"2.5\"} 3",
            "gateway_http_request_duration_seconds_bucket{endpoint=\"/v1/models\",le=\"+Inf\"} 3",
            "gateway_http_request_duration_seconds_count{endpoint=\"/v1/models\"} 3",
            "gateway_http_requests_in_flight 0",
            "gateway_receipts_issued_total 1",
            "gateway_embeddings_requests_by_sealing_total{sealing=\"gateway\"} 1",
            "gateway_embeddings_requests_by_sealing_total{sealing=\"plain\"} 0",
            "gateway_auth_rejections_total{reason=\"rate_limited\"} 1",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line:?} in\n{t}");
        }
        // Every sample line is `name{labels} value` or `name value`.
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = l.rsplit_once(' ').unwrap();
            assert!(v.parse::<f64>().is_ok(), "bad sample {l:?}");
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
