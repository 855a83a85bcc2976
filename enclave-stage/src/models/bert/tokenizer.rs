//! The entry stage's tokenizer for a BERT-family model folder, as
//! sentence-transformers (through transformers 5) builds it from the
//! folder's `tokenizer.json` and `tokenizer_config.json`:
//!
//! - BERT: the WordPiece vocabulary, pre-tokenizer and `[CLS] … [SEP]`
//!   template from `tokenizer.json`, but the normalizer from
//!   `tokenizer_config.json`'s `do_lower_case`, `strip_accents` and
//!   `tokenize_chinese_chars` (defaults `true`, none, `true`, also when the
//!   file is absent), which transformers' `BertTokenizer` applies over
//!   whatever `tokenizer.json` says.
//! - XLM-RoBERTa: the Unigram vocabulary, the SentencePiece character map
//!   (`Precompiled`) and the added tokens from `tokenizer.json`, the rest as
//!   transformers' `XLMRobertaTokenizer` rebuilds it: unknown id 3, no byte
//!   fallback, whitespace split then `▁` prepended (unless
//!   `add_prefix_space` is false), `<s> … </s>` around the text. The
//!   difference is real: the file's own pipeline keeps a `▁` for trailing
//!   spaces, transformers 5 (and SentencePiece) drop it.
//!
//! Truncated to the manifest's `max_seq_len`, special tokens included, from
//! the side `tokenizer_config.json`'s `truncation_side` names (`right`, the
//! default, or `left`: a long text keeps its end), as transformers does.
//!
//! Refused, named, rather than served with other vectors than
//! sentence-transformers would give: a `tokenizer_class` of another family
//! than the encoder's, `do_lower_case = true` in `sentence_bert_config.json`
//! (the text itself lower-cased), a `default_prompt_name` in
//! `config_sentence_transformers.json` (a prompt prepended to every text),
//! an XLM-RoBERTa `tokenizer.json` whose model is not Unigram or has no
//! `<s>`/`</s>`, a vocabulary larger than the encoder's embedding table,
//! and a `max_seq_len` that leaves no room after the special tokens.

use crate::models::bert::BertConfig;
use anyhow::{bail, Context, Result};
use proto::manifest::LoadedManifest;
use serde_json::{json, Value};
use tokenizers::normalizers::BertNormalizer;
use tokenizers::{PostProcessor, Tokenizer, TruncationDirection, TruncationParams};

/// A JSON file the manifest lists, read and checked (`None` if unlisted).
fn pinned_json(manifest: &LoadedManifest, rel: &str) -> Result<Option<Value>> {
    if !manifest.lists(rel) {
        return Ok(None);
    }
    Ok(Some(manifest.verified_json(rel)?))
}

/// Text of many scripts and character kinds, tokenized once at load.
const PROBE: &str = "Hello, World! 12345 café Ｆｕｌｌ ﬁ e\u{301} \t\n Пример 患者 مرحبا नमस्ते \
     สวัสดี 한국어 🙂 \u{a0}\u{200b}\u{feff} <s> </s> <pad> <mask>";

/// Refuses a `tokenizer_config.json` whose `tokenizer_class` is not one of
/// `served` (the encoder's family).
fn check_class(config: &Value, served: [&str; 2]) -> Result<()> {
    if let Some(class) = config["tokenizer_class"].as_str() {
        if !served.contains(&class) {
            bail!(
                "tokenizer_config.json: tokenizer_class {class:?} is not served for this \
                 encoder (served: {})",
                served.join(", ")
            );
        }
    }
    Ok(())
}

