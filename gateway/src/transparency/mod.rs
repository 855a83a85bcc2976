//! The gateway's transparency log (issue 49): a file-backed append-only log
//! of `proto::transparency` entries that cuts C2SP tlog-tiles tiles and
//! entry bundles and signs checkpoints. Not yet served over HTTP.

pub mod store;

pub use store::Log;
