//! `gateway policy from-build`: writes a measurement policy from the build
//! record of an enclave image the client built itself, so that it pins what
//! it rebuilt from source, not what a server told it.
//!
//! The record is `build-record.json`, written by `scripts/build-eif.sh`
//! (`scripts/build_record.py`, docs/deploy-nitro.md "Reproducible builds").
//! Where nitro-cli built the EIF, the record holds its PCR0/1/2 (and PCR8
//! when signed): the policy pins them for every stage (one EIF serves every
//! stage), with the layers and model manifest the record names, and refuses
//! mock and debug-mode evidence. A record without PCRs (a `--binary-only` or
//! `--image-only` build, or one made where nitro-cli is absent) gives a
//! policy only with `--mock`: the mock measurement of the record's binary,
//! manifest and in-enclave policy (or of `--stage-policy FILE`, the policy
//! the stages are really started with), for development and tests.

use crate::policy_file::write_policy;
use crate::EXIT_OK;
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use proto::attestation::mock_measurement;
use proto::digest::Sha256Digest;
use proto::policy::{NitroPcrPolicy, Policy, StagePolicy};
use serde_json::Value;
use std::path::PathBuf;

/// The `format` a build record must carry.
pub const RECORD_FORMAT: &str = "enclave-stage build record v1";

/// `gateway policy from-build`
#[derive(Args, Debug)]
pub struct FromBuildArgs {
    /// The build record (`build-record.json` from `scripts/build-eif.sh`).
    pub record: PathBuf,
    /// The policy file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Write a MOCK-evidence policy (development, tests): the mock
    /// measurement of the record's binary, manifest and in-enclave policy,
    /// for stages started from that binary with `--attestation mock`.
    #[arg(long)]
    pub mock: bool,
    /// With --mock: the policy file the stages are started with
    /// (`--policy`), when it is not the image's own: its digest replaces
    /// the record's in the measurement.
    #[arg(long, requires = "mock")]
    pub stage_policy: Option<PathBuf>,
}

/// What a policy needs from a build record.
#[derive(Debug, PartialEq, Eq)]
pub struct BuildRecord {
    /// The enclave binary's SHA-256.
    pub binary: Sha256Digest,
    /// The model manifest's SHA-256.
    pub manifest: Sha256Digest,
    /// The in-enclave policy's SHA-256.
    pub stage_policy: Sha256Digest,
    /// Each stage's layer range, in stage order.
    pub layers: Vec<[u32; 2]>,
    /// The EIF's PCRs, where nitro-cli built one.
    pub pcrs: Option<NitroPcrPolicy>,
    /// A `build-eif.sh --debug-policy` image (first bring-up): its
    /// enclaves run in Nitro debug mode, whose PCRs read zero.
    pub debug_policy: bool,
    /// The source commit, when the build ran in a git checkout.
    pub commit: Option<String>,
    /// Whether tracked files differed from that commit.
    pub dirty: bool,
}

