//! How a stage serves its model kind across the pipeline: sentence
//! embeddings ([`embedding`]: micro-batching, the compute thread, receipt
//! bookkeeping) and text generation ([`generation`]: continuous batching,
//! chat templates, grammars, output rules, the compute thread).

pub mod embedding;
pub mod generation;
