//! `confidential_gateway._native`: the client crate (`client`) for
//! Python. Evidence verification, sealing, opening and receipt checks here
//! are the very functions `gateway verify` and `gateway proxy` run
//! ([`client::sealed`]); the Python side (`python/confidential_gateway/`)
//! only moves bytes over HTTP with httpx.
//!
//! Every refusal is raised as one of the exceptions of
//! `confidential_gateway.errors`, with the proxy's machine-readable code.

use client::log_state::sans_io::{step, Step, TileCache};
use client::log_state::LogState as KeptCheckpoints;
use client::sealed::{self, Attested, Refused, StreamEnd, StreamOpen};
use proto::receipt::{ReceiptBody, ReceiptTrailer, VerifyReport};
use proto::sealing::Aead;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// The exception of `confidential_gateway.errors` for a refusal `code`,
/// carrying the code, the message and (receipts) the failed check's reason.
fn raise(py: Python<'_>, code: &str, message: String, reason: Option<&str>) -> PyErr {
    let class = match code {
        "receipt_verification_failed" | "receipt_not_logged" => "ReceiptError",
        "response_unopenable" | "response_not_sealed" | "upstream_status_mismatch" => {
            "ResponseError"
        }
        "evidence_not_verified" => "EvidenceError",
        _ => "ConfidentialError",
    };
    let made = py
        .import("confidential_gateway.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.call1((code, message, reason)));
    match made {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

fn refused(py: Python<'_>, r: Refused) -> PyErr {
    raise(py, r.code, r.message, None)
}

/// The API paths whose requests are sealed (`/v1/embeddings`, ...).
#[pyfunction]
fn endpoints() -> Vec<&'static str> {
    proto::openai::ApiEndpoint::ALL
        .iter()
        .map(|e| e.path())
        .collect()
}

/// `url` without a trailing slash, refusing plain HTTP off loopback unless
/// `insecure_plain_http` (the rule `gateway proxy` applies).
#[pyfunction]
#[pyo3(signature = (url, insecure_plain_http = false))]
fn base_url(url: &str, insecure_plain_http: bool) -> PyResult<String> {
    let t = client::Transport {
        cacert: None,
        insecure_plain_http,
    };
    client::transport::base_url(url, &t).map_err(|e| PyValueError::new_err(format!("{e:#}")))
}

/// Parses `argv` as the subcommands `C` of `prog` (`about` for its help)
/// and runs the one given with `run`; returns the exit code (2 for usage
/// errors, 0 after `--help`).
fn run_cli<C, E>(
    prog: &'static str,
    about: &'static str,
    argv: Vec<String>,
    run: impl FnOnce(C) -> Result<i32, E>,
) -> i32
where
    C: clap::Subcommand,
    E: std::fmt::Display,
{
    let cmd = C::augment_subcommands(
        clap::Command::new("python -m confidential_gateway")
            .about(about)
            .subcommand_required(true)
            .arg_required_else_help(true),
    );
    let parsed = cmd
        .try_get_matches_from(std::iter::once(prog.to_string()).chain(argv))
        .and_then(|m| C::from_arg_matches(&m));
    let c = match parsed {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                client::EXIT_ERROR
            } else {
                client::EXIT_OK
            };
        }
    };
    match run(c) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            client::EXIT_ERROR
        }
    }
}

/// Runs `gateway verify ARGS...` (evidence, receipt, attestation) in this
/// process; returns the exit code (0 verified, 1 failed, 2 usage or I/O).
#[pyfunction]
fn main(argv: Vec<String>) -> i32 {
    run_cli(
        "python -m confidential_gateway verify",
        "Offline verification, as `gateway verify`",
        argv,
        client::verify::run,
    )
}

/// Evidence that verified against a measurement policy.
#[pyclass(frozen, module = "confidential_gateway._native")]
struct Evidence {
    att: Arc<Attested>,
}

