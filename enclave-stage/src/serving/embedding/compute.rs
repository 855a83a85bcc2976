//! The compute thread of a stage. Model work runs here, off the async
//! runtime. The entry stage drains everything queued, plans micro-batches
//! and runs them one after another (new arrivals wait for the next drain);
//! each finished micro-batch goes downstream at once, so the next stage
//! works on batch k while this one works on batch k+1.
//!
//! Requests are announced (`Begin`) before their rows and closed by the
//! previous stage's receipt links; the [`Tracker`] turns a request that is
//! complete here into this stage's signed link (or, at the exit stage, the
//! sealed response and its receipt).
//!
//! A micro-batch that fails is retried one sequence at a time, so that only
//! the sequences that fail alone are reported failed and every other
//! request's output is still produced.

use crate::fault::Fault;
use crate::keys::StageKeys;
use crate::serving::embedding::batcher::{plan, BatchLimits, Seq, ShapeInfo};
use crate::serving::embedding::engine::{Engine, Padded};
use crate::serving::embedding::tracker::{row_digest, Finished, Tracker};
use crate::stats::STATS;
use crate::work::{failure, Output, Work};
use proto::frames::{ActivationBatch, ActivationMessage, BatchItem, ErrorKind};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::Sender;

/// Rows the entry stage has admitted and not yet computed or dropped: what
/// its admission bounds ([`admit_rows`]), so that the work queue stays
/// bounded.
static QUEUED_ROWS: AtomicUsize = AtomicUsize::new(0);

/// Admits `n` more rows if at most `cap` would then be waiting (entry
/// stage); `false`: the request must be refused (503, retry later).
pub fn admit_rows(n: usize, cap: usize) -> bool {
    let before = QUEUED_ROWS.fetch_add(n, Ordering::SeqCst);
    if before + n > cap && before > 0 {
        QUEUED_ROWS.fetch_sub(n, Ordering::SeqCst);
        return false;
    }
    true
}

/// `n` admitted rows left the queue (computed, dropped, or never queued).
pub fn rows_left(n: usize) {
    let _ = QUEUED_ROWS.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| {
        Some(q.saturating_sub(n))
    });
}

/// State of the compute thread.
pub struct Compute {
    engine: Arc<Engine>,
    keys: Arc<StageKeys>,
    out: Sender<Output>,
    limits: BatchLimits,
    shape: ShapeInfo,
    fault: Fault,
    next_batch: u64,
    tracker: Tracker,
}

