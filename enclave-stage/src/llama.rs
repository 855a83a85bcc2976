//! Llama decoder (SmolLM2-135M-Instruct) split by layers, loaded from a GGUF
//! file and written on Candle's primitives, with a per-sequence KV cache.
//!
//! The linear layers, the token embedding and the output head are held in
//! one of three [`WeightFormat`]s: `q4_1` (the default: the packaged GGUF's
//! blocks as they are), `q8_0` (re-quantized at load, 8-bit blocks of 32
//! with one scale, as llama.cpp's Q8_0) or `f32` (dequantized at load;
//! reproduces the `transformers` reference token for token,
//! `tests/llama_reference.rs`). Quantized weights stay quantized in memory
//! and are multiplied by [`crate::qmatmul`] (decode steps; the AVX2 kernel
//! rounds activations to 16-bit blocks) or dequantized per product for an
//! f32 GEMM (prefills), so `q4_1` computes the f32 model up to that rounding
//! and summation order. Quality against `f32`:
//! `tests/llama_quality.rs`, `benchmark_results/quality.md`. Norms stay f32.
//!
//! A stage loads only its own tensors: its layer range, plus the token
//! embedding for the entry stage and the final norm and output head for the
//! exit stage (SmolLM2 ties the head to the token embedding; a GGUF with an
//! `output.weight` uses that instead).
//!
//! Batches are *packed*: the hidden states of all sequences in a step are
//! rows of one `[tokens, hidden]` tensor, described by a list of
//! [`SeqSlice`]s in the same order. A batch may mix prefills (many tokens of
//! one sequence) and decode steps (one token each). All linear layers run once
//! over the whole packed batch; only attention loops over the sequences, each
//! against its own cache, so no padding is ever computed.
//!
//! The GGUF stores `attn_q`/`attn_k` permuted for llama.cpp's interleaved
//! rotary embedding, so this uses the interleaved variant (`rope_i`) on the
//! weights as stored; that is the same function as Hugging Face's
//! `rotate_half` on the un-permuted weights.

use crate::qmatmul::{Kernel, QMatrix};
use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
pub use proto::frames::WeightFormat;
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;

/// What [`LlamaPart::teacher_forced`] measured, one entry per predicted
/// position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TeacherForced {
    /// The model's most likely next token at each position.
    pub top1: Vec<u32>,
    /// `-ln p(true next token)` at each position.
    pub nll: Vec<f64>,
}

impl TeacherForced {
    /// `exp(mean nll)`.
    pub fn perplexity(&self) -> f64 {
        (self.nll.iter().sum::<f64>() / self.nll.len().max(1) as f64).exp()
    }

    /// Share of positions whose top-1 prediction equals `other`'s.
    pub fn agreement(&self, other: &TeacherForced) -> f64 {
        let same = self
            .top1
            .iter()
            .zip(&other.top1)
            .filter(|(a, b)| a == b)
            .count();
        same as f64 / self.top1.len().min(other.top1.len()).max(1) as f64
    }
}

/// Hyper-parameters of a Llama model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Context length the model was trained for (positions available).
    pub max_seq_len: usize,
    /// Beginning-of-sequence token id, if the metadata names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id, if the metadata names one.
    pub eos_token_id: Option<u32>,
    /// Whether the output head is the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
}

fn md<'a>(ct: &'a gguf_file::Content, key: &str) -> candle_core::Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata has no {key}")))
}

impl LlamaConfig {
    /// Reads the configuration from a GGUF's metadata (`llama.*` keys).
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Self> {
        let arch = md(ct, "general.architecture")?.to_string()?;
        if arch != "llama" {
            candle_core::bail!("GGUF architecture is {arch}, not llama");
        }
        let u = |k: &str| -> candle_core::Result<usize> {
            Ok(md(ct, &format!("llama.{k}"))?.to_u32()? as usize)
        };
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = u("rope.dimension_count").unwrap_or(hidden_size / num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            candle_core::bail!("{num_heads} heads cannot share {num_kv_heads} KV heads");
        }
        if head_dim * num_heads != hidden_size || head_dim % 2 != 0 {
            candle_core::bail!("head width {head_dim} × {num_heads} heads ≠ hidden {hidden_size}");
        }
        let embd = ct
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| candle_core::Error::Msg("GGUF has no token_embd.weight".into()))?;
        let vocab_size = embd.shape.dims()[0];
        let token = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: md(ct, "llama.rope.freq_base")
                .and_then(|v| v.to_f32())
                .unwrap_or(10_000.0),
            rms_norm_eps: md(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
            max_seq_len: u("context_length")?,
            bos_token_id: token("tokenizer.ggml.bos_token_id"),
            eos_token_id: token("tokenizer.ggml.eos_token_id"),
            tied_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        })
    }

    /// Bytes of KV cache one token takes in `layers` layers (f32 keys and values).
    pub fn kv_bytes_per_token(&self, layers: usize) -> usize {
        layers * 2 * self.num_kv_heads * self.head_dim * DType::F32.size_in_bytes()
    }
}

