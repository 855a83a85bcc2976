//! The tokio side of `proto` (feature `io`): the stage channel driven over
//! a byte stream ([`channel`]), its cancel-safe queued writer ([`queue`]),
//! the transports it runs over ([`transport`]: TCP, vsock) and the
//! binaries' logging setup ([`logging`]). Everything else in the crate is
//! encoding and crypto without I/O; the client crate and the Python
//! package build without this module.

pub mod channel;
pub mod logging;
pub mod queue;
pub mod transport;
