//! Running a step: the entry stage's planned steps and later stages'
//! batches through this stage's layers, retried one sequence at a time on
//! failure, and the exit stage's sampling.

use super::{chain, seq_key, Generator, StepInput};
use crate::models::llama::SeqSlice;
use crate::serving::generation::scheduler::Planned;
use crate::stats::unix_ns;
use crate::work::Output;
use anyhow::{anyhow, bail, Result};
use candle_core::Tensor;
use proto::feedback::FedToken;
use proto::frames::{
    ActivationMessage, BatchItem, FeedbackMessage, NextToken, ResultMessage, StepBatch, StepSeq,
};
use proto::tensor::TensorFrame;
use std::collections::HashMap;
use std::time::Instant;

impl Generator {
    pub(super) fn run_entry_step(&mut self, plan: Vec<Planned>) {
        let seqs: Vec<StepSeq> = plan
            .iter()
            .map(|p| StepSeq {
                request_id: p.request_id,
                choice: p.choice,
                pos: p.pos,
                len: p.tokens.len() as u32,
                input: (p.pos > 0).then(|| p.tokens.first().copied()).flatten(),
            })
            .collect();
        let ids: Vec<u32> = plan.iter().flat_map(|p| p.tokens.iter().copied()).collect();
        let reserves: Vec<usize> = plan.iter().map(|p| p.reserve).collect();
        self.run_step(seqs, StepInput::Tokens(ids), Some(reserves));
    }

    pub(super) fn run_upstream_step(&mut self, b: StepBatch) {
        let hidden = self.model.config.hidden_size;
        let dims = b.hidden.dims();
        let total: u32 = b.seqs.iter().map(|s| s.len).sum();
        let values = match b.hidden.to_f32() {
            Ok(v) if dims == [total as usize, hidden] => v,
            _ => {
                let ids = request_ids(&b.seqs);
                return self.fail(
                    &ids,
                    &anyhow!("step shape {dims:?} does not fit its sequences"),
                );
            }
        };
        // Digest what we received, row by row. A sequence that is not one
        // of its request's choices fails the request.
        let mut off = 0usize;
        let mut strays = Vec::new();
        for s in &b.seqs {
            let len = s.len as usize * hidden * 4;
            if let Some(r) = self.requests.get_mut(&s.request_id) {
                match r.received.get_mut(s.choice as usize) {
                    Some(slot) => *slot = Some(chain(*slot, s, &b.hidden.data[off..off + len])),
                    None => strays.push(s.request_id),
                }
            }
            off += len;
        }
        if !strays.is_empty() {
            self.fail(
                &strays,
                &anyhow!("a step row is not one of its request's choices"),
            );
        }
        let t = match Tensor::from_vec(values, (total as usize, hidden), self.part.device()) {
            Ok(t) => t,
            Err(e) => return self.fail(&request_ids(&b.seqs), &e.into()),
        };
        self.run_step(b.seqs, StepInput::Hidden(t), None);
    }

