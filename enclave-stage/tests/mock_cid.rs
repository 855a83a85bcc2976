//! `--mock-cid` (issue 33) names the CID to read the stage from only under
//! mock attestation, where there is no vsock device; with `--attestation
//! nitro` the CID is the enclave's own and the flag is refused before
//! anything else happens.

use std::process::Command;

#[test]
fn mock_cid_is_refused_with_nitro_attestation() {
    let out = Command::new(env!("CARGO_BIN_EXE_enclave-stage"))
        .args([
            "--model-dir",
            "/nonexistent",
            "--policy",
            "/nonexistent",
            "--layers",
            "0..3,3..6",
            "--stage-from-cid",
            "16",
            "--mock-cid",
            "17",
            "--attestation",
            "nitro",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--mock-cid is for --attestation mock only"),
        "{err}"
    );
    // Without --stage-from-cid it means nothing and clap refuses it.
    let out = Command::new(env!("CARGO_BIN_EXE_enclave-stage"))
        .args([
            "--model-dir",
            "/x",
            "--policy",
            "/x",
            "--layers",
            "0..6",
            "--mock-cid",
            "3",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stage-from-cid"));
}
