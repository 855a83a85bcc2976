//! A measurement policy written as TOML, for `gateway policy pin` and
//! `gateway policy from-build`: a header saying where it came from, and the
//! file read back as a verifier reads it before it is written.

use anyhow::{anyhow, bail, Context, Result};
use proto::policy::Policy;
use std::path::Path;

/// The policy as TOML, after `header` (comment lines saying where it came
/// from).
fn policy_toml(policy: &Policy, header: &str) -> String {
    let q = |v: &str| serde_json::Value::from(v).to_string();
    let mut t = format!("{header}allow_mock = {}\n", policy.allow_mock);
    if let Some(m) = &policy.manifest_sha256 {
        t += &format!("manifest_sha256 = {}\n", q(m));
    }
    if let Some(log) = &policy.transparency {
        // Every field, by name: a field added to the policy must be written here.
        let proto::policy::LogPolicy {
            log_key,
            witnesses,
            witness_quorum,
            receipts_logged,
        } = log;
        t += &format!("\n[transparency]\nlog_key = {}\n", q(log_key));
        if !witnesses.is_empty() {
            let ws: Vec<String> = witnesses.iter().map(|w| q(w)).collect();
            t += &format!("witnesses = [{}]\n", ws.join(", "));
        }
        if let Some(n) = witness_quorum {
            t += &format!("witness_quorum = {n}\n");
        }
        if *receipts_logged {
            t += "receipts_logged = true\n";
        }
    }
    for s in &policy.stages {
        let ms: Vec<String> = s.measurements.iter().map(|m| q(m)).collect();
        t += &format!(
            "\n[[stages]]\nindex = {}\nlayers = [{}, {}]\nmeasurements = [{}]\n",
            s.index,
            s.layers[0],
            s.layers[1],
            ms.join(", ")
        );
        for n in &s.nitro {
            t += &format!(
                "[[stages.nitro]]\npcr0 = {}\npcr1 = {}\npcr2 = {}\n",
                q(&n.pcr0),
                q(&n.pcr1),
                q(&n.pcr2)
            );
            if let Some(p8) = &n.pcr8 {
                t += &format!("pcr8 = {}\n", q(p8));
            }
        }
    }
    t
}

/// Writes `policy` to `path` as TOML after `header`, once it reads back as
/// the same policy.
pub fn write_policy(path: &Path, policy: &Policy, header: &str) -> Result<()> {
    let text = policy_toml(policy, header);
    // Read back as a verifier will read it: the same policy.
    let back =
        Policy::from_toml(&text).map_err(|e| anyhow!("the written policy does not parse: {e}"))?;
    if &back != policy {
        bail!("the written policy does not read back as the one meant");
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
