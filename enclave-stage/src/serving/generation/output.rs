//! The exit stage's view of one choice: sampling (with penalties and logit
//! bias), incremental detokenization, stop sequences, `max_tokens`, the
//! context limit, and which text may be streamed yet.
//!
//! Text is decoded incrementally the way byte-level BPE needs: the newest
//! tokens are decoded together with a few earlier ones and only the part
//! after the earlier ones' text counts, and nothing is released while it
//! ends in an incomplete UTF-8 sequence (decoded as U+FFFD). Streamed text
//! holds back any tail that could be the start of a stop sequence, so a
//! stream never shows text that the non-streamed response would not.

use crate::sampling::{log_sum_exp, Sampler, SamplingParams};
use llguidance::Matcher;
use proto::completions::{Choice, FinishReason, Logprobs};
use std::collections::HashMap;

/// Turns token ids into text (the tokenizer; a table in tests).
pub trait Detokenize {
    /// The text of `ids` (special tokens skipped).
    fn text(&self, ids: &[u32]) -> String;

    /// One token's text as it reads inside the output (`logprobs`' token
    /// strings).
    fn token(&self, id: u32) -> String {
        self.text(&[id])
    }
}

impl Detokenize for tokenizers::Tokenizer {
    fn text(&self, ids: &[u32]) -> String {
        self.decode(ids, true).unwrap_or_default()
    }

    /// A SentencePiece decoder strips the first space of what it decodes,
    /// so `"▁the"` alone decodes to `"the"`, where in the output it reads
    /// `" the"` (as llama.cpp and OpenAI give the token). The token is
    /// decoded after a plain one (`"a"`) and that one's text taken off;
    /// byte-level BPE decodes the same either way.
    fn token(&self, id: u32) -> String {
        let Some(anchor) = self.token_to_id("a").filter(|&a| a != id) else {
            return self.text(&[id]);
        };
        let (before, both) = (self.text(&[anchor]), self.text(&[anchor, id]));
        match both.strip_prefix(&before) {
            Some(rest) if !before.is_empty() => rest.to_string(),
            _ => self.text(&[id]),
        }
    }
}

/// Per-request generation settings shared by its choices.
#[derive(Clone, Debug)]
pub struct ChoiceRules {
    /// Most tokens to generate.
    pub max_tokens: u32,
    /// Context length of the model.
    pub context: usize,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// End-of-sequence token.
    pub eos: Option<u32>,
    /// Alternatives per position when log-probabilities are asked for.
    pub logprobs: Option<u32>,
    /// OpenAI presence penalty.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty.
    pub frequency_penalty: f32,
    /// Additive logit biases.
    pub logit_bias: Vec<(u32, f32)>,
}

/// One choice being generated.
pub struct ChoiceOut {
    index: u32,
    sampler: Sampler,
    prompt_tokens: usize,
    generated: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    text: String,
    emitted: usize,
    stop_checked: usize,
    finish: Option<FinishReason>,
    logprobs: Option<Logprobs>,
    counts: HashMap<u32, u32>,
    prefix: String,
    prefix_emitted: bool,
    /// The grammar the text must follow (structured outputs, tool calls).
    grammar: Option<Matcher>,
}

impl ChoiceOut {
    /// Choice `index` of a prompt of `prompt_tokens` tokens, sampled with
    /// `params` on random stream `stream`; `prefix` is the echoed prompt.
    pub fn new(
        index: u32,
        params: SamplingParams,
        stream: u64,
        prompt_tokens: usize,
        prefix: String,
        want_logprobs: bool,
    ) -> Self {
        Self {
            index,
            sampler: Sampler::with_stream(params, stream),
            prompt_tokens,
            generated: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            text: String::new(),
            emitted: 0,
            stop_checked: 0,
            finish: None,
            logprobs: want_logprobs.then(Logprobs::default),
            counts: HashMap::new(),
            prefix,
            prefix_emitted: false,
            grammar: None,
        }
    }

