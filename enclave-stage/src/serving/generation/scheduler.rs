//! The entry stage's continuous-batching scheduler: which sequences run in
//! the next step, admission by KV-cache memory, and the wait queue.
//!
//! - **Admission by memory.** Every request reserves, per choice, room for
//!   its prompt plus `max_tokens` (capped at the context) in a budget of
//!   KV-cache *tokens* that every stage of the pipeline holds for its own
//!   layers. A request that does not fit now waits (FIFO); one that could
//!   never fit, or that finds the wait queue full, is rejected, so no stage
//!   ever allocates past its budget.
//! - **Continuous batching.** Sequences join (prefill) and leave (finish)
//!   between steps; a step packs the prefills and decode steps of every
//!   ready sequence, up to a token and sequence budget.
//! - **Keeping every stage busy.** A sequence is in flight from the step
//!   that feeds it until its next token comes back from the exit stage. With
//!   `N` stages, a step takes at most ⌈active / N⌉ sequences, so that about
//!   `N` groups circulate and each stage works on one while the others work
//!   on the rest.

use std::collections::{HashMap, VecDeque};

/// Budgets of the scheduler.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerLimits {
    /// KV-cache budget in tokens (each stage holds this many for its layers).
    pub kv_tokens: usize,
    /// Most tokens in one step (a longer prefill runs alone).
    pub step_tokens: usize,
    /// Most sequences in one step.
    pub max_step_seqs: usize,
    /// Most requests waiting for KV room.
    pub max_waiting: usize,
    /// Stages in the pipeline.
    pub num_stages: usize,
}

/// What [`Scheduler::offer`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Its KV room is reserved; it runs from the next step.
    Running,
    /// It waits for KV room.
    Waiting,
    /// It needs more KV room than the whole budget.
    TooLarge {
        /// Tokens it needs.
        need: usize,
        /// The budget.
        capacity: usize,
    },
    /// The wait queue is full.
    Busy,
}

/// One sequence's part of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// Request.
    pub request_id: u64,
    /// Choice.
    pub choice: u32,
    /// Tokens already cached.
    pub pos: u32,
    /// Input tokens of this step (the prompt, or the last sampled token).
    pub tokens: Vec<u32>,
    /// Tokens to reserve in the KV cache on its first step, else 0.
    pub reserve: usize,
}

struct Seq {
    input: Vec<u32>,
    pos: u32,
    reserve: usize,
    started: bool,
    in_flight: bool,
    done: bool,
}

struct Request {
    reserve: usize,
    seqs: Vec<Seq>,
    remaining: usize,
}

/// The scheduler.
pub struct Scheduler {
    limits: SchedulerLimits,
    used: usize,
    waiting: VecDeque<(u64, Request)>,
    running: HashMap<u64, Request>,
    ready: VecDeque<(u64, u32)>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(limits: SchedulerLimits) -> Self {
        Self {
            limits,
            used: 0,
            waiting: VecDeque::new(),
            running: HashMap::new(),
            ready: VecDeque::new(),
        }
    }

    /// Drops every request, waiting or running.
    pub fn clear(&mut self) {
        self.waiting.clear();
        self.running.clear();
        self.ready.clear();
        self.used = 0;
    }

    /// KV tokens reserved by running requests.
    pub fn kv_tokens_used(&self) -> usize {
        self.used
    }

    /// Requests waiting for KV room.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences running and not finished.
    pub fn active_seqs(&self) -> usize {
        self.running
            .values()
            .map(|r| r.seqs.iter().filter(|s| !s.done).count())
            .sum()
    }

    /// Whether a step could run now.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Offers a request: per choice its prompt ids and the KV tokens to
    /// reserve for it.
    pub fn offer(&mut self, request_id: u64, choices: Vec<(Vec<u32>, usize)>) -> Admission {
        let reserve: usize = choices.iter().map(|c| c.1).sum();
        if reserve > self.limits.kv_tokens {
            return Admission::TooLarge {
                need: reserve,
                capacity: self.limits.kv_tokens,
            };
        }
        let req = Request {
            reserve,
            remaining: choices.len(),
            seqs: choices
                .into_iter()
                .map(|(input, reserve)| Seq {
                    input,
                    pos: 0,
                    reserve,
                    started: false,
                    in_flight: false,
                    done: false,
                })
                .collect(),
        };
        if self.waiting.is_empty() && self.used + reserve <= self.limits.kv_tokens {
            self.start(request_id, req);
            Admission::Running
        } else if self.waiting.len() < self.limits.max_waiting {
            self.waiting.push_back((request_id, req));
            Admission::Waiting
        } else {
            Admission::Busy
        }
    }

    fn start(&mut self, request_id: u64, req: Request) {
        self.used += req.reserve;
        for c in 0..req.seqs.len() {
            self.ready.push_back((request_id, c as u32));
        }
        self.running.insert(request_id, req);
    }

    fn admit_waiting(&mut self) {
        while let Some((_, r)) = self.waiting.front() {
            if self.used + r.reserve > self.limits.kv_tokens {
                break;
            }
            let (id, r) = self.waiting.pop_front().expect("front exists");
            self.start(id, r);
        }
    }

