//! Micro-batch planning for the entry stage: sequences waiting at one moment
//! are sorted by length and cut into micro-batches that respect a padded
//! token budget, a row limit and an activation-memory budget.

pub use crate::work::Seq;

/// Limits of one micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct BatchLimits {
    /// Padded tokens (`rows × longest`) per micro-batch.
    pub token_budget: usize,
    /// Rows per micro-batch.
    pub max_rows: usize,
    /// Estimated activation bytes per micro-batch.
    pub memory_budget: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self {
            token_budget: 4096,
            max_rows: 64,
            memory_budget: 192 << 20,
        }
    }
}

/// Model shape numbers the memory estimate needs.
#[derive(Clone, Copy, Debug)]
pub struct ShapeInfo {
    /// Hidden width.
    pub hidden: usize,
    /// Feed-forward width.
    pub intermediate: usize,
    /// Attention heads.
    pub heads: usize,
}

impl ShapeInfo {
    /// Upper estimate of live activation bytes while one layer runs on a
    /// `rows × len` batch: a few hidden-sized tensors, the feed-forward
    /// tensor, and the attention scores and probabilities.
    pub fn activation_bytes(&self, rows: usize, len: usize) -> usize {
        let tokens = rows * len;
        4 * (tokens * (6 * self.hidden + 2 * self.intermediate) + 3 * rows * self.heads * len * len)
    }
}

/// Fewest rows worth a micro-batch of its own when splitting for pipelining.
const MIN_SPLIT_ROWS: usize = 4;

/// Cuts `seqs` into micro-batches. Every sequence ends in exactly one batch;
/// a sequence that alone exceeds a budget gets a batch of its own.
///
/// With `stages > 1` and enough sequences, at least `stages` micro-batches
/// are made, so that the next stage can start on the first while this stage
/// computes the next (a single large micro-batch would make the stages take
/// turns instead of working at once).
pub fn plan(
    mut seqs: Vec<Seq>,
    limits: &BatchLimits,
    shape: &ShapeInfo,
    stages: usize,
) -> Vec<Vec<Seq>> {
    let mut limits = *limits;
    if stages > 1 && seqs.len() >= stages * MIN_SPLIT_ROWS {
        limits.max_rows = limits.max_rows.min(seqs.len().div_ceil(stages));
    }
    let limits = &limits;
    seqs.sort_by_key(|s| s.ids.len());
    let mut out: Vec<Vec<Seq>> = Vec::new();
    let mut cur: Vec<Seq> = Vec::new();
    for s in seqs {
        // Sorted ascending, so the newcomer is the longest in the batch.
        let len = s.ids.len();
        let rows = cur.len() + 1;
        let fits = rows <= limits.max_rows
            && rows * len <= limits.token_budget
            && shape.activation_bytes(rows, len) <= limits.memory_budget;
        if !fits && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(s);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::frames::BatchItem;

    fn seq(id: u64, len: usize) -> Seq {
        Seq {
            item: BatchItem {
                request_id: id,
                index: 0,
                tokens: len as u32,
            },
            ids: vec![1; len],
        }
    }

    const SHAPE: ShapeInfo = ShapeInfo {
        hidden: 384,
        intermediate: 1536,
        heads: 12,
    };

    #[test]
    fn respects_budgets_and_keeps_everything() {
        let limits = BatchLimits {
            token_budget: 100,
            max_rows: 4,
            memory_budget: usize::MAX,
        };
        let seqs: Vec<Seq> = (0..10).map(|i| seq(i, 5 + (i as usize * 7) % 40)).collect();
        let batches = plan(seqs, &limits, &SHAPE, 1);
        let mut ids: Vec<u64> = batches
            .iter()
            .flatten()
            .map(|s| s.item.request_id)
            .collect();
        ids.sort();
        assert_eq!(ids, (0..10).collect::<Vec<_>>());
        for b in &batches {
            let longest = b.iter().map(|s| s.ids.len()).max().unwrap();
            assert!(b.len() <= 4);
            assert!(
                b.len() == 1 || b.len() * longest <= 100,
                "{} x {}",
                b.len(),
                longest
            );
        }
    }

    #[test]
    fn oversized_sequence_gets_its_own_batch() {
        let limits = BatchLimits {
            token_budget: 10,
            max_rows: 8,
            memory_budget: usize::MAX,
        };
        let batches = plan(vec![seq(1, 3), seq(2, 50), seq(3, 2)], &limits, &SHAPE, 1);
        assert_eq!(batches.len(), 2);
        assert_eq!(batches[1].len(), 1);
        assert_eq!(batches[1][0].item.request_id, 2);
    }

    #[test]
    fn splits_for_pipelining_when_worth_it() {
        let limits = BatchLimits::default();
        let many: Vec<Seq> = (0..64).map(|i| seq(i, 12)).collect();
        assert_eq!(plan(many.clone(), &limits, &SHAPE, 1).len(), 1);
        let split = plan(many, &limits, &SHAPE, 2);
        assert_eq!(split.len(), 2);
        assert!(split.iter().all(|b| b.len() == 32));
        let few: Vec<Seq> = (0..5).map(|i| seq(i, 12)).collect();
        assert_eq!(
            plan(few, &limits, &SHAPE, 2).len(),
            1,
            "too few rows to split"
        );
    }

    #[test]
    fn memory_budget_limits_rows() {
        let one = SHAPE.activation_bytes(1, 256);
        let limits = BatchLimits {
            token_budget: usize::MAX,
            max_rows: 64,
            memory_budget: one * 2,
        };
        let batches = plan((0..6).map(|i| seq(i, 256)).collect(), &limits, &SHAPE, 1);
        assert!(batches.iter().all(|b| b.len() <= 2));
    }
}