impl BuildRecord {
    /// Parses and checks a record's JSON text.
    pub fn parse(text: &str) -> Result<Self> {
        let v: Value = serde_json::from_str(text).context("not JSON")?;
        let format = v.get("format").and_then(Value::as_str).unwrap_or("");
        if format != RECORD_FORMAT {
            bail!("not a build record: format {format:?}, expected {RECORD_FORMAT:?}");
        }
        let str_at = |path: &str| {
            v.pointer(path)
                .and_then(Value::as_str)
                .ok_or_else(|| anyhow!("no {path} in the record"))
        };
        let digest = |path: &str| -> Result<Sha256Digest> {
            Sha256Digest::from_hex(str_at(path)?).map_err(|e| anyhow!("{path}: {e}"))
        };
        let layers = v
            .pointer("/pipeline/layers")
            .and_then(Value::as_array)
            .ok_or_else(|| anyhow!("no /pipeline/layers in the record"))?
            .iter()
            .map(|r| {
                let pair: Option<Vec<u32>> = r.as_array().and_then(|a| {
                    a.iter()
                        .map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect()
                });
                match pair.as_deref() {
                    Some(&[a, b]) if a < b => Ok([a, b]),
                    _ => Err(anyhow!("/pipeline/layers: {r} is not a range [start, end)")),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        if layers.is_empty() {
            bail!("/pipeline/layers is empty");
        }
        for w in layers.windows(2) {
            if w[0][1] != w[1][0] {
                bail!("/pipeline/layers: {:?} and {:?} do not meet", w[0], w[1]);
            }
        }
        let pcrs = match v.get("nitro") {
            None | Some(Value::Null) => None,
            Some(_) => {
                let pcr = |i: u8| -> Result<Option<String>> {
                    let Some(p) = v.pointer(&format!("/nitro/pcr{i}")) else {
                        return Ok(None);
                    };
                    let p = p.as_str().unwrap_or_default().to_ascii_lowercase();
                    if p.len() != 96 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                        bail!("/nitro/pcr{i} is not 96 hex digits (SHA-384)");
                    }
                    Ok(Some(p))
                };
                let need = |i: u8| -> Result<String> {
                    let p = pcr(i)?.ok_or_else(|| anyhow!("no /nitro/pcr{i} in the record"))?;
                    if p.bytes().all(|b| b == b'0') {
                        bail!(
                            "/nitro/pcr{i} is all zeros (a debug-mode measurement): \
                             no production policy accepts it"
                        );
                    }
                    Ok(p)
                };
                Some(NitroPcrPolicy {
                    pcr0: need(0)?,
                    pcr1: need(1)?,
                    pcr2: need(2)?,
                    pcr3: None,
                    pcr4: None,
                    pcr8: pcr(8)?,
                })
            }
        };
        Ok(BuildRecord {
            binary: digest("/binary/sha256")?,
            manifest: digest("/model/manifest_sha256")?,
            stage_policy: digest("/stage_policy/sha256")?,
            layers,
            pcrs,
            commit: v
                .pointer("/source/commit")
                .and_then(Value::as_str)
                .map(str::to_string),
            dirty: v.pointer("/source/dirty").and_then(Value::as_bool) == Some(true),
            debug_policy: v
                .pointer("/stage_policy/debug_policy")
                .and_then(Value::as_bool)
                == Some(true),
        })
    }

    /// The measurement stages of this build report: its EIF's PCRs (PCR8
    /// when signed), or with `mock` the mock measurement of its binary,
    /// manifest and the stage policy digest `stage_policy` (the record's own
    /// when `None`).
    pub fn measurement(
        &self,
        mock: bool,
        stage_policy: Option<&Sha256Digest>,
    ) -> Result<proto::evidence::Measurement> {
        self.refuse_debug(mock)?;
        if mock {
            return Ok(mock_measurement(
                &self.binary,
                &self.manifest,
                stage_policy.unwrap_or(&self.stage_policy),
            ));
        }
        let Some(p) = &self.pcrs else {
            bail!("the record has no PCRs (nitro-cli did not build this image); --mock for its mock measurement");
        };
        let mut pcrs = std::collections::BTreeMap::new();
        for (i, v) in [
            (0u8, Some(&p.pcr0)),
            (1, Some(&p.pcr1)),
            (2, Some(&p.pcr2)),
            (8, p.pcr8.as_ref()),
        ] {
            if let Some(v) = v {
                pcrs.insert(i, hex::decode(v).context("a PCR is not hex")?);
            }
        }
        Ok(proto::evidence::Measurement::Nitro(proto::evidence::Pcrs(
            pcrs,
        )))
    }

    /// A `--debug-policy` build's enclaves report zero PCRs in debug mode,
    /// not the record's: nothing a client pins or a log holds comes from it
    /// (its mock measurement, for tests, excepted).
    fn refuse_debug(&self, mock: bool) -> Result<()> {
        if self.debug_policy && !mock {
            bail!(
                "the record is of a build-eif.sh --debug-policy image (a first bring-up): its \
                 enclaves run in Nitro debug mode, whose PCRs read zero, not the record's; \
                 rebuild without --debug-policy for a policy or a release"
            );
        }
        Ok(())
    }

    /// The policy for this build: its PCRs (Nitro evidence only), or with
    /// `mock` the mock measurement of its binary, manifest and the stage
    /// policy digest `stage_policy` (the record's own when `None`).
    pub fn policy(&self, mock: bool, stage_policy: Option<&Sha256Digest>) -> Result<Policy> {
        self.refuse_debug(mock)?;
        let measurement = mock.then(|| {
            mock_measurement(
                &self.binary,
                &self.manifest,
                stage_policy.unwrap_or(&self.stage_policy),
            )
            .pinned_form()
        });
        if !mock && self.pcrs.is_none() {
            bail!(
                "the record has no PCRs: nitro-cli did not build this image (a --binary-only \
                 or --image-only build, or a machine without nitro-cli). Rebuild with \
                 scripts/build-eif.sh where nitro-cli runs, or pass --mock for a mock-evidence \
                 policy (development only)"
            );
        }
        let stages = self
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| StagePolicy {
                index: i as u32,
                layers: *l,
                measurements: measurement.iter().cloned().collect(),
                nitro: if mock {
                    Vec::new()
                } else {
                    self.pcrs.iter().cloned().collect()
                },
            })
            .collect();
        Ok(Policy {
            allow_mock: mock,
            trust_local_build: false,
            allow_debug: false,
            transparency: None,
            trust_same_image: false,
            manifest_sha256: Some(self.manifest.hex()),
            stages,
        })
    }
}

/// Runs `gateway policy from-build`; returns the exit code.
pub fn run(a: FromBuildArgs) -> Result<i32> {
    let text = std::fs::read_to_string(&a.record)
        .with_context(|| format!("reading {}", a.record.display()))?;
    let record = BuildRecord::parse(&text)
        .with_context(|| format!("build record {}", a.record.display()))?;
    let stage_policy = match &a.stage_policy {
        Some(p) => Some(
            Sha256Digest::of_file(p).with_context(|| format!("--stage-policy {}", p.display()))?,
        ),
        None => None,
    };
    let policy = record.policy(a.mock, stage_policy.as_ref())?;
    let source = match (&record.commit, record.dirty) {
        (Some(c), false) => format!("commit {c}"),
        (Some(c), true) => format!("commit {c} WITH UNCOMMITTED CHANGES"),
        (None, _) => "a source tree without git (no commit recorded)".to_string(),
    };
    if record.dirty {
        eprintln!("WARNING: the record says the build had uncommitted changes: its commit does not describe the binary");
    }
    let mut header = format!(
        "# Written by `gateway policy from-build` from {}\n\
         # (enclave-stage sha256 {}, built from {source}).\n",
        a.record.display(),
        record.binary.hex()
    );
    let what = if a.mock {
        header += "# MOCK evidence: development and tests only, never production.\n";
        if let Some(p) = &a.stage_policy {
            header += &format!("# Stage policy: {} (not the image's own).\n", p.display());
        }
        eprintln!(
            "WARNING: --mock: this policy accepts MOCK evidence (development and tests only)"
        );
        "mock measurement"
    } else {
        "Nitro PCRs"
    };
    write_policy(&a.out, &policy, &header)?;
    println!(
        "wrote {}: {} stage(s), {what} of the build, manifest {}",
        a.out.display(),
        policy.stages.len(),
        record.manifest.hex()
    );
    Ok(EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(nitro: &str) -> String {
        format!(
            r#"{{"format": "{RECORD_FORMAT}",
            "source": {{"commit": "abc", "dirty": false, "source_date_epoch": 1}},
            "binary": {{"file": "enclave-stage", "sha256": "{b}"}},
            "model": {{"manifest_sha256": "{m}"}},
            "stage_policy": {{"sha256": "{p}"}},
            "pipeline": {{"layers": [[0, 3], [3, 6]]}}{nitro}}}"#,
            b = "11".repeat(32),
            m = "22".repeat(32),
            p = "33".repeat(32),
        )
    }

