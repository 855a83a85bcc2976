//! Config tests: the shipped files, every check, environment overrides.

use super::{GatewayConfig, Launch};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[test]
fn shipped_config_loads_with_auth_off() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml");
    let cfg = GatewayConfig::load(&path).unwrap();
    assert!(!cfg.auth.enabled);
    assert!(cfg.auth.keys.is_empty());
    assert_eq!(cfg.server.receipt_retention, 10_000);
}

#[test]
fn container_config_loads_as_remote() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/gateway.toml");
    let cfg = GatewayConfig::load(&path).unwrap();
    assert_eq!(cfg.pipeline.launch, Launch::Remote);
    let addrs: Vec<_> = cfg
        .pipeline
        .stages
        .iter()
        .map(|s| s.address.clone())
        .collect();
    assert_eq!(
        addrs,
        [
            Some("tcp://stage0:9000".to_string()),
            Some("tcp://stage1:9000".to_string())
        ]
    );
    assert!(cfg.server.allow_plain_http && cfg.server.tls.is_none());
}

#[test]
fn nitro_config_has_vsock_stages_and_a_peer_address() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway-nitro.toml");
    let cfg = GatewayConfig::load(&path).unwrap();
    assert_eq!(cfg.pipeline.launch, Launch::Remote);
    let s = &cfg.pipeline.stages;
    assert_eq!(s[0].address.as_deref(), Some("vsock://16:9000"));
    assert_eq!(s[1].peer_address.as_deref(), Some("vsock://3:8001"));
    // A bad peer address, or one without remote stages, names the key.
    let text = std::fs::read_to_string(&path).unwrap();
    let bad = text.replace("vsock://3:8001", "vsock://three:8001");
    let e = format!("{:#}", GatewayConfig::parse(&bad, env(&[])).unwrap_err());
    assert!(e.contains("pipeline.stages[1].peer_address"), "{e}");
    let e = format!(
        "{:#}",
        GatewayConfig::parse(&text, env(&[("GATEWAY_PIPELINE__LAUNCH", "local")])).unwrap_err()
    );
    assert!(e.contains("peer_address: only with"), "{e}");
}

#[test]
fn a_stage_an_enclave_dials_must_be_relayed_by_the_parent() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway-nitro.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    // Stage 0 is the enclave at CID 16: it can reach stage 1 only through
    // its parent (CID 3), never at stage 1's own CID or by TCP.
    for peer in [None, Some("vsock://17:9000"), Some("tcp://10.0.0.2:9001")] {
        let bad = match peer {
            None => text.replace("peer_address = \"vsock://3:8001\"", ""),
            Some(p) => text.replace("vsock://3:8001", p),
        };
        let e = format!("{:#}", GatewayConfig::parse(&bad, env(&[])).unwrap_err());
        assert!(
            e.contains("pipeline.stages[1].peer_address") && e.contains("vsock://3:PORT"),
            "{peer:?}: {e}"
        );
    }
    // A stage the gateway dials over TCP needs no relay.
    let tcp = text
        .replace("vsock://16:9000", "tcp://10.0.0.1:9000")
        .replace("peer_address = \"vsock://3:8001\"", "");
    GatewayConfig::parse(&tcp, env(&[])).unwrap();
    // A generation pipeline of enclaves: the exit stage dials the entry
    // stage too (its feedback), so the entry stage needs a relay as well.
    let completions = format!(
        "{text}\n[completions]\npolicy = \"config/policy-completions.toml\"\n\
         model_dir = \"models/smollm2-135m-instruct\"\n\
         [[completions.stages]]\nlayers = [0, 15]\naddress = \"vsock://20:9000\"\n\
         [[completions.stages]]\nlayers = [15, 30]\naddress = \"vsock://21:9000\"\n\
         peer_address = \"vsock://3:8101\"\n"
    );
    let e = format!(
        "{:#}",
        GatewayConfig::parse(&completions, env(&[])).unwrap_err()
    );
    assert!(e.contains("completions.stages[0].peer_address"), "{e}");
    let fixed = completions.replace(
        "address = \"vsock://20:9000\"",
        "address = \"vsock://20:9000\"\npeer_address = \"vsock://3:8100\"",
    );
    GatewayConfig::parse(&fixed, env(&[])).unwrap();
}

