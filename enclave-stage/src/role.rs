//! A stage's place in the pipeline ([`StageSpec`]: index, stage count, layer range): from
//! the command line, or, when one enclave image serves every stage, from the
//! enclave's vsock CID (`--stage-from-cid BASE`: stage `CID - BASE`).
//!
//! The CID is chosen by the untrusted parent (`nitro-cli run-enclave
//! --enclave-cid`). That is safe: the role becomes the stage's claims, bound
//! in its attestation document, and every verifier (gateway, neighbouring
//! stages, clients) checks index and layers against its policy.

use anyhow::{bail, Context, Result};
use proto::frames::StageClaims;
use proto::manifest::LoadedManifest;
use std::ops::Range;
use std::path::Path;

/// Which part of the model a stage runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// Position (0 = entry stage).
    pub stage_index: u32,
    /// Number of stages.
    pub num_stages: u32,
    /// Layers `[start, end)`.
    pub layers: Range<usize>,
}

impl StageSpec {
    /// Loads the manifest in `model_dir`, checks that it is a model of one
    /// of `architectures` for `task` and that this stage's position is
    /// valid, and returns it with the stage's claims (keys not yet filled in).
    pub fn open_manifest(
        &self,
        model_dir: &Path,
        architectures: &[&str],
        task: &str,
    ) -> Result<(LoadedManifest, StageClaims)> {
        let manifest = LoadedManifest::load(model_dir)?;
        let m = &manifest.manifest;
        if !architectures.contains(&m.architecture.as_str()) || m.task != task {
            bail!(
                "model {} is a {} {} model; this stage loads {task} models of {}",
                m.model_id,
                m.architecture,
                m.task,
                architectures.join(", ")
            );
        }
        if self.num_stages == 0 || self.stage_index >= self.num_stages {
            bail!(
                "stage index {} out of {} stages",
                self.stage_index,
                self.num_stages
            );
        }
        let claims = StageClaims {
            stage_index: self.stage_index,
            num_stages: self.num_stages,
            layer_start: self.layers.start as u32,
            layer_end: self.layers.end as u32,
            model_id: m.model_id.clone(),
            manifest_sha256: manifest.digest,
            receipt_key: [0; 32],
            hpke_keys: Vec::new(),
            weights: None,
        };
        Ok((manifest, claims))
    }
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
pub fn from_cid(cid: u32, base: u32, layers: &str) -> Result<StageSpec> {
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
    Ok(StageSpec {
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
            StageSpec {
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
