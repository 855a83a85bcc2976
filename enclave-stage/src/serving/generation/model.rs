//! What a generation stage loads: the model manifest (every file checked),
//! the Llama configuration, the tokenizer (entry stage: prompts; exit stage:
//! output text), the chat template (entry stage), the grammar compiler of
//! structured outputs (entry and exit stages), and, for the compute thread,
//! its [`LlamaPart`].

use super::chat_template::ChatTemplate;
use super::content_text::{self, ContentMarks};
use super::grammar::Grammars;
use crate::models::gguf_tokenizer;
use crate::models::llama::{Architecture, LlamaConfig, LlamaPart, WeightFormat};
use crate::role::StageSpec;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use proto::frames::StageClaims;
use proto::manifest::LoadedManifest;
use std::path::PathBuf;
use tokenizers::Tokenizer;

/// A loaded generation stage, minus the weights (which the compute thread owns).
pub struct GenModel {
    /// The manifest the files were checked against.
    pub manifest: LoadedManifest,
    /// What this stage claims in its evidence.
    pub claims: StageClaims,
    /// Model hyper-parameters.
    pub config: LlamaConfig,
    /// The tokenizer (entry and exit stages).
    pub tokenizer: Option<Tokenizer>,
    /// The GGUF's chat template (entry stage; `None` if the model has none).
    pub chat_template: Option<ChatTemplate>,
    /// Compiles structured-output grammars for this vocabulary (entry and
    /// exit stages).
    pub grammars: Option<Grammars>,
    spec: StageSpec,
    gguf: PathBuf,
    weights: WeightFormat,
}

impl GenModel {
    /// Checks the manifest and files in `model_dir` and reads the model's
    /// configuration; the weights are loaded by [`GenModel::load_part`] in
    /// `weights` (which the stage's claims name).
    pub fn load(
        model_dir: &std::path::Path,
        spec: &StageSpec,
        weights: WeightFormat,
    ) -> Result<Self> {
        let (manifest, mut claims) =
            spec.open_manifest(model_dir, &Architecture::NAMES, "completion")?;
        claims.weights = Some(weights);
        let m = &manifest.manifest;
        let gguf_name = m
            .files
            .iter()
            .find(|f| f.path.ends_with(".gguf"))
            .map(|f| f.path.clone())
            .context("the manifest names no .gguf file")?;
        let gguf = manifest.verified_path(&gguf_name)?;
        let entry = spec.stage_index == 0;
        let exit = spec.stage_index + 1 == spec.num_stages;
        let (config, template_source, gguf_tokenizer) = {
            let mut f = std::fs::File::open(&gguf)?;
            let ct = gguf_file::Content::read(&mut f).map_err(|e| e.with_path(&gguf))?;
            let template = match ct.metadata.get("tokenizer.chat_template") {
                Some(v) => Some(v.to_string()?.clone()),
                None => None,
            };
            // Without a pinned tokenizer.json the GGUF's own metadata is the
            // tokenizer (a user's model: one file, one digest).
            // Only the entry and exit stages tokenize (a middle stage does
            // not build it: a SentencePiece vocabulary's merges are
            // recovered from all its scores).
            let tokenizer = if !(entry || exit) || manifest.lists("tokenizer.json") {
                None
            } else {
                Some(
                    gguf_tokenizer::tokenizer_json(&ct)
                        .map_err(anyhow::Error::msg)
                        .with_context(|| format!("the tokenizer of {}", gguf.display()))?,
                )
            };
            (LlamaConfig::from_gguf(&ct)?, template, tokenizer)
        };
        if config.architecture.name() != m.architecture {
            bail!(
                "the manifest says {}, the GGUF's metadata says {}",
                m.architecture,
                config.architecture.name()
            );
        }
        if spec.layers.end > config.num_layers {
            bail!(
                "layers {:?} outside the model's {} layers",
                spec.layers,
                config.num_layers
            );
        }
        if exit && spec.layers.end != config.num_layers {
            bail!(
                "the exit stage must run the last layer ({}), not {:?}",
                config.num_layers,
                spec.layers
            );
        }
        let (tokenizer, grammars) = if entry || exit {
            let (bytes, path) = match gguf_tokenizer {
                Some(doc) => (serde_json::to_vec(&doc)?, gguf.clone()),
                None => (
                    manifest.verified_bytes("tokenizer.json")?,
                    manifest.dir.join("tokenizer.json"),
                ),
            };
            let tokenizer = Tokenizer::from_bytes(&bytes)
                .map_err(|e| anyhow::anyhow!("loading the tokenizer of {}: {e}", path.display()))?;
            // Without an end-of-sequence token no grammar could end.
            let grammars = match config.eos_token_id {
                Some(eos) => Some(
                    Grammars::new(&bytes, tokenizer.clone(), config.vocab_size, eos).with_context(
                        || format!("the vocabulary of {} for grammars", path.display()),
                    )?,
                ),
                None => None,
            };
            (Some(tokenizer), grammars)
        } else {
            (None, None)
        };
        let chat_template = match (entry, &tokenizer, template_source) {
            (true, Some(t), Some(source)) => {
                let token = |id: Option<u32>| id.and_then(|i| t.id_to_token(i)).unwrap_or_default();
                Some(
                    ChatTemplate::new(
                        &source,
                        &token(config.bos_token_id),
                        &token(config.eos_token_id),
                    )
                    .and_then(|c| c.with_marks(ContentMarks::of_tokenizer(t)))
                    .map_err(anyhow::Error::msg)?,
                )
            }
            _ => None,
        };
        Ok(Self {
            manifest,
            claims,
            config,
            tokenizer,
            chat_template,
            grammars,
            spec: spec.clone(),
            gguf,
            weights,
        })
    }

    /// Loads this stage's weights from the GGUF checked by [`GenModel::load`].
    pub fn load_part(&self) -> Result<LlamaPart> {
        let path = &self.gguf;
        LlamaPart::load_as(
            path,
            self.spec.layers.clone(),
            self.claims.is_entry(),
            self.claims.is_exit(),
            self.weights,
        )
        .with_context(|| {
            format!(
                "loading layers {:?} from {} as {}",
                self.spec.layers,
                path.display(),
                self.weights
            )
        })
    }

    /// Tokenizes a prompt: a raw one (`special`: a `/v1/completions`
    /// prompt, the caller's own text) with its special-token text as
    /// special tokens and the BOS token where the model's tokenizer puts
    /// one (for a GGUF's own tokenizer, where llama.cpp would:
    /// `crate::models::gguf_tokenizer`); a chat rendered by
    /// [`GenModel::chat_template`] with no BOS added (its template writes
    /// its own) and its content's special-token text as text
    /// ([`content_text`]).
    pub fn tokenize(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        if special {
            crate::tokens::encode(self.tokenizer.as_ref(), text, true)
        } else {
            let t = self
                .tokenizer
                .as_ref()
                .ok_or("this stage does not tokenize")?;
            content_text::encode(t, text)
        }
    }
}
