//! The entry stage's tokenizer for a BERT-family model folder, as
//! sentence-transformers (through transformers 5) builds it: the WordPiece
//! vocabulary, pre-tokenizer and `[CLS] … [SEP]` template from
//! `tokenizer.json`, but the normalizer from `tokenizer_config.json`'s
//! `do_lower_case`, `strip_accents` and `tokenize_chinese_chars` (defaults
//! `true`, none, `true`, also when the file is absent), which transformers'
//! `BertTokenizer` applies over whatever `tokenizer.json` says. Truncated to
//! the manifest's `max_seq_len`, special tokens included, from the side
//! `tokenizer_config.json`'s `truncation_side` names (`right`, the
//! default, or `left`: a long text keeps its end), as transformers does.
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
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection, TruncationParams};

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
    let config = pinned_json(manifest, "tokenizer_config.json")?;
    let normalizer = bert_normalizer(config.as_ref())?;
    let side = truncation_side(config.as_ref())?;
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
    truncate(&mut t, max, side)?;
    t.with_padding(None);
    Ok(t)
}

/// The side transformers cuts a long text from: `tokenizer_config.json`'s
/// `truncation_side`, `right` unless it says `left`; anything else is
/// refused, named.
fn truncation_side(config: Option<&Value>) -> Result<TruncationDirection> {
    match config.map(|c| &c["truncation_side"]) {
        None | Some(Value::Null) => Ok(TruncationDirection::Right),
        Some(Value::String(s)) if s == "right" => Ok(TruncationDirection::Right),
        Some(Value::String(s)) if s == "left" => Ok(TruncationDirection::Left),
        Some(other) => bail!(
            "tokenizer_config.json: truncation_side {other} is not served (served: \"right\", \"left\")"
        ),
    }
}

/// Encodings of `t` at most `max` tokens long, special tokens included,
/// cut from `side`.
fn truncate(t: &mut Tokenizer, max: usize, side: TruncationDirection) -> Result<()> {
    t.with_truncation(Some(TruncationParams {
        max_length: max,
        direction: side,
        ..Default::default()
    }))
    .map_err(|e| anyhow::anyhow!("tokenizer truncation: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `left` keeps a long text's end and `right` its start, the special
    /// tokens kept either way; an unknown side is refused.
    #[test]
    fn truncation_follows_the_configured_side() {
        let doc = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}},
                           {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {
                    "[CLS]": {"id": "[CLS]", "ids": [0], "tokens": ["[CLS]"]},
                    "[SEP]": {"id": "[SEP]", "ids": [1], "tokens": ["[SEP]"]}}},
            "decoder": null,
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                "max_input_chars_per_word": 100,
                "vocab": {"[CLS]": 0, "[SEP]": 1, "[UNK]": 2, "a": 3, "b": 4, "c": 5, "d": 6}}
        });
        let cut = |side: &str| -> Vec<u32> {
            let config = serde_json::json!({ "truncation_side": side });
            let mut t: Tokenizer = doc.to_string().parse().unwrap();
            truncate(&mut t, 4, truncation_side(Some(&config)).unwrap()).unwrap();
            t.encode("a b c d", true).unwrap().get_ids().to_vec()
        };
        assert_eq!(cut("right"), [0, 3, 4, 1]);
        assert_eq!(cut("left"), [0, 5, 6, 1]);
        assert_eq!(truncation_side(None).unwrap(), TruncationDirection::Right);
        let e = truncation_side(Some(&serde_json::json!({"truncation_side": "middle"})));
        assert!(e.unwrap_err().to_string().contains("truncation_side"));
    }
}
