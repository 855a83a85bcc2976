//! Why a receipt, or one of its checks, failed.

/// Why a receipt (or one of its checks) failed. [`ReceiptError::code`] is
/// the stable machine-readable name used in reports and test vectors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReceiptError {
    /// The stage keys given to the verifier are inconsistent.
    #[error("stage keys from the evidence are inconsistent: {0}")]
    BadStageKeys(String),
    /// The receipt is not a well-formed COSE_Sign1 or its payload does not
    /// decode as a receipt.
    #[error("malformed receipt: {0}")]
    Malformed(String),
    /// The receipt's COSE headers are not the expected ones.
    #[error("unexpected receipt header: {0}")]
    BadHeader(String),
    /// A payload is not in deterministic CBOR.
    #[error("payload is not deterministic CBOR")]
    NotCanonical,
    /// The receipt's signature does not verify under its `kid`.
    #[error("receipt signature does not verify")]
    BadSignature,
    /// The receipt is validly signed by a key that is in no stage's evidence.
    #[error("receipt signed by a key that is not in the evidence")]
    UnknownSigner,
    /// The receipt is validly signed by a stage that is not the exit stage.
    #[error("receipt signed by stage {stage}, not by the exit stage")]
    SignerNotExitStage {
        /// Index of the stage whose key signed.
        stage: u32,
    },
    /// A mock receipt, and the caller's policy forbids mock evidence.
    #[error("mock receipt, and the policy does not allow mock evidence")]
    MockNotAllowed,
    /// The receipt names another model manifest than expected.
    #[error("manifest digest differs from the evidence")]
    ManifestMismatch,
    /// The chain has another number of links (signed links plus the exit
    /// stage's) than there are stages (a stage dropped or duplicated).
    #[error("chain has {got} links, the evidence has {expected} stages")]
    ChainLength {
        /// Number of stages in the evidence.
        expected: usize,
        /// Number of links in the receipt.
        got: usize,
    },
    /// A link does not parse.
    #[error("link {position} is malformed: {detail}")]
    LinkMalformed {
        /// Position in the chain.
        position: usize,
        /// What is wrong.
        detail: String,
    },
    /// A signed link's signature does not verify under its `kid`.
    #[error("link {position}: signature does not verify")]
    LinkBadSignature {
        /// Position in the chain.
        position: usize,
    },
    /// A link is validly signed by a key in no stage's evidence (a stage
    /// swapped for an unattested one).
    #[error("link {position}: signed by a key that is not in the evidence")]
    LinkUnknownSigner {
        /// Position in the chain.
        position: usize,
    },
    /// A link is signed by another stage than the one at its position (links
    /// reordered, or one stage's link duplicated in place of another's).
    #[error("link {position}: signed by stage {signer_stage}")]
    LinkWrongStage {
        /// Position in the chain.
        position: usize,
        /// Index of the stage whose key signed.
        signer_stage: u32,
    },
    /// A link's stage index is not its position.
    #[error("link {position}: claims stage index {got}")]
    LinkStageIndex {
        /// Position in the chain.
        position: usize,
        /// The index it claims.
        got: u32,
    },
    /// A link names another receipt id than the receipt.
    #[error("link {position}: receipt id differs from the receipt's")]
    LinkReceiptId {
        /// Position in the chain.
        position: usize,
    },
    /// A link's layer range differs from the stage's evidence.
    #[error("link {position}: layer range differs from the evidence")]
    LinkLayers {
        /// Position in the chain.
        position: usize,
    },
    /// A link's evidence digest differs from the stage's evidence.
    #[error("link {position}: evidence digest differs from the evidence")]
    LinkEvidence {
        /// Position in the chain.
        position: usize,
    },
    /// A link's previous-link digest is not the digest of the link before it
    /// (or is not null for stage 0).
    #[error("link {position}: previous-link digest does not match")]
    LinkPrevDigest {
        /// Position in the chain.
        position: usize,
    },
    /// What a stage received is not what the previous stage sent.
    #[error("link {position}: received digest differs from the previous stage's sent digest")]
    LinkDataFlow {
        /// Position in the chain.
        position: usize,
    },
    /// The first stage did not receive the request the receipt names.
    #[error("first link's received digest differs from the request digest")]
    ChainRequestDigest,
    /// The last stage did not send the response the receipt names.
    #[error("last link's sent digest differs from the response digest")]
    ChainResponseDigest,
    /// The request bytes given do not match the receipt.
    #[error("request bytes do not match the receipt's request digest")]
    RequestMismatch,
    /// The response bytes given do not match the receipt.
    #[error("response bytes do not match the receipt's response digest")]
    ResponseMismatch,
    /// Request or response bytes were given for a receipt with salted
    /// digests, but not its salt.
    #[error(
        "this receipt's digests are salted: give the digest salt that came \
         with it in the sealed response to check request or response bytes"
    )]
    DigestSaltMissing,
    /// A nonce was expected and the receipt carries none.
    #[error("receipt carries no client nonce, one was expected")]
    NonceMissing,
    /// The receipt carries another nonce than expected.
    #[error("client nonce differs from the expected one")]
    NonceMismatch,
    /// The entry stage's link does not say which key it opened, or a later
    /// stage's link claims to have opened one (v3 receipts).
    #[error("link {position}: the opened-key field is missing or misplaced")]
    LinkOpened {
        /// Position in the chain.
        position: usize,
    },
    /// What the entry stage opened contradicts the receipt's `sealing`: it
    /// opened another encapsulated key than the client's, yet the receipt
    /// says `enclave` (the host opened the request and re-sealed it), or it
    /// opened the client's own while the receipt says otherwise.
    #[error("sealing: {0}")]
    SealingMismatch(String),
}

impl ReceiptError {
    /// Stable machine-readable reason name.
    pub fn code(&self) -> &'static str {
        use ReceiptError::*;
        match self {
            BadStageKeys(_) => "bad_stage_keys",
            Malformed(_) => "malformed",
            BadHeader(_) => "bad_header",
            NotCanonical => "not_canonical",
            BadSignature => "bad_signature",
            UnknownSigner => "unknown_signer",
            SignerNotExitStage { .. } => "signer_not_exit_stage",
            MockNotAllowed => "mock_not_allowed",
            ManifestMismatch => "manifest_mismatch",
            ChainLength { .. } => "chain_length",
            LinkMalformed { .. } => "link_malformed",
            LinkBadSignature { .. } => "link_bad_signature",
            LinkUnknownSigner { .. } => "link_unknown_signer",
            LinkWrongStage { .. } => "link_wrong_stage",
            LinkStageIndex { .. } => "link_stage_index",
            LinkReceiptId { .. } => "link_receipt_id",
            LinkLayers { .. } => "link_layers",
            LinkEvidence { .. } => "link_evidence",
            LinkPrevDigest { .. } => "link_prev_digest",
            LinkDataFlow { .. } => "link_data_flow",
            ChainRequestDigest => "chain_request_digest",
            ChainResponseDigest => "chain_response_digest",
            RequestMismatch => "request_mismatch",
            ResponseMismatch => "response_mismatch",
            DigestSaltMissing => "digest_salt_missing",
            NonceMissing => "nonce_missing",
            NonceMismatch => "nonce_mismatch",
            LinkOpened { .. } => "link_opened",
            SealingMismatch(_) => "sealing_mismatch",
        }
    }
}
