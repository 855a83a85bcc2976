//! `gateway policy from-build` section: a policy written from a build record
//! (made here the way `scripts/build-eif.sh` writes one, for the stage
//! binary, model and stage policy this gateway's stages run) verifies their
//! evidence; a record with PCRs gives a Nitro policy that refuses it, and
//! that `gateway check-config` loads.

use super::Ctx;
use crate::common::{cli, model_dir, p, stage_binary};
use proto::digest::Sha256Digest;

fn record(c: &Ctx, nitro: Option<[&str; 3]>) -> String {
    let digest = |path: &std::path::Path| Sha256Digest::of_file(path).unwrap().hex();
    let mut r = serde_json::json!({
        "format": "enclave-stage build record v1",
        "source": {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": false,
                   "source_date_epoch": 1_700_000_000},
        "binary": {"file": "enclave-stage", "sha256": digest(&stage_binary())},
        "model": {"name": "all-minilm-l6-v2",
                  "manifest_sha256": digest(&model_dir().join("manifest.json"))},
        "stage_policy": {"path_in_image": "/config/policy.toml",
                         "sha256": digest(&c.stage_policy)},
        "pipeline": {"layers": [[0, 3], [3, 6]]},
    });
    if let Some([a, b, d]) = nitro {
        r["nitro"] = serde_json::json!({"nitro_cli": "Nitro CLI 1.4.2",
            "pcr0": a.repeat(48), "pcr1": b.repeat(48), "pcr2": d.repeat(48)});
    }
    serde_json::to_string_pretty(&r).unwrap()
}

pub(super) fn policy_from_build_checks(c: &Ctx) {
    let nonce = hex::encode(&c.nonce);
    let verify = |policy: &std::path::Path| {
        cli(&[
            "verify",
            "evidence",
            "--policy",
            p(policy),
            "--nonce",
            &nonce,
            p(&c.evidence_cbor),
        ])
    };
    let mock_record = c.dir.join("build-record.json");
    std::fs::write(&mock_record, record(c, None)).unwrap();
    let out = c.dir.join("from-build.toml");
    let from_build = |rec: &std::path::Path, extra: &[&str]| {
        let head = ["policy", "from-build", p(rec), "--out", p(&out)];
        cli(&[&head[..], extra].concat())
    };

    // No PCRs in the record and no --mock: refused, nothing written.
    let (code, _, err) = from_build(&mock_record, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no PCRs") && err.contains("--mock"), "{err}");
    assert!(!out.exists());

    // --mock: the measurement of the recorded binary, manifest and stage
    // policy, which is what the stages report.
    let (code, stdout, err) = from_build(&mock_record, &["--mock"]);
    assert_eq!(code, 0, "{stdout}\n{err}");
    assert!(err.contains("MOCK"), "{err}");
    assert!(stdout.contains("2 stage(s), mock measurement"), "{stdout}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("gateway policy from-build"), "{text}");
    assert!(text.contains("commit 0123456789abcdef"), "{text}");
    assert_eq!(text.matches("measurements = [\"mock:").count(), 2, "{text}");
    let (code, report, _) = verify(&out);
    assert_eq!(code, 0, "the policy from the record must verify:\n{report}");
    assert!(report.contains("RESULT: OK"), "{report}");

    // Another stage policy in the measurement: another build, refused.
    let other = c.dir.join("other-stage-policy.toml");
    std::fs::write(&other, "allow_mock = true\nstages = []\n").unwrap();
    let (code, _, err) = from_build(&mock_record, &["--mock", "--stage-policy", p(&other)]);
    assert_eq!(code, 0, "{err}");
    let (code, report, _) = verify(&out);
    assert_eq!(
        code, 1,
        "a stage policy that is not the stages' own:\n{report}"
    );

    // PCRs in the record: a Nitro policy (no mock, no debug), the same PCRs
    // for both stages; the mock stages are refused; check-config loads it.
    let nitro_record = c.dir.join("build-record-nitro.json");
    std::fs::write(&nitro_record, record(c, Some(["a1", "b2", "c3"]))).unwrap();
    let (code, stdout, err) = from_build(&nitro_record, &[]);
    assert_eq!(code, 0, "{stdout}\n{err}");
    assert!(stdout.contains("2 stage(s), Nitro PCRs"), "{stdout}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("allow_mock = false"), "{text}");
    assert!(!text.contains("allow_debug = true"), "{text}");
    assert_eq!(
        text.matches(&format!("pcr2 = \"{}\"", "c3".repeat(48)))
            .count(),
        2,
        "{text}"
    );
    let (code, report, _) = verify(&out);
    assert_eq!(code, 1, "mock evidence under a Nitro policy:\n{report}");
    assert!(report.contains("allow_mock = false"), "{report}");
    let config = std::fs::read_to_string(c.gateway_dir.join("gateway.toml")).unwrap();
    let policy_line = format!("policy = {:?}", c.gateway_dir.join("policy.toml"));
    assert!(config.contains(&policy_line), "{config}");
    let checked = c.dir.join("from-build-gateway.toml");
    std::fs::write(
        &checked,
        config.replace(&policy_line, &format!("policy = {out:?}")),
    )
    .unwrap();
    let (code, stdout, err) = cli(&["check-config", "--config", p(&checked)]);
    assert_eq!(
        code, 0,
        "check-config on the policy from the record:\n{stdout}\n{err}"
    );

    // A debug-mode record (PCRs zero) gives no policy.
    std::fs::write(&nitro_record, record(c, Some(["00", "00", "00"]))).unwrap();
    let (code, _, err) = from_build(&nitro_record, &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("debug-mode"), "{err}");
}
