//! Wire formats and crypto shared by the gateway and the enclave stages.
//!
//! Everything that crosses a process boundary is defined here and only here:
//! the attested stage channel ([`channel`]), its pipeline messages
//! ([`frames`]), tensor frames ([`tensor`]), attestation evidence and its
//! verifiers ([`attestation`], AWS Nitro documents in [`nitro`]), measurement policies ([`policy`]), model
//! manifests ([`manifest`]), HPKE body sealing for client requests and
//! responses ([`sealing`]) and signed receipts ([`receipt`]).
//!
//! None of it does I/O. The tokio driver of the channel, the transports
//! (TCP, vsock) and the binaries' logging setup are `io`, behind the
//! feature `io` that the gateway and the stage enable; the client crate
//! and the Python package build without it (no tokio-vsock, no
//! tracing-subscriber).

pub mod attestation;
pub mod bundle;
pub mod cbor;
pub mod channel;
pub mod chat;
pub mod claims;
pub mod completions;
pub mod digest;
pub mod evidence;
pub mod feedback;
pub mod frames;
#[cfg(feature = "io")]
pub mod io;
pub mod key_rotation;
pub mod manifest;
pub mod nitro;
pub mod openai;
pub mod policy;
pub mod receipt;
pub mod report;
pub mod sealing;
pub mod structured;
pub mod tensor;
pub mod text;
pub mod tools;
pub mod transparency;
pub mod wipe;
