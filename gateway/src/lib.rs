//! `gateway`: the host side of the confidential inference system, as a
//! library with a thin binary (`main.rs` calls [`app::run`]).
//!
//! - the HTTP server and the OpenAI-compatible API: [`serve`], [`api`]
//!   (HTTP only) over [`service`] (replicas, sealing, relaying, receipts),
//!   [`auth`], [`timeouts`], [`shutdown`], [`tls`], [`openai_error`];
//! - the pipelines of attested stages: [`pipeline`], [`launcher`],
//!   [`host_proxy`] (Nitro), [`receipt_store`];
//! - operations: [`config`], [`metrics`], [`stage_metrics`], [`telemetry`];
//! - a user's GGUF served without a config (`serve --model`): [`own_model`],
//!   split across stages by memory with [`plan`];
//! - the client verbs, which run in the client's trust domain (`verify`,
//!   `seal`, `open`, `proxy`), are the `client` crate (`client/`);
//!   the binary only dispatches to them.

pub mod api;
pub mod app;
pub mod attestation_limits;
pub mod auth;
pub mod config;
pub mod host_proxy;
pub mod in_flight;
pub mod launcher;
pub mod metrics;
pub mod openai_error;
pub mod own_model;
pub mod pipeline;
pub mod plan;
pub mod receipt_store;
pub mod serve;
pub mod service;
pub mod shutdown;
pub mod stage_metrics;
pub mod telemetry;
pub mod timeouts;
pub mod tls;
pub mod transparency;