    /// Plans the next step: ready sequences in the order they became ready,
    /// within the budgets; marks them in flight.
    pub fn next_step(&mut self) -> Vec<Planned> {
        let active = self.active_seqs().max(1);
        let stages = self.limits.num_stages.max(1);
        let cap = active
            .div_ceil(stages)
            .min(self.limits.max_step_seqs)
            .max(1);
        let mut out = Vec::new();
        let mut tokens = 0;
        while out.len() < cap {
            let Some(&(rid, c)) = self.ready.front() else {
                break;
            };
            let Some(seq) = self
                .running
                .get_mut(&rid)
                .and_then(|r| r.seqs.get_mut(c as usize))
            else {
                self.ready.pop_front();
                continue;
            };
            if seq.done || seq.in_flight {
                self.ready.pop_front();
                continue;
            }
            if !out.is_empty() && tokens + seq.input.len() > self.limits.step_tokens {
                break;
            }
            self.ready.pop_front();
            tokens += seq.input.len();
            let input = std::mem::take(&mut seq.input);
            out.push(Planned {
                request_id: rid,
                choice: c,
                pos: seq.pos,
                reserve: if seq.started { 0 } else { seq.reserve },
                tokens: input,
            });
            seq.started = true;
            seq.pos += out.last().expect("pushed").tokens.len() as u32;
            seq.in_flight = true;
        }
        out
    }

    /// The position a sequence's next token comes back for (its tokens
    /// cached once its step ran), while that token is awaited: `None` when
    /// the sequence is unknown, done, or has no step in flight.
    pub fn awaited_pos(&self, request_id: u64, choice: u32) -> Option<u32> {
        let seq = self.running.get(&request_id)?.seqs.get(choice as usize)?;
        (seq.in_flight && !seq.done).then_some(seq.pos)
    }

    /// A sequence's next token came back. Returns `true` when this finished
    /// the whole request (its KV room is released and waiting requests may
    /// start).
    pub fn feed(&mut self, request_id: u64, choice: u32, token: u32, finished: bool) -> bool {
        let Some(req) = self.running.get_mut(&request_id) else {
            return false;
        };
        let Some(seq) = req.seqs.get_mut(choice as usize) else {
            return false;
        };
        if seq.done || !seq.in_flight {
            return false;
        }
        seq.in_flight = false;
        if finished {
            seq.done = true;
            req.remaining -= 1;
            if req.remaining == 0 {
                self.remove(request_id);
                return true;
            }
        } else {
            seq.input = vec![token];
            self.ready.push_back((request_id, choice));
        }
        false
    }

    /// Drops a request (finished, failed or cancelled), waiting or running;
    /// returns whether it was known.
    pub fn remove(&mut self, request_id: u64) -> bool {
        let known = if let Some(r) = self.running.remove(&request_id) {
            self.used -= r.reserve;
            true
        } else if let Some(i) = self.waiting.iter().position(|(id, _)| *id == request_id) {
            self.waiting.remove(i);
            true
        } else {
            false
        };
        self.admit_waiting();
        known
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(kv: usize, stages: usize) -> SchedulerLimits {
        SchedulerLimits {
            kv_tokens: kv,
            step_tokens: 100,
            max_step_seqs: 64,
            max_waiting: 2,
            num_stages: stages,
        }
    }

    #[test]
    fn admits_by_memory_then_waits_then_refuses() {
        let mut s = Scheduler::new(limits(100, 1));
        assert_eq!(
            s.offer(1, vec![(vec![1; 10], 101)]),
            Admission::TooLarge {
                need: 101,
                capacity: 100
            }
        );
        assert_eq!(s.offer(1, vec![(vec![1; 10], 60)]), Admission::Running);
        assert_eq!(s.offer(2, vec![(vec![1; 10], 50)]), Admission::Waiting);
        // FIFO: a small request does not overtake the waiting one.
        assert_eq!(s.offer(3, vec![(vec![1; 2], 10)]), Admission::Waiting);
        assert_eq!(s.offer(4, vec![(vec![1; 2], 10)]), Admission::Busy);
        assert_eq!(s.kv_tokens_used(), 60);
        let step = s.next_step();
        assert_eq!(step.len(), 1);
        assert_eq!(
            (step[0].pos, step[0].tokens.len(), step[0].reserve),
            (0, 10, 60)
        );
        assert!(s.feed(1, 0, 7, true), "its only choice finished");
        assert_eq!(s.kv_tokens_used(), 60, "2 (50) and 3 (10) started");
        assert_eq!(s.waiting(), 0);
        assert!(s.remove(2) && !s.remove(2));
        assert_eq!(s.kv_tokens_used(), 10);
    }

    #[test]
    fn decode_steps_follow_feedback() {
        let mut s = Scheduler::new(limits(1000, 1));
        s.offer(1, vec![(vec![5, 6, 7], 10), (vec![5, 6, 7], 10)]);
        let step = s.next_step();
        assert_eq!(step.len(), 2);
        assert!(s.next_step().is_empty(), "both in flight");
        assert!(!s.feed(1, 0, 42, false));
        assert!(!s.feed(1, 0, 43, false), "not in flight: ignored");
        let step = s.next_step();
        assert_eq!(
            step,
            vec![Planned {
                request_id: 1,
                choice: 0,
                pos: 3,
                tokens: vec![42],
                reserve: 0
            }]
        );
        assert!(!s.feed(1, 1, 0, true));
        assert!(s.feed(1, 0, 0, true));
        assert_eq!(s.kv_tokens_used(), 0);
    }

    #[test]
    fn groups_per_stage_and_token_budget() {
        let mut s = Scheduler::new(limits(10_000, 2));
        for r in 0..4 {
            s.offer(r, vec![(vec![1; 10], 20)]);
        }
        // 4 active sequences, 2 stages: two groups of two.
        assert_eq!(s.next_step().len(), 2);
        assert_eq!(s.next_step().len(), 2);
        assert!(s.next_step().is_empty());
        // A prefill over the token budget runs alone.
        let mut s = Scheduler::new(limits(10_000, 1));
        s.offer(1, vec![(vec![1; 150], 200)]);
        s.offer(2, vec![(vec![1; 10], 20)]);
        assert_eq!(s.next_step().len(), 1);
        assert_eq!(s.next_step().len(), 1);
    }
}
