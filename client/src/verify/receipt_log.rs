//! `gateway verify receipt`'s transparency lines, for a log-backed policy:
//! the receipt's RFC 9942 inclusion receipt (`--inclusion`) checked against
//! the policy's log key (`log inclusion`; required where the policy says
//! `receipts_logged`), and the tree it proves against the checkpoint kept
//! in `--log-state` (`log consistency`: no split view).

use super::{pass_or_fail, Line};
use crate::io::read_input;
use crate::log_state::{HttpTiles, LogState};

use anyhow::{bail, Result};
use proto::policy::Policy;
use proto::transparency::{log_origin, verify_receipt_logged};
use std::path::PathBuf;

/// What `gateway verify receipt` was given for the log.
pub(super) struct LogArgs<'a> {
    /// `--inclusion`.
    pub inclusion: Option<&'a PathBuf>,
    /// `--log-state`.
    pub log_state: Option<&'a PathBuf>,
    /// `--log`.
    pub log: Option<&'a str>,
    /// How to reach `--log`.
    pub transport: &'a crate::Transport,
}

/// The transparency lines for `receipt` (its COSE_Sign1 bytes); an error
/// for arguments that need a log-backed policy without one, or unreadable
/// files. A missing `--inclusion` under `receipts_logged` is reported by
/// the command line's own checks.
pub(super) fn log_lines(a: &LogArgs<'_>, policy: &Policy, receipt: &[u8]) -> Result<Vec<Line>> {
    let Some(log) = &policy.transparency else {
        if a.inclusion.is_some() || a.log_state.is_some() {
            bail!("--inclusion and --log-state need a log-backed policy ([transparency] log_key)");
        }
        return Ok(Vec::new());
    };
    let Some(path) = a.inclusion else {
        if a.log_state.is_some() {
            bail!("--log-state checks the tree an inclusion receipt proves: give --inclusion");
        }
        return Ok(Vec::new());
    };
    let inclusion = read_input(path)?;
    let origin = log_origin(&log.log_key).unwrap_or("?");
    let proven = match verify_receipt_logged(&log.log_key, receipt, &inclusion) {
        Ok(p) => p,
        Err(why) => {
            return Ok(vec![pass_or_fail(
                false,
                "log inclusion",
                why,
                "receipt_not_logged",
            )])
        }
    };
    let mut out = vec![pass_or_fail(
        true,
        "log inclusion",
        format!(
            "the receipt's entry (its SHA-256) is entry {} of log {origin}'s tree of size {} with root {} (RFC 9942 receipt, signed by the log's key)",
            proven.index,
            proven.size,
            hex::encode(proven.root.0)
        ),
        "receipt_not_logged",
    )];
    if let Some(state_path) = a.log_state {
        // Checked against the kept checkpoint and remembered in the file
        // when newer, as the proxy does.
        let mut state = LogState::load(state_path)?;
        let tiles = HttpTiles::from_arg(a.log, a.transport)?;
        let seen = crate::transport::runtime()?.block_on(state.check_root(
            &log.log_key,
            proven.size,
            proven.root,
            &tiles,
        ));
        out.push(match seen {
            Ok(seen) => pass_or_fail(
                true,
                "log consistency",
                format!("{seen} ({})", state_path.display()),
                "log_inconsistent",
            ),
            Err(e) => pass_or_fail(
                false,
                "log consistency",
                format!("{e:#}"),
                "log_inconsistent",
            ),
        });
    }
    Ok(out)
}
