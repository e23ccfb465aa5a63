//! FlowMatch Euler sampling as the Qwen-Image-2.1 pipeline drives it (diffusers 0.42.1
//! `QwenImage21Pipeline.__call__` step 4 + `scheduling_flow_match_euler_discrete.py`), spec A8.
//!
//! - The base list is the model's `sample_sigmas` (`model_index.json`, when not null, read by
//!   [`super::config::parse_model_index`]; the step count is then ignored, as the pipeline
//!   ignores it) or `np.linspace(1.0, 1/N, N)` in `f64`, cast to `f32` by `set_timesteps`.
//! - `μ = calculate_shift(target image tokens)`, in `f64`: linear from `base_shift` at
//!   `base_image_seq_len` tokens to `max_shift` at `max_image_seq_len` (0.5 at 256, 0.9 at 8192
//!   for the release; extrapolated beyond). Condition-image and text tokens do not count.
//! - The scheduler shifts by `μ` (`time_shift_type` exponential: `σ = e^μ / (e^μ + 1/s − 1)`),
//!   stretches the list to end at `shift_terminal` (0.02), sets `timesteps = σ · 1000` and
//!   appends σ = 0 ([`crate::flow_match`], shared with Z-Image).
//! - The transformer receives `t = timestep / 1000` (`f32`); a step is `x ← x + (σ_{i+1} − σ_i)·v`
//!   on the model output as it is ([`euler_step`]).
//!
//! The fixture test checks the σ lists, timesteps and transformer times bit for bit against the
//! pipeline's own code path. Where the reference and the spec differ: the reference builds the
//! linspace in `f64` (not `f32`) and only then casts; and one step with `shift_terminal` set gives
//! σ₀ = NaN in the reference (the stretch divides `1 − σ₀ = 0` by 0) — refused here with the
//! reason. The spec's `sample_sigmas` turbo list [1, 0.9375, …, 0.25] is shifted and stretched
//! like any other (it ends at 0.02, not 0.25).

use std::path::Path;

use tessera_core::{Error, Result};

use crate::flow_match::{FlowMatchConfig, numpy_linspace_to_reciprocal, schedule_from};
pub use crate::flow_match::{MAX_STEPS, Schedule, euler_step};

/// `scheduler/scheduler_config.json`, with what the pipeline reads for `μ` checked present.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    pub flow: FlowMatchConfig,
    /// `base_shift`, `max_shift` (the μ range; the pipeline's defaults 0.5 and 1.15 when the keys
    /// are absent).
    pub base_shift: f64,
    pub max_shift: f64,
}

impl SchedulerConfig {
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let flow = FlowMatchConfig::parse(path, json)?;
        let need = |v: Option<f64>, field: &str| {
            v.ok_or_else(|| {
                Error::config(
                    path,
                    field,
                    "is null; the Qwen-Image pipeline computes the shift μ from it",
                )
            })
        };
        let base_shift = need(flow.base_shift, "base_shift")?;
        let max_shift = need(flow.max_shift, "max_shift")?;
        if flow.base_image_seq_len == flow.max_image_seq_len {
            return Err(Error::config(
                path,
                "max_image_seq_len",
                format!(
                    "equals base_image_seq_len ({}): the shift μ would divide by zero",
                    flow.base_image_seq_len
                ),
            ));
        }
        Ok(SchedulerConfig {
            flow,
            base_shift,
            max_shift,
        })
    }

    /// The pipeline's `calculate_shift(image_tokens, …)`, in `f64` in its order.
    pub fn mu(&self, image_tokens: usize) -> f64 {
        let f = &self.flow;
        let m = (self.max_shift - self.base_shift)
            / (f.max_image_seq_len as f64 - f.base_image_seq_len as f64);
        let b = self.base_shift - m * f.base_image_seq_len as f64;
        image_tokens as f64 * m + b
    }
}

/// An explicit σ list must have 1 ..= [`MAX_STEPS`] values in (0, 1] (stricter than the
/// reference, which computes garbage from others).
fn check_sigmas(sigmas: &[f64]) -> Result<()> {
    if sigmas.is_empty() || sigmas.len() > MAX_STEPS {
        return Err(Error::input(format!(
            "{} σ values: give between 1 and {MAX_STEPS}",
            sigmas.len()
        )));
    }
    if let Some((i, s)) = sigmas
        .iter()
        .enumerate()
        .find(|(_, s)| !(**s > 0.0 && **s <= 1.0))
    {
        return Err(Error::input(format!(
            "σ[{i}] = {s}: every σ must be in (0, 1]"
        )));
    }
    Ok(())
}

