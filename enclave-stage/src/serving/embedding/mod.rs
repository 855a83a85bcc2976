//! Sentence embeddings (`/v1/embeddings`) pipelined across stages: the model
//! a stage loads ([`engine`]: a BERT encoder, `crate::models::bert`, over
//! its layer range), the entry stage's micro-batch planning ([`batcher`]),
//! the compute thread ([`compute`]), its per-request receipt bookkeeping
//! ([`tracker`]), and the model as the stage serves it ([`service`]:
//! starting the compute thread, admitting a request).

pub mod batcher;
pub mod compute;
pub mod engine;
pub mod service;
pub mod tracker;
