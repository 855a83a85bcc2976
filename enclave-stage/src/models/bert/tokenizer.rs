//! The entry stage's tokenizer for a BERT-family model folder, as
//! sentence-transformers (through transformers 5) builds it: the WordPiece
//! vocabulary, pre-tokenizer and `[CLS] … [SEP]` template from
//! `tokenizer.json`, but the normalizer from `tokenizer_config.json`'s
//! `do_lower_case`, `strip_accents` and `tokenize_chinese_chars` (defaults
//! `true`, none, `true`, also when the file is absent), which transformers'
//! `BertTokenizer` applies over whatever `tokenizer.json` says. Truncated to
//! the manifest's `max_seq_len`, special tokens included.
//!
//! Refused, named, rather than served with other vectors than
//! sentence-transformers would give: a `tokenizer_class` other than BERT's,
//! `do_lower_case = true` in `sentence_bert_config.json` (the text itself
//! lower-cased), a `default_prompt_name` in
//! `config_sentence_transformers.json` (a prompt prepended to every text),
//! a vocabulary larger than the encoder's embedding table, and a
//! `max_seq_len` that leaves no room after the special tokens.

use anyhow::{bail, Result};
use proto::manifest::LoadedManifest;
use serde_json::Value;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::{PostProcessor, Tokenizer, TruncationParams};

/// A JSON file the manifest lists, read and checked (`None` if unlisted).
fn pinned_json(manifest: &LoadedManifest, rel: &str) -> Result<Option<Value>> {
    if !manifest.lists(rel) {
        return Ok(None);
    }
    Ok(Some(manifest.verified_json(rel)?))
}

/// The normalizer transformers' `BertTokenizer` builds from
/// `tokenizer_config.json` (`None`: the file's settings at their defaults).
fn bert_normalizer(config: Option<&Value>) -> Result<BertNormalizer> {
    let empty = Value::Object(Default::default());
    let c = config.unwrap_or(&empty);
    if let Some(class) = c["tokenizer_class"].as_str() {
        if !matches!(class, "BertTokenizer" | "BertTokenizerFast") {
            bail!(
                "tokenizer_config.json: tokenizer_class {class:?} is not served \
                 (served: BertTokenizer, BertTokenizerFast)"
            );
        }
    }
    let flag = |key: &str, default: bool| -> Result<bool> {
        match &c[key] {
            Value::Null => Ok(default),
            Value::Bool(b) => Ok(*b),
            other => bail!("tokenizer_config.json: {key} is {other}, not a boolean"),
        }
    };
    let strip_accents = match &c["strip_accents"] {
        Value::Null => None,
        Value::Bool(b) => Some(*b),
        other => bail!("tokenizer_config.json: strip_accents is {other}, not a boolean"),
    };
    Ok(BertNormalizer::new(
        true,
        flag("tokenize_chinese_chars", true)?,
        strip_accents,
        flag("do_lower_case", true)?,
    ))
}

/// Loads the entry stage's tokenizer for an encoder of `vocab_size` token
/// embeddings, refusing what it does not serve (module docs).
pub fn load(manifest: &LoadedManifest, vocab_size: usize) -> Result<Tokenizer> {
    if let Some(c) = pinned_json(manifest, "sentence_bert_config.json")? {
        if c["do_lower_case"] == Value::Bool(true) {
            bail!("sentence_bert_config.json: do_lower_case = true is not served");
        }
    }
    if let Some(c) = pinned_json(manifest, "config_sentence_transformers.json")? {
        if let Some(p) = c.get("default_prompt_name").filter(|p| !p.is_null()) {
            bail!(
                "config_sentence_transformers.json: default_prompt_name {p} is not served \
                 (a prompt prepended to every text: send it as part of the input instead)"
            );
        }
    }
    let normalizer = bert_normalizer(pinned_json(manifest, "tokenizer_config.json")?.as_ref())?;
    let bytes = manifest.verified_bytes("tokenizer.json")?;
    let mut t = Tokenizer::from_bytes(&bytes)
        .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
    t.with_normalizer(Some(normalizer))
        .map_err(|e| anyhow::anyhow!("tokenizer normalizer: {e}"))?;
    let vocab = t.get_vocab_size(true);
    if vocab > vocab_size {
        bail!("tokenizer.json has {vocab} tokens, but the encoder embeds {vocab_size}");
    }
    let max = manifest.manifest.max_seq_len;
    let special = t.get_post_processor().map_or(0, |p| p.added_tokens(false));
    if max <= special {
        bail!("max_seq_len {max} leaves no room after the {special} special tokens");
    }
    t.with_truncation(Some(TruncationParams {
        max_length: max,
        ..Default::default()
    }))
    .map_err(|e| anyhow::anyhow!("tokenizer truncation: {e}"))?;
    t.with_padding(None);
    Ok(t)
}