    #[test]
    fn nitro_record_pins_its_pcrs_for_every_stage() {
        let r = BuildRecord::parse(&record(&format!(
            r#", "nitro": {{"nitro_cli": "Nitro CLI 1.4.2", "pcr0": "{}", "pcr1": "{}", "pcr2": "{}"}}"#,
            "AA".repeat(48),
            "bb".repeat(48),
            "cc".repeat(48)
        )))
        .unwrap();
        let p = r.policy(false, None).unwrap();
        assert!(!p.allow_mock && !p.allow_debug && !p.trust_local_build);
        assert_eq!(p.manifest_sha256.as_deref(), Some(&*"22".repeat(32)));
        assert_eq!(p.stages.len(), 2);
        assert_eq!(p.stages[1].layers, [3, 6]);
        for s in &p.stages {
            assert!(s.measurements.is_empty());
            assert_eq!(s.nitro[0].pcr0, "aa".repeat(48));
            assert_eq!(s.nitro[0].pcr8, None);
        }
    }

    #[test]
    fn mock_needs_the_flag_and_covers_binary_manifest_and_policy() {
        let r = BuildRecord::parse(&record("")).unwrap();
        let err = r.policy(false, None).unwrap_err().to_string();
        assert!(err.contains("no PCRs") && err.contains("--mock"), "{err}");
        let d = |b: u8| Sha256Digest([b; 32]);
        let want = mock_measurement(&d(0x11), &d(0x22), &d(0x33)).pinned_form();
        let p = r.policy(true, None).unwrap();
        assert!(p.allow_mock);
        assert_eq!(p.stages[0].measurements, vec![want.clone()]);
        let other = r.policy(true, Some(&d(0x44))).unwrap();
        assert_ne!(other.stages[0].measurements, vec![want]);
    }

