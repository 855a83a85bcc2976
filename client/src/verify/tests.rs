//! `gateway verify` unit tests.

use super::receipt::decode_receipt_text;
use base64::Engine as _;

#[test]
fn receipt_text_forms() {
    let raw = vec![0x84, 1, 2, 3, 0xff];
    assert_eq!(decode_receipt_text(&raw).unwrap(), raw);
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&raw);
    assert_eq!(decode_receipt_text(b64.as_bytes()).unwrap(), raw);
    assert_eq!(
        decode_receipt_text(format!("{b64}\n").as_bytes()).unwrap(),
        raw
    );
    assert_eq!(
        decode_receipt_text(format!("Receipt: {b64}\r\n").as_bytes()).unwrap(),
        raw
    );
    let dump = format!("HTTP/1.1 200 OK\r\nreceipt-id: 00ff\r\nReceipt: {b64}\r\n\r\n");
    assert_eq!(decode_receipt_text(dump.as_bytes()).unwrap(), raw);
    assert!(decode_receipt_text(b"not base64 at all!").is_err());
}

/// `gateway verify evidence --log-state`: the `log consistency` line for
/// bundles carrying checkpoints of one log, then of a fork; tiles over
/// HTTP only with `--log`.
#[test]
fn log_state_lines() {
    use super::{log_consistency, EvidenceArgs, Line};
    use crate::log_state::tests::{note, serve_tiles, temp_path, tree, vkey};
    use proto::bundle::EvidenceBundle;
    use proto::report::CheckStatus;
    use proto::transparency::ReleaseProofs;

    let state = temp_path("verify");
    let (a, b) = (tree(300, 300, "a"), tree(4, 300, "b"));
    let server = tokio::runtime::Runtime::new().unwrap();
    let url = server.block_on(serve_tiles(a.clone()));
    let policy = proto::policy::Policy::from_toml(&format!(
        "allow_mock = false\nstages = []\n[transparency]\nlog_key = \"{}\"\n",
        vkey()
    ))
    .unwrap();
    let args = |log: Option<&str>| EvidenceArgs {
        policy: "unused".into(),
        nonce: None,
        at: None,
        json: false,
        log_state: Some(state.clone()),
        log: log.map(str::to_string),
        transport: Default::default(),
        bundle: "unused".into(),
    };
    let bundle = |checkpoint: Vec<u8>| EvidenceBundle {
        nonce: vec![],
        manifest: vec![],
        transparency: Some(ReleaseProofs {
            checkpoint,
            stages: vec![],
            key_set: None,
        }),
        stages: vec![],
    };
    let line = |log: Option<&str>, cp: Vec<u8>| -> Line {
        let l = log_consistency(&args(log), &policy, &bundle(cp)).unwrap();
        assert_eq!(l.name, "log consistency");
        l
    };
    let pass = |l: Line, says: &str| {
        assert_eq!(l.status, CheckStatus::Pass, "{l}");
        assert!(l.detail.contains(says), "{l}");
    };
    let fail = |l: Line, says: &str| {
        assert_eq!(l.status, CheckStatus::Fail, "{l}");
        assert!(l.detail.contains(says), "{l}");
    };
    pass(line(None, note(&a, 5, 1)), "first checkpoint");
    pass(line(None, note(&a, 5, 1)), "the same checkpoint");
    // Another size needs the tiles: without --log it fails, saying so.
    fail(line(None, note(&a, 257, 1)), "--log URL");
    pass(line(Some(&url), note(&a, 257, 1)), "size 257 now kept");
    pass(line(Some(&url), note(&a, 6, 1)), "older checkpoint");
    // Kept in the file across runs: a fork at the same size or another.
    let saved = std::fs::read(&state).unwrap();
    fail(line(None, note(&b, 257, 1)), "split view");
    fail(line(Some(&url), note(&b, 5, 1)), "split view");
    assert_eq!(std::fs::read(&state).unwrap(), saved);
    // A damaged state file is an error, not a new start.
    std::fs::write(&state, b"{").unwrap();
    assert!(log_consistency(&args(None), &policy, &bundle(note(&a, 5, 1))).is_err());
    std::fs::remove_dir_all(state.parent().unwrap()).unwrap();
}

/// The `--log-state` / `--log` flags of `verify evidence` and `proxy`.
#[test]
fn log_state_flags_parse() {
    use clap::{CommandFactory as _, Parser};
    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        verb: crate::ClientCommand,
    }
    Cli::command().debug_assert();
    let parse = |args: &str| Cli::try_parse_from(args.split(' '));
    let Ok(Cli {
        verb: crate::ClientCommand::Verify(super::VerifyCommand::Evidence(e)),
    }) = parse("g verify evidence --policy p --log-state s.json --log http://l/v1/transparency b")
    else {
        panic!("verify evidence --log-state --log");
    };
    assert_eq!(e.log_state.as_deref(), Some(std::path::Path::new("s.json")));
    assert_eq!(e.log.as_deref(), Some("http://l/v1/transparency"));
    // --log alone means nothing to keep: refused.
    assert!(parse("g verify evidence --policy p --log http://l b").is_err());
    let Ok(Cli {
        verb: crate::ClientCommand::Proxy(p),
    }) = parse("g proxy --upstream http://u --policy p --log-state s.json --log http://l")
    else {
        panic!("proxy --log-state --log");
    };
    assert_eq!(p.log_state.as_deref(), Some(std::path::Path::new("s.json")));
    assert_eq!(p.log.as_deref(), Some("http://l"));
}