#[pymethods]
impl Evidence {
    /// Verifies `bundle` (what `GET /v1/attestation` returned, CBOR or JSON),
    /// fetched with `nonce`, against the policy TOML `policy`; raises
    /// `EvidenceError` with every failed check.
    #[staticmethod]
    fn verify(py: Python<'_>, bundle: &[u8], policy: &str, nonce: &[u8]) -> PyResult<Self> {
        let not_verified = |msg: String| raise(py, "evidence_not_verified", msg, None);
        let policy = proto::policy::Policy::from_toml(policy)
            .map_err(|e| PyValueError::new_err(format!("policy: {e}")))?;
        let bundle =
            client::bundle::decode_bundle(bundle).map_err(|e| not_verified(format!("{e:#}")))?;
        let att = Attested::verify(bundle, &policy, nonce).map_err(|lines| {
            not_verified(format!(
                "the evidence does not verify against the policy: {}",
                lines.join("; ")
            ))
        })?;
        Ok(Self { att: Arc::new(att) })
    }

    /// Whether the stages use mock attestation (no hardware: development only).
    #[getter]
    fn mock(&self) -> bool {
        self.att.verified.mock
    }

    /// Each stage's measurement, entry stage first.
    #[getter]
    fn measurements(&self) -> Vec<String> {
        self.att.verified.measurements.clone()
    }

    /// The attested entry keys: `(key id, public key hex)`.
    #[getter]
    fn entry_keys(&self) -> Vec<(u8, String)> {
        self.att
            .verified
            .entry_keys
            .iter()
            .map(|k| (k.key_id, hex::encode(k.public_key)))
            .collect()
    }

    /// Whether the policy requires every receipt to be proven logged in
    /// its transparency log (`receipts_logged`).
    #[getter]
    fn receipts_logged(&self) -> bool {
        self.att.receipts_logged()
    }

    /// Under a log-backed policy: requires the bundle's log checkpoint to
    /// be consistent with the latest one `state` kept (no split view), and
    /// keeps the larger. A step: returns `(None, paths)` when tiles (paths
    /// under the log's `/v1/transparency/`) are needed first: fetch them and
    /// call again with them added to `tiles`; else `(what it found, [])`
    /// (`""` without a log). Raises `EvidenceError` on a split view.
    fn observe_log(
        &self,
        py: Python<'_>,
        state: &LogState,
        tiles: HashMap<String, Vec<u8>>,
    ) -> PyResult<(Option<String>, Vec<String>)> {
        let Some(log) = &self.att.log else {
            return Ok((Some(String::new()), Vec::new()));
        };
        let fail = |e: anyhow::Error| {
            raise(
                py,
                "evidence_not_verified",
                format!("log consistency: {e:#}"),
                None,
            )
        };
        let Some(proofs) = &self.att.bundle.transparency else {
            return Err(fail(anyhow::anyhow!(
                "the bundle carries no log checkpoint"
            )));
        };
        let cache = TileCache::new(tiles);
        let mut kept = state.inner.lock().expect("lock");
        match step(
            &cache,
            kept.observe(&log.log_key, &proofs.checkpoint, &cache),
        )
        .map_err(fail)?
        {
            Step::Done(seen) => Ok((Some(seen.to_string()), Vec::new())),
            Step::Need(paths) => Ok((None, paths)),
        }
    }

    /// Checks `inclusion`, the RFC 9942 inclusion receipt of `receipt` (its
    /// COSE bytes), against the policy's log key, and the tree it proves
    /// against the latest checkpoint `state` kept (no split view). A step,
    /// as `observe_log`. Raises `ReceiptError` (`receipt_not_logged`).
    fn check_inclusion(
        &self,
        py: Python<'_>,
        state: &LogState,
        receipt: &[u8],
        inclusion: &[u8],
        tiles: HashMap<String, Vec<u8>>,
    ) -> PyResult<(Option<String>, Vec<String>)> {
        let proven = self
            .att
            .check_inclusion(receipt, inclusion)
            .map_err(|r| refused(py, r))?;
        let log = self
            .att
            .log
            .as_ref()
            .expect("a proven inclusion names a log");
        let not_logged = |e: anyhow::Error| {
            raise(
                py,
                client::sealed::inclusion::NOT_LOGGED,
                format!("the receipt's log entry: {e:#}; the response was withheld"),
                None,
            )
        };
        let cache = TileCache::new(tiles);
        let mut kept = state.inner.lock().expect("lock");
        let seen = step(
            &cache,
            kept.check_root(&log.log_key, proven.size, proven.root, &cache),
        )
        .map_err(not_logged)?;
        match seen {
            Step::Done(seen) => Ok((
                Some(format!(
                    "entry {} of the log's tree of size {}: {seen}",
                    proven.index, proven.size
                )),
                Vec::new(),
            )),
            Step::Need(paths) => Ok((None, paths)),
        }
    }

