//! The model engine of one stage: loads its layers after checking every file
//! against the manifest, tokenizes (entry stage), runs its layers, and pools
//! (exit stage). Pure compute, no networking; also used in-process by the
//! benchmark's bare-Candle baseline.

use crate::kernels::bf16_matmul::Kernel;
use crate::models::bert::pooling::Pooling;
use crate::models::bert::{BertConfig, BertPart};
use crate::role::StageSpec;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use proto::frames::{StageClaims, WeightFormat};
use proto::manifest::LoadedManifest;
use proto::tensor::TensorFrame;
use std::path::Path;
use tokenizers::Tokenizer;

/// A loaded stage model.
pub struct Engine {
    /// The manifest the files were checked against.
    pub manifest: LoadedManifest,
    /// What this stage claims in its evidence (keys are filled in by the
    /// binary once it has generated them).
    pub claims: StageClaims,
    part: BertPart,
    tokenizer: Option<Tokenizer>,
    /// The exit stage's pooling (`None` at other stages).
    pooling: Option<Pooling>,
}

/// A padded batch on its way through the stage.
pub struct Padded {
    /// `[batch, seq, hidden]` f32.
    pub hidden: Tensor,
    /// `[batch, seq]` f32 mask.
    pub mask: Tensor,
}

impl Engine {
    /// Loads the stage's part of the model in `model_dir`, its dense layers
    /// held as `format` (`f32` or `bf16`, which the claims name).
    ///
    /// Every file is checked against the manifest's SHA-256 by this process
    /// before it is used; a mismatch is an error naming the file.
    pub fn load(model_dir: &Path, spec: &StageSpec, format: WeightFormat) -> Result<Self> {
        let (manifest, mut claims) =
            spec.open_manifest(model_dir, &crate::models::bert::SERVED, "embedding")?;
        // f32 is the model's own weights: left unnamed, as before there was a choice.
        claims.weights = (format != WeightFormat::F32).then_some(format);
        let m = &manifest.manifest;
        let cfg: BertConfig = serde_json::from_value(manifest.verified_json("config.json")?)
            .context("parsing config.json")?;
        cfg.check()?;
        if cfg.model_type != m.architecture {
            bail!(
                "config.json's model_type {:?} is not the manifest's architecture {:?}",
                cfg.model_type,
                m.architecture
            );
        }
        if m.max_seq_len == 0 || m.max_seq_len > cfg.max_tokens() {
            bail!(
                "the manifest's max_seq_len {} is outside 1..={} (config.json's \
                 max_position_embeddings {}, from position {})",
                m.max_seq_len,
                cfg.max_tokens(),
                cfg.max_position_embeddings,
                cfg.first_position()
            );
        }
        let is_entry = spec.stage_index == 0;
        let pooling = if claims.is_exit() {
            Some(Pooling::from_manifest(&manifest, cfg.hidden_size)?)
        } else {
            None
        };
        let tokenizer = if is_entry {
            Some(crate::models::bert::tokenizer::load(&manifest, &cfg)?)
        } else {
            None
        };
        let weights = manifest.verified_path("model.safetensors")?;
        let device = Device::Cpu;
        // SAFETY: the file was just checked against the manifest; the mapping
        // lives only while the stage's tensors are copied out of it.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&weights], DType::F32, &device)? };
        let part =
            BertPart::load(vb, cfg, spec.layers.clone(), is_entry, format).with_context(|| {
                format!(
                    "loading layers {:?} from {}",
                    spec.layers,
                    weights.display()
                )
            })?;
        Ok(Self {
            manifest,
            claims,
            part,
            tokenizer,
            pooling,
        })
    }

    /// Shape numbers for the activation-memory estimate.
    pub fn shape(&self) -> crate::serving::embedding::batcher::ShapeInfo {
        let c = self.part.config();
        crate::serving::embedding::batcher::ShapeInfo {
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
        }
    }

    /// Hidden width.
    pub fn hidden_size(&self) -> usize {
        self.part.hidden_size()
    }

    /// How the dense layers' weights are held (as the claims say), and
    /// the bf16 kernel their products run on.
    pub fn weights(&self) -> (WeightFormat, Option<Kernel>) {
        (
            self.claims.weights.unwrap_or(WeightFormat::F32),
            self.part.bf16_kernel(),
        )
    }

