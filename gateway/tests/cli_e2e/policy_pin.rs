//! `gateway policy pin` section: the policy it writes from what the gateway
//! reports verifies that gateway's evidence, and `gateway proxy` starts on it.

use super::{Ctx, MODEL};
use crate::common::{cli, dev_policy, p, start_proxy};

pub(super) fn policy_pin_checks(c: &Ctx) {
    let out = c.dir.join("pinned.toml");
    let pin = |extra: &[&str]| {
        let head = ["policy", "pin", "--gateway", &c.url, "--out", p(&out)];
        cli(&[&head[..], extra].concat())
    };

    // Without the flag that says what it does: refused, nothing written.
    let (code, _, err) = pin(&["--model", MODEL]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--trust-on-first-use"), "{err}");
    assert!(!out.exists());

    let (code, stdout, err) = pin(&["--model", MODEL, "--trust-on-first-use"]);
    assert_eq!(code, 0, "{stdout}\n{err}");
    assert!(
        err.contains("TRUST ON FIRST USE"),
        "loudly labelled:\n{err}"
    );
    assert!(
        stdout.contains(&format!("pinned {MODEL}: 2 stage(s), mock")),
        "{stdout}"
    );
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("TRUST ON FIRST USE"), "{text}");
    assert!(!text.contains("trust_local_build"), "{text}");
    assert_eq!(text.matches("measurements = [\"mock:").count(), 2, "{text}");
    assert!(text.contains("manifest_sha256 = \""), "{text}");

    // The pinned policy verifies the gateway's evidence (fetched before
    // the pin, under another nonce), offline.
    let nonce = hex::encode(&c.nonce);
    let (code, report, _) = cli(&[
        "verify",
        "evidence",
        "--policy",
        p(&out),
        "--nonce",
        &nonce,
        p(&c.evidence_cbor),
    ]);
    assert_eq!(
        code, 0,
        "the pinned policy must verify the evidence:\n{report}"
    );
    assert!(report.contains("RESULT: OK"), "{report}");

    // --all: a folder with a policy per model.
    let all = c.dir.join("pinned-all");
    let (code, stdout, err) = cli(&[
        "policy",
        "pin",
        "--gateway",
        &c.url,
        "--all",
        "--trust-on-first-use",
        "--out",
        p(&all),
    ]);
    assert_eq!(code, 0, "{stdout}\n{err}");
    let per_model = all.join(format!("{MODEL}.toml"));
    assert_eq!(
        std::fs::read_to_string(&per_model)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>(),
        "--all pins the same stages"
    );

    // A client given the gateway's own kind of policy (trust_local_build)
    // is told what to use instead.
    let dev = c.dir.join("dev-policy.toml");
    std::fs::write(&dev, dev_policy(&[[0, 3], [3, 6]])).unwrap();
    let (code, report, _) = cli(&[
        "verify",
        "evidence",
        "--policy",
        p(&dev),
        "--nonce",
        &nonce,
        p(&c.evidence_cbor),
    ]);
    assert_eq!(code, 1, "{report}");
    assert!(report.contains("INFO hint"), "{report}");
    assert!(report.contains("gateway policy pin"), "{report}");
    let refused = start_proxy(&c.url, &[&dev], &[], &c.dir).map(|_| ());
    let (_, log) = refused.expect_err("the proxy must refuse a trust_local_build policy");
    assert!(log.contains("gateway policy pin"), "{log}");

    // And `gateway proxy` attests the gateway with the pinned policy.
    let proxy = start_proxy(&c.url, &[&out], &[], &c.dir)
        .unwrap_or_else(|(code, log)| panic!("proxy on the pinned policy ({code}):\n{log}"));
    drop(proxy);
}
