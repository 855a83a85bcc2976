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
    // A model's tokenizer tables are read from its files and trusted by the
    // tokenizers crate, which can panic on malformed ones: that fails this
    // text, not the task serving it.
    let enc = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.encode(text, special)))
        .map_err(|_| "tokenizer: the model's tokenizer failed on this text".to_string())?
        .map_err(|e| format!("tokenizer: {e}"))?;
    Ok(enc.get_ids().to_vec())
}

/// Requests with at most this many bytes of text are tokenized inline.
const INLINE_TOKENIZE_BYTES: usize = 2048;

/// Runs tokenizer work `f` over `bytes` of text: small inputs tokenize in
/// microseconds, so inline rather than pay a thread hand-off; large ones go
/// to the blocking pool so they never stall the runtime.
pub async fn off_runtime_if_large<T: Send + 'static>(
    bytes: usize,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    if bytes <= INLINE_TOKENIZE_BYTES {
        f()
    } else {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| format!("tokenizer task failed: {e}"))?
    }
}
