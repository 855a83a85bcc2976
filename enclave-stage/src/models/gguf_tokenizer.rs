//! The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata,
//! written as the Hugging Face `tokenizer.json` document that `transformers`
//! makes of it, so a stage serving a user's GGUF needs no other file: the
//! tokenizer is pinned by the GGUF's own digest.
//!
//! Two kinds are supported:
//! - byte-level BPE (`tokenizer.ggml.model = gpt2`: Llama 3.x,
//!   Qwen2/2.5/3, SmolLM, Phi-4, Phi-4-mini), with the split rules the
//!   file's `tokenizer.ggml.pre` names (GPT-2's, Llama 3's, Qwen2's, and
//!   `dbrx` and `gpt-4o` as llama.cpp applies them; Llama 3's also ignores
//!   merges for words in the vocabulary, as its `tokenizer.json` and
//!   llama.cpp do);
//! - SentencePiece BPE (`llama`: Llama 2, TinyLlama, Mistral 7B v0.1), as
//!   llama.cpp tokenizes it: spaces written `▁` and one prepended to each
//!   run of text (at the start and after every special token, unless
//!   `tokenizer.ggml.add_space_prefix` is false), the best-scored pair
//!   merged first (merges recovered from the scores as transformers
//!   recovers them; llama.cpp never reads a SentencePiece file's listed
//!   merges, and neither does this), characters outside the vocabulary as
//!   its `<0xXX>` byte tokens. That equals llama.cpp's cut when the
//!   vocabulary's mergeable pieces have distinct scores, as SentencePiece
//!   trains them; a file with tied scores (gguf-py writes -1000 for every
//!   piece it converts from a `tokenizer.json`) is refused, because
//!   llama.cpp merges tied pairs leftmost first, which no ranking of merges
//!   can say. So are duplicate pieces, malformed `<0x…>` byte tokens and
//!   pieces too long to be learned merges that a recovery would spend
//!   quadratic time on.
//!
//! Any other tokenizer model or split rule (Mistral Nemo's `tekken` among
//! them) is refused with an error naming it.
//!
//! A raw `/v1/completions` prompt starts with the BOS token where llama.cpp
//! would put one (the document's post-processor: the file's
//! `tokenizer.ggml.add_bos_token`, else llama.cpp's default for the
//! tokenizer, [`prompt_bos`]); a chat template writes its own BOS, so a
//! rendered chat is tokenized without the post-processor.
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

/// Split rule of `tokenizer.ggml.pre = gpt-4o` (Phi-4-mini) as llama.cpp
/// applies it, which is not GPT-4o's own (o200k) rule: llama.cpp rewrites
/// o200k's case classes as "a letter that is not a-z" and "a letter that is
/// not A-Z" (so every non-ASCII letter counts as both cases and a change of
/// case between them does not split: `приветМир` is one piece, o200k makes
/// two) and leaves out combining marks (`\p{M}`), which then split from
/// their letters; its contractions are ASCII. Written here with the same
/// classes (`[^\P{L}a-z]`: a letter but not a-z) instead of llama.cpp's
/// per-character lookaheads.
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[^\P{L}a-z]*[^\P{L}A-Z]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[^\P{L}a-z]+[^\P{L}A-Z]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// llama.cpp's end-of-generation token names: a token with one of these
/// texts is made a control (special) token whatever type the file gives
/// it ("control-looking token … its type will be overridden").
const EOG_NAMES: [&str; 22] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
];

/// A token's type as llama.cpp uses it: the file's, except that a token
/// named as an end of generation ([`EOG_NAMES`]) is a control token.
fn llama_cpp_type(token: &str, file_type: i64) -> i64 {
    if EOG_NAMES.contains(&token) {
        CONTROL
    } else {
        file_type
    }
}

/// The longest SentencePiece piece, in bytes, that merges are recovered
/// for: SentencePiece learns pieces of at most 16 characters by default
/// (64 bytes of UTF-8); longer ones are added tokens, matched whole.
const MAX_MERGED_PIECE: usize = 64;

/// The most merges a SentencePiece vocabulary may imply (Llama 2's 32,000
/// pieces imply about 60,000; a vocabulary of 256,000 well under this).
const MAX_MERGES: usize = 4_000_000;