    /// Seals `body` for `endpoint` to the attested entry key.
    #[pyo3(signature = (endpoint, body, nonce, aead = "aes128gcm"))]
    fn seal(
        &self,
        py: Python<'_>,
        endpoint: &str,
        body: &[u8],
        nonce: &[u8],
        aead: &str,
    ) -> PyResult<Sealed> {
        let aead = match aead {
            "aes128gcm" => Aead::Aes128Gcm,
            "chacha20poly1305" => Aead::ChaCha20Poly1305,
            other => {
                return Err(PyValueError::new_err(format!(
                    "aead {other:?}: expected \"aes128gcm\" or \"chacha20poly1305\""
                )))
            }
        };
        let inner = sealed::Sealed::new(&self.att.verified, aead, endpoint, body, nonce)
            .map_err(|r| refused(py, r))?;
        Ok(Sealed {
            inner: Arc::new(inner),
            att: self.att.clone(),
        })
    }
}

/// The latest transparency-log checkpoint seen of each log, kept in
/// memory or in a JSON file (as `gateway proxy --log-state`).
#[pyclass(frozen, module = "confidential_gateway._native")]
struct LogState {
    inner: Mutex<KeptCheckpoints>,
}

#[pymethods]
impl LogState {
    /// The state kept in `path` (made when first written), or in memory.
    #[new]
    #[pyo3(signature = (path = None))]
    fn new(path: Option<PathBuf>) -> PyResult<Self> {
        let inner = match path {
            Some(p) => KeptCheckpoints::load(&p)
                .map_err(|e| PyValueError::new_err(format!("log state: {e:#}")))?,
            None => KeptCheckpoints::in_memory(),
        };
        Ok(Self {
            inner: Mutex::new(inner),
        })
    }
}

/// What a verified receipt says, and its bytes.
#[pyclass(frozen, get_all, module = "confidential_gateway._native")]
struct Receipt {
    /// The receipt id (hex).
    id: String,
    /// The signed receipt (COSE_Sign1, CBOR): what `gateway verify receipt` checks.
    cose: Py<PyBytes>,
    /// The salt of its digests (hex), or None.
    digest_salt: Option<String>,
    /// The API path it was issued for.
    endpoint: String,
    /// The model that answered.
    model: String,
    /// How the request reached the entry stage: `enclave` for this package.
    sealing: String,
    /// Whether the stages use mock attestation.
    mock: bool,
    /// The receipt nonce it is bound to (hex).
    nonce: String,
    /// When the exit stage issued it (Unix milliseconds).
    issued_at_ms: u64,
    /// The manifest digest of the stages (hex).
    manifest_sha256: String,
}

fn receipt(py: Python<'_>, t: &ReceiptTrailer, b: &ReceiptBody) -> Receipt {
    Receipt {
        id: hex::encode(b.receipt_id),
        cose: PyBytes::new(py, &t.receipt).unbind(),
        digest_salt: t.digest_salt.map(hex::encode),
        endpoint: b.endpoint.clone(),
        model: b.model_id.clone(),
        sealing: b.sealing.as_str().to_string(),
        mock: b.mock,
        nonce: b
            .client_nonce
            .as_deref()
            .map(hex::encode)
            .unwrap_or_default(),
        issued_at_ms: b.issued_at_ms,
        manifest_sha256: b.manifest_digest.hex(),
    }
}

/// A receipt's verdict as the receipt, or `ReceiptError` with the failed check.
fn verdict(py: Python<'_>, report: VerifyReport, t: &ReceiptTrailer) -> PyResult<Receipt> {
    match sealed::refusal(&report) {
        Some(r) => {
            let reason = report.failure().map(|e| e.code());
            Err(raise(py, r.code, r.message, reason))
        }
        None => Ok(receipt(py, t, report.receipt.as_ref().expect("verified"))),
    }
}

