//! The training data: loading a run's corpus, checking it against the model, and drawing the
//! global batch's windows (one seeded sampler, drawn in a fixed order, so every layout sees the
//! same sequences).

use crate::config::RunConfig;
use crate::error::{user, Result};
use data::{Dataset, Tokenizer, Tokens};
use std::path::PathBuf;
use tensor::Rng;

/// Loads the training data for `cfg` (its paths, or the Rust books) with `tokenizer` when the
/// run already has one (resume), else the configured tokenizer spec.
pub fn load_data(cfg: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<Dataset> {
    let frac = cfg.data.val_fraction;
    if cfg.data.paths.is_empty() {
        let (text, files) = data::default_corpus()?;
        let tok = match tokenizer {
            Some(t) => t,
            None => Tokenizer::from_spec(&cfg.data.tokenizer, Some(&text))?,
        };
        let ids = tok.encode(&text)?;
        let n_train = ((ids.len() as f64) * (1.0 - frac)) as usize;
        let description = format!("the Rust books ({} files, {} tokens, {} tokenizer, vocab {})", files.len(), ids.len(), tok.kind(), tok.vocab_size());
        return Ok(Dataset { val: Tokens::from_vec(ids[n_train..].to_vec()), train: Tokens::from_vec(ids[..n_train].to_vec()), tokenizer: tok, description, files, skipped: 0 });
    }
    let paths: Vec<PathBuf> = cfg.data.paths.iter().map(PathBuf::from).collect();
    Ok(match tokenizer {
        Some(t) => data::load_with(&paths, t, frac)?,
        None => data::load(&paths, &cfg.data.tokenizer, frac)?,
    })
}

fn data_name(cfg: &RunConfig) -> String {
    if cfg.data.paths.is_empty() { "the default corpus".into() } else { cfg.data.paths.join(", ") }
}

/// Checks the data against the model: a training length within the model's positions, enough
/// tokens for one window (`train.seq_len + 1` tokens) in each split, a model vocabulary that
/// covers the tokenizer's, and a loss vocabulary between the two.
pub(super) fn check_data_fits(cfg: &RunConfig, ds: &Dataset) -> Result<()> {
    let (t, bs) = (cfg.seq_len(), cfg.model.block_size);
    if t > bs {
        return user(format!("train.seq_len ({t}) exceeds the model's positions, model.block_size ({bs})"));
    }
    for (split, toks) in [("training", &ds.train), ("validation", &ds.val)] {
        if toks.len() < t + 1 {
            return user(format!(
                "train.seq_len ({t}) needs windows of {} tokens, but the {split} split of {} has {}: use a shorter --seq-len or more data",
                t + 1, data_name(cfg), toks.len()
            ));
        }
    }
    let vocab = ds.tokenizer.vocab_size();
    if cfg.model.vocab_size != 0 && cfg.model.vocab_size < vocab {
        return user(format!("model.vocab_size ({}) is smaller than the {} tokenizer's vocabulary ({vocab})", cfg.model.vocab_size, ds.tokenizer.kind()));
    }
    let lv = cfg.model.loss_vocab;
    if lv != 0 && (lv < vocab || (cfg.model.vocab_size != 0 && lv > cfg.model.vocab_size)) {
        return user(format!("model.loss_vocab ({lv}) must lie between the tokenizer's vocabulary ({vocab}) and model.vocab_size ({})", cfg.model.vocab_size));
    }
    Ok(())
}

/// Draws the sequence start offsets of one global batch.
pub(super) fn sample_offsets(rng: &mut Rng, n_tokens: usize, t: usize, count: usize) -> Vec<usize> {
    (0..count).map(|_| rng.below((n_tokens - t) as u64) as usize).collect()
}

pub(super) fn fill_windows(toks: &Tokens, offsets: &[usize], t: usize, x: &mut [u32], y: &mut [i32]) {
    let mut buf = vec![0u32; t + 1];
    for (i, &o) in offsets.iter().enumerate() {
        toks.copy_to(o, &mut buf);
        x[i * t..(i + 1) * t].copy_from_slice(&buf[..t]);
        for j in 0..t {
            y[i * t + j] = buf[j + 1] as i32;
        }
    }
}