/// SentencePiece's spelling of a space.
const SPACE: &str = "\u{2581}";

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
        // Phi-4's (cl100k): Llama 3's split, but merges always applied.
        "dbrx" => (serde_json::Value::Null, split(LLAMA3_SPLIT), false),
        "gpt-4o" => (serde_json::Value::Null, split(GPT4O_SPLIT), false),
        "qwen2" => (json!({"type": "NFC"}), split(QWEN2_SPLIT), false),
        other => {
            return Err(format!(
                "the GGUF's tokenizer split rule tokenizer.ggml.pre = {other:?} is not supported \
                 (supported: default, gpt2, smollm, llama-bpe, llama3, llama-v3, dbrx, gpt-4o, qwen2)"
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
    if !matches!(model.as_str(), "gpt2" | "llama") {
        return Err(format!(
            "the GGUF's tokenizer model {model:?} is not supported \
             (supported: gpt2, byte-level BPE; llama, SentencePiece BPE)"
        ));
    }
    let tokens = strings(ct, "tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match ct.metadata.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a.iter().map(|v| int(v).unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err("tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length".into());
    }
    if model == "gpt2" {
        byte_level(ct, tokens, &types)
    } else {
        sentencepiece(ct, tokens, &types)
    }
}

/// A byte-level BPE document (`tokenizer.ggml.model = gpt2`).
fn byte_level(
    ct: &Content,
    tokens: Vec<String>,
    types: &[i64],
) -> Result<serde_json::Value, String> {
    let pre = match ct.metadata.get("tokenizer.ggml.pre") {
        Some(v) => v.to_string().map_err(|e| e.to_string())?.clone(),
        None => "default".into(),
    };
    let (normalizer, pre_tokenizer, ignore_merges) = pre_tokenizer(&pre)?;
    let merges = strings(ct, "tokenizer.ggml.merges")?;
    let spelling = bytes_to_unicode();
    let in_alphabet = |t: &str| t.chars().all(|c| spelling.contains(&c));
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, (tok, ty)) in tokens.iter().zip(types).enumerate() {
        let key = if in_alphabet(tok) {
            tok.clone()
        } else {
            tok.bytes().map(|b| spelling[b as usize]).collect()
        };
        vocab.entry(key).or_insert(json!(i));
        let ty = llama_cpp_type(tok, *ty);
        if (ty == CONTROL || ty == USER_DEFINED) && in_alphabet(tok) {
            added.push(json!({
                "id": i, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == CONTROL,
            }));
        }
    }
    // llama.cpp puts a BOS before prompts for Llama 3's split rule only.
    let llama3 = matches!(pre.as_str(), "llama-bpe" | "llama3" | "llama-v3");
    let bos = prompt_bos(ct, &tokens, llama3, 11)?;
    Ok(document(
        added,
        normalizer,
        pre_tokenizer,
        bos,
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
        json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": listed_merges(&merges),
        }),
    ))
}

/// The file's merges (`"a b"` each) as the document lists them.
fn listed_merges(merges: &[String]) -> Vec<serde_json::Value> {
    merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap_or((m, ""));
            json!([a, b])
        })
        .collect()
}

