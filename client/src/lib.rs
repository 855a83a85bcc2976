//! The client side: everything a client that does not trust the host needs,
//! in its own trust domain, as a library (the `gateway` binary's client verbs
//! use it, and so can a client library in another language) and as the verbs themselves.
//!
//! - `gateway verify evidence` / `gateway verify receipt`: offline checks of
//!   an evidence bundle against a measurement policy, and of a receipt
//!   against verified evidence and the request/response bytes the client
//!   kept ([`verify`]);
//! - `gateway seal` / `gateway open`: HPKE-seal a request body for `curl`
//!   and open the sealed response ([`seal_open`]);
//! - `gateway proxy`: a local OpenAI-compatible endpoint that verifies the
//!   upstream's evidence, seals every request to the attested entry stage
//!   and verifies every receipt ([`proxy`]);
//! - `gateway policy pin`: a policy pinning what a gateway's stages report
//!   now, trust on first use, for development, or only what its
//!   transparency log holds under a key the client names ([`policy_pin`],
//!   [`log_view`]);
//! - `gateway policy from-build`: a policy from the build record of an
//!   enclave image the client rebuilt itself ([`policy_build`]).
//!
//! Exit codes: 0 when everything holds, 1 when a verification fails (or the
//! proxy refuses to start), 2 for usage and I/O errors.
//! The walkthrough is `docs/curl.md`.

pub mod bundle;
pub mod client_key;
pub mod io;
pub mod log_state;
pub mod log_view;
pub mod policy_build;
pub mod policy_file;
pub mod policy_pin;
pub mod proxy;
pub mod seal_open;
pub mod sealed;
pub mod transport;
pub mod verify;

pub use transport::Transport;

use clap::Subcommand;

/// Exit code: everything verified / the command succeeded.
pub const EXIT_OK: i32 = 0;
/// Exit code: a verification failed.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: bad usage, unreadable input, network error.
pub const EXIT_ERROR: i32 = 2;

/// The client verbs (flattened into the binary's subcommands).
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Verify evidence or a receipt offline (exit code 0 only when everything holds).
    #[command(subcommand)]
    Verify(verify::VerifyCommand),
    /// Seal a request body to the entry stage's HPKE key (for curl users).
    Seal(seal_open::SealArgs),
    /// Open a sealed response with the key `gateway seal` wrote.
    Open(seal_open::OpenArgs),
    /// A local OpenAI-compatible endpoint that verifies the upstream gateway's
    /// evidence, seals every request end to end and verifies every receipt.
    Proxy(proxy::ProxyArgs),
    /// Measurement policies: `gateway policy from-build` writes one from a
    /// build record of the enclave image; `gateway policy pin` from what a
    /// gateway reports (trust on first use, development only).
    #[command(subcommand)]
    Policy(policy_pin::PolicyCommand),
}

/// Runs a client verb; returns the process exit code.
pub fn run(cmd: ClientCommand) -> i32 {
    let result = match cmd {
        ClientCommand::Verify(c) => verify::run(c),
        ClientCommand::Seal(a) => seal_open::run_seal(a).map(|()| EXIT_OK),
        ClientCommand::Open(a) => seal_open::run_open(a),
        ClientCommand::Proxy(a) => proxy::run(a),
        ClientCommand::Policy(c) => policy_pin::run(c),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            EXIT_ERROR
        }
    }
}
