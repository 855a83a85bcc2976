//! One attested pipeline stage: a layer range of a Candle model behind the
//! stage channel. The binary (`main.rs`) wires these modules together; the
//! engine is also used in-process by tests and the benchmark baseline.

pub mod clock;
pub mod fault;
pub mod kernels;
pub mod keys;
pub mod memory;
pub mod model;
pub mod models;
pub mod provider;
pub mod receipt_link;
pub mod request_ids;
pub mod role;
pub mod sampling;
pub mod server;
pub mod serving;
pub mod stats;
pub mod tokens;
pub mod work;
