//! The entry stage's end of the feedback loop: tokens the exit stage
//! sampled come back here and become the next step's inputs, each checked
//! against its request's feedback key first (`proto::feedback`), and the
//! exit stage's way of sending them (in this thread for a one-stage
//! pipeline, else over the attested feedback channel).

use super::Generator;
use crate::work::Output;
use proto::feedback::FedToken;
use proto::frames::{FeedbackMessage, NextToken};

impl Generator {
    pub(super) fn send_feedback(&mut self, m: FeedbackMessage) {
        if self.model.claims.is_entry() {
            // One-stage pipeline: the feedback loop is in this thread.
            if let FeedbackMessage::Tokens(t) = m {
                self.feedback(t);
            }
        } else {
            self.send(Output::Feedback(m));
        }
    }

    /// Entry stage: tokens from the exit stage. Each must carry its
    /// request's feedback tag over the position it is awaited at; a token
    /// that does not (from another pipeline's exit stage, or not awaited)
    /// fails its request before anything of that request is fed, whatever
    /// the token, so the outcome tells the host nothing about its value.
    pub(super) fn feedback(&mut self, tokens: Vec<NextToken>) {
        let Some(sched) = self.sched.as_mut() else {
            tracing::warn!("feedback tokens at a stage that is not the entry; ignored");
            return;
        };
        let mut forged = Vec::new();
        for t in &tokens {
            // A request that already ended here has nothing left to feed.
            let Some(r) = self.requests.get(&t.request_id) else {
                continue;
            };
            let bound = sched
                .awaited_pos(t.request_id, t.choice)
                .is_some_and(|pos| {
                    let fed = FedToken {
                        request_id: t.request_id,
                        choice: t.choice,
                        pos,
                        token: t.token,
                        finished: t.finished,
                    };
                    r.ctx.feedback_key.verify(&fed, &t.tag)
                });
            if !bound {
                forged.push(t.request_id);
            }
        }
        forged.sort_unstable();
        forged.dedup();
        let mut completed = Vec::new();
        for t in tokens {
            if forged.binary_search(&t.request_id).is_ok() {
                continue;
            }
            if sched.feed(t.request_id, t.choice, t.token, t.finished) {
                completed.push(t.request_id);
            }
        }
        if !forged.is_empty() {
            self.fail(
                &forged,
                &anyhow::anyhow!("a fed-back token is not bound to its request; refused"),
            );
        }
        for request_id in completed {
            if let Some(r) = self.requests.get_mut(&request_id) {
                r.done = true;
            }
            self.try_finish(request_id);
        }
    }
}
