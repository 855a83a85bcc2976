//! Target `config`: the files an operator or a client hands the binaries:
//! measurement policies (TOML), the gateway's config (TOML, with its checks),
//! and model manifests (JSON).
//!
//! Properties: a config that loads shows an effective TOML that loads again;
//! an accepted manifest names only files inside its model folder.

use gateway::config::GatewayConfig;
use proto::manifest::{is_plain_relative, LoadedManifest};
use proto::policy::Policy;
use std::path::Path;

/// Runs one input: the first byte picks the format.
pub fn run(data: &[u8]) {
    let Some((which, bytes)) = crate::selector(data) else {
        return;
    };
    match which % 3 {
        0 => {
            if let Ok(text) = std::str::from_utf8(bytes) {
                let _ = Policy::from_toml(text);
            }
        }
        1 => {
            if let Ok(text) = std::str::from_utf8(bytes) {
                gateway_config(text);
            }
        }
        _ => {
            if let Ok(m) = LoadedManifest::from_bytes(bytes.to_vec(), Path::new("/models/m")) {
                assert!(m.manifest.files.iter().all(|f| is_plain_relative(&f.path)));
            }
        }
    }
}

fn gateway_config(text: &str) {
    let Ok(cfg) = GatewayConfig::parse(text, std::iter::empty()) else {
        return;
    };
    let shown = cfg.effective_toml();
    if cfg.auth.keys.is_empty() {
        if let Err(e) = GatewayConfig::parse(&shown, std::iter::empty()) {
            panic!("the effective config does not load again: {e:#}\n{shown}");
        }
    }
}
