//! Time of one step's token mask under a grammar, for
//! `scripts/bench_structured.py`: for each case of the JSON file given
//! (`[{"name", "body", "text"}]`: a chat request body as a client sends it
//! and an answer the model wrote under it), the request's grammar is
//! compiled on SmolLM2's vocabulary and the answer fed to it token by
//! token, the mask of every step timed as the exit stage computes it.
//! Prints `{"<name>": {"compile_us": …, "mask_us": [...]}, ...}`.
//! `bench_grammar --tools-prompt TOOLS_JSON` prints instead the system text
//! the entry stage adds for those tools.

use enclave_stage::serving::generation::grammar::{grammar_text, Grammars};
use serde_json::{json, Map, Value};
use std::time::Instant;
use tokenizers::Tokenizer;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let (Some("--tools-prompt"), Some(tools)) = (args.get(1).map(String::as_str), args.get(2)) {
        // The system text the entry stage adds for these tools, so that an
        // unconstrained run can be given the same prompt.
        let body = json!({ "tools": serde_json::from_str::<Value>(tools)? });
        let tools = proto::tools::parse_tools(body.as_object().expect("an object"))
            .map_err(|e| anyhow::anyhow!("{}", e.message))?
            .ok_or_else(|| anyhow::anyhow!("no tools"))?;
        print!("{}", proto::tools::tools_prompt(&tools.defs));
        return Ok(());
    }
    let (Some(model_dir), Some(cases)) = (args.get(1), args.get(2)) else {
        anyhow::bail!("usage: bench_grammar MODEL_DIR CASES.json");
    };
    let bytes = std::fs::read(format!("{model_dir}/tokenizer.json"))?;
    let tokenizer = Tokenizer::from_bytes(&bytes).map_err(anyhow::Error::msg)?;
    let eos = tokenizer
        .token_to_id("<|im_end|>")
        .ok_or_else(|| anyhow::anyhow!("no <|im_end|> token"))?;
    let vocab = tokenizer.get_vocab_size(true);
    let grammars = Grammars::new(&bytes, tokenizer.clone(), vocab, eos)?;
    let cases: Vec<Value> = serde_json::from_slice(&std::fs::read(cases)?)?;
    let mut out = Map::new();
    for case in cases {
        let name = case["name"].as_str().unwrap_or("case").to_string();
        let body = serde_json::to_vec(&case["body"])?;
        let request = proto::chat::parse_chat(&body, vocab as u32, 1024)
            .map_err(|e| anyhow::anyhow!("{name}: {}", e.message))?
            .request;
        let Some(lark) = grammar_text(&request) else {
            anyhow::bail!("{name}: the request is not constrained");
        };
        let t = Instant::now();
        let mut m = grammars.matcher(&lark).map_err(anyhow::Error::msg)?;
        let compile_us = t.elapsed().as_secs_f64() * 1e6;
        let text = case["text"].as_str().unwrap_or_default();
        let ids = tokenizer
            .encode(text, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec();
        let mut mask_us = Vec::with_capacity(ids.len());
        for id in ids {
            let t = Instant::now();
            let mask = m.compute_mask_or_eos().map_err(anyhow::Error::msg)?;
            mask_us.push(t.elapsed().as_secs_f64() * 1e6);
            if !mask.is_allowed(id) {
                // The answer was cut (a length limit) at a token boundary the
                // grammar's own tokenization does not share: stop here.
                break;
            }
            m.consume_token(id).map_err(anyhow::Error::msg)?;
        }
        out.insert(name, json!({"compile_us": compile_us, "mask_us": mask_us}));
    }
    println!("{}", Value::Object(out));
    Ok(())
}
