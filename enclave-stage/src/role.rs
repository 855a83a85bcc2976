//! A stage's place in the pipeline (index, stage count, layer range): from
//! the command line, or, when one enclave image serves every stage, from the
//! enclave's vsock CID (`--stage-from-cid BASE`: stage `CID - BASE`).
//!
//! The CID is chosen by the untrusted parent (`nitro-cli run-enclave
//! --enclave-cid`). That is safe: the role becomes the stage's claims, bound
//! in its attestation document, and every verifier (gateway, neighbouring
//! stages, clients) checks index and layers against its policy.

use anyhow::{bail, Context, Result};
use std::ops::Range;

/// Index, count and layers of this stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Role {
    /// Position (0 = entry stage).
    pub stage_index: u32,
    /// Number of stages.
    pub num_stages: u32,
    /// Layers `[start, end)`.
    pub layers: Range<usize>,
}

/// Parses `START..END` (end exclusive, non-empty).
pub fn parse_layers(s: &str) -> Result<Range<usize>> {
    let (a, b) = s.split_once("..").context("--layers takes START..END")?;
    let (a, b): (usize, usize) = (
        a.trim().parse().with_context(|| format!("--layers {s}"))?,
        b.trim().parse().with_context(|| format!("--layers {s}"))?,
    );
    if a >= b {
        bail!("--layers {s}: empty range");
    }
    Ok(a..b)
}

/// The role for the enclave with vsock CID `cid`: stage `cid - base` of
/// `layers` (one `START..END` per stage, comma-separated, contiguous from 0).
pub fn from_cid(cid: u32, base: u32, layers: &str) -> Result<Role> {
    let ranges = layers
        .split(',')
        .map(parse_layers)
        .collect::<Result<Vec<_>>>()?;
    let mut expect = 0;
    for r in &ranges {
        if r.start != expect {
            bail!("--layers {layers}: the ranges must be contiguous from 0");
        }
        expect = r.end;
    }
    let index = cid
        .checked_sub(base)
        .filter(|&i| (i as usize) < ranges.len())
        .with_context(|| {
            format!(
                "vsock CID {cid} is not a stage of this pipeline: --stage-from-cid {base} \
                 takes CIDs {base} to {} (start the enclaves with those --enclave-cid values)",
                base as usize + ranges.len() - 1
            )
        })?;
    Ok(Role {
        stage_index: index,
        num_stages: ranges.len() as u32,
        layers: ranges[index as usize].clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_parse() {
        assert_eq!(parse_layers("0..3").unwrap(), 0..3);
        assert!(parse_layers("3..3").is_err());
        assert!(parse_layers("3").is_err());
        assert!(parse_layers("a..3").is_err());
    }

    #[test]
    fn cid_picks_the_stage() {
        let r = from_cid(17, 16, "0..3,3..6").unwrap();
        assert_eq!(
            r,
            Role {
                stage_index: 1,
                num_stages: 2,
                layers: 3..6
            }
        );
        assert_eq!(from_cid(16, 16, "0..15,15..30").unwrap().layers, 0..15);
        assert_eq!(from_cid(5, 5, "0..6").unwrap().num_stages, 1);
        for (cid, layers, want) in [
            (18, "0..3,3..6", "not a stage"),
            (15, "0..3,3..6", "not a stage"),
            (16, "0..3,4..6", "contiguous"),
            (16, "1..3", "contiguous"),
            (16, "0..3,", "START..END"),
        ] {
            let e = format!("{:#}", from_cid(cid, 16, layers).unwrap_err());
            assert!(e.contains(want), "{cid} {layers}: {e}");
        }
    }
}