/// A SentencePiece BPE document (`tokenizer.ggml.model = llama`), written
/// to tokenize as llama.cpp does (module docs): the space prefix is a
/// normalizer, which runs on each run of text between added tokens, rather
/// than transformers' `Metaspace`, which prefixes only the first.
fn sentencepiece(
    ct: &Content,
    tokens: Vec<String>,
    types: &[i64],
) -> Result<serde_json::Value, String> {
    let scores: Vec<f32> = match ct.metadata.get("tokenizer.ggml.scores") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.to_f32()
                    .map_err(|e| format!("tokenizer.ggml.scores: {e}"))
            })
            .collect::<Result<_, _>>()?,
        _ => return Err("GGUF metadata has no tokenizer.ggml.scores".into()),
    };
    if scores.len() != tokens.len() {
        return Err("tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length".into());
    }
    if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
        return Err(format!("tokenizer.ggml.scores[{i}] is {}", scores[i]));
    }
    let mut seen = std::collections::HashSet::new();
    for (i, tok) in tokens.iter().enumerate() {
        if !seen.insert(tok.as_str()) {
            return Err(format!(
                "tokenizer.ggml.tokens[{i}] {tok:?} is listed twice"
            ));
        }
        // A byte token is `<0xHH>`; anything else so named would be read
        // as one (and refused by the grammar engine's vocabulary reader).
        if tok.starts_with("<0x")
            && !(tok.len() == 6
                && tok.ends_with('>')
                && tok[3..5].bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(format!(
                "tokenizer.ggml.tokens[{i}] {tok:?} is not a byte token <0xHH>"
            ));
        }
    }
    // llama.cpp merges by score alone: listed merges are never read.
    let merges = recovered_merges(&tokens, &scores)?;
    let phi3 = ct
        .metadata
        .get("general.name")
        .and_then(|v| v.to_string().ok())
        .is_some_and(|n| {
            let n = n.to_lowercase();
            n.contains("phi3") || n.contains("phi-3")
        });
    let add_space = match ct.metadata.get("tokenizer.ggml.add_space_prefix") {
        Some(v) => v
            .to_bool()
            .map_err(|e| format!("tokenizer.ggml.add_space_prefix: {e}"))?,
        None => true,
    };
    let unk = ct
        .metadata
        .get("tokenizer.ggml.unknown_token_id")
        .and_then(int)
        .and_then(|i| tokens.get(usize::try_from(i).ok()?).cloned());
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (i, (tok, ty)) in tokens.iter().zip(types).enumerate() {
        vocab.insert(tok.clone(), json!(i));
        let ty = llama_cpp_type(tok, *ty);
        if matches!(ty, UNKNOWN | CONTROL | USER_DEFINED) {
            // llama.cpp strips the spaces after a Phi-3 file's special
            // tokens (control, user-defined and unknown alike), but for
            // these three.
            let rstrip = phi3 && !matches!(tok.as_str(), "<unk>" | "<s>" | "<|endoftext|>");
            added.push(json!({
                "id": i, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": rstrip, "normalized": false, "special": ty != USER_DEFINED,
            }));
        }
    }
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE});
    let normalizer = if add_space {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace]})
    } else {
        replace
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": SPACE}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let bos = prompt_bos(ct, &tokens, true, 1)?;
    Ok(document(
        added,
        normalizer,
        serde_json::Value::Null,
        bos,
        json!({"type": "Sequence", "decoders": decoders}),
        json!({
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        }),
    ))
}

/// The merges a SentencePiece vocabulary implies, as transformers recovers
/// them (`generate_merges`): every split of every piece into two pieces,
/// the best-scored merged piece first, then longer left and right parts
/// first, ties in vocabulary order. Merging by these ranks is
/// SentencePiece's (and llama.cpp's) rule of merging the best-scored pair
/// first, provided no two mergeable pieces share a score (refused here,
/// named). Pieces longer than [`MAX_MERGED_PIECE`] bytes are not split.
fn recovered_merges(tokens: &[String], scores: &[f32]) -> Result<Vec<serde_json::Value>, String> {
    let index: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // (left, right, score, chars of left, chars of right)
    let mut merges: Vec<(&str, &str, f32, usize, usize)> = Vec::new();
    // The score of each piece that merges make, to find ties.
    let mut merged: Vec<(f32, usize)> = Vec::new();
    for (i, (tok, &score)) in tokens.iter().zip(scores).enumerate() {
        if tok.len() > MAX_MERGED_PIECE {
            continue;
        }
        let mut local: Vec<(usize, usize, &str, &str)> = tok
            .char_indices()
            .skip(1)
            .filter_map(|(k, _)| {
                let (l, r) = tok.split_at(k);
                Some((*index.get(l)?, *index.get(r)?, l, r))
            })
            .collect();
        if local.is_empty() {
            continue;
        }
        merged.push((score, i));
        local.sort_by_key(|m| (m.0, m.1));
        merges.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (l, r, score, l.chars().count(), r.chars().count())),
        );
        if merges.len() > MAX_MERGES {
            return Err(format!(
                "the SentencePiece vocabulary implies more than {MAX_MERGES} merges"
            ));
        }
    }
    merged.sort_by(|a, b| a.0.total_cmp(&b.0));
    if let Some(w) = merged.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(format!(
            "SentencePiece pieces {:?} and {:?} share the score {}: llama.cpp merges tied pairs \
             leftmost first, which a ranking of merges cannot reproduce (a file converted from a \
             tokenizer.json without scores?)",
            tokens[w[0].1], tokens[w[1].1], w[0].0
        ));
    }
    // A stable sort, descending: equal keys keep their order, as Python's
    // `sorted(..., reverse=True)` keeps them.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)));
    Ok(merges.into_iter().map(|(l, r, ..)| json!([l, r])).collect())
}