/// The tokens of one sequence inside a packed batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    /// The sequence.
    pub seq_id: u64,
    /// Position of the first of these tokens: how many tokens of this
    /// sequence are already cached (0 for a prefill from scratch). Checked
    /// against the part's cache, so stages that drift apart fail loudly.
    pub pos: usize,
    /// Number of tokens of this sequence in the batch (1 for a decode step).
    pub len: usize,
}

impl SeqSlice {
    /// `len` tokens of `seq_id` starting at position `pos`.
    pub fn new(seq_id: u64, pos: usize, len: usize) -> Self {
        Self { seq_id, pos, len }
    }
}

/// Total number of tokens a batch description covers.
pub fn batch_tokens(batch: &[SeqSlice]) -> usize {
    batch.iter().map(|s| s.len).sum()
}

/// The keys and values one sequence has cached in the layers of one part.
///
/// Each layer holds `[kv_heads, capacity, head_dim]` f32 tensors; positions
/// `0..len` are valid. Capacity grows by doubling (or is set up front with
/// [`LlamaPart::reserve`]), so appending a token is a copy of one row.
pub struct KvCache {
    len: usize,
    capacity: usize,
    layers: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// Tokens cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens the allocated tensors can hold without growing.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes allocated for this sequence's keys and values.
    pub fn allocated_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * DType::F32.size_in_bytes())
            .sum()
    }
}

/// Products with at least this many activation rows dequantize the weights
/// and use the f32 GEMM; fewer use the quantized dot products, which read a
/// quarter (Q8_0) or a sixth (Q4_1) of the f32 weight bytes.
const DEQUANTIZE_MIN_ROWS: usize = 48;

/// A weight matrix `[out, in]` applied as `x · Wᵀ`: f32 (Candle's GEMM), or
/// quantized blocks ([`crate::qmatmul`]).
enum Weight {
    Dense(Linear),
    Quant(QMatrix, Kernel),
}

impl Weight {
    /// Loads GGUF tensor `name` in `format`: Q4_1 blocks are taken as
    /// stored; anything else is dequantized first (and, for Q8_0, quantized
    /// again).
    fn load(
        ct: &gguf_file::Content,
        file: &mut File,
        name: &str,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let q = ct.tensor(file, name, device)?;
        let (rows, cols) = q.shape().dims2()?;
        Ok(match format {
            WeightFormat::F32 => Weight::Dense(Linear::new(q.dequantize(device)?, None)),
            WeightFormat::Q4_1 => {
                let m = match q.dtype() {
                    GgmlDType::Q4_1 => QMatrix::from_ggml_q4_1(&q.data()?, rows, cols),
                    GgmlDType::Q8_0 => QMatrix::from_ggml_q8_0(&q.data()?, rows, cols),
                    other => Err(format!(
                        "stored as {other:?}; q4_1 serves the GGUF's Q4_1 and Q8_0 blocks as they are"
                    )),
                }
                .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
                Weight::Quant(m, Kernel::detect())
            }
            WeightFormat::Q8_0 if q.dtype() == GgmlDType::Q8_0 => {
                let m = QMatrix::from_ggml_q8_0(&q.data()?, rows, cols)
                    .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
                Weight::Quant(m, Kernel::detect())
            }
            WeightFormat::Q8_0 => {
                let f = q.dequantize(device)?.flatten_all()?.to_vec1::<f32>()?;
                Weight::Quant(QMatrix::q8_0(&f, rows, cols), Kernel::detect())
            }
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Weight::Dense(l) => l.forward(x),
            Weight::Quant(q, kernel) => {
                let (rows, cols) = q.shape();
                let (t, k) = x.dims2()?;
                if k != cols {
                    candle_core::bail!("activation width {k}, weight has {cols} columns");
                }
                if t >= DEQUANTIZE_MIN_ROWS {
                    // A prefill (or a large decode batch): the matrix is
                    // dequantized for this product only (a transient f32
                    // buffer of at most a few MiB) and goes through Candle's
                    // f32 GEMM, which re-uses each weight across many rows.
                    // The activations are f32 on both paths, so the result is
                    // the same product up to summation order.
                    let w = Tensor::from_vec(q.dequantize(), (rows, cols), x.device())?;
                    return x.matmul(&w.t()?);
                }
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; t * rows];
                q.matmul_t(&xs, &mut out, *kernel);
                Tensor::from_vec(out, (t, rows), x.device())
            }
        }
    }

