//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
//! written as the Hugging Face `tokenizer.json` document that `transformers`
//! makes of it, so a stage serving a user's GGUF needs no other file: the
//! tokenizer is pinned by the GGUF's own digest.
//!
//! Byte-level BPE (`tokenizer.ggml.model = gpt2`: Llama 3.x, Qwen2/2.5/3,
//! SmolLM) is supported, with the split rules the file's
//! `tokenizer.ggml.pre` names (GPT-2's, Llama 3's, Qwen2's; Llama 3's also
//! ignores merges for words in the vocabulary, as its `tokenizer.json`
//! and llama.cpp do). SentencePiece files (`llama`: Llama 2, TinyLlama,
//! Mistral 7B) and any other split rule (Mistral Nemo's `tekken` among
//! them) are refused with an error naming them.
//!
//! Prompts are tokenized without special tokens: a chat template writes
//! its own BOS, and a raw `/v1/completions` prompt gets none even where the
//! file asks for one (`tokenizer.ggml.add_bos_token`).
//!
//! For SmolLM2 the document equals the shipped, pinned `tokenizer.json`
//! (made by `scripts/place_models.py`, byte for byte what `transformers`
//! saves); `tests` checks that.

use candle_core::quantized::gguf_file::{Content, Value};
use serde_json::{json, Map};

/// Split rule of Llama 3's tokenizer (`tokenizer.ggml.pre = llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Split rule of Qwen2's tokenizer (`tokenizer.ggml.pre = qwen2`), as its
/// `tokenizer.json` writes it.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// GPT-2's byte → printable character table (as in transformers and
/// tokenizers' `ByteLevel`).
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let mut n = 0;
    for b in 0..256u32 {
        table[b as usize] = if printable(b) {
            char::from_u32(b).expect("latin-1")
        } else {
            n += 1;
            char::from_u32(255 + n).expect("below U+0200")
        };
    }
    table
}

fn strings(ct: &Content, key: &str) -> Result<Vec<String>, String> {
    match ct.metadata.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| format!("{key}: {e}")))
            .collect(),
        Some(_) => Err(format!("GGUF metadata {key} is not a list of strings")),
        None => Err(format!("GGUF metadata has no {key}")),
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::I32(x) => Some(*x as i64),
        Value::U32(x) => Some(*x as i64),
        Value::I64(x) => Some(*x),
        Value::U64(x) => i64::try_from(*x).ok(),
        Value::I8(x) => Some(*x as i64),
        Value::U8(x) => Some(*x as i64),
        Value::I16(x) => Some(*x as i64),
        Value::U16(x) => Some(*x as i64),
        _ => None,
    }
}

/// The normalizer, pre-tokenizer and `ignore_merges` for a
/// `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> Result<(serde_json::Value, serde_json::Value, bool), String> {
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |pattern: &str| {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            byte_level(false),
        ]})
    };
    Ok(match pre {
        // transformers has no split rule of its own for SmolLM's "smollm"
        // and uses GPT-2's, as for "gpt2" and "default".
        "default" | "gpt2" | "smollm" => (serde_json::Value::Null, byte_level(true), false),
        "llama-bpe" | "llama3" | "llama-v3" => (serde_json::Value::Null, split(LLAMA3_SPLIT), true),
        "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT), false),
        other => {
            return Err(format!(
                "the GGUF's tokenizer split rule tokenizer.ggml.pre = {other:?} is not supported \
                 (supported: default, gpt2, smollm, llama-bpe, llama3, llama-v3, qwen2)"
            ))
        }
    })
}

/// The `tokenizer.json` document for the GGUF's tokenizer, or an error
/// naming what is not supported.
pub fn tokenizer_json(ct: &Content) -> Result<serde_json::Value, String> {
    let model = match ct.metadata.get("tokenizer.ggml.model") {
        Some(v) => v.to_string().map_err(|e| e.to_string())?.clone(),
        None => return Err("GGUF metadata has no tokenizer.ggml.model".into()),
    };
    if model != "gpt2" {
        return Err(format!(
            "the GGUF's tokenizer model {model:?} is not supported (supported: gpt2, byte-level BPE)"
        ));
    }
    let pre = match ct.metadata.get("tokenizer.ggml.pre") {
        Some(v) => v.to_string().map_err(|e| e.to_string())?.clone(),
        None => "default".into(),
    };
    let (normalizer, pre_tokenizer, ignore_merges) = pre_tokenizer(&pre)?;
    let tokens = strings(ct, "tokenizer.ggml.tokens")?;
    let merges = strings(ct, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match ct.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|v| int(v).unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length".into());
    }
    let spelling = bytes_to_unicode();
    let in_alphabet = |t: &str| t.chars().all(|c| spelling.contains(&c));
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, (tok, ty)) in tokens.iter().zip(&types).enumerate() {
        let key = if in_alphabet(tok) {
            tok.clone()
        } else {
            tok.bytes().map(|b| spelling[b as usize]).collect()
        };
        vocab.entry(key).or_insert(json!(i));
        if (*ty == CONTROL || *ty == USER_DEFINED) && in_alphabet(tok) {
            added.push(json!({
                "id": i, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": *ty == CONTROL,
            }));
        }
    }
    let merges: Vec<serde_json::Value> = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap_or((m, ""));
            json!([a, b])
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = bytes_to_unicode();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xad], 'Ń');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    /// Each split rule cuts a text where its tokenizer does: Llama 3's
    /// digits in threes, Qwen2's one by one, GPT-2's in runs.
    #[test]
    fn split_rules_cut_digits_as_their_tokenizers_do() {
        use tokenizers::{
            OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer,
        };
        let spelling = bytes_to_unicode();
        let mut metadata = std::collections::HashMap::new();
        let tokens: Vec<Value> = spelling
            .iter()
            .map(|c| Value::String(c.to_string()))
            .collect();
        metadata.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
        metadata.insert("tokenizer.ggml.tokens".into(), Value::Array(tokens));
        metadata.insert("tokenizer.ggml.merges".into(), Value::Array(vec![]));
        for (pre, want) in [
            ("llama-bpe", vec!["123", "45", "Ġab"]),
            ("qwen2", vec!["1", "2", "3", "4", "5", "Ġab"]),
            ("gpt2", vec!["12345", "Ġab"]),
        ] {
            metadata.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
            let ct = Content {
                magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
                metadata: metadata.clone(),
                tensor_infos: Default::default(),
                tensor_data_offset: 0,
            };
            let doc = tokenizer_json(&ct).unwrap();
            assert_eq!(doc["model"]["ignore_merges"], pre == "llama-bpe", "{pre}");
            let t = Tokenizer::from_bytes(serde_json::to_vec(&doc).unwrap()).unwrap();
            let mut split = PreTokenizedString::from("12345 ab");
            t.get_pre_tokenizer()
                .unwrap()
                .pre_tokenize(&mut split)
                .unwrap();
            let got: Vec<String> = split
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(s, _, _)| s.to_string())
                .collect();
            assert_eq!(got, want, "{pre}");
        }
    }

    #[test]
    fn unsupported_split_rules_and_models_are_named() {
        assert!(pre_tokenizer("deepseek-coder")
            .unwrap_err()
            .contains("deepseek-coder"));
        let mut ct = Content {
            magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
            metadata: Default::default(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        };
        ct.metadata
            .insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        assert!(tokenizer_json(&ct).unwrap_err().contains("\"llama\""));
    }
}