    /// Tokenizes one text (with `[CLS]`/`[SEP]`, truncated to the model's
    /// maximum length).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, String> {
        crate::tokens::encode(self.tokenizer.as_ref(), text, true)
    }

    /// Pads token sequences into a batch and runs embeddings + this stage's layers.
    pub fn run_tokens(&self, seqs: &[&[u32]]) -> Result<Padded> {
        let max = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        if max == 0 {
            bail!("empty batch");
        }
        let mut ids = vec![0u32; seqs.len() * max];
        let mut mask = vec![0f32; seqs.len() * max];
        for (r, s) in seqs.iter().enumerate() {
            ids[r * max..r * max + s.len()].copy_from_slice(s);
            mask[r * max..r * max + s.len()]
                .iter_mut()
                .for_each(|m| *m = 1.0);
        }
        let dev = self.part.device();
        let ids = Tensor::from_vec(ids, (seqs.len(), max), dev)?;
        let mask = Tensor::from_vec(mask, (seqs.len(), max), dev)?;
        let hidden = self.part.embed(&ids)?;
        let hidden = self.part.forward_layers(&hidden, &mask)?;
        Ok(Padded { hidden, mask })
    }

    /// Runs this stage's layers on a batch from the previous stage.
    pub fn run_hidden(&self, input: Padded) -> Result<Padded> {
        let hidden = self.part.forward_layers(&input.hidden, &input.mask)?;
        Ok(Padded {
            hidden,
            mask: input.mask,
        })
    }

    /// Pools (and normalizes, if the model says so) as the model's
    /// sentence-transformers modules do (exit stage only); returns
    /// `[batch, hidden]` row-major.
    pub fn pool(&self, batch: &Padded) -> Result<Vec<f32>> {
        let pooling = self.pooling.as_ref().context("only the exit stage pools")?;
        Ok(pooling
            .apply(&batch.hidden, &batch.mask)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Embeds texts entirely in this process (requires a single-stage
    /// engine). Used by tests and the benchmark baseline.
    pub fn embed_texts(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        if !(self.claims.is_entry() && self.claims.is_exit()) {
            bail!("embed_texts needs a single-stage engine");
        }
        let seqs: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| self.tokenize(t).map_err(anyhow::Error::msg))
            .collect::<Result<_>>()?;
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        let out = self.pool(&self.run_tokens(&refs)?)?;
        Ok(out.chunks(self.hidden_size()).map(|c| c.to_vec()).collect())
    }
}

impl Padded {
    /// Encodes as wire frames (hidden f32, mask u32).
    pub fn to_frames(&self) -> Result<(TensorFrame, TensorFrame)> {
        let dims = self.hidden.dims().to_vec();
        let hidden = TensorFrame::from_f32(&dims, &self.hidden.flatten_all()?.to_vec1::<f32>()?);
        let mdims = self.mask.dims().to_vec();
        let mask: Vec<u32> = self
            .mask
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .map(|m| m as u32)
            .collect();
        Ok((hidden, TensorFrame::from_u32(&mdims, &mask)))
    }

    /// Decodes wire frames, checking that their shapes agree.
    pub fn from_frames(
        hidden: &TensorFrame,
        mask: &TensorFrame,
        hidden_size: usize,
    ) -> Result<Self> {
        let hd = hidden.dims();
        let md = mask.dims();
        if hd.len() != 3
            || md.len() != 2
            || hd[0] != md[0]
            || hd[1] != md[1]
            || hd[2] != hidden_size
        {
            bail!("activation shapes {hd:?} / mask {md:?} do not fit hidden size {hidden_size}");
        }
        let dev = Device::Cpu;
        let h = Tensor::from_vec(hidden.to_f32().map_err(anyhow::Error::msg)?, hd, &dev)?;
        let m: Vec<f32> = mask
            .to_u32()
            .map_err(anyhow::Error::msg)?
            .into_iter()
            .map(|v| if v != 0 { 1.0 } else { 0.0 })
            .collect();
        let m = Tensor::from_vec(m, md, &dev)?;
        Ok(Self { hidden: h, mask: m })
    }

    /// Rows `[start, start+len)` of the batch, trimmed of padding columns
    /// that no remaining row uses.
    pub fn rows(&self, start: usize, len: usize, max_tokens: usize) -> Result<Self> {
        let hidden = self
            .hidden
            .narrow(0, start, len)?
            .narrow(1, 0, max_tokens)?
            .contiguous()?;
        let mask = self
            .mask
            .narrow(0, start, len)?
            .narrow(1, 0, max_tokens)?
            .contiguous()?;
        Ok(Self { hidden, mask })
    }
}
