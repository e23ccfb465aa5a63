//! The sampling flags `tessera chat` and `tessera bench chat` share: each overrides the model's
//! default (its generation_config.json, greedy when it has none).

use clap::Args;
use tessera_core::Result;
use tessera_runtime::decode::SamplingParams;

#[derive(Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// 0 for greedy decoding.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to this (1 keeps
    /// every token).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep only the this many most likely tokens; 0 keeps every token.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Drop tokens less likely than this fraction of the most likely one (0 keeps every token).
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Make tokens already in the conversation less likely by this factor (1 for none).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// Seed of the sampler: the same seed gives the same reply (greedy decoding uses none).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    /// `defaults` with the flags given, checked.
    pub fn params(&self, defaults: SamplingParams) -> Result<SamplingParams> {
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            seed: self.seed,
        };
        sampling.check()?;
        Ok(sampling)
    }
}
