//! The pipelines' part of `/metrics`: stage health and attestation failures
//! of every pipeline, what the stages report about their load (asked over
//! the host channel with a `Stats` frame at each scrape: requests held,
//! requests waiting for KV room, sequences, KV tokens, micro-batch sizes,
//! tokens and compute time), and what the gateway derives from the exit
//! stage's per-request report (requests, input and output tokens, finish
//! reasons, time to first token).
//!
//! Label values are fixed: the pipeline (`embeddings`, `completions`), the
//! stage index, the operation and the finish reason (`stop`, `length`,
//! anything else as `other`). No request content can become a label.

use crate::metrics::{family, Histogram, PipelineHealth, BUCKETS};
use proto::frames::{RequestTelemetry, StageStats, BATCH_SIZE_BOUNDS};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// How long a scrape waits for a stage's counters.
pub const STATS_TIMEOUT: Duration = Duration::from_millis(500);

/// Unix time in nanoseconds.
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Per pipeline: what the exit stage reported about finished requests, and
/// time to first token.
#[derive(Default)]
pub struct UsageCounters {
    requests: AtomicU64,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    finish_reasons: Mutex<BTreeMap<&'static str, u64>>,
    first_token: Mutex<Histogram>,
}

impl UsageCounters {
    /// A request finished with a response; `t` is the exit stage's report.
    pub fn finished(&self, t: &RequestTelemetry) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.input_tokens
            .fetch_add(t.input_tokens, Ordering::Relaxed);
        self.output_tokens
            .fetch_add(t.output_tokens, Ordering::Relaxed);
        let mut f = self.finish_reasons.lock().unwrap();
        for r in &t.finish_reasons {
            let label = match r.as_str() {
                "stop" => "stop",
                "length" => "length",
                _ => "other",
            };
            *f.entry(label).or_default() += 1;
        }
    }

    /// Time from submission to the first generated token.
    pub fn first_token(&self, d: Duration) {
        self.first_token.lock().unwrap().observe(d.as_secs_f64());
    }
}

/// A usage counter family: name, help, value.
type UsageFamily = (&'static str, &'static str, fn(&UsageCounters) -> u64);
/// A stage family: name, type, help, value.
type StageFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&StageStats) -> f64,
);

/// One pipeline as its metrics show it, taken by the pipeline at a scrape
/// (plain data: this module knows nothing of pipelines).
pub struct PipelineView<'a> {
    /// Whether it generates text (`completions`) or embeds (`embeddings`).
    pub generation: bool,
    /// Readiness and connection counters.
    pub health: PipelineHealth,
    /// The exit stage's per-request reports.
    pub usage: &'a UsageCounters,
    /// Each stage's counters, `None` where the stage did not answer in time.
    pub stats: Vec<Option<StageStats>>,
    /// Which replica of its model it is, when the model has several (then
    /// every sample carries a `replica` label).
    pub replica: Option<usize>,
}

/// The labels naming a pipeline: `pipeline="embeddings"` or
/// `pipeline="completions"`, plus `replica="N"` where there are replicas.
fn labels(p: &PipelineView) -> String {
    let name = if p.generation {
        "completions"
    } else {
        "embeddings"
    };
    match p.replica {
        Some(r) => format!("pipeline=\"{name}\",replica=\"{r}\""),
        None => format!("pipeline=\"{name}\""),
    }
}

fn operation(p: &PipelineView) -> &'static str {
    if p.generation {
        "text_completion"
    } else {
        "embeddings"
    }
}

/// The pipeline families of every pipeline.
pub fn render(pipelines: &[PipelineView]) -> String {
    let mut o = String::new();
    family(
        &mut o,
        "gateway_pipeline_stage_up",
        "gauge",
        "Per pipeline and stage: 1 when connected over a verified attested channel, else 0.",
    );
    for p in pipelines {
        let up = u8::from(p.health.ready);
        for i in 0..p.health.stage_count {
            let _ = writeln!(
                o,
                "gateway_pipeline_stage_up{{{},stage=\"{i}\"}} {up}",
                labels(p)
            );
        }
    }
    family(
        &mut o,
        "gateway_pipeline_attestation_failures_total",
        "counter",
        "Per pipeline: stage connection attempts refused because evidence or claims failed the policy.",
    );
    for p in pipelines {
        let _ = writeln!(
            o,
            "gateway_pipeline_attestation_failures_total{{{}}} {}",
            labels(p),
            p.health.attestation_failures
        );
    }
    render_usage(&mut o, pipelines);
    render_stages(&mut o, pipelines);
    o
}