/// The normalizer transformers' `BertTokenizer` builds from
/// `tokenizer_config.json` (its settings at their defaults when absent).
fn bert_normalizer(c: &Value) -> Result<BertNormalizer> {
    check_class(c, ["BertTokenizer", "BertTokenizerFast"])?;
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

/// `tokenizer.json` rewritten as transformers' `XLMRobertaTokenizer`
/// rebuilds it from that file and `tokenizer_config.json` (`c`): the file's
/// Unigram vocabulary and added tokens, its `Precompiled` character map as
/// the only normalizer, unknown id 3, no byte fallback, whitespace split
/// then Metaspace, and `bos … eos` around the text.
fn xlm_roberta_document(file: &[u8], c: &Value) -> Result<Value> {
    check_class(c, ["XLMRobertaTokenizer", "XLMRobertaTokenizerFast"])?;
    let mut doc: Value = serde_json::from_slice(file).context("parsing tokenizer.json")?;
    let model = &mut doc["model"];
    if model["type"] != "Unigram" {
        bail!(
            "tokenizer.json: an XLM-RoBERTa tokenizer's model is Unigram, not {}",
            model["type"]
        );
    }
    let vocab = model["vocab"].as_array().map_or(0, Vec::len);
    if vocab <= 3 {
        bail!(
            "tokenizer.json: a Unigram vocabulary of {vocab} pieces has no unknown piece at id 3"
        );
    }
    model["unk_id"] = json!(3);
    model["byte_fallback"] = json!(false);
    // The last piece of that name, as the Unigram model maps names to ids.
    let id_of = |token: &str| -> Option<usize> {
        model["vocab"]
            .as_array()?
            .iter()
            .rposition(|p| p[0].as_str() == Some(token))
    };
    let special = |key: &str, default: &str| -> Result<(String, usize)> {
        let token = match &c[key] {
            Value::Null => default.to_string(),
            Value::String(s) => s.clone(),
            // The `AddedToken` form: `{"content": …, …}`.
            Value::Object(o) => match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                _ => bail!("tokenizer_config.json: {key} has no content"),
            },
            other => bail!("tokenizer_config.json: {key} is {other}, not a token"),
        };
        let id = id_of(&token).with_context(|| {
            format!("tokenizer.json: the {key} {token:?} is not in the vocabulary")
        })?;
        Ok((token, id))
    };
    let (bos, bos_id) = special("bos_token", "<s>")?;
    let (eos, eos_id) = special("eos_token", "</s>")?;
    // Absent: the class's default, true; an explicit null is falsy.
    let prepend = match c.get("add_prefix_space") {
        None | Some(Value::Bool(true)) => "always",
        Some(Value::Null | Value::Bool(false)) => "never",
        Some(other) => bail!("tokenizer_config.json: add_prefix_space is {other}, not a boolean"),
    };
    // transformers adds the tokens `added_tokens_decoder` lists, with their
    // flags, instead of tokenizer.json's.
    if let Some(decoder) = c.get("added_tokens_decoder") {
        doc["added_tokens"] = added_tokens(decoder)?;
    }
    let normalizers = match doc["normalizer"]["type"].as_str() {
        Some("Sequence") => doc["normalizer"]["normalizers"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
        Some(_) => vec![doc["normalizer"].clone()],
        None => vec![],
    };
    doc["normalizer"] = normalizers
        .into_iter()
        .find(|n| n["type"] == "Precompiled")
        .unwrap_or(Value::Null);
    doc["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": true},
    ]});
    let piece = |t: &str| json!({"SpecialToken": {"id": t, "type_id": 0}});
    let a = json!({"Sequence": {"id": "A", "type_id": 0}});
    let b = json!({"Sequence": {"id": "B", "type_id": 0}});
    doc["post_processor"] = json!({
        "type": "TemplateProcessing",
        "single": [piece(&bos), a.clone(), piece(&eos)],
        "pair": [piece(&bos), a, piece(&eos), piece(&eos), b, piece(&eos)],
        "special_tokens": {
            bos.clone(): {"id": bos, "ids": [bos_id], "tokens": [bos]},
            eos.clone(): {"id": eos, "ids": [eos_id], "tokens": [eos]},
        },
    });
    Ok(doc)
}

/// `tokenizer_config.json`'s `added_tokens_decoder` (`{"id": {"content": …,
/// flags}}`) as tokenizer.json's `added_tokens`, with `AddedToken`'s
/// defaults for absent flags.
fn added_tokens(decoder: &Value) -> Result<Value> {
    let entries = decoder
        .as_object()
        .context("tokenizer_config.json: added_tokens_decoder is not an object")?;
    let mut tokens = Vec::with_capacity(entries.len());
    for (id, t) in entries {
        let id: u32 = id
            .parse()
            .with_context(|| format!("tokenizer_config.json: added token id {id:?}"))?;
        let content = t["content"]
            .as_str()
            .with_context(|| format!("tokenizer_config.json: added token {id} has no content"))?;
        let flag = |key: &str, default: bool| t[key].as_bool().unwrap_or(default);
        let special = flag("special", false);
        tokens.push((
            id,
            json!({"id": id, "content": content, "single_word": flag("single_word", false),
                   "lstrip": flag("lstrip", false), "rstrip": flag("rstrip", false),
                   "normalized": flag("normalized", !special), "special": special}),
        ));
    }
    tokens.sort_by_key(|(id, _)| *id);
    Ok(Value::Array(tokens.into_iter().map(|(_, t)| t).collect()))
}

