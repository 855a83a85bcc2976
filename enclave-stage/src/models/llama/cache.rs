//! Packed batches ([`SeqSlice`]) and per-sequence KV caches.

use candle_core::{DType, Device, Tensor};

// Named only in doc links.
#[cfg(doc)]
use super::LlamaPart;

/// A sequence's key in a part's KV caches (wide enough that a request id
/// and a choice index never share one).
pub type SeqId = u128;

/// The tokens of one sequence inside a packed batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    /// The sequence.
    pub seq_id: SeqId,
    /// Position of the first of these tokens: how many tokens of this
    /// sequence are already cached (0 for a prefill from scratch). Checked
    /// against the part's cache, so stages that drift apart fail loudly.
    pub pos: usize,
    /// Number of tokens of this sequence in the batch (1 for a decode step).
    pub len: usize,
}

impl SeqSlice {
    /// `len` tokens of `seq_id` starting at position `pos`.
    pub fn new(seq_id: SeqId, pos: usize, len: usize) -> Self {
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
    pub(super) len: usize,
    pub(super) capacity: usize,
    pub(super) layers: Vec<(Tensor, Tensor)>,
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

/// Grows `cache` to hold at least `tokens` tokens, keeping its contents.
pub(super) fn grow(
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