/// A request sealed to the attested entry key.
#[pyclass(frozen, module = "confidential_gateway._native")]
struct Sealed {
    inner: Arc<sealed::Sealed>,
    att: Arc<Attested>,
}

impl Sealed {
    fn evidence<'a>(&'a self, evidence: Option<&'a Evidence>) -> &'a Attested {
        evidence.map_or(&self.att, |e| &e.att)
    }
}

#[pymethods]
impl Sealed {
    /// The sealed body to send.
    #[getter]
    fn body<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.body)
    }

    /// The headers to send with it: the sealing headers and `receipt-nonce`.
    #[getter]
    fn headers(&self) -> Vec<(&'static str, String)> {
        self.inner.send_headers()
    }

    /// The receipt nonce (hex).
    #[getter]
    fn nonce(&self) -> String {
        hex::encode(&self.inner.nonce)
    }

    /// Opens a whole sealed success and verifies its receipt (against
    /// `evidence`, or the evidence it was sealed with): `(plaintext, Receipt)`.
    #[pyo3(signature = (body, evidence = None))]
    fn open<'py>(
        &self,
        py: Python<'py>,
        body: &[u8],
        evidence: Option<&Evidence>,
    ) -> PyResult<(Bound<'py, PyBytes>, Receipt)> {
        let (plain, trailer) = self.inner.open(body).map_err(|r| refused(py, r))?;
        let trailer = trailer.ok_or_else(|| {
            raise(
                py,
                "receipt_verification_failed",
                "the sealed response carries no receipt; the response was withheld".into(),
                None,
            )
        })?;
        let report = self.inner.check(self.evidence(evidence), &trailer, &plain);
        let r = verdict(py, report, &trailer)?;
        Ok((PyBytes::new(py, &plain), r))
    }

    /// Opens a sealed body that came under HTTP error `status`: the stage's
    /// error object, or `ResponseError` when the status was altered.
    fn open_error<'py>(
        &self,
        py: Python<'py>,
        status: u16,
        body: &[u8],
    ) -> PyResult<Bound<'py, PyBytes>> {
        let plain = self
            .inner
            .open_error(status, body)
            .map_err(|r| refused(py, r))?;
        Ok(PyBytes::new(py, &plain))
    }

    /// An opener for a sealed event stream.
    fn stream(&self) -> StreamOpener {
        StreamOpener {
            sealed: self.inner.clone(),
            att: self.att.clone(),
            state: Mutex::new(Stream::Open(Box::new(self.inner.stream()))),
        }
    }

    /// Writes the verified exchange to `dir/<receipt id>/` (owner-only),
    /// with the receipt's inclusion receipt where one was checked, as
    /// `gateway proxy --archive` does.
    #[pyo3(signature = (dir, receipt, response, inclusion = None))]
    fn archive(
        &self,
        py: Python<'_>,
        dir: PathBuf,
        receipt: &Receipt,
        response: &[u8],
        inclusion: Option<&[u8]>,
    ) -> PyResult<()> {
        let mut id = [0u8; 16];
        hex::decode_to_slice(&receipt.id, &mut id)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let trailer = ReceiptTrailer {
            receipt: receipt.cose.bind(py).as_bytes().to_vec(),
            digest_salt: receipt
                .digest_salt
                .as_deref()
                .map(|s| {
                    let mut salt = [0u8; 32];
                    hex::decode_to_slice(s, &mut salt).map(|()| salt)
                })
                .transpose()
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
        };
        sealed::archive(
            &dir,
            &id,
            &self.inner.record(),
            &self.att,
            &trailer,
            inclusion,
            response,
        )
        .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{e:#}")))
    }
}

enum Stream {
    Open(Box<StreamOpen>),
    Ended(StreamEnd),
    Gone,
}

/// A sealed event stream opened piece by piece: `feed` returns the whole
/// events that may go out; `[DONE]` is held until `verify` passes.
#[pyclass(frozen, module = "confidential_gateway._native")]
struct StreamOpener {
    sealed: Arc<sealed::Sealed>,
    att: Arc<Attested>,
    state: Mutex<Stream>,
}