#[test]
fn auth_keys_are_validated_by_name() {
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"),
    )
    .unwrap()
    .replace("[auth]\nenabled = false", "[auth]\nenabled = true");
    let with = |keys: &str| {
        let text = base.replace("keys = [", &format!("keys = [{keys},"));
        let cfg: GatewayConfig = toml::from_str(&text).unwrap();
        cfg.validate().map_err(|e| e.to_string())
    };
    let d = "ab".repeat(32);
    assert!(with(&format!("{{ name = \"a\", sha256 = \"{d}\" }}")).is_ok());
    let e = with(&format!(
        "{{ name = \"a\", sha256 = \"{d}\" }}, {{ name = \"a\", sha256 = \"{d}\" }}"
    ))
    .unwrap_err();
    assert!(e.contains("auth.keys[1].name"), "{e}");
    let e = with(&format!(
        "{{ name = \"a\", sha256 = \"{d}\", requests_per_minute = 0 }}"
    ))
    .unwrap_err();
    assert!(e.contains("auth.keys[0].requests_per_minute"), "{e}");
    let e = with("{ name = \"a\", sha256 = \"xyz\" }").unwrap_err();
    assert!(e.contains("auth.keys[0].sha256"), "{e}");
}

#[test]
fn plain_http_off_loopback_needs_the_key() {
    let base = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"),
    )
    .unwrap();
    let with = |listen: &str, extra: &str| {
        let text = base.replace(
            "listen = \"127.0.0.1:8080\"",
            &format!("listen = {listen:?}\n{extra}"),
        );
        let cfg: GatewayConfig = toml::from_str(&text).unwrap();
        cfg.validate().map_err(|e| e.to_string())
    };
    for ok in [
        "127.0.0.1:8080",
        "[::1]:8080",
        "localhost:8080",
        "127.0.0.2:1",
    ] {
        assert!(with(ok, "").is_ok(), "{ok}");
    }
    for bad in [
        "0.0.0.0:8080",
        "[::]:8080",
        "10.0.0.1:80",
        "gateway.example:443",
    ] {
        let e = with(bad, "").unwrap_err();
        assert!(e.contains("server.allow_plain_http"), "{bad}: {e}");
    }
    assert!(with("0.0.0.0:8080", "allow_plain_http = true").is_ok());
    let tls = "[server.tls]\ncert = \"c.pem\"\nkey = \"k.pem\"\n";
    let text = base.replace("[pipeline]", &format!("{tls}\n[pipeline]"));
    let text = text.replace("127.0.0.1:8080", "0.0.0.0:8443");
    let cfg: GatewayConfig = toml::from_str(&text).unwrap();
    cfg.validate().unwrap();
    assert_eq!(cfg.server.tls.unwrap().cert, PathBuf::from("c.pem"));
}

fn shipped() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"))
        .unwrap()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, std::ffi::OsString)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.into()))
        .collect()
}

