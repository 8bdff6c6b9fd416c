//! The GPT-2 model config. Field names are the `model.*` config keys.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    /// Maximum context length (rows of the position embedding).
    pub block_size: usize,
    /// Rows of the token embedding. May exceed the tokenizer's vocabulary (GPT-2: 50304 = 50257
    /// padded up to a multiple of 64 for matmul-friendly shapes); the padded rows are never
    /// predicted.
    pub vocab_size: usize,
    /// Biases in Linear layers and LayerNorms (GPT-2: true; nanoGPT's shakespeare-char: false).
    pub bias: bool,
    /// Dropout probability on embeddings, attention probabilities and residual branches.
    pub dropout: f32,
    /// Output head shares the token embedding matrix (GPT-2: true).
    pub tied_embeddings: bool,
}

impl GptConfig {
    /// GPT-2 small (124M), Radford et al. 2019, with the vocabulary padded to 50304.
    pub fn gpt2_124m() -> GptConfig {
        GptConfig { n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab_size: 50304, bias: true, dropout: 0.0, tied_embeddings: true }
    }

    /// Checks every size; the error names the `model.*` key at fault.
    pub fn validate(&self) -> Result<(), String> {
        for (key, v) in [("n_layer", self.n_layer), ("n_head", self.n_head), ("n_embd", self.n_embd), ("block_size", self.block_size), ("vocab_size", self.vocab_size)] {
            if v == 0 {
                return Err(format!("model.{key} must be positive, got 0"));
            }
        }
        if self.n_embd % self.n_head != 0 {
            return Err(format!("model.n_embd ({}) must be divisible by model.n_head ({})", self.n_embd, self.n_head));
        }
        if !(0.0..1.0).contains(&self.dropout) || self.dropout.is_nan() {
            return Err(format!("model.dropout must be in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }

    pub fn head_size(&self) -> usize {
        self.n_embd / self.n_head
    }
}
