//! Llama-family decoders split by layers, loaded from a GGUF file and
//! written on Candle's primitives, with a per-sequence KV cache: the
//! architectures `llama` (Llama 2 and 3.x with its `rope_freqs` factors,
//! Mistral-style, SmolLM2, TinyLlama), `qwen2` (q/k/v biases), `qwen3`
//! (per-head q/k norms), `phi3` (fused q/k/v and gate/up matrices, split
//! at load; LongRoPE; a partial rotary embedding) and `gemma2` (post-norms,
//! GELU, soft caps, a sliding window on alternate layers), read from the file's own metadata
//! ([`LlamaConfig::from_gguf`]). Anything else, an unknown tensor
//! included, is refused at load, named.
//!
//! The linear layers, the token embedding and the output head are held in
//! one of three [`WeightFormat`]s: `q4_1` (the default: the file's 4-bit
//! blocks as they are, Q4_0 and Q4_K repacked into Q4_1 blocks without
//! changing a value, Q8_0 as stored, wider types re-quantized to Q8_0),
//! `q8_0` (everything Q8_0, as llama.cpp's) or `f32` (dequantized at load;
//! reproduces the `transformers` reference token for token,
//! `tests/llama_reference.rs`, and llama.cpp's F32 logits to a KL of
//! 1e-12, `scripts/test_gguf_models.py`). Quantized weights stay quantized
//! in memory and are multiplied by [`crate::kernels::qmatmul`] (decode
//! steps, and prefills on AVX-512 VNNI with its integer GEMM; the SIMD
//! kernels round activations to 16-bit blocks) or, on other CPUs,
//! dequantized per product for an f32 GEMM (prefills), so `q4_1` computes
//! the f32 model up to that rounding and summation order. Quality against `f32`:
//! `tests/llama_quality.rs`, `benchmark_results/quality.md`. Norms and
//! biases stay f32.
//!
//! A stage loads only its own tensors: its layer range, plus the token
//! embedding for the entry stage and the final norm and output head for the
//! exit stage (a GGUF without `output.weight` ties the head to the token
//! embedding).
//!
//! Batches are *packed*: the hidden states of all sequences in a step are
//! rows of one `[tokens, hidden]` tensor, described by a list of
//! [`SeqSlice`]s in the same order. A batch may mix prefills (many tokens of
//! one sequence) and decode steps (one token each). All linear layers run once
//! over the whole packed batch; only attention loops over the sequences, each
//! against its own cache, so no padding is ever computed.
//!
//! A `llama` GGUF stores `attn_q`/`attn_k` permuted for llama.cpp's
//! interleaved rotary embedding, so `llama` uses the interleaved variant
//! (`rope_i`) on the weights as stored (the same function as Hugging Face's
//! `rotate_half` on the un-permuted weights); `qwen2` and `qwen3` files are
//! not permuted and use the halves variant (`rope`), as llama.cpp does.

mod cache;
mod config;
mod forward;
mod load;
mod weights;

use cache::grow;
pub use cache::{batch_tokens, KvCache, SeqId, SeqSlice};
pub use config::{Activation, Architecture, LlamaConfig, RopeStyle, SlidingWindow, TeacherForced};
pub use forward::argmax_rows;
use forward::{block_forward, rope_for};
use weights::Weight;

use candle_core::{Device, Tensor};
pub use proto::frames::WeightFormat;
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;

struct Block {
    attn_norm: Tensor,
    q: Weight,
    k: Weight,
    v: Weight,
    o: Weight,
    /// q/k/v/output biases, where the file has them (`qwen2` always).
    bias: Biases,
    /// RMSNorm weights `[head_dim]` of each query and key head (`qwen3`).
    qk_norm: Option<(Tensor, Tensor)>,
    ffn_norm: Tensor,
    /// RMSNorm weights `[hidden]` of the attention output and of the
    /// feed-forward output, before each is added (`gemma2`).
    post_norms: Option<(Tensor, Tensor)>,
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
            + [&self.bias.q, &self.bias.k, &self.bias.v, &self.bias.o]
                .into_iter()
                .flatten()
                .chain(self.qk_norm.iter().flat_map(|(q, k)| [q, k]))
                .chain(self.post_norms.iter().flat_map(|(a, f)| [a, f]))
                .chain([&self.attn_norm, &self.ffn_norm])
                .map(|t| t.elem_count() * 4)
                .sum::<usize>()
    }
}

/// The optional biases of a block's attention products, `[out]` each.
#[derive(Default)]
struct Biases {
    q: Option<Tensor>,
    k: Option<Tensor>,
    v: Option<Tensor>,
    o: Option<Tensor>,
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
    /// The rotary embedding's angle per position, `[1, rope_dim / 2]`
    /// (Llama 3's `rope_freqs` or LongRoPE's factors and linear scaling
    /// applied).
    inv_freq: Tensor,
    caches: HashMap<SeqId, KvCache>,
    device: Device,
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
    pub fn cache(&self, seq_id: SeqId) -> Option<&KvCache> {
        self.caches.get(&seq_id)
    }

    /// Number of sequences with a cache.
    pub fn num_sequences(&self) -> usize {
        self.caches.len()
    }

    /// Allocates room for `tokens` tokens of `seq_id` up front (creating its
    /// cache if needed), so that a stage can account its KV memory exactly
    /// when it admits a request. Never shrinks.
    pub fn reserve(&mut self, seq_id: SeqId, tokens: usize) -> candle_core::Result<()> {
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
    pub fn free(&mut self, seq_id: SeqId) -> bool {
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
        let rows = e.rows(tokens, &self.device)?;
        if self.cfg.architecture.scales_embedding() {
            // Gemma: × sqrt(hidden) in f32, as llama.cpp's `ggml_scale`.
            return rows * f64::from((self.cfg.hidden_size as f32).sqrt());
        }
        Ok(rows)
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
        let attn_factor = self.cfg.rope_attn_factor;
        let (cos, sin) = rope_for(&self.inv_freq, &positions, attn_factor, &self.device)?;

        let mut x = hidden.clone();
        for (li, block) in self.blocks.iter().enumerate() {
            let window = self.cfg.window(self.layers.start + li);
            x = block_forward(
                &self.cfg,
                block,
                li,
                window,
                &x,
                batch,
                &cos,
                &sin,
                &self.caches,
            )?;
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
        let logits = head
            .weight
            .as_ref()
            .or(self.embedding.as_ref())
            .expect("an untied head, or the embedding it is tied to")
            .forward(&x)?;
        match self.cfg.final_softcap {
            Some(cap) => forward::soft_cap(&logits, cap),
            None => Ok(logits),
        }
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
        seq_id: SeqId,
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