    /// Runs a step; on failure retries each sequence alone.
    pub(super) fn run_step(
        &mut self,
        seqs: Vec<StepSeq>,
        input: StepInput,
        reserves: Option<Vec<usize>>,
    ) {
        // Sequences of requests dropped meanwhile (failed, cancelled) are skipped.
        let keep: Vec<bool> = seqs
            .iter()
            .map(|s| self.requests.contains_key(&s.request_id))
            .collect();
        let (seqs, input, reserves) = if keep.iter().all(|&k| k) {
            (seqs, input, reserves)
        } else {
            match select(&seqs, &input, reserves.as_deref(), &keep) {
                Ok(v) => v,
                Err(e) => return self.fail(&request_ids(&seqs), &e),
            }
        };
        if seqs.is_empty() {
            return;
        }
        // A panic in a step is that step's failure, retried per sequence
        // like any other: one request's poison fails that request only.
        let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.try_step(&seqs, &input, reserves.as_deref())
        }))
        .unwrap_or_else(|_| Err(anyhow!("the step panicked")));
        match tried {
            Ok(()) => {}
            Err(e) if seqs.len() > 1 => {
                tracing::warn!(seqs = seqs.len(), error = %e, "step failed; retrying its sequences one by one");
                for i in 0..seqs.len() {
                    let mut only = vec![false; seqs.len()];
                    only[i] = true;
                    match select(&seqs, &input, reserves.as_deref(), &only) {
                        Ok((s, inp, res)) => self.run_step(s, inp, res),
                        Err(e) => self.fail(&[seqs[i].request_id], &e),
                    }
                }
            }
            Err(e) => self.fail(&request_ids(&seqs), &e),
        }
    }

    pub(super) fn try_step(
        &mut self,
        seqs: &[StepSeq],
        input: &StepInput,
        reserves: Option<&[usize]>,
    ) -> Result<()> {
        let items: Vec<BatchItem> = seqs
            .iter()
            .map(|s| BatchItem {
                request_id: s.request_id,
                index: s.choice,
                tokens: s.len,
            })
            .collect();
        let ids = match input {
            StepInput::Tokens(ids) => Some(ids.as_slice()),
            StepInput::Hidden(_) => None,
        };
        if self
            .fault
            .fires_step(self.model.claims.stage_index, &items, ids)
        {
            if self.fault.panics() {
                panic!("injected panic in a step");
            }
            bail!("injected fault");
        }
        let began = Instant::now();
        // Reserve KV room on each sequence's first step.
        for (i, s) in seqs.iter().enumerate() {
            let key = seq_key(s.request_id, s.choice);
            if self.part.cache(key).is_some() {
                continue;
            }
            let want = match reserves {
                Some(r) => r[i],
                None => self
                    .requests
                    .get(&s.request_id)
                    .map_or(0, |r| r.reserve(s.choice, self.model.config.max_seq_len)),
            }
            .max((s.pos + s.len) as usize);
            let used = self.kv_tokens_used();
            if used + want > self.limits.kv_tokens {
                bail!(
                    "KV budget exceeded: {used} + {want} tokens > {}",
                    self.limits.kv_tokens
                );
            }
            self.part.reserve(key, want)?;
        }
        let slices: Vec<SeqSlice> = seqs
            .iter()
            .map(|s| {
                SeqSlice::new(
                    seq_key(s.request_id, s.choice),
                    s.pos as usize,
                    s.len as usize,
                )
            })
            .collect();
        let hidden = match input {
            StepInput::Tokens(ids) => self.part.embed(ids)?,
            StepInput::Hidden(h) => h.clone(),
        };
        let out = self.part.forward(&hidden, &slices)?;
        if self.is_exit() {
            let logits = self.part.logits_last(&out, &slices)?.to_vec2::<f32>()?;
            self.record_step(seqs, began);
            self.sample(seqs, logits);
        } else {
            let values = out.flatten_all()?.to_vec1::<f32>()?;
            let frame = TensorFrame::from_f32(
                &[
                    values.len() / self.model.config.hidden_size,
                    self.model.config.hidden_size,
                ],
                &values,
            );
            let h = self.model.config.hidden_size * 4;
            let mut off = 0usize;
            for s in seqs {
                let len = s.len as usize * h;
                if let Some(r) = self.requests.get_mut(&s.request_id) {
                    if let Some(slot) = r.sent.get_mut(s.choice as usize) {
                        *slot = Some(chain(*slot, s, &frame.data[off..off + len]));
                    }
                }
                off += len;
            }
            self.record_step(seqs, began);
            let step_id = self.next_step;
            self.next_step += 1;
            self.send(Output::Activation(ActivationMessage::Step(StepBatch {
                step_id,
                seqs: seqs.to_vec(),
                hidden: frame,
            })));
        }
        Ok(())
    }

    /// Exit stage: samples one token per sequence, streams what may be
    /// streamed, sends the tokens back, finishes requests.
    pub(super) fn sample(&mut self, seqs: &[StepSeq], mut logits: Vec<Vec<f32>>) {
        // An Arc clone, so the tokenizer can be borrowed while requests change.
        let model = self.model.clone();
        let Some(tok) = model.tokenizer.as_ref() else {
            return;
        };
        let mut next = Vec::with_capacity(seqs.len());
        let mut events: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut completed = Vec::new();
        let mut misfed = Vec::new();
        let mut grammar_failed = Vec::new();
        for (s, row) in seqs.iter().zip(logits.iter_mut()) {
            let Some(r) = self.requests.get_mut(&s.request_id) else {
                continue;
            };
            let Some(ex) = r.exit.as_mut() else { continue };
            if ex.first_token_unix_ns.is_none() {
                ex.first_token_unix_ns = Some(unix_ns());
            }
            let Some(choice) = ex.choices.get_mut(s.choice as usize) else {
                continue;
            };
            // The step's input must be what this stage sampled last for the
            // choice (nothing for a prefill), and the choice still open: a
            // token the entry stage got from anywhere else fails the request.
            if choice.finish().is_some() || s.input != choice.last_token() {
                misfed.push(s.request_id);
                continue;
            }
            let token = match choice.step(row, &ex.rules, tok) {
                Ok(t) => t,
                Err(why) => {
                    grammar_failed.push((s.request_id, why));
                    continue;
                }
            };
            let finish = choice.finish();
            if let Some(st) = ex.stream.as_mut() {
                let ev = st.events(choice, &ex.rules.stop);
                if !ev.is_empty() {
                    events.entry(s.request_id).or_default().extend(ev);
                }
            }
            if finish.is_some() {
                ex.finished += 1;
                if ex.finished == ex.choices.len() {
                    r.done = true;
                    completed.push(s.request_id);
                }
            }
            let fed = FedToken {
                request_id: s.request_id,
                choice: s.choice,
                pos: s.pos + s.len,
                token,
                finished: finish.is_some(),
            };
            next.push(NextToken {
                request_id: s.request_id,
                choice: s.choice,
                token,
                finished: fed.finished,
                tag: r.ctx.feedback_key.tag(&fed),
            });
        }
        // Seal each stream's events of this step as one chunk (or of its
        // time slice, with `stream_options.coalesce_ms`).
        let mut ids: Vec<u64> = events.keys().copied().collect();
        ids.sort_unstable();
        let now = std::time::Instant::now();
        for request_id in ids {
            let ev = events.remove(&request_id).expect("listed");
            let Some(st) = self
                .requests
                .get_mut(&request_id)
                .and_then(|r| r.exit.as_mut())
                .and_then(|e| e.stream.as_mut())
            else {
                continue;
            };
            let Some(chunk) = st.take_chunk(ev, now) else {
                continue;
            };
            match st.sealer.seal(&chunk, false) {
                Ok(data) => self.send(Output::Result(ResultMessage::StreamData {
                    request_id,
                    data,
                })),
                Err(e) => self.fail(&[request_id], &anyhow!("sealing a stream chunk: {e}")),
            }
        }
        if !misfed.is_empty() {
            misfed.sort_unstable();
            misfed.dedup();
            self.fail(
                &misfed,
                &anyhow!("a step's input is not the token this stage sampled for its choice"),
            );
        }
        for (request_id, why) in grammar_failed {
            // The engine's message names a limit or state, not the text.
            self.fail(&[request_id], &anyhow!("{why}"));
            next.retain(|t| t.request_id != request_id);
        }
        self.send_feedback(FeedbackMessage::Tokens(next));
        for request_id in completed {
            self.try_finish(request_id);
        }
    }
}