#[test]
fn env_overrides_set_keys_of_every_kind() {
    let cfg = GatewayConfig::parse(
        &shipped(),
        env(&[
            ("GATEWAY_SERVER__LISTEN", "127.0.0.1:9999"),
            ("GATEWAY_SERVER__MAX_INPUTS", "16"),
            ("GATEWAY_AUTH__ENABLED", "true"),
            ("GATEWAY_PIPELINE__LAUNCH", "remote"),
            (
                "GATEWAY_PIPELINE__STAGES__0__ADDRESS",
                "tcp://10.0.0.1:7000",
            ),
            (
                "GATEWAY_PIPELINE__STAGES__1__ADDRESS",
                "tcp://10.0.0.2:7000",
            ),
            ("GATEWAY_PIPELINE__STAGES__1__LAYERS", "[3, 6]"),
            (
                "GATEWAY_COMPLETIONS__STAGES__0__ADDRESS",
                "tcp://10.0.0.3:7000",
            ),
            (
                "GATEWAY_COMPLETIONS__STAGES__1__ADDRESS",
                "tcp://10.0.0.4:7000",
            ),
            ("GATEWAY_PIPELINE__STAGE_BINARY", "\"123\""),
            // Not overrides: no `__` after the prefix, or another prefix.
            ("GATEWAY_API_KEYS", "a:b"),
            ("SERVER__LISTEN", "x"),
        ]),
    )
    .unwrap();
    assert_eq!(cfg.server.listen, "127.0.0.1:9999");
    assert_eq!(cfg.server.max_inputs, 16);
    assert!(cfg.auth.enabled);
    assert_eq!(cfg.pipeline.launch, Launch::Remote);
    assert_eq!(
        cfg.pipeline.stages[1].address.as_deref(),
        Some("tcp://10.0.0.2:7000")
    );
    assert_eq!(cfg.pipeline.stage_binary, Some(PathBuf::from("123")));
    assert_eq!(
        cfg.overrides
            .get("pipeline.stages[1].address")
            .map(String::as_str),
        Some("GATEWAY_PIPELINE__STAGES__1__ADDRESS")
    );
    assert_eq!(cfg.overrides.len(), 10);
    // The effective config shows the values and where they came from.
    let shown = cfg.effective_toml();
    assert!(
        shown.contains("# server.listen is set by GATEWAY_SERVER__LISTEN"),
        "{shown}"
    );
    assert!(shown.contains("listen = \"127.0.0.1:9999\""), "{shown}");
    // Defaults are filled in.
    assert!(shown.contains("receipt_retention = 10000"), "{shown}");
    let again: GatewayConfig = toml::from_str(
        &shown
            .lines()
            .filter(|l| !l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    assert_eq!(again.server.listen, cfg.server.listen);
}

#[test]
fn env_override_errors_name_the_variable() {
    let err = |pairs: &[(&str, &str)]| {
        format!(
            "{:#}",
            GatewayConfig::parse(&shipped(), env(pairs)).unwrap_err()
        )
    };
    for (pairs, want) in [
        (
            vec![("GATEWAY_SERVER__MAX_INPUTS", "0")],
            "GATEWAY_SERVER__MAX_INPUTS (server.max_inputs): must be at least 1",
        ),
        (
            vec![("GATEWAY_SERVER__MAX_BODY_BYTES", "lots")],
            "GATEWAY_SERVER__MAX_BODY_BYTES (server.max_body_bytes): invalid type",
        ),
        (
            vec![("GATEWAY_SERVER__BOGUS", "1")],
            "GATEWAY_SERVER__BOGUS",
        ),
        (
            vec![("GATEWAY_PIPELINE__STAGES__1__LAYERS", "[4, 6]")],
            "GATEWAY_PIPELINE__STAGES__1__LAYERS (pipeline.stages[1].layers): expected",
        ),
        (
            vec![("GATEWAY_PIPELINE__STAGES__5__LAYERS", "[6, 7]")],
            "GATEWAY_PIPELINE__STAGES__5__LAYERS: pipeline.stages[5]: index out of range",
        ),
        (
            vec![("GATEWAY_SERVER__LISTEN__PORT", "1")],
            "GATEWAY_SERVER__LISTEN__PORT: server.listen is a value",
        ),
        (
            vec![("GATEWAY_SERVER____LISTEN", "1")],
            "GATEWAY_SERVER____LISTEN: empty key level",
        ),
        (
            vec![("GATEWAY_AUTH__KEYS__0__NAME", "a")],
            "GATEWAY_AUTH__KEYS__0__NAME (auth.keys[0]",
        ),
    ] {
        let e = err(&pairs);
        assert!(e.contains(want), "{pairs:?}: expected {want:?} in {e:?}");
    }
    // A bad key in the file is named without any variable.
    let text = shipped().replace("max_inputs = 2048", "max_inputs = 0");
    let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
    assert!(
        e.starts_with("server.max_inputs: must be at least 1"),
        "{e}"
    );
    let text = shipped().replace("max_inputs = 2048", "send_buffer_bytes = 100");
    let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
    assert!(
        e.starts_with("server.send_buffer_bytes: must be at least 4096"),
        "{e}"
    );
    let text = shipped().replace("max_inputs = 2048", "max_inputs = \"many\"");
    let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
    assert!(e.starts_with("server.max_inputs: invalid type"), "{e}");
}

#[test]
fn env_override_turns_tracing_on_and_errors_name_it() {
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml");
    let load = |v: &str| {
        GatewayConfig::load_with_env(
            &shipped,
            [("GATEWAY_TELEMETRY__OTLP_ENDPOINT".to_string(), v.into())],
        )
    };
    let cfg = load("http://127.0.0.1:4318").unwrap();
    assert_eq!(
        cfg.telemetry.otlp_endpoint.as_deref(),
        Some("http://127.0.0.1:4318")
    );
    assert_eq!(cfg.telemetry.service_name, "confidential-gateway");
    let shown = cfg.effective_toml();
    assert!(
        shown.contains("[telemetry]")
            && shown.contains("otlp_endpoint = \"http://127.0.0.1:4318\""),
        "{shown}"
    );
    let e = format!("{:#}", load("grpc://x:4317").unwrap_err());
    assert!(
        e.contains(
            "GATEWAY_TELEMETRY__OTLP_ENDPOINT (telemetry.otlp_endpoint): must be an http:// URL"
        ),
        "{e}"
    );
    // Off by default.
    let cfg = GatewayConfig::load_with_env(&shipped, []).unwrap();
    assert!(cfg.telemetry.otlp_endpoint.is_none());
}

#[test]
fn key_rotation_reaches_local_stages_and_needs_an_overlap() {
    let cfg = GatewayConfig::parse(&shipped(), env(&[])).unwrap();
    assert_eq!(cfg.keys.rotation(), None, "off by default");
    assert!(cfg
        .pipelines()
        .iter()
        .all(|p| !p.stage_args.contains(&"--hpke-rotate-secs".to_string())));
    let text = format!(
        "{}\n[keys]\nrotate_secs = 86400\noverlap_secs = 600\n",
        shipped()
    );
    let cfg = GatewayConfig::parse(&text, env(&[])).unwrap();
    assert_eq!(
        cfg.keys.rotation(),
        Some((Duration::from_secs(86400), Duration::from_secs(600)))
    );
    for p in cfg.pipelines() {
        let at = p
            .stage_args
            .iter()
            .position(|a| a == "--hpke-rotate-secs")
            .unwrap();
        assert_eq!(p.stage_args[at + 1], "86400");
        assert_eq!(p.stage_args[at + 3], "600");
    }
    let text = format!(
        "{}\n[keys]\nrotate_secs = 60\noverlap_secs = 0\n",
        shipped()
    );
    let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
    assert!(e.contains("keys.overlap_secs"), "{e}");
}

#[test]
fn receipt_store_is_sqlite_by_default_and_postgres_needs_a_url_without_a_password() {
    let cfg = GatewayConfig::parse(&shipped(), env(&[])).unwrap();
    assert_eq!(cfg.receipts.store, crate::receipt_store::StoreKind::Sqlite);
    assert_eq!(cfg.receipts.path, Path::new("data/receipts.sqlite3"));
    let e = format!(
        "{:#}",
        GatewayConfig::parse(&shipped(), env(&[("GATEWAY_RECEIPTS__STORE", "postgres")]))
            .unwrap_err()
    );
    assert!(e.contains("needs a connection URL"), "{e}");
    let e = format!(
        "{:#}",
        GatewayConfig::parse(
            &shipped(),
            env(&[
                ("GATEWAY_RECEIPTS__STORE", "postgres"),
                ("GATEWAY_RECEIPTS__URL", "postgres://gw:hunter2@db/receipts"),
            ])
        )
        .unwrap_err()
    );
    assert!(
        e.contains("GATEWAY_RECEIPTS__URL") && e.contains("PGPASSWORD"),
        "{e}"
    );
    assert!(!e.contains("hunter2"), "{e}");
    let e = format!(
        "{:#}",
        GatewayConfig::parse(&shipped(), env(&[("GATEWAY_RECEIPTS__STORE", "redis")])).unwrap_err()
    );
    assert!(e.contains("receipts.store"), "{e}");
}

#[test]
fn replicas_need_local_stages_or_dns_addresses() {
    let remote = |a0: &str, a1: &str, replicas: u32| {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/gateway.toml"),
        )
        .unwrap()
        .replace("tcp://stage0:9000", a0)
        .replace("tcp://stage1:9000", a1);
        GatewayConfig::parse(
            &text,
            env(&[("GATEWAY_PIPELINE__REPLICAS", &replicas.to_string())]),
        )
    };
    let cfg = remote("dns://stage0.ns.svc:9000", "dns://stage1.ns.svc:9000", 4).unwrap();
    assert_eq!(
        cfg.pipelines()[0].discovery,
        Some(vec![
            "stage0.ns.svc:9000".into(),
            "stage1.ns.svc:9000".into()
        ])
    );
    assert_eq!(cfg.pipelines()[0].replicas, 4);
    let e = format!(
        "{:#}",
        remote("tcp://a:9000", "tcp://b:9000", 2).unwrap_err()
    );
    assert!(
        e.contains("GATEWAY_PIPELINE__REPLICAS") && e.contains("dns://"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        remote("dns://a:9000", "tcp://b:9000", 1).unwrap_err()
    );
    assert!(e.contains("every stage address is dns://"), "{e}");
    let e = format!("{:#}", remote("dns://a", "dns://b:9000", 1).unwrap_err());
    assert!(e.contains("expected dns://host:port"), "{e}");
    let e = format!("{:#}", remote("dns://a:1", "dns://b:9000", 32).unwrap_err());
    assert!(e.contains("from 1 to 31"), "{e}");
    assert!(remote("tcp://a:9000", "tcp://b:9000", 1)
        .unwrap()
        .pipelines()[0]
        .discovery
        .is_none());
}

#[test]
fn kubernetes_configs_load_with_dns_stages() {
    for (file, peer) in [
        ("../docker/k8s/base/gateway.toml", None),
        (
            "../docker/k8s/overlays/nitro/gateway.toml",
            Some("vsock://3:8001"),
        ),
    ] {
        let cfg = GatewayConfig::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join(file)).unwrap();
        let spec = &cfg.pipelines()[0];
        assert_eq!(
            spec.discovery,
            Some(vec![
                "embeddings-stages:9000".into(),
                "embeddings-stages:9001".into()
            ]),
            "{file}"
        );
        assert!(spec.replicas > 1, "{file}");
        assert_eq!(
            cfg.receipts.store,
            crate::receipt_store::StoreKind::Postgres
        );
        assert_eq!(
            cfg.pipeline.stages[1].peer_address.as_deref(),
            peer,
            "{file}"
        );
    }
}

#[test]
fn weight_formats_reach_the_stages_and_each_pipeline_takes_only_its_own() {
    let args = |cfg: &GatewayConfig, name: &str| {
        let p = cfg
            .pipelines()
            .into_iter()
            .find(|p| p.name == name)
            .unwrap();
        let at = p.stage_args.iter().position(|a| a == "--weights");
        at.map(|i| p.stage_args[i + 1].clone())
    };
    let cfg = GatewayConfig::parse(&shipped(), env(&[])).unwrap();
    assert_eq!(args(&cfg, "embeddings").as_deref(), Some("bf16"));
    assert_eq!(args(&cfg, "completions").as_deref(), Some("q4_1"));
    // Left out: the stage's own default (and no flag).
    let text = shipped().replace("weights = \"bf16\"", "");
    let cfg = GatewayConfig::parse(&text, env(&[])).unwrap();
    assert_eq!(cfg.pipeline.weights, None);
    assert_eq!(args(&cfg, "embeddings"), None);
    let text = shipped().replace("weights = \"bf16\"", "weights = \"f32\"");
    let cfg = GatewayConfig::parse(&text, env(&[])).unwrap();
    assert_eq!(args(&cfg, "embeddings").as_deref(), Some("f32"));
    for (from, to, want) in [
        (
            "weights = \"bf16\"",
            "weights = \"q4_1\"",
            "pipeline.weights: q4_1 is not served here (f32 or bf16)",
        ),
        (
            "weights = \"q4_1\"",
            "weights = \"bf16\"",
            "completions.weights: bf16 is not served here (f32 or q8_0 or q4_1)",
        ),
        (
            "weights = \"bf16\"",
            "weights = \"int4\"",
            "unknown variant `int4`",
        ),
    ] {
        let text = shipped().replace(from, to);
        let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
        assert!(e.contains(want), "{to}: {e}");
    }
}

#[test]
fn completions_stage_memory_is_a_size() {
    let with = |v: &str| {
        shipped().replace(
            "weights = \"q4_1\"",
            &format!("weights = \"q4_1\"\nstage_memory = {v:?}"),
        )
    };
    let cfg = GatewayConfig::parse(&with("1GiB"), env(&[])).unwrap();
    assert_eq!(
        cfg.completions.unwrap().stage_memory.as_deref(),
        Some("1GiB")
    );
    let e = format!(
        "{:#}",
        GatewayConfig::parse(&with("lots"), env(&[])).unwrap_err()
    );
    assert!(e.contains("completions.stage_memory"), "{e}");
}