    /// Rows `ids` as f32 `[ids, cols]` (the token-embedding lookup).
    fn rows(&self, ids: &[u32], device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Weight::Dense(l) => {
                let idx = Tensor::new(ids, device)?;
                l.weight().index_select(&idx, 0)
            }
            Weight::Quant(q, _) => {
                let cols = q.shape().1;
                let mut out = vec![0f32; ids.len() * cols];
                for (row, &id) in out.chunks_exact_mut(cols).zip(ids) {
                    q.dequantize_row(id as usize, row);
                }
                Tensor::from_vec(out, (ids.len(), cols), device)
            }
        }
    }

    /// Bytes the weights take in memory.
    fn bytes(&self) -> usize {
        match self {
            Weight::Dense(l) => l.weight().elem_count() * 4,
            Weight::Quant(q, _) => q.bytes(),
        }
    }
}

struct Block {
    attn_norm: Tensor,
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    ffn_norm: Tensor,
    gate: Weight,
    up: Weight,
    down: Weight,
}

impl Block {
    fn weight_bytes(&self) -> usize {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
        .iter()
        .map(|w| w.bytes())
        .sum::<usize>()
            + (self.attn_norm.elem_count() + self.ffn_norm.elem_count()) * 4
    }
}

struct Head {
    norm: Tensor,
    /// `[vocab, hidden]`; `None` when it is the token embedding this part
    /// already holds (tied weights, a part with both ends): one copy, not two.
    weight: Option<Weight>,
}

/// The part of a Llama model one stage runs, with the KV caches of the
/// sequences it has seen.
pub struct LlamaPart {
    cfg: LlamaConfig,
    layers: Range<usize>,
    format: WeightFormat,
    /// The token embedding `[vocab, hidden]` (entry stage): f32, or the
    /// quantized table whose rows are dequantized per lookup.
    embedding: Option<Weight>,
    blocks: Vec<Block>,
    head: Option<Head>,
    /// `[max_seq_len, head_dim / 2]` each.
    cos: Tensor,
    sin: Tensor,
    caches: HashMap<u64, KvCache>,
    device: Device,
}

/// Reads one tensor from the GGUF and dequantizes it to f32.
fn load_f32(
    ct: &gguf_file::Content,
    file: &mut File,
    name: &str,
    device: &Device,
) -> candle_core::Result<Tensor> {
    ct.tensor(file, name, device)?.dequantize(device)
}

impl LlamaPart {
    /// Loads layers `layers` of the GGUF at `path` (on the CPU) with f32
    /// weights, plus the token embedding if `with_embeddings` and the final
    /// norm and output head if `with_head`.
    pub fn load(
        path: &Path,
        layers: Range<usize>,
        with_embeddings: bool,
        with_head: bool,
    ) -> candle_core::Result<Self> {
        Self::load_as(path, layers, with_embeddings, with_head, WeightFormat::F32)
    }

    /// [`LlamaPart::load`] with the weights in `format`.
    pub fn load_as(
        path: &Path,
        layers: Range<usize>,
        with_embeddings: bool,
        with_head: bool,
        format: WeightFormat,
    ) -> candle_core::Result<Self> {
        Self::load_on(
            path,
            layers,
            with_embeddings,
            with_head,
            format,
            &Device::Cpu,
        )
    }