/// The token llama.cpp puts before a prompt it tokenizes with its special
/// tokens, if any: where `tokenizer.ggml.add_bos_token` says so, or where
/// the file does not say and llama.cpp's default for the tokenizer is yes
/// (`default`: SentencePiece, and Llama 3's split rule); the token is
/// `tokenizer.ggml.bos_token_id`, llama.cpp's `default_id` where absent.
fn prompt_bos(
    ct: &Content,
    tokens: &[String],
    default: bool,
    default_id: i64,
) -> Result<Option<(String, i64)>, String> {
    let add = match ct.metadata.get("tokenizer.ggml.add_bos_token") {
        Some(v) => v
            .to_bool()
            .map_err(|e| format!("tokenizer.ggml.add_bos_token: {e}"))?,
        None => default,
    };
    if !add {
        return Ok(None);
    }
    let id = match ct.metadata.get("tokenizer.ggml.bos_token_id") {
        Some(v) => int(v).ok_or("tokenizer.ggml.bos_token_id is not an integer")?,
        None => default_id,
    };
    let token = usize::try_from(id)
        .ok()
        .and_then(|i| tokens.get(i))
        .ok_or_else(|| format!("the BOS token id {id} is outside the vocabulary"))?;
    Ok(Some((token.clone(), id)))
}

