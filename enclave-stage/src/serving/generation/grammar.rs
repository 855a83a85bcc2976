//! Grammar-constrained sampling for structured outputs and tool calls, with
//! llguidance: a request's `response_format` and tools become one Lark
//! grammar ([`grammar_text`]), compiled for the model's vocabulary into a
//! [`Matcher`] per choice, which gives the tokens allowed at each step.
//!
//! The entry stage compiles a request's grammar once to refuse what cannot
//! be compiled (a 400 naming the field); the exit stage, where sampling
//! happens, needs it again. The last [`CACHED_GRAMMARS`] grammars that
//! compiled are kept by the digest of their text, so a client that sends
//! the same schema or tools each time (the usual case) pays for one
//! compile per stage, not one per request on the exit stage's compute
//! thread. Work is bounded by llguidance's fuel limits ([`limits`]): a
//! grammar that needs more to compile, or a step that needs more to
//! compute its mask, fails rather than hangs.

use anyhow::{anyhow, Result};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::earley::SlicedBiasComputer;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use proto::completions::CompletionsRequest;
use proto::digest::Sha256Digest;
use proto::openai::ApiError;
use proto::tools::{ToolCalls, CALL_CLOSE, CALL_MID, CALL_OPEN, CALL_SEP, CALL_TAG};
use serde_json::Value;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokenizers::Tokenizer;

/// JSON whitespace the model may write between two tokens: up to 32
/// characters. Unbounded whitespace lets a small model loop on newlines
/// until its token limit; a bound this size still allows the indentation
/// models write unconstrained.
const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,32}";

/// llguidance's work limits for one request: how much compiling a grammar
/// and computing one step's mask may cost (the defaults, whose documented
/// speeds bound a mask near 15 ms and a compile near 20 ms), and error
/// messages without the parser's state (which holds generated text).
pub fn limits() -> ParserLimits {
    ParserLimits {
        verbose_errors: false,
        ..ParserLimits::default()
    }
}

/// The model's vocabulary as llguidance sees it: each token's bytes (from
/// `tokenizer.json`) and the tokenizer that forced text goes through.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        let text = String::from_utf8_lossy(s);
        self.tokenizer
            .encode(text.as_ref(), false)
            .map(|e| e.get_ids().to_vec())
            .unwrap_or_default()
    }
}

/// How many compiled grammars a stage keeps (each its parser and lexer
/// tables: tens to hundreds of KiB).
pub const CACHED_GRAMMARS: usize = 16;

/// Compiles requests' grammars for one model's vocabulary, and keeps the
/// last few that compiled.
pub struct Grammars {
    factory: ParserFactory,
    /// Compiled grammars by the digest of their text, most recent first.
    compiled: Mutex<VecDeque<(Sha256Digest, Matcher)>>,
    /// Matchers served from `compiled`.
    hits: AtomicU64,
}

