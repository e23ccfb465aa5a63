//! FlowMatch Euler sampling as diffusers 0.42.1's `FlowMatchEulerDiscreteScheduler` computes it,
//! shared by the families whose pipelines drive it: Z-Image (static shift, [`crate::zimage`]) and
//! Qwen-Image-2.1 (resolution-dependent exponential shift and a terminal stretch,
//! [`crate::qwen_image`]).
//!
//! A pipeline hands `set_timesteps` a base list `s_0 … s_{N−1}` (each family builds its own: the
//! two pipelines use different linspaces); the scheduler then
//!
//! 1. shifts it: statically, `σ = shift·s / (1 + (shift − 1)·s)`, or dynamically by `μ`,
//!    `σ = e^μ / (e^μ + (1/s − 1))` (exponential) or `μ / (μ + (1/s − 1))` (linear);
//! 2. if `shift_terminal` is set, stretches it so that it ends there:
//!    `σ' = 1 − (1 − σ) / ((1 − σ_{N−1}) / (1 − shift_terminal))`;
//! 3. sets `timesteps = σ · num_train_timesteps` and appends `σ_N = 0`.
//!
//! `step` moves `x ← x + (σ_{i+1} − σ_i)·v`. Every value is computed in `f32` in the reference's
//! order with the reference's roundings — numpy evaluates the shift on an `f32` array with the
//! Python scalars (`shift`, `e^μ` in `f64`, `1 − shift_terminal`) cast to `f32` — so the σ lists
//! are bit-identical to diffusers' (both families' fixture tests check them).
//!
//! Not implemented (refused when a config asks for them): Karras, exponential and beta σ
//! conversions, inverted σ, stochastic sampling, explicit timesteps.

use std::path::Path;

use serde::Deserialize;
use tessera_core::{Error, Result};

/// The most steps accepted: past the scheduler's 1000 training timesteps the σ values stop being
/// distinct timesteps, and more would only burn time.
pub const MAX_STEPS: usize = 1000;

/// One generation's σ schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// `σ_0 … σ_N`, ending with 0.
    pub sigmas: Vec<f32>,
    /// `σ_i · num_train_timesteps` (`scheduler.timesteps`).
    pub timesteps: Vec<f32>,
    /// The transformer's time input per step, as the family's pipeline derives it from
    /// `timesteps`.
    pub t_model: Vec<f32>,
}

impl Schedule {
    pub fn steps(&self) -> usize {
        self.t_model.len()
    }
}

/// The dynamic shift's form (`time_shift_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeShift {
    /// `e^μ / (e^μ + (1/s − 1))`.
    Exponential,
    /// `μ / (μ + (1/s − 1))`.
    Linear,
}

/// How the base σ list is shifted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Shift {
    /// `shift·s / (1 + (shift − 1)·s)`.
    Static(f64),
    /// By `μ`, which the pipeline computes (from the image size for Qwen-Image).
    Dynamic { mu: f64, kind: TimeShift },
}

/// `scheduler/scheduler_config.json` (`FlowMatchEulerDiscreteScheduler`): every field that
/// changes the schedule, with diffusers' defaults for the keys a file leaves out.
#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchConfig {
    pub num_train_timesteps: usize,
    /// The static shift (used when `use_dynamic_shifting` is off).
    pub shift: f64,
    pub use_dynamic_shifting: bool,
    /// The dynamic shift's `μ` range over image sizes (read by the pipeline, not the scheduler):
    /// `base_shift` at `base_image_seq_len` tokens, `max_shift` at `max_image_seq_len`.
    pub base_shift: Option<f64>,
    pub max_shift: Option<f64>,
    pub base_image_seq_len: usize,
    pub max_image_seq_len: usize,
    /// Where the stretched schedule ends (`None`, or 0 in the file: no stretch).
    pub shift_terminal: Option<f64>,
    pub time_shift: TimeShift,
}

fn default_train() -> usize {
    1000
}
fn default_shift() -> f64 {
    1.0
}
fn default_base_shift() -> Option<f64> {
    Some(0.5)
}
fn default_max_shift() -> Option<f64> {
    Some(1.15)
}
fn default_base_len() -> usize {
    256
}
fn default_max_len() -> usize {
    4096
}
fn default_time_shift() -> String {
    "exponential".into()
}

#[derive(Deserialize)]
struct RawScheduler {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    #[serde(default = "default_train")]
    num_train_timesteps: usize,
    #[serde(default = "default_shift")]
    shift: f64,
    #[serde(default)]
    use_dynamic_shifting: bool,
    #[serde(default = "default_base_shift")]
    base_shift: Option<f64>,
    #[serde(default = "default_max_shift")]
    max_shift: Option<f64>,
    #[serde(default = "default_base_len")]
    base_image_seq_len: usize,
    #[serde(default = "default_max_len")]
    max_image_seq_len: usize,
    #[serde(default)]
    invert_sigmas: bool,
    #[serde(default)]
    shift_terminal: Option<f64>,
    #[serde(default)]
    use_karras_sigmas: bool,
    #[serde(default)]
    use_exponential_sigmas: bool,
    #[serde(default)]
    use_beta_sigmas: bool,
    #[serde(default = "default_time_shift")]
    time_shift_type: String,
    #[serde(default)]
    stochastic_sampling: bool,
}

