//! How many stages a GGUF needs and which layers each runs, from each
//! stage's memory (`gateway plan`, and `gateway serve --model` with
//! `--stage-memory`): every tensor is costed as the stages hold it in the
//! chosen weight format, each stage is given its KV-cache budget and a fixed
//! allowance for the rest of the process, and the layers are split into the
//! fewest contiguous ranges that fit, as evenly as those allow.
//!
//! The byte counts follow the stages' in-memory layouts
//! (`enclave_stage::kernels::qmatmul`, `enclave_stage::models::llama`), per block of 32
//! values: Q4_0 and Q4_1 24 bytes (16 of nibbles, an f32 scale and an f32
//! min), Q4_K 19 (16 of nibbles, a 6-bit scale and min a byte each, and an
//! eighth of its super-block's two f32), Q6_K 26.5 (16 + 8 bytes of bits,
//! two i8 scales, an eighth of an f32), Q8_0 36 (32 int8 and an f32
//! scale); f32 4 bytes a value; rows are padded to whole groups of four;
//! norms and biases are f32.
//! `own_model_e2e` checks them against a loaded stage's own count.

use anyhow::{bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType};
use proto::frames::WeightFormat;
use serde::Serialize;

/// The most layers a planned model may have (the planner's work grows with
/// the cube of the count).
const MAX_LAYERS: usize = 1024;

/// The allowance a stage gets besides its weights and KV cache (runtime,
/// activations, tokenizer and grammar tables): the RSS goal,
/// `weights + KV + 100 MB`.
pub const DEFAULT_OVERHEAD: u64 = 100 << 20;

/// What the pieces of a model cost in a stage's memory.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCosts {
    /// The token embedding (entry stage).
    pub embedding: u64,
    /// The final norm and the output head (exit stage); the head is free in
    /// a stage that also holds the embedding it is tied to.
    pub head: u64,
    /// Whether the head is the token embedding.
    pub tied: bool,
    /// Each layer's weights.
    pub layers: Vec<u64>,
    /// KV-cache bytes one token takes in one layer.
    pub kv_per_token_layer: u64,
}

/// One stage of a plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StagePlan {
    /// Layers `[start, end)`.
    pub layers: [u32; 2],
    /// Weight bytes (layers, and the embedding or head at the ends).
    pub weight_bytes: u64,
    /// KV-cache bytes at the planned budget.
    pub kv_bytes: u64,
    /// Weights, KV cache and the overhead allowance.
    pub total_bytes: u64,
}

/// Bytes a tensor takes in a stage holding weights in `format`.
fn tensor_bytes(info: &gguf_file::TensorInfo, format: WeightFormat) -> u64 {
    let dims = info.shape.dims();
    let elems = info.shape.elem_count() as u64;
    if dims.len() != 2 || format == WeightFormat::F32 {
        return elems * 4;
    }
    let (rows, cols) = (dims[0].next_multiple_of(4) as u64, dims[1] as u64);
    // Bytes per eight blocks (a K-quant super-block) in the stage's layout.
    let per_eight = match (format, info.ggml_dtype) {
        (WeightFormat::Q4_1, GgmlDType::Q4_0 | GgmlDType::Q4_1) => 8 * 24,
        (WeightFormat::Q4_1, GgmlDType::Q4K) => 8 * 18 + 8,
        (WeightFormat::Q4_1, GgmlDType::Q6K) => 8 * 26 + 4,
        _ => 8 * 36,
    };
    rows * cols / 32 * per_eight / 8
}

