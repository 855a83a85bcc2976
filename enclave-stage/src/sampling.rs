//! Choosing the next token from a row of logits: greedy argmax, or
//! temperature + nucleus (top-p) sampling from a seeded ChaCha20 stream, so a
//! given seed always gives the same tokens (ChaCha20's output is fixed by its
//! specification, unlike `rand`'s `StdRng`, which may change between
//! versions).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// How to pick tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy (argmax, no randomness).
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`: sample only from the most likely tokens whose
    /// probabilities add up to at least this (1 = the whole vocabulary).
    pub top_p: f32,
    /// Seed of the random stream.
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }

    /// Whether these parameters mean argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Rejects values the OpenAI API does not allow either.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature > 2.0 || self.temperature < 0.0 {
            return Err(format!("temperature {} is not in [0, 2]", self.temperature));
        }
        if !self.top_p.is_finite() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(format!("top_p {} is not in (0, 1]", self.top_p));
        }
        Ok(())
    }
}

/// Index of the largest value (ties → lowest index; NaN never wins; 0 for an
/// empty or all-NaN row).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && (!found || v > best_v) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

/// `log Σ exp(logits)` in f64 (NaN entries ignored), the normalizer of
/// [`log_prob`].
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    logits
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max
}

/// `log softmax(logits)[token]`, computed in f64 (the model's own
/// distribution, before temperature or top-p).
pub fn log_prob(logits: &[f32], token: u32) -> f64 {
    let lse = log_sum_exp(logits);
    logits
        .get(token as usize)
        .map_or(f64::NEG_INFINITY, |&v| v as f64 - lse)
}

/// Picks tokens for one sequence; owns that sequence's random stream.
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// Scratch: (probability, token) pairs.
    scratch: Vec<(f64, u32)>,
}

impl Sampler {
    /// A sampler whose stream is fixed by `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self::with_stream(params, 0)
    }

    /// A sampler on ChaCha20 stream `stream` of the seed (stream 0 is
    /// [`Sampler::new`]), so that the choices of one request draw
    /// independent but reproducible numbers.
    pub fn with_stream(params: SamplingParams, stream: u64) -> Self {
        let mut rng = ChaCha20Rng::seed_from_u64(params.seed);
        rng.set_stream(stream);
        Self {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token for one row of logits. Greedy parameters draw nothing
    /// from the stream.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.is_empty() {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.params.temperature as f64;
        let max = logits
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        if !max.is_finite() {
            return argmax(logits);
        }
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (((v as f64 - max) * inv_t).exp(), i as u32))
                .filter(|(p, _)| *p > 0.0),
        );
        let total: f64 = self.scratch.iter().map(|(p, _)| p).sum();
        let mut keep = self.scratch.len();
        if self.params.top_p < 1.0 {
            // Most likely first; equal probabilities by token id, so the
            // order (and the draw) never depends on the sort algorithm.
            self.scratch
                .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let want = self.params.top_p as f64 * total;
            let mut cum = 0.0;
            for (i, (p, _)) in self.scratch.iter().enumerate() {
                cum += p;
                if cum >= want {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept = &self.scratch[..keep];
        let mass: f64 = kept.iter().map(|(p, _)| p).sum();
        let mut u = self.rng.gen::<f64>() * mass;
        for &(p, tok) in kept {
            if u < p {
                return tok;
            }
            u -= p;
        }
        kept.last().map_or_else(|| argmax(logits), |&(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, f32::NAN]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn greedy_sampler_is_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 5.0, 4.9]), 1);
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 0.9,
            top_p: 0.8,
            seed: 42,
        };
        let run = |p| {
            let mut s = Sampler::new(p);
            (0..50).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(p), run(p));
        assert_ne!(run(p), run(SamplingParams { seed: 43, ..p }));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // p ≈ [0.97, 0.01, 0.01, 0.01]: top_p 0.5 must always give token 0.
        let logits = [5.0, 0.4, 0.4, 0.4];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 7,
        });
        assert!((0..200).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn log_prob_normalises() {
        let logits = [1.0f32, 2.0, 3.0];
        let total: f64 = (0..3).map(|t| log_prob(&logits, t).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
    }
}