pub(super) fn request_ids(seqs: &[StepSeq]) -> Vec<u64> {
    let mut ids: Vec<u64> = seqs.iter().map(|s| s.request_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

pub(super) type Selected = (Vec<StepSeq>, StepInput, Option<Vec<usize>>);

/// The sequences of a step marked in `keep`, with their input rows.
pub(super) fn select(
    seqs: &[StepSeq],
    input: &StepInput,
    reserves: Option<&[usize]>,
    keep: &[bool],
) -> Result<Selected> {
    let mut out_seqs = Vec::new();
    let mut out_res = Vec::new();
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    let mut off = 0usize;
    for (i, s) in seqs.iter().enumerate() {
        let len = s.len as usize;
        if keep[i] {
            out_seqs.push(*s);
            if let Some(r) = reserves {
                out_res.push(r[i]);
            }
            match input {
                StepInput::Tokens(t) => ids.extend_from_slice(&t[off..off + len]),
                StepInput::Hidden(h) => rows.push(h.narrow(0, off, len)?),
            }
        }
        off += len;
    }
    let input = match input {
        StepInput::Tokens(_) => StepInput::Tokens(ids),
        StepInput::Hidden(_) if rows.is_empty() => StepInput::Tokens(Vec::new()),
        StepInput::Hidden(_) => StepInput::Hidden(Tensor::cat(&rows, 0)?),
    };
    Ok((out_seqs, input, reserves.map(|_| out_res)))
}
