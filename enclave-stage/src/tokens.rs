//! Text to token ids, shared by the embedding and generation models.

use tokenizers::Tokenizer;

/// Encodes `text` with the stage's tokenizer (`special`: add the model's
/// special tokens); an error on a stage that holds no tokenizer.
pub fn encode(
    tokenizer: Option<&Tokenizer>,
    text: &str,
    special: bool,
) -> Result<Vec<u32>, String> {
    let t = tokenizer.ok_or("this stage does not tokenize")?;
    let enc = t
        .encode(text, special)
        .map_err(|e| format!("tokenizer: {e}"))?;
    Ok(enc.get_ids().to_vec())
}
