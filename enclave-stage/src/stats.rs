//! What a stage measures about its own work, with no request content:
//! process-wide load counters (answered to the gateway's `Stats` request on
//! the host channel) and each request's timing in this stage (reported back
//! with the response so the gateway can emit per-stage trace spans).

use proto::frames::{StageStats, StageTiming, BATCH_SIZE_BOUNDS};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Load counters of this stage process (one stage per process).
pub struct StageCounters {
    requests: AtomicU64,
    waiting: AtomicU64,
    active_sequences: AtomicU64,
    kv_tokens_used: AtomicU64,
    batches: AtomicU64,
    batch_rows: AtomicU64,
    batch_sizes: [AtomicU64; BATCH_SIZE_BOUNDS.len() + 1],
    tokens: AtomicU64,
    compute_ns: AtomicU64,
}

/// The stage's counters.
pub static STATS: StageCounters = StageCounters::zeroed();

impl StageCounters {
    /// All counters at zero.
    const fn zeroed() -> Self {
        StageCounters {
            requests: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            active_sequences: AtomicU64::new(0),
            kv_tokens_used: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_rows: AtomicU64::new(0),
            batch_sizes: [const { AtomicU64::new(0) }; BATCH_SIZE_BOUNDS.len() + 1],
            tokens: AtomicU64::new(0),
            compute_ns: AtomicU64::new(0),
        }
    }
}

impl StageCounters {
    /// One micro-batch (or step) of `rows` sequences and `tokens` tokens ran for `took`.
    pub fn batch(&self, rows: usize, tokens: u64, took: Duration) {
        let rows = rows as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.batch_rows.fetch_add(rows, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        self.compute_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        let i = BATCH_SIZE_BOUNDS
            .iter()
            .position(|&b| rows <= b)
            .unwrap_or(BATCH_SIZE_BOUNDS.len());
        self.batch_sizes[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the gauges: requests held, requests waiting for KV room,
    /// sequences generating, KV tokens allocated.
    pub fn gauges(&self, requests: usize, waiting: usize, active: usize, kv_tokens: usize) {
        self.requests.store(requests as u64, Ordering::Relaxed);
        self.waiting.store(waiting as u64, Ordering::Relaxed);
        self.active_sequences
            .store(active as u64, Ordering::Relaxed);
        self.kv_tokens_used
            .store(kv_tokens as u64, Ordering::Relaxed);
    }

    /// A snapshot for the gateway.
    pub fn snapshot(&self) -> StageStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StageStats {
            requests: get(&self.requests),
            waiting: get(&self.waiting),
            active_sequences: get(&self.active_sequences),
            // Bucketed as sealed requests' token counts are: polled
            // exactly, they would tell a lone request's prompt length and
            // `max_tokens × n` (issue 47).
            kv_tokens_used: proto::frames::bucket_count(get(&self.kv_tokens_used)),
            batches: get(&self.batches),
            batch_rows: get(&self.batch_rows),
            batch_size_counts: self.batch_sizes.iter().map(get).collect(),
            tokens: proto::frames::bucket_count(get(&self.tokens)),
            compute_ns: get(&self.compute_ns),
        }
    }
}

/// Unix time in nanoseconds.
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// One request's time in this stage.
#[derive(Clone, Debug)]
pub struct RequestTimer {
    arrived: Instant,
    start_unix_ns: u64,
    first_compute: Option<Instant>,
    compute: Duration,
    batches: u32,
}

impl RequestTimer {
    /// Starts timing now (the request reached the stage).
    pub fn start() -> Self {
        Self {
            arrived: Instant::now(),
            start_unix_ns: unix_ns(),
            first_compute: None,
            compute: Duration::ZERO,
            batches: 0,
        }
    }

    /// The request took part in a micro-batch (or step) that began at
    /// `began` and took `took`.
    pub fn computed(&mut self, began: Instant, took: Duration) {
        if self.first_compute.is_none() {
            self.first_compute = Some(began);
        }
        self.compute += took;
        self.batches += 1;
    }

    /// The timing as reported, ending now.
    pub fn finish(&self, stage_index: u32) -> StageTiming {
        let queue = self.first_compute.map_or(Duration::ZERO, |f| {
            f.saturating_duration_since(self.arrived)
        });
        StageTiming {
            stage_index,
            start_unix_ns: self.start_unix_ns,
            queue_ns: queue.as_nanos() as u64,
            compute_ns: self.compute.as_nanos() as u64,
            end_unix_ns: self.start_unix_ns + self.arrived.elapsed().as_nanos() as u64,
            batches: self.batches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_sizes_land_in_their_buckets() {
        let c = StageCounters::zeroed();
        for rows in [1, 2, 3, 300] {
            c.batch(rows, 10, Duration::from_millis(1));
        }
        let s = c.snapshot();
        assert_eq!(s.batches, 4);
        assert_eq!(s.batch_rows, 306);
        // 40 tokens, shown to the host to their bucket.
        assert_eq!(s.tokens, 48);
        assert_eq!(&s.batch_size_counts[..3], &[1, 1, 1]);
        assert_eq!(*s.batch_size_counts.last().unwrap(), 1);
    }

    #[test]
    fn timer_reports_queue_then_compute() {
        let mut t = RequestTimer::start();
        std::thread::sleep(Duration::from_millis(5));
        t.computed(Instant::now(), Duration::from_millis(3));
        let r = t.finish(1);
        assert_eq!(r.stage_index, 1);
        assert!(r.queue_ns >= 5_000_000, "{r:?}");
        assert_eq!(r.compute_ns, 3_000_000);
        assert_eq!(r.batches, 1);
        assert!(r.end_unix_ns >= r.start_unix_ns + r.queue_ns);
    }
}