fn render_usage(o: &mut String, pipelines: &[PipelineView]) {
    let counters: [UsageFamily; 3] = [
        (
            "gateway_genai_requests_total",
            "Requests answered with a response by the exit stage, by operation.",
            |u| u.requests.load(Ordering::Relaxed),
        ),
        (
            "gateway_genai_input_tokens_total",
            "Input (prompt) tokens of answered requests, as the exit stage counted them.",
            |u| u.input_tokens.load(Ordering::Relaxed),
        ),
        (
            "gateway_genai_output_tokens_total",
            "Generated tokens of answered requests; rate() of it is tokens per second.",
            |u| u.output_tokens.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, get) in counters {
        family(o, name, "counter", help);
        for p in pipelines {
            let _ = writeln!(
                o,
                "{name}{{{},operation=\"{}\"}} {}",
                labels(p),
                operation(p),
                get(p.usage)
            );
        }
    }
    let gen: Vec<_> = pipelines.iter().filter(|p| p.generation).collect();
    family(
        o,
        "gateway_completions_finish_reasons_total",
        "counter",
        "Finished completion choices by finish reason (stop, length).",
    );
    for p in &gen {
        let f = p.usage.finish_reasons.lock().unwrap();
        for reason in ["stop", "length", "other"] {
            let _ = writeln!(
                o,
                "gateway_completions_finish_reasons_total{{{},reason=\"{reason}\"}} {}",
                labels(p),
                f.get(reason).copied().unwrap_or(0)
            );
        }
    }
    let name = "gateway_completions_time_to_first_token_seconds";
    family(
        o,
        name,
        "histogram",
        "From submission to the entry stage until the first token: the first stream bytes reaching the gateway, or (not streamed) the exit stage's sampling time.",
    );
    for p in &gen {
        let h = p.usage.first_token.lock().unwrap();
        let labels = labels(p);
        for (b, c) in BUCKETS.iter().zip(h.counts) {
            let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            o,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}\n{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}",
            h.count, h.sum, h.count
        );
    }
}

fn render_stages(o: &mut String, pipelines: &[PipelineView]) {
    let each = |o: &mut String, f: &dyn Fn(&mut String, &str, &StageStats)| {
        for p in pipelines {
            let st = &p.stats;
            for (i, s) in st.iter().enumerate() {
                if let Some(s) = s {
                    let labels = format!("{},stage=\"{i}\"", labels(p));
                    f(o, &labels, s);
                }
            }
        }
    };
    family(
        o,
        "gateway_stage_stats_up",
        "gauge",
        "1 when the stage answered the scrape's Stats request in time (its stage_* samples are present), else 0.",
    );
    for p in pipelines {
        let st = &p.stats;
        for (i, s) in st.iter().enumerate() {
            let _ = writeln!(
                o,
                "gateway_stage_stats_up{{{},stage=\"{i}\"}} {}",
                labels(p),
                u8::from(s.is_some())
            );
        }
    }
    let gauges: [StageFamily; 7] = [
        (
            "gateway_stage_requests",
            "gauge",
            "Requests the stage holds now (queued or being computed there): its queue depth.",
            |s| s.requests as f64,
        ),
        (
            "gateway_stage_waiting_requests",
            "gauge",
            "Requests waiting for KV-cache room (completions entry stage).",
            |s| s.waiting as f64,
        ),
        (
            "gateway_stage_active_sequences",
            "gauge",
            "Sequences being generated in the stage.",
            |s| s.active_sequences as f64,
        ),
        (
            "gateway_stage_kv_cache_tokens",
            "gauge",
            "KV-cache tokens allocated in the stage.",
            |s| s.kv_tokens_used as f64,
        ),
        (
            "gateway_stage_tokens_total",
            "counter",
            "Tokens run through the stage's layers; rate() of it is the stage's tokens per second.",
            |s| s.tokens as f64,
        ),
        (
            "gateway_stage_compute_seconds_total",
            "counter",
            "Time the stage spent computing micro-batches or steps.",
            |s| s.compute_ns as f64 / 1e9,
        ),
        (
            "gateway_stage_batches_total",
            "counter",
            "Micro-batches (embeddings) or steps (completions) the stage ran.",
            |s| s.batches as f64,
        ),
    ];
    for (name, kind, help, get) in gauges {
        family(o, name, kind, help);
        each(o, &|o, labels, s| {
            let _ = writeln!(o, "{name}{{{labels}}} {}", get(s));
        });
    }
    let name = "gateway_stage_batch_size";
    family(
        o,
        name,
        "histogram",
        "Sequences per micro-batch (embeddings) or step (completions), as the stage counted them.",
    );
    each(o, &|o, labels, s| {
        let mut cum = 0u64;
        for (b, c) in BATCH_SIZE_BOUNDS.iter().zip(&s.batch_size_counts) {
            cum += c;
            let _ = writeln!(o, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(
            o,
            "{name}_bucket{{{labels},le=\"+Inf\"}} {}\n{name}_sum{{{labels}}} {}\n{name}_count{{{labels}}} {}",
            s.batches, s.batch_rows, s.batches
        );
    });
}