/// The whole `tokenizer.json` document around a model: no truncation or
/// padding, and the BOS token `bos` (text, id) put before a text encoded
/// with its special tokens (a raw prompt; a chat template writes its own).
fn document(
    added: Vec<serde_json::Value>,
    normalizer: serde_json::Value,
    pre_tokenizer: serde_json::Value,
    bos: Option<(String, i64)>,
    decoder: serde_json::Value,
    model: serde_json::Value,
) -> serde_json::Value {
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let (single, pair, special_tokens) = match &bos {
        None => (vec![seq("A", 0)], vec![seq("A", 0), seq("B", 1)], json!({})),
        Some((text, id)) => {
            let b = |type_id: u32| json!({"SpecialToken": {"id": text, "type_id": type_id}});
            (
                vec![b(0), seq("A", 0)],
                vec![b(0), seq("A", 0), b(1), seq("B", 1)],
                json!({ text.as_str(): {"id": text, "ids": [id], "tokens": [text]} }),
            )
        }
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": single,
            "pair": pair,
            "special_tokens": special_tokens,
        },
        "decoder": decoder,
        "model": model,
    })
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
    /// (and dbrx's, gpt-4o's) digits in threes, Qwen2's one by one, GPT-2's
    /// in runs; gpt-4o splits an ASCII change of case but, as llama.cpp,
    /// not a Cyrillic one (o200k itself would).
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
            ("dbrx", vec!["123", "45", "Ġab"]),
            ("gpt-4o", vec!["123", "45", "Ġab"]),
            // " приветМир" one piece, byte-level spelled.
            ("gpt-4o", vec!["Hello", "World", "ĠÐ¿ÑĢÐ¸Ð²ÐµÑĤÐľÐ¸ÑĢ"]),
        ] {
            let text = if want[0] == "Hello" {
                "HelloWorld приветМир"
            } else {
                "12345 ab"
            };
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
            let mut split = PreTokenizedString::from(text);
            t.get_pre_tokenizer()
                .unwrap()
                .pre_tokenize(&mut split)
                .unwrap();
            let got: Vec<String> = split
                .get_splits(OffsetReferential::Original, OffsetType::Byte)
                .into_iter()
                .map(|(s, _, _)| s.to_string())
                .collect();
            assert_eq!(got, want, "{pre} {text:?}");
        }
    }

    #[test]
    fn sentencepiece_merges_are_recovered_best_scored_first() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "abc", "bc"]
            .map(String::from)
            .to_vec();
        let merges = recovered_merges(&tokens, &[-1.0, -2.0, -3.0, -0.5, -0.1, -0.7]).unwrap();
        // "abc" scores best: both its splits, the longer left part first;
        // then "ab", then "bc".
        assert_eq!(
            merges,
            vec![
                json!(["ab", "c"]),
                json!(["a", "bc"]),
                json!(["a", "b"]),
                json!(["b", "c"])
            ]
        );
    }

    /// A SentencePiece file's metadata: `tokens` with `scores`, all NORMAL.
    fn spm(tokens: &[&str], scores: &[f32], merges: Option<&[&str]>) -> Content {
        let mut ct = Content {
            magic: candle_core::quantized::gguf_file::VersionedMagic::GgufV3,
            metadata: Default::default(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        };
        let list =
            |v: &[&str]| Value::Array(v.iter().map(|t| Value::String(t.to_string())).collect());
        let m = &mut ct.metadata;
        m.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
        m.insert("tokenizer.ggml.tokens".into(), list(tokens));
        m.insert(
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.iter().map(|s| Value::F32(*s)).collect()),
        );
        if let Some(merges) = merges {
            m.insert("tokenizer.ggml.merges".into(), list(merges));
        }
        ct
    }

    #[test]
    fn sentencepiece_files_llama_cpp_would_cut_otherwise_are_refused() {
        let toks = ["a", "b", "c", "ab", "bc"];
        // Listed merges are not read (llama.cpp merges by score): "bc"
        // scores best, whatever the list says.
        let doc =
            tokenizer_json(&spm(&toks, &[-1., -2., -3., -0.9, -0.5], Some(&["a b"]))).unwrap();
        assert_eq!(doc["model"]["merges"][0], json!(["b", "c"]));
        let err =
            |toks: &[&str], scores: &[f32]| tokenizer_json(&spm(toks, scores, None)).unwrap_err();
        let e = err(&toks, &[-1., -2., -3., -0.5, -0.5]);
        assert!(e.contains("share the score"), "{e}");
        let e = err(&["a", "b", "a"], &[-1., -2., -3.]);
        assert!(e.contains("listed twice"), "{e}");
        let e = err(&["a", "<0xZZ>"], &[-1., -2.]);
        assert!(e.contains("not a byte token"), "{e}");
        let e = err(&["a", "b"], &[-1., f32::NAN]);
        assert!(e.contains("scores[1]"), "{e}");
    }

    /// A raw prompt gets the BOS token where llama.cpp adds one: a
    /// SentencePiece file by default, never where the file says no; a
    /// rendered chat (no special tokens) never does.
    #[test]
    fn raw_prompts_get_the_bos_llama_cpp_adds() {
        let toks = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab"];
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.7];
        let encode = |ct: &Content, special: bool| -> Vec<u32> {
            let doc = tokenizer_json(ct).unwrap().to_string();
            let t: tokenizers::Tokenizer = doc.parse().unwrap();
            t.encode("a ab", special).unwrap().get_ids().to_vec()
        };
        let mut ct = spm(&toks, &scores, None);
        ct.metadata
            .insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
        let plain = encode(&ct, false);
        assert_ne!(plain.first(), Some(&1));
        assert_eq!(encode(&ct, true), [&[1][..], &plain].concat());
        ct.metadata
            .insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
        assert_eq!(encode(&ct, true), plain);
        ct.metadata
            .insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(true));
        ct.metadata
            .insert("tokenizer.ggml.bos_token_id".into(), Value::U32(99));
        assert!(tokenizer_json(&ct).unwrap_err().contains("BOS token id 99"));
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
            .insert("tokenizer.ggml.model".into(), Value::String("t5".into()));
        assert!(tokenizer_json(&ct).unwrap_err().contains("\"t5\""));
    }
}
