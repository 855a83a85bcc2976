//! Reading a part from a GGUF file: its configuration, the tensors of its
//! layer range (Phi-3's fused matrices split by rows, Gemma 2's post-norms), the rotary
//! frequencies, and the refusal of any tensor the computation would not
//! use or of a shape the metadata does not imply.

use super::config::{self, LlamaConfig};
use super::forward::rope_inv_freq;
use super::weights::{load_f32, Weight};
use super::{Biases, Block, Head, LlamaPart, WeightFormat};
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::Path;

impl LlamaPart {
    /// [`LlamaPart::load_as`] on a given device.
    pub fn load_on(
        path: &Path,
        layers: Range<usize>,
        with_embeddings: bool,
        with_head: bool,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let mut file = File::open(path)
            .map_err(|e| candle_core::Error::Msg(format!("opening {}: {e}", path.display())))?;
        let ct = gguf_file::Content::read(&mut file).map_err(|e| e.with_path(path))?;
        let cfg = LlamaConfig::from_gguf(&ct)?;
        if layers.start > layers.end || layers.end > cfg.num_layers {
            candle_core::bail!(
                "layer range {layers:?} outside the model's {} layers",
                cfg.num_layers
            );
        }
        let embedding = if with_embeddings {
            Some(Weight::load(
                &ct,
                &mut file,
                "token_embd.weight",
                format,
                device,
            )?)
        } else {
            None
        };
        let head = if with_head {
            let name = if cfg.tied_embeddings {
                "token_embd.weight"
            } else {
                "output.weight"
            };
            let shared = cfg.tied_embeddings && embedding.is_some();
            Some(Head {
                norm: load_f32(&ct, &mut file, "output_norm.weight", device)?,
                weight: if shared {
                    None
                } else {
                    Some(Weight::load(&ct, &mut file, name, format, device)?)
                },
            })
        } else {
            None
        };
        check_tensors(&ct, &cfg)?;
        let arch = cfg.architecture;
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let lin = |file: &mut File, n: &str| -> candle_core::Result<Weight> {
                Weight::load(&ct, file, &format!("blk.{i}.{n}.weight"), format, device)
            };
            let (q, k, v, gate, up) = if arch.fused_products() {
                // Phi-3: rows [q | k | v] of attn_qkv, [gate | up] of ffn_up,
                // each split into its own matrix (rows are independent).
                let (nq, nkv) = (
                    cfg.num_heads * cfg.head_dim,
                    cfg.num_kv_heads * cfg.head_dim,
                );
                let (qkv, ffn_up) = (
                    format!("blk.{i}.attn_qkv.weight"),
                    format!("blk.{i}.ffn_up.weight"),
                );
                let [q, k, v] =
                    Weight::load_split(&ct, &mut file, &qkv, &[nq, nkv, nkv], format, device)?;
                let f = cfg.intermediate_size;
                let [gate, up] =
                    Weight::load_split(&ct, &mut file, &ffn_up, &[f, f], format, device)?;
                (q, k, v, gate, up)
            } else {
                (
                    lin(&mut file, "attn_q")?,
                    lin(&mut file, "attn_k")?,
                    lin(&mut file, "attn_v")?,
                    lin(&mut file, "ffn_gate")?,
                    lin(&mut file, "ffn_up")?,
                )
            };
            let (o, down) = (lin(&mut file, "attn_output")?, lin(&mut file, "ffn_down")?);
            let mut f32_tensor =
                |n: &str| load_f32(&ct, &mut file, &format!("blk.{i}.{n}"), device);
            let attn_norm = f32_tensor("attn_norm.weight")?;
            let ffn_norm = f32_tensor("ffn_norm.weight")?;
            // Two norms a family has or has not.
            let mut norms = |on: bool, a: &str, b: &str| -> candle_core::Result<_> {
                Ok(if on {
                    Some((f32_tensor(a)?, f32_tensor(b)?))
                } else {
                    None
                })
            };
            let post_norms = norms(
                arch.post_norms(),
                "post_attention_norm.weight",
                "post_ffw_norm.weight",
            )?;
            let qk_norm = norms(
                arch.needs_qk_norm(),
                "attn_q_norm.weight",
                "attn_k_norm.weight",
            )?;
            let mut bias = |n: &str, required: bool| -> candle_core::Result<Option<Tensor>> {
                let name = format!("blk.{i}.{n}.bias");
                if ct.tensor_infos.contains_key(&name) {
                    Ok(Some(load_f32(&ct, &mut file, &name, device)?))
                } else if required {
                    candle_core::bail!("{} needs {name}, which the GGUF lacks", arch.name())
                } else {
                    Ok(None)
                }
            };
            let need = arch.needs_qkv_bias();
            let bias = Biases {
                q: bias("attn_q", need)?,
                k: bias("attn_k", need)?,
                v: bias("attn_v", need)?,
                o: bias("attn_output", false)?,
            };
            blocks.push(Block {
                q,
                k,
                v,
                o,
                bias,
                qk_norm,
                gate,
                up,
                down,
                attn_norm,
                ffn_norm,
                post_norms,
            });
        }
        let freq_factors = match cfg.rope_factors {
            Some(name) => Some(
                load_f32(&ct, &mut file, name, device)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            ),
            None => None,
        };
        let inv_freq = rope_inv_freq(&cfg, freq_factors.as_deref(), device)?;
        Ok(Self {
            cfg,
            layers,
            format,
            embedding,
            blocks,
            head,
            inv_freq,
            caches: HashMap::new(),
            device: device.clone(),
        })
    }
}