#[pymethods]
impl StreamOpener {
    /// Opens one piece of the sealed stream; returns what may go out now.
    fn feed<'py>(&self, py: Python<'py>, piece: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let mut state = self.state.lock().expect("lock");
        let Stream::Open(open) = &mut *state else {
            return Err(PyValueError::new_err("the stream has ended"));
        };
        let out = open.feed(piece).map_err(|r| refused(py, r))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Whether the sealed stream's last chunk arrived.
    #[getter]
    fn is_complete(&self) -> bool {
        matches!(&*self.state.lock().expect("lock"), Stream::Open(o) if o.is_complete())
    }

    /// Ends the stream: it must be complete and carry its receipt (or end
    /// with a stage's error event). Raises `ResponseError`/`ReceiptError`.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let mut state = self.state.lock().expect("lock");
        let Stream::Open(open) = std::mem::replace(&mut *state, Stream::Gone) else {
            return Err(PyValueError::new_err("the stream has ended"));
        };
        *state = Stream::Ended(open.finish().map_err(|r| refused(py, r))?);
        Ok(())
    }

    /// After `finish`: verifies the receipt over the whole stream (against
    /// `evidence`, or the evidence it was sealed with). Returns the receipt
    /// and the bytes still to hand out (`[DONE]`); the receipt is None for a
    /// stream a stage ended with an error event.
    #[pyo3(signature = (evidence = None))]
    fn verify<'py>(
        &self,
        py: Python<'py>,
        evidence: Option<&Evidence>,
    ) -> PyResult<(Option<Receipt>, Bound<'py, PyBytes>)> {
        let state = self.state.lock().expect("lock");
        let Stream::Ended(end) = &*state else {
            return Err(PyValueError::new_err("finish() the stream first"));
        };
        let att = evidence.map_or(&self.att, |e| &e.att);
        let r = match &end.receipt {
            Some(t) => Some(verdict(py, self.sealed.check(att, t, &end.all), t)?),
            None => None,
        };
        Ok((r, PyBytes::new(py, &end.rest)))
    }

    /// After `finish`: the whole event stream (what the receipt covers).
    #[getter]
    fn all<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        match &*self.state.lock().expect("lock") {
            Stream::Ended(end) => Ok(PyBytes::new(py, &end.all)),
            _ => Err(PyValueError::new_err("finish() the stream first")),
        }
    }
}

/// Runs `gateway policy ARGS...` (`pin`, `from-build`) in this process;
/// returns the exit code (0 written, 1 the evidence did not verify, 2 usage
/// or I/O).
#[pyfunction]
fn policy_main(argv: Vec<String>) -> i32 {
    run_cli(
        "python -m confidential_gateway",
        "Measurement policies, as `gateway policy`",
        argv,
        client::policy_pin::run,
    )
}

/// The message of an answer refused because its inclusion receipt never
/// came (`why`: what the gateway answered last).
#[pyfunction]
fn never_logged(why: &str) -> String {
    client::sealed::inclusion::never_logged(why).message
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use client::sealed::inclusion as inc;
    // How long to wait for a receipt's inclusion receipt, the first pause
    // and the longest (seconds), as `gateway proxy` does.
    m.add(
        "INCLUSION_WAIT",
        (
            inc::INCLUSION_WAIT.as_secs_f64(),
            inc::INCLUSION_POLL_FIRST.as_secs_f64(),
            inc::INCLUSION_POLL_MAX.as_secs_f64(),
        ),
    )?;
    // How many rounds of tile fetching a log check may take.
    m.add("LOG_STEPS", client::log_state::sans_io::MAX_STEPS)?;
    m.add_function(wrap_pyfunction!(never_logged, m)?)?;
    m.add_function(wrap_pyfunction!(endpoints, m)?)?;
    m.add_function(wrap_pyfunction!(base_url, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(policy_main, m)?)?;
    m.add_class::<Evidence>()?;
    m.add_class::<Sealed>()?;
    m.add_class::<StreamOpener>()?;
    m.add_class::<Receipt>()?;
    m.add_class::<LogState>()?;
    Ok(())
}