    /// [`LlamaPart::load_as`] on a given device.
    pub fn load_on(
        path: &Path,
        layers: Range<usize>,
        with_embeddings: bool,
        with_head: bool,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let mut file = File::open(path)
            .map_err(|e| candle_core::Error::Msg(format!("opening {}: {e}", path.display())))?;
        let ct = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(path))?;
        let cfg = LlamaConfig::from_gguf(&ct)?;
        if layers.start > layers.end || layers.end > cfg.num_layers {
            candle_core::bail!(
                "layer range {layers:?} outside the model's {} layers",
                cfg.num_layers
            );
        }
        let embedding = if with_embeddings {
            Some(Weight::load(
                &ct,
                &mut file,
                "token_embd.weight",
                format,
                device,
            )?)
        } else {
            None
        };
        let head = if with_head {
            let name = if cfg.tied_embeddings {
                "token_embd.weight"
            } else {
                "output.weight"
            };
            let shared = cfg.tied_embeddings && embedding.is_some();
            Some(Head {
                norm: load_f32(&ct, &mut file, "output_norm.weight", device)?,
                weight: if shared {
                    None
                } else {
                    Some(Weight::load(&ct, &mut file, name, format, device)?)
                },
            })
        } else {
            None
        };
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let mut lin = |n: &str| -> candle_core::Result<Weight> {
                Weight::load(
                    &ct,
                    &mut file,
                    &format!("blk.{i}.{n}.weight"),
                    format,
                    device,
                )
            };
            blocks.push(Block {
                q: lin("attn_q")?,
                k: lin("attn_k")?,
                v: lin("attn_v")?,
                o: lin("attn_output")?,
                gate: lin("ffn_gate")?,
                up: lin("ffn_up")?,
                down: lin("ffn_down")?,
                attn_norm: load_f32(&ct, &mut file, &format!("blk.{i}.attn_norm.weight"), device)?,
                ffn_norm: load_f32(&ct, &mut file, &format!("blk.{i}.ffn_norm.weight"), device)?,
            });
        }
        let (cos, sin) = rope_tables(&cfg, device)?;
        Ok(Self {
            cfg,
            layers,
            format,
            embedding,
            blocks,
            head,
            cos,
            sin,
            caches: HashMap::new(),
            device: device.clone(),
        })
    }

    /// The format the weights are held in.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes this part's weights take in memory (layers, embedding, head).
    pub fn weight_bytes(&self) -> usize {
        let emb = self.embedding.as_ref().map_or(0, Weight::bytes);
        let head = self.head.as_ref().map_or(0, |h| {
            h.weight.as_ref().map_or(0, Weight::bytes) + h.norm.elem_count() * 4
        });
        emb + head + self.blocks.iter().map(Block::weight_bytes).sum::<usize>()
    }

    /// The model configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The layers this part runs.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The device tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether this part holds the token embedding (entry stage).
    pub fn has_embeddings(&self) -> bool {
        self.embedding.is_some()
    }

    /// Whether this part holds the output head (exit stage).
    pub fn has_head(&self) -> bool {
        self.head.is_some()
    }

    /// Bytes of KV cache one token of one sequence takes in this part.
    pub fn bytes_per_token(&self) -> usize {
        self.cfg.kv_bytes_per_token(self.blocks.len())
    }

    /// Bytes currently allocated for all sequences' KV caches.
    pub fn kv_bytes_allocated(&self) -> usize {
        self.caches.values().map(KvCache::allocated_bytes).sum()
    }

    /// The cache of one sequence, if this part has seen it.
    pub fn cache(&self, seq_id: u64) -> Option<&KvCache> {
        self.caches.get(&seq_id)
    }

    /// Number of sequences with a cache.
    pub fn num_sequences(&self) -> usize {
        self.caches.len()
    }

    /// Allocates room for `tokens` tokens of `seq_id` up front (creating its
    /// cache if needed), so that a stage can account its KV memory exactly
    /// when it admits a request. Never shrinks.
    pub fn reserve(&mut self, seq_id: u64, tokens: usize) -> candle_core::Result<()> {
        if tokens > self.cfg.max_seq_len {
            candle_core::bail!(
                "{tokens} tokens exceed the context length of {}",
                self.cfg.max_seq_len
            );
        }
        let (n_layers, kv, d, dev) = (
            self.blocks.len(),
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            self.device.clone(),
        );
        let cache = self.caches.entry(seq_id).or_insert_with(|| KvCache {
            len: 0,
            capacity: 0,
            layers: Vec::new(),
        });
        grow(cache, tokens, n_layers, kv, d, &dev)
    }

    /// Drops the cache of `seq_id`; returns whether there was one.
    pub fn free(&mut self, seq_id: u64) -> bool {
        self.caches.remove(&seq_id).is_some()
    }

    /// Token ids of a packed batch → embeddings `[tokens, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let e = self
            .embedding
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("this stage has no token embedding".into()))?;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            candle_core::bail!(
                "token id {t} outside the vocabulary of {}",
                self.cfg.vocab_size
            );
        }
        e.rows(tokens, &self.device)
    }

    /// Runs this part's layers over a packed batch `hidden` `[tokens, hidden]`
    /// described by `batch`, appending each sequence's keys and values to its
    /// cache (a sequence at `pos` 0 without a cache gets a new one). Returns
    /// the hidden states `[tokens, hidden]` for the next part.
    ///
    /// Either the whole batch is applied or, on error, no cache advances
    /// (a cache created for a new sequence stays, empty, until [`LlamaPart::free`]).
    pub fn forward(&mut self, hidden: &Tensor, batch: &[SeqSlice]) -> candle_core::Result<Tensor> {
        // Inside the thread pool: the quantized products split their
        // columns across its threads with a cheap fork/join instead of a
        // wake-up per product (one hand-off per step instead of ~200).
        rayon::scope(|_| self.forward_in_pool(hidden, batch))
    }

    fn forward_in_pool(
        &mut self,
        hidden: &Tensor,
        batch: &[SeqSlice],
    ) -> candle_core::Result<Tensor> {
        let (t, h) = hidden.dims2()?;
        if h != self.cfg.hidden_size {
            candle_core::bail!("hidden width {h}, model has {}", self.cfg.hidden_size);
        }
        if batch_tokens(batch) != t {
            candle_core::bail!(
                "batch describes {} tokens, hidden has {t}",
                batch_tokens(batch)
            );
        }
        self.prepare(batch)?;

        // Rotary tables for every token of the packed batch, by position.
        let positions: Vec<u32> = batch
            .iter()
            .flat_map(|s| (s.pos..s.pos + s.len).map(|p| p as u32))
            .collect();
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        let cos = self.cos.index_select(&pos, 0)?;
        let sin = self.sin.index_select(&pos, 0)?;

        let mut x = hidden.clone();
        for (li, block) in self.blocks.iter().enumerate() {
            x = block_forward(&self.cfg, block, li, &x, batch, &cos, &sin, &self.caches)?;
        }
        // Every layer succeeded: commit the new lengths.
        for s in batch {
            self.caches.get_mut(&s.seq_id).expect("prepared").len = s.pos + s.len;
        }
        Ok(x)
    }

    /// Exit stage: final norm and output head on the *last* position of each
    /// sequence in the batch → logits `[sequences, vocab]` (f32).
    pub fn logits_last(&self, hidden: &Tensor, batch: &[SeqSlice]) -> candle_core::Result<Tensor> {
        let head = self
            .head
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("this stage has no output head".into()))?;
        let (t, _) = hidden.dims2()?;
        if batch_tokens(batch) != t || batch.iter().any(|s| s.len == 0) {
            candle_core::bail!("batch does not describe the {t} hidden rows");
        }
        let mut last = Vec::with_capacity(batch.len());
        let mut off = 0u32;
        for s in batch {
            off += s.len as u32;
            last.push(off - 1);
        }
        let idx = Tensor::new(last.as_slice(), &self.device)?;
        let x = hidden.index_select(&idx, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &head.norm, self.cfg.rms_norm_eps as f32)?;
        head.weight
            .as_ref()
            .or(self.embedding.as_ref())
            .expect("an untied head, or the embedding it is tied to")
            .forward(&x)
    }

    /// Teacher-forced evaluation of a whole model (this part must have the
    /// embedding and the head): feeds `tokens` one at a time, as decoding
    /// does (so quantized weights meet int8-rounded activations, as in a
    /// decode step), and returns, for every position after the first, the
    /// model's top-1 prediction and the negative log-likelihood of the true
    /// next token. Uses sequence id `seq_id` and frees it afterwards.
    pub fn teacher_forced(
        &mut self,
        tokens: &[u32],
        seq_id: u64,
    ) -> candle_core::Result<TeacherForced> {
        let mut out = TeacherForced::default();
        let result = (|| {
            for (i, pair) in tokens.windows(2).enumerate() {
                let batch = [SeqSlice::new(seq_id, i, 1)];
                let h = self.embed(&pair[..1])?;
                let h = self.forward(&h, &batch)?;
                let logits = self.logits_last(&h, &batch)?.squeeze(0)?.to_vec1::<f32>()?;
                out.top1.push(crate::sampling::argmax(&logits));
                out.nll.push(-crate::sampling::log_prob(&logits, pair[1]));
            }
            Ok(())
        })();
        self.free(seq_id);
        result.map(|()| out)
    }

    /// Checks a batch against the caches and makes room for it.
    fn prepare(&mut self, batch: &[SeqSlice]) -> candle_core::Result<()> {
        for (i, s) in batch.iter().enumerate() {
            if s.len == 0 {
                candle_core::bail!("sequence {} has no tokens in the batch", s.seq_id);
            }
            if batch[..i].iter().any(|o| o.seq_id == s.seq_id) {
                candle_core::bail!("sequence {} appears twice in one batch", s.seq_id);
            }
            if s.pos + s.len > self.cfg.max_seq_len {
                candle_core::bail!(
                    "sequence {} would reach {} tokens, over the context length of {}",
                    s.seq_id,
                    s.pos + s.len,
                    self.cfg.max_seq_len
                );
            }
            let have = self.caches.get(&s.seq_id).map_or(0, KvCache::len);
            if have != s.pos {
                candle_core::bail!(
                    "sequence {} is at position {have} in layers {:?}, batch says {}",
                    s.seq_id,
                    self.layers,
                    s.pos
                );
            }
        }
        for s in batch {
            let need = s.pos + s.len;
            let cur = self.caches.get(&s.seq_id).map_or(0, KvCache::capacity);
            if need > cur {
                // Double (at least), in steps of 64 tokens, capped at the context.
                let target = need
                    .max(cur * 2)
                    .next_multiple_of(64)
                    .min(self.cfg.max_seq_len);
                self.reserve(s.seq_id, target)?;
            }
        }
        Ok(())
    }
}