    /// Samples this choice under `grammar` from now on.
    pub fn constrain(&mut self, grammar: Matcher) {
        self.grammar = Some(grammar);
    }

    /// The text so far (without an echoed prompt) that no stop sequence
    /// can still cut: until the choice ends, a tail that could begin one of
    /// `stops` is left out, as [`ChoiceOut::take_stream_text`] holds it.
    pub fn stable_text(&self, stops: &[String]) -> &str {
        &self.text[..self.stable_len(stops)]
    }

    /// Length of [`ChoiceOut::stable_text`].
    fn stable_len(&self, stops: &[String]) -> usize {
        let hold = match self.finish {
            Some(_) => 0,
            None => stops
                .iter()
                .map(|s| held_back(&self.text, s))
                .max()
                .unwrap_or(0),
        };
        self.text.len() - hold
    }

    /// The choice index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Why it ended, once it has.
    pub fn finish(&self) -> Option<FinishReason> {
        self.finish
    }

    /// The token sampled last (the next step's input), if any yet.
    pub fn last_token(&self) -> Option<u32> {
        self.generated.last().copied()
    }

    /// Tokens generated (the end-of-sequence token included).
    pub fn completion_tokens(&self) -> usize {
        self.generated.len()
    }

    /// Picks the next token from this position's `logits` and applies it.
    /// Returns the token; [`ChoiceOut::finish`] tells whether it was the
    /// last. An error (only under a grammar: its step budget spent, or no
    /// token allowed) ends the request.
    pub fn step(
        &mut self,
        logits: &mut [f32],
        rules: &ChoiceRules,
        tok: &dyn Detokenize,
    ) -> Result<u32, String> {
        let alternatives = self
            .logprobs
            .as_ref()
            .map(|_| top_k(logits, rules.logprobs));
        // With logprobs on: the raw logits that bias and penalties change
        // (first value wins: the model's own).
        let mut raw = Vec::new();
        let keep = alternatives.is_some();
        for &(t, b) in &rules.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                if keep {
                    raw.push((t, *l));
                }
                *l += b;
            }
        }
        if rules.presence_penalty != 0.0 || rules.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    if keep {
                        raw.push((t, *l));
                    }
                    *l -= rules.presence_penalty + rules.frequency_penalty * c as f32;
                }
            }
        }
        if let Some(g) = self.grammar.as_mut() {
            let mask = g
                .compute_mask_or_eos()
                // Fixed messages: the engine's may quote the output.
                .map_err(|_| {
                    "the output grammar's step failed (its work limit, or no token allowed)"
                        .to_string()
                })?;
            for (t, l) in logits.iter_mut().enumerate() {
                if !mask.is_allowed(t as u32) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let token = self.sampler.sample(logits);
        // The end of sequence ends the choice; the grammar allowed it.
        if let Some(g) = self.grammar.as_mut().filter(|_| Some(token) != rules.eos) {
            g.consume_token(token)
                .map_err(|_| "the output grammar refused the sampled token".to_string())?;
        }
        if let (Some(lp), Some(alts)) = (self.logprobs.as_mut(), alternatives) {
            // The model's own distribution, before bias and penalties.
            let logit = raw
                .iter()
                .find(|&&(t, _)| t == token)
                .map(|&(_, l)| l)
                .or_else(|| logits.get(token as usize).copied());
            lp.text_offset.push(self.text.len());
            lp.tokens.push(tok.token(token));
            lp.token_logprobs
                .push(logit.map_or(f64::NEG_INFINITY, |l| l as f64 - alts.lse));
            lp.top_logprobs
                .push(alts.top.iter().map(|&(t, l)| (tok.token(t), l)).collect());
        }
        self.apply(token, rules, tok);
        Ok(token)
    }

    /// Applies a chosen token (end of sequence, text, stop sequences, limits).
    fn apply(&mut self, token: u32, rules: &ChoiceRules, tok: &dyn Detokenize) {
        self.generated.push(token);
        *self.counts.entry(token).or_insert(0) += 1;
        if Some(token) == rules.eos {
            self.finish = Some(FinishReason::Stop);
            return;
        }
        self.decode_new(tok);
        if let Some(p) = self.find_stop(&rules.stop) {
            self.text.truncate(p);
            self.finish = Some(FinishReason::Stop);
            return;
        }
        if self.generated.len() >= rules.max_tokens as usize
            || self.prompt_tokens + self.generated.len() >= rules.context
        {
            // Release a trailing partial character as the tokenizer decodes it.
            let rest = tok.text(&self.generated[self.prefix_offset..]);
            let done = tok.text(&self.generated[self.prefix_offset..self.read_offset]);
            if rest.len() > done.len() && rest.starts_with(&done) {
                self.text.push_str(&rest[done.len()..]);
            }
            if let Some(p) = self.find_stop(&rules.stop) {
                self.text.truncate(p);
                self.finish = Some(FinishReason::Stop);
                return;
            }
            self.finish = Some(FinishReason::Length);
        }
    }

    fn decode_new(&mut self, tok: &dyn Detokenize) {
        let done = tok.text(&self.generated[self.prefix_offset..self.read_offset]);
        let all = tok.text(&self.generated[self.prefix_offset..]);
        if all.len() > done.len() && !all.ends_with('\u{FFFD}') && all.starts_with(&done) {
            self.text.push_str(&all[done.len()..]);
            self.prefix_offset = self.read_offset;
            self.read_offset = self.generated.len();
        }
    }

    /// Earliest stop-sequence match in the text not yet searched.
    fn find_stop(&mut self, stops: &[String]) -> Option<usize> {
        let longest = stops.iter().map(String::len).max()?;
        let mut from = self.stop_checked.saturating_sub(longest - 1);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        self.stop_checked = self.text.len();
        stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
            .min()
    }

    /// Text that may be streamed now (and marks it streamed): everything
    /// new, except a tail that could begin a stop sequence, until finished.
    pub fn take_stream_text(&mut self, stops: &[String]) -> String {
        let end = self.stable_len(stops);
        let mut out = String::new();
        if !self.prefix_emitted {
            out.push_str(&self.prefix);
            self.prefix_emitted = true;
        }
        if end > self.emitted {
            out.push_str(&self.text[self.emitted..end]);
            self.emitted = end;
        }
        out
    }

    /// The finished choice.
    pub fn into_choice(self) -> Choice {
        Choice {
            index: self.index,
            text: format!("{}{}", self.prefix, self.text),
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            logprobs: self.logprobs,
            tool_calls: Vec::new(),
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`
/// (on a character boundary).
fn held_back(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - k..])
        })
        .unwrap_or(0)
}

/// The log-probability normalizer of one position and its `k` most likely
/// tokens.
struct Alternatives {
    lse: f64,
    top: Vec<(u32, f64)>,
}

/// The `k` most likely tokens with their log-probabilities (one
/// normalization pass over the vocabulary, no copy of the logits).
fn top_k(logits: &[f32], k: Option<u32>) -> Alternatives {
    let k = k.unwrap_or(0) as usize;
    let lse = log_sum_exp(logits);
    let top = if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let key = |i: &u32| std::cmp::Reverse(ordered(logits[*i as usize]));
        let nth = k.min(idx.len()) - 1;
        idx.select_nth_unstable_by_key(nth, key);
        idx.truncate(k);
        idx.sort_by_key(key);
        idx.iter()
            .map(|&t| (t, logits[t as usize] as f64 - lse))
            .collect()
    } else {
        Vec::new()
    };
    Alternatives { lse, top }
}

/// A total order on f32 with NaN lowest.
fn ordered(v: f32) -> i64 {
    if v.is_nan() {
        i64::MIN
    } else {
        let b = v.to_bits() as i32;
        (if b < 0 { !(b & 0x7fff_ffff) } else { b }) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece token's string keeps its leading space (the
    /// decoder strips the first space of a whole text, not of each token),
    /// and a byte-level one is its own decoding.
    #[test]
    fn token_strings_keep_their_leading_space() {
        let spm = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"a": 0, "▁the": 1, "cat": 2, "<0x41>": 3}, "merges": []}
        });
        let t: tokenizers::Tokenizer = spm.to_string().parse().unwrap();
        assert_eq!(t.text(&[1]), "the", "the decoder strips a first space");
        assert_eq!(t.token(1), " the");
        assert_eq!(t.token(2), "cat");
        assert_eq!(t.token(0), "a");
        assert_eq!(t.token(3), "A");
    }

    /// Token `i` is the i-th string; 100 is end of sequence.
    struct Table(Vec<&'static str>);

    impl Detokenize for Table {
        fn text(&self, ids: &[u32]) -> String {
            ids.iter()
                .filter(|&&i| i != 100)
                .map(|&i| self.0[i as usize])
                .collect()
        }
    }

    fn rules(max_tokens: u32, stop: &[&str]) -> ChoiceRules {
        ChoiceRules {
            max_tokens,
            context: 1000,
            stop: stop.iter().map(|s| s.to_string()).collect(),
            eos: Some(100),
            logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }

    #[test]
    fn logprobs_are_the_models_own_before_bias_and_penalties() {
        let table = Table(vec!["Hel", "lo", " wor", "ld", "\n", "EN", "D", "x"]);
        let mut r = rules(2, &[]);
        r.logprobs = Some(2);
        r.logit_bias = vec![(7, 50.0)];
        r.presence_penalty = 1.0;
        let mut c = ChoiceOut::new(0, SamplingParams::greedy(), 0, 1, String::new(), true);
        // Eight tokens (the table's); token 1 is the model's favourite.
        let mut logits = vec![0.0, 4.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0];
        let raw = logits.clone();
        // The bias makes greedy pick 7; its log-probability is the raw one.
        assert_eq!(c.step(&mut logits, &r, &table).unwrap(), 7);
        let mut logits = vec![0.0, 4.0, 1.0, 0.5, 0.0, 0.0, 0.0, 5.0];
        let raw2 = logits.clone();
        // Token 7 now carries the bias and the presence penalty: still raw.
        assert_eq!(c.step(&mut logits, &r, &table).unwrap(), 7);
        let lp = c.into_choice().logprobs.unwrap();
        let want = [
            crate::sampling::log_prob(&raw, 7),
            crate::sampling::log_prob(&raw2, 7),
        ];
        for (got, want) in lp.token_logprobs.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{got} vs {want}");
        }
        assert_eq!(lp.top_logprobs[0][0].0, "lo");
        assert!((lp.top_logprobs[0][0].1 - crate::sampling::log_prob(&raw, 1)).abs() < 1e-12);
    }

    /// Logits that make greedy pick `t`.
    fn pick(t: u32) -> Vec<f32> {
        let mut l = vec![0.0; 101];
        l[t as usize] = 10.0;
        l
    }

    fn run(tokens: &[u32], r: &ChoiceRules, stream: bool) -> (String, Option<FinishReason>) {
        let table = Table(vec!["Hel", "lo", " wor", "ld", "\n", "EN", "D", "x"]);
        let mut c = ChoiceOut::new(0, SamplingParams::greedy(), 0, 3, String::new(), false);
        let mut streamed = String::new();
        for &t in tokens {
            if c.finish().is_some() {
                break;
            }
            assert_eq!(c.step(&mut pick(t), r, &table).unwrap(), t);
            if stream {
                streamed.push_str(&c.take_stream_text(&r.stop));
            }
        }
        let f = c.finish();
        let text = c.into_choice().text;
        if stream {
            assert_eq!(streamed, text, "streamed text equals the final text");
        }
        (text, f)
    }

    #[test]
    fn length_eos_and_stop_sequences() {
        let r = rules(3, &[]);
        assert_eq!(
            run(&[0, 1, 2, 3], &r, true),
            ("Hello wor".into(), Some(FinishReason::Length))
        );
        let r = rules(10, &[]);
        assert_eq!(
            run(&[0, 1, 100, 3], &r, true),
            ("Hello".into(), Some(FinishReason::Stop))
        );
        // A stop sequence spanning two tokens is cut out, and never streamed.
        let r = rules(10, &["END"]);
        assert_eq!(
            run(&[0, 1, 5, 6, 7], &r, true),
            ("Hello".into(), Some(FinishReason::Stop))
        );
        let r = rules(10, &["o w"]);
        assert_eq!(
            run(&[0, 1, 2, 3], &r, true),
            ("Hell".into(), Some(FinishReason::Stop))
        );
        // A held-back prefix that does not become a stop is released.
        let r = rules(4, &["ENX"]);
        assert_eq!(
            run(&[0, 5, 6, 1], &r, true),
            ("HelENDlo".into(), Some(FinishReason::Length))
        );
    }

    #[test]
    fn held_back_tail() {
        assert_eq!(held_back("abcEN", "END"), 2);
        assert_eq!(held_back("abcE", "END"), 1);
        assert_eq!(held_back("abc", "END"), 0);
        assert_eq!(held_back("aé", "é!"), 2);
    }

    #[test]
    fn bias_penalties_and_logprobs() {
        let table = Table(vec!["a", "b", "c"]);
        let mut r = rules(5, &[]);
        r.logit_bias = vec![(1, 100.0)];
        r.logprobs = Some(2);
        let mut c = ChoiceOut::new(0, SamplingParams::greedy(), 0, 1, "P:".into(), true);
        let mut l = vec![1.0, 0.0, 0.5];
        assert_eq!(c.step(&mut l, &r, &table).unwrap(), 1, "bias wins");
        let ch = c.into_choice();
        assert_eq!(ch.text, "P:b");
        let lp = ch.logprobs.unwrap();
        assert_eq!(lp.tokens, vec!["b"]);
        // log-probability under the raw logits [1, 0, 0.5]
        let z = (1f64.exp() + 1.0 + 0.5f64.exp()).ln();
        assert!((lp.token_logprobs[0] - (0.0 - z)).abs() < 1e-9);
        assert_eq!(lp.top_logprobs[0].len(), 2);
        assert_eq!(lp.top_logprobs[0][0].0, "a");

        let mut r = rules(5, &[]);
        r.frequency_penalty = 2.0;
        let mut c = ChoiceOut::new(0, SamplingParams::greedy(), 0, 1, String::new(), false);
        assert_eq!(c.step(&mut [1.0, 0.0, 0.5], &r, &table).unwrap(), 0);
        // 1.0 - 2.0 < 0.5: the penalty moves greedy to token 2.
        assert_eq!(c.step(&mut [1.0, 0.0, 0.5], &r, &table).unwrap(), 2);
    }

    #[test]
    fn incomplete_utf8_is_held_until_complete() {
        // Token 0 and 1 are the two halves of "é" as a byte-level BPE
        // decodes them: alone, the first is U+FFFD.
        struct Bytes;
        impl Detokenize for Bytes {
            fn text(&self, ids: &[u32]) -> String {
                let b: Vec<u8> = ids
                    .iter()
                    .map(|&i| match i {
                        0 => 0xc3,
                        1 => 0xa9,
                        _ => b'!',
                    })
                    .collect();
                String::from_utf8_lossy(&b).into_owned()
            }
        }
        let r = rules(10, &[]);
        let mut c = ChoiceOut::new(0, SamplingParams::greedy(), 0, 1, String::new(), false);
        c.step(&mut [5.0, 0.0, 0.0], &r, &Bytes).unwrap();
        assert_eq!(c.take_stream_text(&[]), "");
        c.step(&mut [0.0, 5.0, 0.0], &r, &Bytes).unwrap();
        assert_eq!(c.take_stream_text(&[]), "é");
        c.step(&mut [0.0, 0.0, 5.0], &r, &Bytes).unwrap();
        assert_eq!(c.take_stream_text(&[]), "!");
    }
}