/// The shape `[rows, cols]` (or `[len]`) a tensor of a `cfg` model must
/// have, `None` for a tensor such a model does not have.
fn expected_shape(name: &str, cfg: &LlamaConfig) -> Option<Vec<usize>> {
    let (h, v, f) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
    let (q, kv, d) = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.head_dim,
    );
    let arch = cfg.architecture;
    let fused = arch.fused_products();
    match name {
        "token_embd.weight" => return Some(vec![v, h]),
        "output.weight" if !arch.always_tied() => return Some(vec![v, h]),
        "output_norm.weight" => return Some(vec![h]),
        // llama.cpp's phi3 loader has no rope_freqs and no biases.
        config::ROPE_FREQS if !fused => return Some(vec![cfg.rope_dim / 2]),
        config::LONG_FACTORS | config::SHORT_FACTORS if fused => {
            return Some(vec![cfg.rope_dim / 2])
        }
        _ => {}
    }
    let (i, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    if !i.parse::<usize>().is_ok_and(|i| i < cfg.num_layers) {
        return None;
    }
    let qk_norm = arch.needs_qk_norm();
    let post = arch.post_norms();
    Some(match rest {
        "attn_norm.weight" | "ffn_norm.weight" => vec![h],
        "post_attention_norm.weight" | "post_ffw_norm.weight" if post => vec![h],
        // llama.cpp's gemma2 graph has no output bias.
        "attn_output.bias" if !fused && !post => vec![h],
        "attn_qkv.weight" if fused => vec![q + 2 * kv, h],
        "ffn_up.weight" if fused => vec![2 * f, h],
        "attn_q.weight" if !fused => vec![q, h],
        "attn_k.weight" | "attn_v.weight" if !fused => vec![kv, h],
        "attn_output.weight" => vec![h, q],
        "ffn_gate.weight" | "ffn_up.weight" if !fused => vec![f, h],
        "ffn_down.weight" => vec![h, f],
        "attn_q.bias" if !fused => vec![q],
        "attn_k.bias" | "attn_v.bias" if !fused => vec![kv],
        "attn_q_norm.weight" | "attn_k_norm.weight" if qk_norm => vec![d],
        _ => return None,
    })
}

/// Refuses a GGUF with a tensor this loader would not use, or of another
/// shape than the metadata implies: an unused tensor means a feature of the
/// file (a bias, a norm, another kind of block) that the computation here
/// would silently leave out, and a wrong shape would fail in the middle of
/// a request instead of at load.
fn check_tensors(ct: &gguf_file::Content, cfg: &LlamaConfig) -> candle_core::Result<()> {
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let Some(want) = expected_shape(name, cfg) else {
            candle_core::bail!(
                "tensor {name} is not part of a {} model as this stage runs it",
                cfg.architecture.name()
            );
        };
        let have = ct.tensor_infos[name].shape.dims();
        if have != want.as_slice() {
            candle_core::bail!("tensor {name} has shape {have:?}; the metadata implies {want:?}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::llama::Architecture;

    fn config(architecture: Architecture) -> LlamaConfig {
        LlamaConfig {
            architecture,
            vocab_size: 100,
            hidden_size: 256,
            intermediate_size: 512,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            rope_dim: 64,
            rope_theta: 10_000.0,
            rope_linear_factor: 1.0,
            rope_attn_factor: 1.0,
            rope_factors: None,
            rms_norm_eps: 1e-6,
            max_seq_len: 2048,
            bos_token_id: None,
            eos_token_id: None,
            tied_embeddings: true,
            attn_scale: 0.125,
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
        }
    }

    /// A phi3 file holds the fused matrices and LongRoPE's factors, and
    /// nothing llama.cpp's phi3 loader would not create (separate q/k/v or
    /// gate, biases, Llama 3's rope_freqs); the other families the reverse.
    #[test]
    fn phi3_tensors_are_the_fused_ones() {
        let phi3 = config(Architecture::Phi3);
        assert_eq!(
            expected_shape("blk.0.attn_qkv.weight", &phi3),
            Some(vec![512, 256])
        );
        assert_eq!(
            expected_shape("blk.1.ffn_up.weight", &phi3),
            Some(vec![1024, 256])
        );
        assert_eq!(expected_shape(config::LONG_FACTORS, &phi3), Some(vec![32]));
        for name in [
            "blk.0.attn_q.weight",
            "blk.0.ffn_gate.weight",
            "blk.0.attn_q.bias",
            "blk.0.attn_output.bias",
            config::ROPE_FREQS,
        ] {
            assert_eq!(expected_shape(name, &phi3), None, "{name}");
        }
        let llama = config(Architecture::Llama);
        assert_eq!(
            expected_shape("blk.1.ffn_up.weight", &llama),
            Some(vec![512, 256])
        );
        assert_eq!(expected_shape(config::ROPE_FREQS, &llama), Some(vec![32]));
        for name in ["blk.0.attn_qkv.weight", config::SHORT_FACTORS] {
            assert_eq!(expected_shape(name, &llama), None, "{name}");
        }
    }

    /// A gemma2 file has the post-norms and no head of its own; the other
    /// families no post-norms.
    #[test]
    fn gemma2_tensors_have_post_norms_and_no_head() {
        let gemma2 = config(Architecture::Gemma2);
        for name in [
            "blk.1.post_attention_norm.weight",
            "blk.0.post_ffw_norm.weight",
        ] {
            assert_eq!(expected_shape(name, &gemma2), Some(vec![256]), "{name}");
            assert_eq!(
                expected_shape(name, &config(Architecture::Llama)),
                None,
                "{name}"
            );
        }
        for name in [
            "output.weight",
            "blk.0.attn_output.bias",
            "blk.0.attn_qkv.weight",
        ] {
            assert_eq!(expected_shape(name, &gemma2), None, "{name}");
        }
        assert_eq!(
            expected_shape("blk.0.attn_q.weight", &gemma2),
            Some(vec![256, 256])
        );
    }
}