/// Grows `cache` to hold at least `tokens` tokens, keeping its contents.
fn grow(
    cache: &mut KvCache,
    tokens: usize,
    n_layers: usize,
    kv: usize,
    d: usize,
    dev: &Device,
) -> candle_core::Result<()> {
    if tokens <= cache.capacity && cache.layers.len() == n_layers {
        return Ok(());
    }
    let cap = tokens.max(cache.capacity);
    let mut layers = Vec::with_capacity(n_layers);
    for li in 0..n_layers {
        let k = Tensor::zeros((kv, cap, d), DType::F32, dev)?;
        let v = Tensor::zeros((kv, cap, d), DType::F32, dev)?;
        if cache.len > 0 {
            let (ok, ov) = &cache.layers[li];
            k.slice_set(&ok.narrow(1, 0, cache.len)?.contiguous()?, 1, 0)?;
            v.slice_set(&ov.narrow(1, 0, cache.len)?.contiguous()?, 1, 0)?;
        }
        layers.push((k, v));
    }
    cache.layers = layers;
    cache.capacity = cap;
    Ok(())
}

/// `cos`/`sin` tables `[max_seq_len, head_dim / 2]`, computed in f32 as
/// Hugging Face does (`inv_freq = 1 / theta^(2i/d)`, angle = pos × inv_freq).
fn rope_tables(cfg: &LlamaConfig, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let d = cfg.head_dim;
    let inv_freq: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / d as f32))
        .collect();
    let inv_freq = Tensor::from_vec(inv_freq, (1, d / 2), device)?;
    let pos = Tensor::arange(0u32, cfg.max_seq_len as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((cfg.max_seq_len, 1))?;
    let freqs = pos.broadcast_mul(&inv_freq)?;
    Ok((freqs.cos()?, freqs.sin()?))
}