impl FlowMatchConfig {
    /// Parse `json` (read from `path`, named in errors), refusing what is not implemented.
    pub fn parse(path: &Path, json: &str) -> Result<Self> {
        let raw: RawScheduler = tessera_core::config::parse_json(path, json)?;
        let err = |field: &str, msg: String| Error::config(path, field, msg);
        if let Some(c) = raw.class_name.as_deref()
            && c != "FlowMatchEulerDiscreteScheduler"
        {
            return Err(err(
                "_class_name",
                format!("{c:?} is not supported (only FlowMatchEulerDiscreteScheduler)"),
            ));
        }
        for (on, field) in [
            (raw.invert_sigmas, "invert_sigmas"),
            (raw.use_karras_sigmas, "use_karras_sigmas"),
            (raw.use_exponential_sigmas, "use_exponential_sigmas"),
            (raw.use_beta_sigmas, "use_beta_sigmas"),
            (raw.stochastic_sampling, "stochastic_sampling"),
        ] {
            if on {
                return Err(err(
                    field,
                    "is set; only the plain FlowMatch Euler schedule is supported".into(),
                ));
            }
        }
        if raw.num_train_timesteps == 0 {
            return Err(err("num_train_timesteps", "must be at least 1".into()));
        }
        if !(raw.shift.is_finite() && raw.shift > 0.0) {
            return Err(err(
                "shift",
                format!("{} must be a positive number", raw.shift),
            ));
        }
        let time_shift = match raw.time_shift_type.as_str() {
            "exponential" => TimeShift::Exponential,
            "linear" => TimeShift::Linear,
            t => {
                return Err(err(
                    "time_shift_type",
                    format!("{t:?}: expected \"exponential\" or \"linear\""),
                ));
            }
        };
        // diffusers stretches when `shift_terminal` is truthy: 0 means no stretch.
        let shift_terminal = match raw.shift_terminal {
            Some(0.0) => None,
            Some(t) if !(0.0..1.0).contains(&t) => {
                return Err(err(
                    "shift_terminal",
                    format!("{t}: must be in [0, 1) (the schedule's last σ)"),
                ));
            }
            t => t,
        };
        for (v, field) in [(raw.base_shift, "base_shift"), (raw.max_shift, "max_shift")] {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(err(field, "must be a finite number".into()));
            }
        }
        Ok(FlowMatchConfig {
            num_train_timesteps: raw.num_train_timesteps,
            shift: raw.shift,
            use_dynamic_shifting: raw.use_dynamic_shifting,
            base_shift: raw.base_shift,
            max_shift: raw.max_shift,
            base_image_seq_len: raw.base_image_seq_len,
            max_image_seq_len: raw.max_image_seq_len,
            shift_terminal,
            time_shift,
        })
    }

    /// The shift `set_timesteps(…, mu)` applies: the static one unless dynamic shifting is on.
    pub fn shift_for(&self, mu: f64) -> Shift {
        if self.use_dynamic_shifting {
            Shift::Dynamic {
                mu,
                kind: self.time_shift,
            }
        } else {
            Shift::Static(self.shift)
        }
    }
}

/// `set_timesteps(sigmas=base, …)`: shift `base` (already `f32`, as the scheduler converts it),
/// stretch it to `terminal` if given, derive `timesteps = σ · train`, append `σ_N = 0`, and the
/// transformer's time input `t_model(timestep)`. A schedule the reference would fill with NaN
/// (one step at σ = 1 with a terminal stretch: `0 / 0`) is an error naming the cause.
pub fn schedule_from(
    base: &[f32],
    shift: Shift,
    terminal: Option<f64>,
    train: usize,
    t_model: impl Fn(f32) -> f32,
) -> Result<Schedule> {
    let mut sigmas: Vec<f32> = match shift {
        Shift::Static(shift) => {
            let (k, k_m1) = (shift as f32, (shift - 1.0) as f32);
            base.iter().map(|&s| (k * s) / (1.0 + k_m1 * s)).collect()
        }
        Shift::Dynamic { mu, kind } => {
            let m = match kind {
                TimeShift::Exponential => mu.exp() as f32,
                TimeShift::Linear => mu as f32,
            };
            // `(1/s − 1) ** 1.0` is exact.
            base.iter().map(|&s| m / (m + (1.0 / s - 1.0))).collect()
        }
    };
    if let (Some(t), Some(&last)) = (terminal, sigmas.last()) {
        let scale = (1.0 - last) / (1.0 - t) as f32;
        for s in &mut sigmas {
            *s = 1.0 - (1.0 - *s) / scale;
        }
    }
    if let Some(i) = sigmas.iter().position(|s| !s.is_finite()) {
        let why = if terminal.is_some() && sigmas.len() == 1 {
            ": one step ending at σ = 1 cannot be stretched to shift_terminal (the reference \
             divides 0 by 0); use at least 2 steps"
        } else {
            ""
        };
        return Err(Error::input(format!(
            "σ_{i} of a {}-step schedule is not a number{why}",
            sigmas.len()
        )));
    }
    let train = train as f32;
    let timesteps: Vec<f32> = sigmas.iter().map(|&s| s * train).collect();
    let t_model = timesteps.iter().map(|&t| t_model(t)).collect();
    sigmas.push(0.0);
    Ok(Schedule {
        sigmas,
        timesteps,
        t_model,
    })
}