    #[test]
    fn a_debug_policy_record_gives_no_nitro_policy_or_release() {
        let text = record(&format!(
            r#", "nitro": {{"pcr0": "{a}", "pcr1": "{a}", "pcr2": "{a}"}}"#,
            a = "aa".repeat(48)
        ))
        .replace(
            r#""stage_policy": {"sha256""#,
            r#""stage_policy": {"debug_policy": true, "sha256""#,
        );
        let r = BuildRecord::parse(&text).unwrap();
        assert!(r.debug_policy);
        for err in [
            r.policy(false, None).unwrap_err(),
            r.measurement(false, None).unwrap_err(),
        ] {
            assert!(err.to_string().contains("--debug-policy"), "{err}");
        }
        assert!(
            r.policy(true, None).is_ok(),
            "its mock measurement, for tests"
        );
    }

    #[test]
    fn refuses_what_is_not_a_usable_record() {
        let zero = format!(
            r#", "nitro": {{"pcr0": "{z}", "pcr1": "{z}", "pcr2": "{z}"}}"#,
            z = "0".repeat(96)
        );
        for (text, why) in [
            (record(&zero), "all zeros"),
            (
                record(r#", "nitro": {"pcr0": "ab", "pcr1": "ab", "pcr2": "ab"}"#),
                "96 hex",
            ),
            (record("").replace("[3, 6]", "[4, 6]"), "do not meet"),
            (
                record("").replace(RECORD_FORMAT, "other"),
                "not a build record",
            ),
            (
                record("").replace(&"11".repeat(32), "xyz"),
                "/binary/sha256",
            ),
        ] {
            let err = format!("{:#}", BuildRecord::parse(&text).unwrap_err());
            assert!(err.contains(why), "{why}: {err}");
        }
    }
}
