//! The model families a stage runs, each split by layers and written on
//! Candle's primitives: BERT encoders in the sentence-transformers layout
//! ([`bert`], with their pooling and tokenizer) and Llama-family decoders
//! from GGUF files ([`llama`], with the tokenizer a GGUF describes in
//! [`gguf_tokenizer`]). A new architecture is a file here.

pub mod bert;
pub mod gguf_tokenizer;
pub mod llama;
