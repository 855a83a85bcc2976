//! One attested pipeline stage: a layer range of a Candle model behind the
//! stage channel. The binary (`main.rs`) wires these modules together; the
//! engine is also used in-process by tests and the benchmark baseline.

pub mod embedding;
pub mod fault;
pub mod generation;
pub mod gguf_tokenizer;
pub mod keys;
pub mod llama;
pub mod memory;
pub mod model;
pub mod provider;
pub mod qmatmul;
pub mod receipt_link;
pub mod role;
pub mod sampling;
pub mod server;
pub mod stats;
pub mod tokens;
pub mod work;