/// Query rows per attention chunk of a long prefill.
const ATTN_CHUNK: usize = 256;

/// One decoder layer over a packed batch.
#[allow(clippy::too_many_arguments)]
fn block_forward(
    cfg: &LlamaConfig,
    b: &Block,
    layer: usize,
    x: &Tensor,
    batch: &[SeqSlice],
    cos: &Tensor,
    sin: &Tensor,
    caches: &HashMap<u64, KvCache>,
) -> candle_core::Result<Tensor> {
    let eps = cfg.rms_norm_eps as f32;
    let (t, hidden) = x.dims2()?;
    let (nh, nkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let group = nh / nkv;

    let xn = candle_nn::ops::rms_norm(x, &b.attn_norm, eps)?;
    // [tokens, heads * d] → [1, heads, tokens, d] for the rotary kernel.
    let heads = |y: Tensor, n: usize| -> candle_core::Result<Tensor> {
        y.reshape((t, n, d))?
            .transpose(0, 1)?
            .contiguous()?
            .unsqueeze(0)
    };
    let q = heads(b.q.forward(&xn)?, nh)?;
    let k = heads(b.k.forward(&xn)?, nkv)?;
    let v = heads(b.v.forward(&xn)?, nkv)?;
    let q = candle_nn::rotary_emb::rope_i(&q, cos, sin)?.squeeze(0)?;
    let k = candle_nn::rotary_emb::rope_i(&k, cos, sin)?.squeeze(0)?;
    let v = v.squeeze(0)?;

    let scale = 1.0 / (d as f64).sqrt();
    let mut outs = Vec::with_capacity(batch.len());
    let mut off = 0;
    for s in batch {
        let n = s.len;
        let cache = caches.get(&s.seq_id).expect("prepared");
        let (kc, vc) = &cache.layers[layer];
        kc.slice_set(&k.narrow(1, off, n)?.contiguous()?, 1, s.pos)?;
        vc.slice_set(&v.narrow(1, off, n)?.contiguous()?, 1, s.pos)?;
        // Long prefills attend in chunks of query rows, so the score matrix
        // stays at most [kv, group * ATTN_CHUNK, total].
        let mut c0 = 0;
        while c0 < n {
            let c = (n - c0).min(ATTN_CHUNK);
            let past = s.pos + c0;
            let total = past + c;
            let keys = kc.narrow(1, 0, total)?; // [kv, total, d]
            let vals = vc.narrow(1, 0, total)?;
            // Query heads that share a KV head are stacked: [kv, group * c, d].
            let qs = q
                .narrow(1, off + c0, c)?
                .contiguous()?
                .reshape((nkv, group * c, d))?;
            let mut scores = (qs.matmul(&keys.t()?)? * scale)?; // [kv, group * c, total]
            if c > 1 {
                scores = scores.broadcast_add(&causal_mask(group, c, past, x.device())?)?;
            }
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let ctx = probs
                .matmul(&vals)? // [kv, group * c, d]
                .reshape((nh, c, d))?
                .transpose(0, 1)?
                .reshape((c, nh * d))?;
            outs.push(ctx);
            c0 += c;
        }
        off += n;
    }
    let ctx = if outs.len() == 1 {
        outs.pop().expect("one")
    } else {
        Tensor::cat(&outs, 0)?
    };
    let x = (x + b.o.forward(&ctx)?)?;
    debug_assert_eq!(x.dims2()?, (t, hidden));

    let xn = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
    let act = (candle_nn::ops::silu(&b.gate.forward(&xn)?)? * b.up.forward(&xn)?)?;
    x + b.down.forward(&act)?
}

/// Additive causal mask `[group * n, past + n]` for `n` new tokens after
/// `past` cached ones (rows repeat per query head of a group).
fn causal_mask(group: usize, n: usize, past: usize, dev: &Device) -> candle_core::Result<Tensor> {
    let total = past + n;
    let mut m = vec![0f32; group * n * total];
    for g in 0..group {
        for i in 0..n {
            let row = &mut m[(g * n + i) * total..(g * n + i + 1) * total];
            for x in row.iter_mut().skip(past + i + 1) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (group * n, total), dev)
}

/// Index of the largest logit of each row of `[rows, vocab]` logits (greedy
/// decoding). Ties go to the lowest index; NaN never wins.
pub fn argmax_rows(logits: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(logits
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?
        .iter()
        .map(|r| crate::sampling::argmax(r))
        .collect())
}
