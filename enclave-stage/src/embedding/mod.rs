//! Sentence embeddings (`/v1/embeddings`) pipelined across stages: the BERT
//! encoder split by layers ([`bert`], its fused CPU operations in
//! [`bert_ops`], its bf16 weight products in [`bf16_matmul`]), the exit
//! stage's pooling as the model's sentence-transformers files name it
//! ([`pooling`]), the entry stage's tokenizer as transformers builds it
//! ([`tokenizer`]), the model a stage loads ([`engine`]), the entry stage's
//! micro-batch planning ([`batcher`]), the compute thread ([`compute`]) and
//! its per-request receipt bookkeeping ([`tracker`]).

pub mod batcher;
pub mod bert;
pub mod bert_ops;
pub mod bf16_matmul;
pub mod compute;
pub mod engine;
pub mod pooling;
pub mod tokenizer;
pub mod tracker;
