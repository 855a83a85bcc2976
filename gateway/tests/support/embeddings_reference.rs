//! The sentence-transformers reference vectors
//! (`gateway/tests/data/embeddings_reference.json`, made by
//! `scripts/make_reference.py`) and cosine similarity, shared by the
//! gateway's and the stage's tests (included with `#[path]`).

use std::path::Path;

/// Reference texts, their token counts and their embeddings.
pub struct Reference {
    /// The input texts.
    pub texts: Vec<String>,
    /// Tokens per text, `[CLS]` and `[SEP]` included.
    pub tokens: Vec<u64>,
    /// sentence-transformers' embedding of each text.
    pub vectors: Vec<Vec<f32>>,
}

/// Loads the reference file under the repository `root`.
pub fn load_reference(root: &Path) -> Reference {
    let path = root.join("gateway/tests/data/embeddings_reference.json");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let items = v["items"].as_array().unwrap();
    let field =
        |f: &str| -> Vec<serde_json::Value> { items.iter().map(|i| i[f].clone()).collect() };
    Reference {
        texts: field("text")
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect(),
        tokens: field("tokens")
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect(),
        vectors: field("embedding")
            .iter()
            .map(|e| {
                e.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

/// Cosine similarity.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}
