//! Text generation (`/v1/completions` and `/v1/chat/completions`) pipelined
//! across stages: the model a stage loads ([`model`]), the chat template the
//! entry stage renders ([`chat_template`]) over content kept as text
//! ([`content_text`]), the grammars of structured
//! outputs and tool calls ([`grammar`]), the entry stage's
//! continuous-batching scheduler ([`scheduler`]), the exit stage's
//! per-choice output rules ([`output`]), the compute thread that ties
//! them together ([`compute`]), and the model as the stage serves it
//! ([`service`]: starting the compute thread, admitting a request).

pub mod chat_template;
pub mod compute;
pub mod content_text;
pub mod grammar;
pub mod model;
pub mod output;
pub mod scheduler;
pub mod service;