/// One Euler step of `FlowMatchEulerDiscreteScheduler.step` on the latent, in `f32`:
/// `x ← x + (σ_{i+1} − σ_i) · v`.
pub fn euler_step(latent: &mut [f32], v: &[f32], schedule: &Schedule, step: usize) {
    let dt = schedule.sigmas[step + 1] - schedule.sigmas[step];
    for (x, &v) in latent.iter_mut().zip(v) {
        *x += dt * v;
    }
}

/// `torch.linspace(1, 1/n, n)` in `f32` exactly as torch's CPU kernel computes it: the first half
/// from the start, the second from the end, each with one fused multiply-add (Z-Image's
/// pipeline).
pub fn torch_linspace_to_reciprocal(n: usize) -> Vec<f32> {
    let (start, end) = (1.0f32, (1.0f64 / n as f64) as f32);
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    (0..n)
        .map(|i| {
            if i < n / 2 {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((n - 1 - i) as f32, end)
            }
        })
        .collect()
}

/// `np.linspace(1.0, 1/n, n)` in `f64` exactly as numpy 2 computes it — `i · step + start`,
/// two roundings, the last element set to the end — then cast to `f32` as `set_timesteps` does
/// (Qwen-Image's pipeline).
pub fn numpy_linspace_to_reciprocal(n: usize) -> Vec<f32> {
    let (start, stop) = (1.0f64, 1.0 / n as f64);
    if n <= 1 {
        return vec![start as f32; n];
    }
    let step = (stop - start) / (n - 1) as f64;
    (0..n)
        .map(|i| {
            if i == n - 1 {
                stop as f32
            } else {
                (i as f64 * step + start) as f32
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspaces_start_at_one_and_end_at_the_reciprocal() {
        for n in [1, 2, 3, 8, 40, 1000] {
            for v in [
                torch_linspace_to_reciprocal(n),
                numpy_linspace_to_reciprocal(n),
            ] {
                assert_eq!(v.len(), n);
                assert_eq!(v[0], 1.0);
                assert_eq!(v[n - 1], (1.0 / n as f64) as f32);
                assert!(v.windows(2).all(|w| w[0] > w[1]), "{n}: {v:?}");
            }
        }
    }

    #[test]
    fn one_step_stretched_to_a_terminal_is_refused_with_the_reason() {
        let e = schedule_from(
            &[1.0],
            Shift::Dynamic {
                mu: 0.5,
                kind: TimeShift::Exponential,
            },
            Some(0.02),
            1000,
            |t| t,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("shift_terminal") && e.contains("2 steps"), "{e}");
    }

    #[test]
    fn config_defaults_follow_diffusers_and_unsupported_options_are_named() {
        let p = Path::new("scheduler/scheduler_config.json");
        let c = FlowMatchConfig::parse(p, "{}").unwrap();
        assert_eq!(
            (c.num_train_timesteps, c.shift, c.use_dynamic_shifting),
            (1000, 1.0, false)
        );
        assert_eq!((c.base_shift, c.max_shift), (Some(0.5), Some(1.15)));
        assert_eq!((c.base_image_seq_len, c.max_image_seq_len), (256, 4096));
        assert_eq!(
            (c.shift_terminal, c.time_shift),
            (None, TimeShift::Exponential)
        );
        let zero = FlowMatchConfig::parse(p, r#"{"shift_terminal": 0.0}"#).unwrap();
        assert_eq!(zero.shift_terminal, None);
        for (json, field) in [
            (r#"{"use_beta_sigmas": true}"#, "use_beta_sigmas"),
            (r#"{"time_shift_type": "cosine"}"#, "time_shift_type"),
            (r#"{"shift_terminal": 1.0}"#, "shift_terminal"),
            (
                r#"{"_class_name": "EulerDiscreteScheduler"}"#,
                "_class_name",
            ),
            (r#"{"num_train_timesteps": 0}"#, "num_train_timesteps"),
        ] {
            let e = FlowMatchConfig::parse(p, json).unwrap_err().to_string();
            assert!(
                e.contains(field) && e.contains("scheduler_config.json"),
                "{json}: {e}"
            );
        }
    }
}