impl Grammars {
    /// The compiler for the vocabulary of `tokenizer_json` (the file's JSON)
    /// and `tokenizer` (the same file, loaded), with `vocab` token ids and
    /// end-of-sequence token `eos`.
    pub fn new(
        tokenizer_json: &[u8],
        tokenizer: Tokenizer,
        vocab: usize,
        eos: u32,
    ) -> Result<Self> {
        let json: Value = serde_json::from_slice(tokenizer_json)?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)?;
        if words.len() > vocab {
            return Err(anyhow!(
                "the tokenizer has {} tokens, the model {vocab}",
                words.len()
            ));
        }
        words.resize(vocab, Vec::new());
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &SlicedBiasComputer::general_slices(),
        )?;
        // Nothing on standard error: a parser's messages may quote output.
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self {
            factory,
            compiled: Mutex::new(VecDeque::new()),
            hits: AtomicU64::new(0),
        })
    }

    /// A fresh matcher for `lark` (see [`grammar_text`]), compiled or a
    /// copy of one compiled before; an error says why it does not compile.
    pub fn matcher(&self, lark: &str) -> Result<Matcher, String> {
        let digest = Sha256Digest::of(lark.as_bytes());
        {
            let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = compiled.iter().position(|(d, _)| *d == digest) {
                let entry = compiled.remove(i).expect("the position is in range");
                let m = entry.1.deep_clone();
                compiled.push_front(entry);
                self.hits.fetch_add(1, Ordering::Relaxed);
                return Ok(m);
            }
        }
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let m = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        compiled.push_front((digest, m.deep_clone()));
        compiled.truncate(CACHED_GRAMMARS);
        Ok(m)
    }

    /// How many matchers were copies of a grammar compiled before.
    pub fn cache_hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// A matcher for JSON valid against `schema` alone (its errors name
    /// the schema's fault, not a place in a grammar).
    fn schema_matcher(&self, schema: &Value) -> Result<Matcher, String> {
        let grammar = TopLevelGrammar::from_json_schema(with_whitespace(schema));
        let m = Matcher::new(self.factory.create_parser(grammar));
        match m.get_error() {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }

    /// Checks that a request's grammar compiles, naming the field at fault:
    /// the response format, or the tool whose parameters do not compile.
    pub fn check(&self, r: &CompletionsRequest) -> Result<(), ApiError> {
        let Some(g) = grammar_text(r) else {
            return Ok(());
        };
        // One compile when the grammar is usable; only when it is not are
        // its parts compiled alone, to name the one at fault.
        let Err(whole) = self.matcher(&g) else {
            return Ok(());
        };
        if let Some(f) = &r.response_format {
            self.schema_matcher(&f.schema()).map_err(|e| {
                ApiError::invalid(
                    Some("response_format"),
                    format!("The schema cannot be used: {}", short(&e)),
                )
            })?;
        }
        if let Some(c) = &r.tool_calls {
            for t in &c.tools {
                let params: Value = serde_json::from_str(&t.parameters).unwrap_or(Value::Null);
                self.schema_matcher(&params).map_err(|e| {
                    ApiError::invalid(
                        Some("tools"),
                        format!(
                            "The parameters of function `{}` cannot be used: {}",
                            t.name,
                            short(&e)
                        ),
                    )
                })?;
            }
        }
        Err(ApiError::invalid(
            Some("tools"),
            format!("The tools cannot be used together: {}", short(&whole)),
        ))
    }
}

/// An engine message cut to a length fit for an error body.
fn short(e: &str) -> String {
    let mut s: String = e.chars().take(400).collect();
    if s.len() < e.len() {
        s.push('…');
    }
    s
}

/// `schema` with the whitespace bound ([`JSON_WHITESPACE`]) as llguidance
/// takes options, and the boolean schemas as objects.
fn with_whitespace(schema: &Value) -> Value {
    // `true` admits any JSON (`false` is refused at validation).
    let mut s = match schema {
        Value::Bool(_) => serde_json::json!({}),
        v => v.clone(),
    };
    if let Some(o) = s.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_pattern": JSON_WHITESPACE}),
        );
    }
    s
}

/// A Lark rule body that is JSON valid against `schema`.
fn json_rule(schema: &Value) -> String {
    format!("%json {}", with_whitespace(schema))
}

/// A Lark string literal.
fn literal(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The rules of the calls an answer may make.
fn calls_rules(c: &ToolCalls, out: &mut String) {
    let mut alternatives = Vec::new();
    for (i, t) in c.tools.iter().enumerate() {
        let params: Value = serde_json::from_str(&t.parameters).unwrap_or(Value::Null);
        out.push_str(&format!("args_{i}: {}\n", json_rule(&params)));
        alternatives.push(format!(
            "{} args_{i} {}",
            literal(&format!("{CALL_OPEN}{}{CALL_MID}", t.name)),
            literal(CALL_CLOSE)
        ));
    }
    out.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    if c.parallel {
        out.push_str(&format!("calls: call ({} call)*\n", literal(CALL_SEP)));
    } else {
        out.push_str("calls: call\n");
    }
}

/// The grammar of a request's answer in llguidance's Lark syntax, or `None`
/// when the answer is free. With tools under `auto`, the answer is either
/// calls or anything that does not begin with the call tag (or, with a
/// response format, that format).
pub fn grammar_text(r: &CompletionsRequest) -> Option<String> {
    if !r.constrained() {
        return None;
    }
    let mut g = String::from("%llguidance {}\n");
    let answer = match &r.response_format {
        Some(f) => format!("answer: {}\n", json_rule(&f.schema())),
        // The tag has no character a regular expression treats specially.
        None => format!("answer: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:[ \\t\\r\\n]*{CALL_TAG}.*)/\n"),
    };
    match &r.tool_calls {
        None => {
            g.push_str("start: answer\n");
            g.push_str(&answer);
        }
        Some(c) if c.required => {
            g.push_str("start: calls\n");
            calls_rules(c, &mut g);
        }
        Some(c) => {
            g.push_str("start: answer | calls\n");
            g.push_str(&answer);
            calls_rules(c, &mut g);
        }
    }
    Some(g)
}