/// The schedule `QwenImage21Pipeline.__call__` makes for an image of `image_tokens` target
/// latent tokens (`h/16 · w/16`): from `sample_sigmas` when given (the model's
/// `model_index.json` list or the call's `sigmas`; `steps` is then ignored, as in the
/// reference), else from `steps` evenly spaced values.
pub fn schedule(
    cfg: &SchedulerConfig,
    steps: usize,
    image_tokens: usize,
    sample_sigmas: Option<&[f64]>,
) -> Result<Schedule> {
    let base: Vec<f32> = match sample_sigmas {
        Some(s) => {
            check_sigmas(s)?;
            s.iter().map(|&v| v as f32).collect()
        }
        None => {
            if steps == 0 || steps > MAX_STEPS {
                return Err(Error::input(format!(
                    "--steps {steps}: choose between 1 and {MAX_STEPS} (Qwen-Image-2.1 uses 40)"
                )));
            }
            numpy_linspace_to_reciprocal(steps)
        }
    };
    let f = &cfg.flow;
    schedule_from(
        &base,
        f.shift_for(cfg.mu(image_tokens)),
        f.shift_terminal,
        f.num_train_timesteps,
        |t| t / 1000.0,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const RELEASED: &str = r#"{"_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": false,
        "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
        "shift_terminal": 0.02, "stochastic_sampling": false, "time_shift_type": "exponential",
        "use_beta_sigmas": false, "use_dynamic_shifting": true, "use_exponential_sigmas": false,
        "use_karras_sigmas": false}"#;

    fn released() -> SchedulerConfig {
        SchedulerConfig::parse(Path::new("scheduler/scheduler_config.json"), RELEASED).unwrap()
    }

    #[test]
    fn mu_spans_the_configured_range() {
        let c = released();
        assert_eq!(c.mu(256), 0.5);
        assert!((c.mu(8192) - 0.9).abs() < 1e-15);
        assert!((c.mu(4096) - (0.5 + 0.4 * 3840.0 / 7936.0)).abs() < 1e-15);
    }

    #[test]
    fn schedules_end_at_the_terminal_then_zero() {
        let s = schedule(&released(), 40, 4096, None).unwrap();
        assert_eq!((s.steps(), s.sigmas.len()), (40, 41));
        assert_eq!(s.sigmas[0], 1.0);
        assert!((s.sigmas[39] - 0.02).abs() < 1e-6, "{:?}", s.sigmas);
        assert_eq!(s.sigmas[40], 0.0);
        assert!(s.sigmas.windows(2).all(|w| w[0] > w[1]));
        assert_eq!(s.t_model[0], 1.0);
    }

    #[test]
    fn sample_sigmas_decide_the_step_count() {
        let turbo = [1.0, 0.9375, 0.875, 0.75, 0.5, 0.25];
        let s = schedule(&released(), 40, 1024, Some(&turbo)).unwrap();
        assert_eq!(s.steps(), 6);
        for bad in [&[][..], &[1.0, 0.0][..], &[1.5][..], &[f64::NAN][..]] {
            let e = schedule(&released(), 40, 1024, Some(bad))
                .unwrap_err()
                .to_string();
            assert!(e.contains("σ"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn bad_step_counts_and_configs_are_refused() {
        let c = released();
        for n in [0, MAX_STEPS + 1] {
            let e = schedule(&c, n, 4096, None).unwrap_err().to_string();
            assert!(e.contains("--steps"), "{e}");
        }
        let e = schedule(&c, 1, 4096, None).unwrap_err().to_string();
        assert!(e.contains("shift_terminal"), "{e}");
        let p = Path::new("scheduler/scheduler_config.json");
        let e = SchedulerConfig::parse(p, &RELEASED.replace("0.9,", "null,"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("max_shift") && e.contains("scheduler_config.json"),
            "{e}"
        );
        let e = SchedulerConfig::parse(p, &RELEASED.replace("8192", "256"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_image_seq_len"), "{e}");
    }
}
