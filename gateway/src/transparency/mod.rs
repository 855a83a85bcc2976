//! The gateway's transparency log (issue 49): a file-backed append-only log
//! of `proto::transparency` entries ([`store`]), served read-only over HTTP
//! in the C2SP tlog-tiles layout ([`http`]), written by the `gateway log`
//! verbs ([`cli`]) and, for locally built stages, by `gateway serve` at
//! start ([`releases`]); its checkpoints cosigned by witnesses
//! ([`witnessing`]), and the witness itself (`gateway witness`, [`witness`]).

pub mod cli;
pub mod http;
pub mod receipts;
pub mod releases;
pub mod store;
pub mod witness;
pub mod witnessing;

pub use store::Log;