impl ModelCosts {
    /// Costs every tensor of the GGUF `ct` in `format`.
    pub fn of(ct: &gguf_file::Content, format: WeightFormat) -> Result<Self> {
        if format == WeightFormat::Bf16 {
            bail!("bf16 is an embedding weight format (generation: f32, q8_0 or q4_1)");
        }
        let get = |k: &str| -> Result<u64> {
            let v = ct
                .metadata
                .get(k)
                .with_context(|| format!("the GGUF's metadata has no {k}"))?;
            Ok(v.to_u32()? as u64)
        };
        let arch = ct
            .metadata
            .get("general.architecture")
            .context("the GGUF's metadata has no general.architecture")?
            .to_string()?
            .clone();
        let n_layers = get(&format!("{arch}.block_count"))? as usize;
        if n_layers == 0 || n_layers > MAX_LAYERS {
            bail!("{n_layers} layers (1 to {MAX_LAYERS})");
        }
        let heads = get(&format!("{arch}.attention.head_count"))?;
        if heads == 0 {
            bail!("0 attention heads");
        }
        let kv_heads = get(&format!("{arch}.attention.head_count_kv")).unwrap_or(heads);
        let head_dim = get(&format!("{arch}.attention.key_length")).or_else(|_| {
            Ok::<_, anyhow::Error>(get(&format!("{arch}.embedding_length"))? / heads)
        })?;
        let cost = |name: &str| ct.tensor_infos.get(name).map(|i| tensor_bytes(i, format));
        let embedding = cost("token_embd.weight").context("the GGUF has no token_embd.weight")?;
        let tied = !ct.tensor_infos.contains_key("output.weight");
        let head = cost("output_norm.weight").unwrap_or(0)
            + if tied {
                embedding
            } else {
                cost("output.weight").unwrap_or(0)
            };
        let mut layers = vec![0u64; n_layers];
        for (name, info) in &ct.tensor_infos {
            if let Some((i, _)) = name
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(i, r)| Some((i.parse::<usize>().ok()?, r)))
            {
                if i < n_layers {
                    layers[i] += tensor_bytes(info, format);
                }
            }
        }
        Ok(Self {
            embedding,
            head,
            tied,
            layers,
            kv_per_token_layer: 2u64
                .saturating_mul(kv_heads)
                .saturating_mul(head_dim)
                .saturating_mul(4),
        })
    }

    /// Weight bytes of a stage running `layers` (`first`/`last`: whether it
    /// is the entry and the exit stage).
    pub fn stage_weights(&self, layers: std::ops::Range<usize>, first: bool, last: bool) -> u64 {
        let mut w: u64 = self.layers[layers].iter().sum();
        if first {
            w += self.embedding;
        }
        if last {
            // A tied head shares the embedding a stage with both ends holds.
            w += if first && self.tied {
                self.head - self.embedding
            } else {
                self.head
            };
        }
        w
    }

    /// What a stage running `layers` costs (the entry stage when they start
    /// at 0, the exit stage when they end at the last layer).
    pub fn stage(
        &self,
        layers: std::ops::Range<usize>,
        kv_tokens: u64,
        overhead: u64,
    ) -> StagePlan {
        let (i, j) = (layers.start, layers.end);
        let weight_bytes = self.stage_weights(i..j, i == 0, j == self.layers.len());
        let kv_bytes = kv_tokens
            .saturating_mul((j - i) as u64)
            .saturating_mul(self.kv_per_token_layer);
        StagePlan {
            layers: [i as u32, j as u32],
            weight_bytes,
            kv_bytes,
            total_bytes: weight_bytes
                .saturating_add(kv_bytes)
                .saturating_add(overhead),
        }
    }

    /// The fewest stages of at most `stage_memory` bytes each (weights,
    /// `kv_tokens` of KV cache, `overhead`), the largest stage as small as
    /// that count allows; an error when even one layer per stage does not
    /// fit.
    pub fn plan(&self, stage_memory: u64, kv_tokens: u64, overhead: u64) -> Result<Vec<StagePlan>> {
        let n = self.layers.len();
        let stage = |i: usize, j: usize| self.stage(i..j, kv_tokens, overhead);
        // best[k][j]: the smallest possible largest stage when layers 0..j
        // make k stages; from[k][j]: where the last of them starts.
        let mut best = vec![vec![u64::MAX; n + 1]; n + 1];
        let mut from = vec![vec![0usize; n + 1]; n + 1];
        best[0][0] = 0;
        for k in 1..=n {
            for j in k..=n {
                for i in (k - 1)..j {
                    if best[k - 1][i] == u64::MAX {
                        continue;
                    }
                    let worst = best[k - 1][i].max(stage(i, j).total_bytes);
                    if worst < best[k][j] {
                        best[k][j] = worst;
                        from[k][j] = i;
                    }
                }
            }
            if best[k][n] <= stage_memory {
                let mut cuts = vec![n];
                let mut j = n;
                for kk in (1..=k).rev() {
                    j = from[kk][j];
                    cuts.push(j);
                }
                cuts.reverse();
                return Ok(cuts.windows(2).map(|w| stage(w[0], w[1])).collect());
            }
        }
        let smallest = (0..n)
            .map(|i| stage(i, i + 1).total_bytes)
            .max()
            .unwrap_or(0);
        bail!(
            "no split fits {} per stage: with one layer per stage the largest stage needs {}",
            human(stage_memory),
            human(smallest)
        )
    }
}