enum Input<'a> {
    Tokens(&'a [Seq]),
    Hidden(&'a Padded),
}

impl Compute {
    /// A compute loop for `engine` sending to `out`.
    pub fn new(
        engine: Arc<Engine>,
        keys: Arc<StageKeys>,
        out: Sender<Output>,
        limits: BatchLimits,
        shape: ShapeInfo,
    ) -> Self {
        Self {
            tracker: Tracker::new(engine.claims.clone()),
            keys,
            engine,
            out,
            limits,
            shape,
            fault: Fault::from_env(),
            next_batch: 0,
        }
    }

    /// Runs until the work queue closes.
    pub fn run(mut self, rx: Receiver<Work>) {
        // Work taken off the queue early (by [`Self::absorb`]), in order.
        let mut backlog = VecDeque::new();
        loop {
            let first = match backlog.pop_front() {
                Some(w) => w,
                None => match rx.recv() {
                    Ok(w) => w,
                    Err(_) => return,
                },
            };
            let mut seqs = Vec::new();
            // Drain before refill: everything queued now joins this round.
            let mut next = Some(first);
            while let Some(w) = next
                .take()
                .or_else(|| backlog.pop_front())
                .or_else(|| rx.try_recv().ok())
            {
                match w {
                    Work::Begin(ctx) => self.begin(ctx),
                    Work::Seqs(s) => seqs.extend(s),
                    Work::Batch(b) => {
                        self.absorb(&rx, &mut backlog);
                        self.run_activation_batch(b)
                    }
                    Work::Links {
                        request_id,
                        links,
                        timings,
                        signer,
                    } => {
                        self.tracker
                            .upstream_links(request_id, links, timings, signer);
                        self.try_finish(request_id);
                    }
                    Work::Failed { request_id, error } => self.upstream_failed(request_id, error),
                    Work::Cancel { request_id } => self.cancel(request_id),
                    Work::Reset => {
                        rows_left(seqs.len());
                        seqs.clear();
                        self.tracker.clear();
                    }
                    Work::BeginGeneration { .. } | Work::Activation(_) | Work::Feedback(_) => {
                        tracing::warn!("generation work sent to an embedding stage; ignored")
                    }
                }
            }
            if !seqs.is_empty() {
                let stages = self.engine.claims.num_stages as usize;
                for mb in plan(seqs, &self.limits, &self.shape, stages) {
                    // Rows of requests cancelled (or failed) meanwhile are
                    // dropped before they are computed.
                    self.absorb(&rx, &mut backlog);
                    let n = mb.len();
                    let live: Vec<Seq> = mb
                        .into_iter()
                        .filter(|s| self.tracker.knows(s.item.request_id))
                        .collect();
                    if !live.is_empty() {
                        self.run_seqs(live);
                    }
                    rows_left(n);
                }
            }
            STATS.gauges(self.tracker.len(), 0, 0, 0);
        }
    }

    /// Takes what is queued now into `backlog` (keeping its order), acting
    /// at once on what drops a request this stage holds: a cancellation,
    /// an upstream failure, a teardown. So a client that hangs up stops
    /// costing compute at the next micro-batch, in every stage, instead of
    /// after all of its rows.
    fn absorb(&mut self, rx: &Receiver<Work>, backlog: &mut VecDeque<Work>) {
        while let Ok(w) = rx.try_recv() {
            match w {
                Work::Cancel { request_id } if self.tracker.knows(request_id) => {
                    self.cancel(request_id)
                }
                Work::Failed { request_id, error } if self.tracker.knows(request_id) => {
                    self.upstream_failed(request_id, error)
                }
                Work::Reset => {
                    // Everything before it belongs to the torn-down pipeline.
                    self.tracker.clear();
                    backlog.push_back(Work::Reset);
                }
                w => backlog.push_back(w),
            }
        }
    }

    /// The client went away (entry stage): the request is dropped here, and
    /// in the later stages, which the failure (499) tells.
    fn cancel(&mut self, request_id: u64) {
        if !self.tracker.knows(request_id) {
            return;
        }
        self.tracker.forget(request_id);
        tracing::info!(
            request_id,
            "request cancelled by the client; its rows are dropped"
        );
        let err = crate::work::cancelled();
        self.send(failure(self.engine.claims.is_exit(), request_id, err));
    }

    /// A request failed in an earlier stage: forgotten here, passed on.
    fn upstream_failed(&mut self, request_id: u64, error: proto::frames::PipelineError) {
        self.tracker.forget(request_id);
        self.send(failure(self.engine.claims.is_exit(), request_id, error));
    }

    /// A request begins here (and, before the exit stage, downstream), unless
    /// its id was used before in this configuration: then it is refused, and
    /// a live request with that id fails too rather than take its rows.
    fn begin(&mut self, ctx: Box<proto::frames::RequestContext>) {
        let request_id = ctx.env.request_id;
        if let Err(why) = self.tracker.may_begin(request_id) {
            tracing::warn!(request_id, reason = %why, "request refused");
            let err = self.tracker.fail(request_id, ErrorKind::Internal, why);
            return self.send(failure(self.engine.claims.is_exit(), request_id, err));
        }
        if !self.engine.claims.is_exit() {
            self.send(Output::Activation(ActivationMessage::Begin(ctx.clone())));
        }
        self.tracker.begin(*ctx);
    }

    /// Counts a micro-batch that began at `began` and took `took`, in the
    /// stage's counters and in each of its requests' timings.
    fn record_batch(&mut self, items: &[BatchItem], began: Instant, took: std::time::Duration) {
        let tokens = items.iter().map(|i| i.tokens as u64).sum();
        STATS.batch(items.len(), tokens, took);
        let mut requests: Vec<u64> = items.iter().map(|i| i.request_id).collect();
        requests.sort_unstable();
        requests.dedup();
        for r in requests {
            self.tracker.computed(r, began, took);
        }
    }

    /// Runs one micro-batch and emits its output. A failed batch of several
    /// rows is handed back (`true`) to be retried one row at a time; a
    /// failed single row is reported failed.
    fn attempt(&mut self, items: &[BatchItem], input: Input<'_>) -> bool {
        let began = Instant::now();
        // A panic in the model's code (a shape it did not expect) fails
        // this micro-batch like an error, not the compute thread and with
        // it every request of the stage.
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.process(items, input)))
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a panic in this stage's compute thread")));
        self.record_batch(items, began, began.elapsed());
        match r {
            Ok(out) => self.emit(items.to_vec(), out),
            Err(e) if items.len() > 1 => {
                tracing::warn!(rows = items.len(), error = %e, "micro-batch failed; retrying its sequences one by one");
                return true;
            }
            Err(e) => self.fail(items, &e),
        }
        false
    }

    fn run_seqs(&mut self, seqs: Vec<Seq>) {
        let items: Vec<BatchItem> = seqs.iter().map(|s| s.item).collect();
        if self.attempt(&items, Input::Tokens(&seqs)) {
            for s in seqs {
                self.run_seqs(vec![s]);
            }
        }
    }

    fn run_activation_batch(&mut self, b: ActivationBatch) {
        if !b.items.iter().any(|i| self.tracker.knows(i.request_id)) {
            // Every row's request was cancelled or failed: nothing to compute.
            return;
        }
        for (row, item) in b.items.iter().enumerate() {
            if let Err(why) = self
                .tracker
                .received_row(item, row_digest(&b.hidden, row, item))
            {
                self.fail(&[*item], &anyhow::anyhow!(why));
            }
        }
        let input = match Padded::from_frames(&b.hidden, &b.mask, self.engine.hidden_size()) {
            Ok(p) if p.hidden.dims()[0] == b.items.len() => p,
            Ok(_) => {
                return self.fail(&b.items, &anyhow::anyhow!("row count does not match items"))
            }
            Err(e) => return self.fail(&b.items, &e),
        };
        self.run_padded(b.items, input);
    }

    fn run_padded(&mut self, items: Vec<BatchItem>, input: Padded) {
        if self.attempt(&items, Input::Hidden(&input)) {
            for (row, item) in items.iter().enumerate() {
                match input.rows(row, 1, item.tokens as usize) {
                    Ok(one) => self.run_padded(vec![*item], one),
                    Err(e) => self.fail(&[*item], &e),
                }
            }
        }
    }

    fn process(&self, items: &[BatchItem], input: Input<'_>) -> anyhow::Result<Padded> {
        if self.fault.fires(self.engine.claims.stage_index, items) {
            if self.fault.panics() {
                panic!("injected panic in a micro-batch");
            }
            anyhow::bail!("injected fault");
        }
        match input {
            Input::Tokens(seqs) => {
                let refs: Vec<&[u32]> = seqs.iter().map(|s| s.ids.as_slice()).collect();
                self.engine.run_tokens(&refs)
            }
            Input::Hidden(p) => self.engine.run_hidden(Padded {
                hidden: p.hidden.clone(),
                mask: p.mask.clone(),
            }),
        }
    }

    fn emit(&mut self, items: Vec<BatchItem>, out: Padded) {
        let micro_batch_id = self.next_batch;
        self.next_batch += 1;
        if !self.engine.claims.is_exit() {
            let (hidden, mask) = match out.to_frames() {
                Ok(f) => f,
                Err(e) => return self.fail(&items, &e),
            };
            for (row, item) in items.iter().enumerate() {
                self.tracker
                    .finished_row(item, row_digest(&hidden, row, item), None);
            }
            self.send(Output::Activation(ActivationMessage::Batch(
                ActivationBatch {
                    micro_batch_id,
                    items: items.clone(),
                    hidden,
                    mask,
                },
            )));
        } else {
            let vectors = match self.engine.pool(&out) {
                Ok(v) => v,
                Err(e) => return self.fail(&items, &e),
            };
            let dim = self.engine.hidden_size();
            for (row, item) in items.iter().enumerate() {
                let v = vectors[row * dim..(row + 1) * dim].to_vec();
                self.tracker.finished_row(item, None, Some(v));
            }
        }
        let mut requests: Vec<u64> = items.iter().map(|i| i.request_id).collect();
        requests.sort_unstable();
        requests.dedup();
        for request_id in requests {
            self.try_finish(request_id);
        }
    }

    fn try_finish(&mut self, request_id: u64) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        match self.tracker.try_finish(request_id, &self.keys, now) {
            None => {}
            Some(Ok(Finished::Links(m))) => self.send(Output::Activation(m)),
            Some(Ok(Finished::Response(m))) => self.send(Output::Result(m)),
            Some(Err(e)) => self.send(failure(self.engine.claims.is_exit(), request_id, e)),
        }
    }

    fn fail(&mut self, items: &[BatchItem], error: &anyhow::Error) {
        let mut requests: Vec<u64> = items.iter().map(|i| i.request_id).collect();
        requests.sort_unstable();
        requests.dedup();
        tracing::warn!(requests = requests.len(), error = %error, "sequence failed in this stage");
        for request_id in requests {
            if !self.tracker.knows(request_id) {
                continue;
            }
            let message = format!(
                "stage {} failed on this request: {error}",
                self.engine.claims.stage_index
            );
            let err = self.tracker.fail(request_id, ErrorKind::Internal, message);
            self.send(failure(self.engine.claims.is_exit(), request_id, err));
        }
    }

    fn send(&self, o: Output) {
        if self.out.blocking_send(o).is_err() {
            tracing::error!("output queue closed; dropping output");
        }
    }
}
