//! Shared by the stage's model tests: where the repository and the models
//! set up by `scripts/setup.sh` are.
#![allow(dead_code)]

use std::path::PathBuf;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `models/<name>`, which must hold `file` (else: run setup).
pub fn model_dir(name: &str, file: &str) -> PathBuf {
    let d = root().join("models").join(name);
    assert!(
        d.join(file).exists(),
        "models/{name} is incomplete (no {file}): run scripts/setup.sh"
    );
    d
}

/// SmolLM2-135M-Instruct's folder.
pub fn smollm_dir() -> PathBuf {
    model_dir("smollm2-135m-instruct", "tokenizer.json")
}

/// SmolLM2's packaged Q4_1 GGUF.
pub fn gguf() -> PathBuf {
    smollm_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf")
}
