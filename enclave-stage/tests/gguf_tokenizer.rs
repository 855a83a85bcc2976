//! The tokenizer built from a GGUF's own metadata
//! (`enclave_stage::models::gguf_tokenizer`) against the shipped SmolLM2
//! `tokenizer.json` (pinned, byte for byte what `transformers` saves for the
//! same GGUF): the two documents are equal as JSON, and both tokenizers cut
//! a mixed text, special tokens included, into the same ids.

mod support;

use candle_core::quantized::gguf_file;
use enclave_stage::models::gguf_tokenizer::tokenizer_json;
use support::smollm_dir;
use tokenizers::Tokenizer;

#[test]
fn smollm2s_gguf_metadata_gives_the_pinned_tokenizer() {
    let dir = smollm_dir();
    let mut f = std::fs::File::open(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let built = tokenizer_json(&ct).unwrap();
    let pinned: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "decoder",
        "post_processor",
    ] {
        assert_eq!(built[key], pinned[key], "{key}");
    }
    assert_eq!(built["model"]["merges"], pinned["model"]["merges"]);
    assert_eq!(built, pinned);

    let ours = Tokenizer::from_bytes(serde_json::to_vec(&built).unwrap()).unwrap();
    let theirs = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let text = "<|im_start|>user\nHéllo, wörld! 1234 ½ 日本語\t  tabs\n\n<|im_end|> 🦀 it's";
    let a = ours.encode(text, false).unwrap();
    let b = theirs.encode(text, false).unwrap();
    assert_eq!(a.get_ids(), b.get_ids());
    assert!(
        a.get_ids().contains(&1),
        "<|im_start|> is one special token"
    );
    assert_eq!(ours.decode(a.get_ids(), false).unwrap(), text);
}
