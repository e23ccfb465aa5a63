//! A checkpoint's `generation_config.json`: the sampling its authors recommend, with
//! transformers' defaults for what it leaves out (greedy unless `do_sample`; when sampling,
//! temperature 1, top-k 50, top-p 1, no min-p, no repetition penalty).

use serde::Deserialize;
use tessera_core::Result;

use crate::ModelFiles;

#[derive(Deserialize, Default)]
struct Raw {
    #[serde(default)]
    do_sample: bool,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repetition_penalty: Option<f32>,
}

/// The recommended sampling; `temperature` 0 means greedy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl SamplingDefaults {
    pub const GREEDY: SamplingDefaults = SamplingDefaults {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
    };

    /// Read `generation_config.json` (greedy when there is none).
    pub fn load(files: &ModelFiles) -> Result<Self> {
        let path = files.path("generation_config.json");
        let raw: Raw = match files.read_optional("generation_config.json")? {
            Some(t) => tessera_core::config::parse_json(&path, &t)?,
            None => Raw::default(),
        };
        Ok(Self::from_raw(&raw))
    }

    fn from_raw(r: &Raw) -> Self {
        let penalty = r.repetition_penalty.unwrap_or(1.0);
        if !r.do_sample {
            return SamplingDefaults {
                repetition_penalty: penalty,
                ..Self::GREEDY
            };
        }
        SamplingDefaults {
            temperature: r.temperature.unwrap_or(1.0),
            top_k: r.top_k.unwrap_or(50),
            top_p: r.top_p.unwrap_or(1.0),
            min_p: r.min_p.unwrap_or(0.0),
            repetition_penalty: penalty,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> SamplingDefaults {
        SamplingDefaults::from_raw(&serde_json::from_str(json).unwrap())
    }

    #[test]
    fn greedy_unless_sampling_and_transformers_defaults_otherwise() {
        assert_eq!(parse(r#"{"bos_token_id": 1}"#), SamplingDefaults::GREEDY);
        // Without do_sample a temperature is ignored, as by transformers; a penalty is not.
        let g = parse(r#"{"temperature": 0.3, "repetition_penalty": 1.05}"#);
        assert_eq!((g.temperature, g.repetition_penalty), (0.0, 1.05));
        let s = parse(r#"{"do_sample": true, "temperature": 0.1, "min_p": 0.15}"#);
        assert_eq!(
            (s.temperature, s.top_k, s.top_p, s.min_p),
            (0.1, 50, 1.0, 0.15)
        );
    }
}
