//! The entry stage's chat prompt against `transformers`: for every
//! conversation in `gateway/tests/data/chat_reference.json` (made by
//! `scripts/make_chat_reference.py` with `apply_chat_template`), the request
//! as an API client sends it is validated by `proto::chat::parse_chat`,
//! rendered with the GGUF's own template by the stage's `ChatTemplate`, and
//! tokenized by the stage's `GenModel::tokenize` path; text and token ids
//! must equal the reference exactly: `ids` for the whole rendered text with
//! its special tokens (as `apply_chat_template` tokenizes it), and
//! `content_ids` for the stage's chat path, where content's special-token
//! text is text (`content_text`; the reference made independently with
//! `split_special_tokens` on the content).

mod support;

use candle_core::quantized::gguf_file;
use enclave_stage::serving::generation::chat_template::ChatTemplate;
use enclave_stage::serving::generation::content_text::{self, ContentMarks};
use serde_json::{json, Value};
use support::{root, smollm_dir};
use tokenizers::Tokenizer;

#[test]
fn chat_prompts_match_transformers_apply_chat_template() {
    let dir = smollm_dir();
    let reference: Value = serde_json::from_slice(
        &std::fs::read(root().join("gateway/tests/data/chat_reference.json")).unwrap(),
    )
    .unwrap();
    let mut f = std::fs::File::open(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    let ct = gguf_file::Content::read(&mut f).unwrap();
    let source = ct.metadata["tokenizer.chat_template"]
        .to_string()
        .unwrap()
        .clone();
    assert_eq!(source, reference["chat_template"].as_str().unwrap());
    let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let template = ChatTemplate::new(&source, "<|im_start|>", "<|im_end|>").unwrap();
    let marked = ChatTemplate::new(&source, "<|im_start|>", "<|im_end|>")
        .unwrap()
        .with_marks(ContentMarks::of_tokenizer(&tok))
        .unwrap();
    let items = reference["items"].as_array().unwrap();
    assert!(items.len() >= 4);
    for (i, item) in items.iter().enumerate() {
        let body = json!({"model": "m", "messages": item["request"]});
        let chat = proto::chat::parse_chat(&serde_json::to_vec(&body).unwrap(), 49152, 16)
            .unwrap_or_else(|e| panic!("item {i}: {e:?}"));
        let expect_msgs: Vec<proto::chat::ChatMessage> =
            serde_json::from_value(item["template"].clone()).unwrap();
        assert_eq!(
            chat.messages, expect_msgs,
            "item {i}: messages as templated"
        );
        let text = template.render(&chat.messages, &[]).unwrap();
        assert_eq!(
            text,
            item["text"].as_str().unwrap(),
            "item {i}: rendered text"
        );
        let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        let want: Vec<u32> = serde_json::from_value(item["ids"].clone()).unwrap();
        assert_eq!(ids, want, "item {i}: token ids");
        // The role markers are single special tokens, not spelled-out text.
        assert_eq!(ids[0], 1, "item {i}: starts with <|im_start|>");
        let marked_text = marked.render(&chat.messages, &[]).unwrap();
        let ids = content_text::encode(&tok, &marked_text).unwrap();
        let want: Vec<u32> = serde_json::from_value(item["content_ids"].clone()).unwrap();
        assert_eq!(ids, want, "item {i}: token ids, content as text");
    }
}