/// A split written `A..B,B..C,…`: contiguous ranges from layer 0 to
/// `layers`, none empty.
pub fn parse_layers(list: &str, layers: u32) -> Result<Vec<[u32; 2]>> {
    let mut out: Vec<[u32; 2]> = Vec::new();
    for part in list.split(',') {
        let (a, b) = part
            .trim()
            .split_once("..")
            .with_context(|| format!("{part:?} is not a range A..B"))?;
        let layer = |x: &str| {
            x.trim()
                .parse::<u32>()
                .with_context(|| format!("{part:?}: {x:?} is not a layer number"))
        };
        let r = [layer(a)?, layer(b)?];
        let start = out.last().map_or(0, |l| l[1]);
        if r[0] != start || r[1] <= r[0] {
            bail!("{part:?}: the ranges must run on from layer {start}, none empty");
        }
        out.push(r);
    }
    match out.last() {
        Some(l) if l[1] == layers => Ok(out),
        _ => bail!("the ranges must end at the model's {layers} layers"),
    }
}

/// `512MiB`, `1GiB`, `1.5GB`, `800M` or a plain byte count.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a size"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        other => bail!("{s:?}: unknown unit {other:?} (B, KiB, MiB, GiB, KB, MB, GB)"),
    };
    if !(num.is_finite() && num > 0.0) {
        bail!("{s:?} is not a positive size");
    }
    Ok((num * mult) as u64)
}

/// Bytes as GiB or MiB with a decimal or two (bytes below 1 MiB).
pub fn human(b: u64) -> String {
    if b < 1 << 20 {
        format!("{b} B")
    } else if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    }
}

/// The plan as the table `gateway plan` prints.
pub fn table(plan: &[StagePlan]) -> String {
    let mut out = String::from("stage  layers      weights        KV cache       total\n");
    for (i, s) in plan.iter().enumerate() {
        out += &format!(
            "{i:>5}  [{:>3}, {:>3})  {:>12}  {:>12}  {:>12}\n",
            s.layers[0],
            s.layers[1],
            human(s.weight_bytes),
            human(s.kv_bytes),
            human(s.total_bytes)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs() -> ModelCosts {
        ModelCosts {
            embedding: 100,
            head: 110,
            tied: false,
            layers: vec![50; 8],
            kv_per_token_layer: 1,
        }
    }

    #[test]
    fn the_fewest_stages_that_fit_split_as_evenly_as_they_allow() {
        let c = costs();
        // Everything in one: 100 + 400 + 110 = 610 (+ 8 KV tokens x 8 layers).
        let one = c.plan(700, 8, 0).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].weight_bytes, 610);
        assert_eq!(one[0].kv_bytes, 64);
        // 400 per stage: two stages, the head's stage one layer shorter.
        let two = c.plan(400, 0, 0).unwrap();
        assert_eq!(
            two.iter().map(|s| s.layers).collect::<Vec<_>>(),
            vec![[0, 4], [4, 8]]
        );
        assert_eq!(two[0].weight_bytes, 300);
        assert_eq!(two[1].weight_bytes, 310);
        // The overhead counts.
        assert_eq!(c.plan(400, 0, 100).unwrap().len(), 3);
        // Nothing fits below one layer plus an end.
        let e = c.plan(150, 0, 0).unwrap_err().to_string();
        assert!(e.contains("needs 160 B"), "{e}");
    }

    #[test]
    fn a_tied_head_is_free_where_the_embedding_is() {
        let c = ModelCosts {
            tied: true,
            head: 104, // norm 4 + the embedding's 100
            ..costs()
        };
        assert_eq!(c.stage_weights(0..8, true, true), 504);
        assert_eq!(c.stage_weights(4..8, false, true), 304);
    }

    #[test]
    fn a_given_split_must_cover_the_layers_in_order() {
        assert_eq!(
            parse_layers("0..15, 15..30", 30).unwrap(),
            vec![[0, 15], [15, 30]]
        );
        for bad in [
            "0..15,16..30",
            "0..15",
            "0..0,0..30",
            "1..30",
            "0..30,30..31",
            "x",
        ] {
            assert!(parse_layers(bad, 30).is_err(), "{bad}");
        }
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_bytes("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GB").unwrap(), 1_500_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1TiB").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