/// Loads the entry stage's tokenizer for the encoder `cfg` describes,
/// refusing what it does not serve (module docs).
pub fn load(manifest: &LoadedManifest, cfg: &BertConfig) -> Result<Tokenizer> {
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
    let config = pinned_json(manifest, "tokenizer_config.json")?.unwrap_or(json!({}));
    if config["split_special_tokens"] == Value::Bool(true) {
        bail!("tokenizer_config.json: split_special_tokens = true is not served");
    }
    let side = truncation_side(&config)?;
    let bytes = manifest.verified_bytes("tokenizer.json")?;
    let mut t = if cfg.is_xlm_roberta() {
        let doc = xlm_roberta_document(&bytes, &config)?;
        let t = Tokenizer::from_bytes(doc.to_string())
            .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
        // The file's SentencePiece character map is a table the tokenizers
        // crate trusts; a malformed one panics when text is normalized. Try
        // it here, on text of many scripts, so such a file stops the start
        // (each request's tokenization also catches a panic:
        // `crate::tokens::encode`).
        if crate::tokens::encode(Some(&t), PROBE, true).is_err() {
            bail!("tokenizer.json: its Precompiled character map fails on text; it is malformed");
        }
        t
    } else {
        let normalizer = bert_normalizer(&config)?;
        let mut t = Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow::anyhow!("loading tokenizer.json: {e}"))?;
        t.with_normalizer(Some(normalizer))
            .map_err(|e| anyhow::anyhow!("tokenizer normalizer: {e}"))?;
        t
    };
    let vocab = t.get_vocab_size(true);
    if vocab > cfg.vocab_size {
        bail!(
            "tokenizer.json has {vocab} tokens, but the encoder embeds {}",
            cfg.vocab_size
        );
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
fn truncation_side(config: &Value) -> Result<TruncationDirection> {
    match &config["truncation_side"] {
        Value::Null => Ok(TruncationDirection::Right),
        Value::String(s) if s == "right" => Ok(TruncationDirection::Right),
        Value::String(s) if s == "left" => Ok(TruncationDirection::Left),
        other => bail!(
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
            truncate(&mut t, 4, truncation_side(&config).unwrap()).unwrap();
            t.encode("a b c d", true).unwrap().get_ids().to_vec()
        };
        assert_eq!(cut("right"), [0, 3, 4, 1]);
        assert_eq!(cut("left"), [0, 5, 6, 1]);
        assert_eq!(
            truncation_side(&json!({})).unwrap(),
            TruncationDirection::Right
        );
        let e = truncation_side(&json!({"truncation_side": "middle"}));
        assert!(e.unwrap_err().to_string().contains("truncation_side"));
    }

    /// An XLM-RoBERTa `tokenizer.json` is rebuilt as transformers 5 does:
    /// the file's own pipeline keeps a `▁` for a trailing space, the rebuilt
    /// one drops it (whitespace split first) and wraps the text in
    /// `<s> … </s>`; a tokenizer of the other family, or a model that is not
    /// Unigram, is refused.
    #[test]
    fn xlm_roberta_tokenizer_follows_transformers() {
        let vocab = ["<s>", "<pad>", "</s>", "<unk>", "▁a", "▁b", "▁", "a", "b"];
        let file = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "}]},
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
                "prepend_scheme": "always", "split": true},
            "post_processor": null, "decoder": null,
            "model": {"type": "Unigram", "unk_id": 3, "byte_fallback": false,
                "vocab": vocab.iter().map(|p| json!([p, -1.0])).collect::<Vec<_>>()}
        });
        let as_is: Tokenizer = file.to_string().parse().unwrap();
        assert_eq!(as_is.encode("a b ", true).unwrap().get_ids(), [4, 5, 6]);
        let config = json!({"tokenizer_class": "XLMRobertaTokenizer"});
        let doc = xlm_roberta_document(file.to_string().as_bytes(), &config).unwrap();
        let rebuilt: Tokenizer = doc.to_string().parse().unwrap();
        assert_eq!(
            rebuilt.encode("a b ", true).unwrap().get_ids(),
            [0, 4, 5, 2]
        );
        let bert = json!({"tokenizer_class": "BertTokenizer"});
        let e = xlm_roberta_document(file.to_string().as_bytes(), &bert).unwrap_err();
        assert!(e.to_string().contains("BertTokenizer"), "{e}");
        let mut wordpiece = file.clone();
        wordpiece["model"]["type"] = json!("WordPiece");
        let e = xlm_roberta_document(wordpiece.to_string().as_bytes(), &config).unwrap_err();
        assert!(e.to_string().contains("Unigram"), "{e}");
        // tokenizer_config.json's added tokens are the ones matched, and an
        // explicit `add_prefix_space: null` prepends no `▁`.
        let encode = |config: Value, text: &str| -> Vec<u32> {
            let doc = xlm_roberta_document(file.to_string().as_bytes(), &config).unwrap();
            let t: Tokenizer = doc.to_string().parse().unwrap();
            t.encode(text, true).unwrap().get_ids().to_vec()
        };
        let pad = json!({"1": {"content": "<pad>", "special": true}});
        let with_pad = json!({ "added_tokens_decoder": pad });
        assert_eq!(encode(with_pad, "a <pad> b"), [0, 4, 1, 5, 2]);
        assert_ne!(encode(json!({}), "a <pad> b")[2], 1);
        assert_eq!(
            encode(json!({ "add_prefix_space": null }), "a b"),
            [0, 7, 8, 2]
        );
    }
}
