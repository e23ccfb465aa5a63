//! FlowMatch Euler sampling as the Z-Image pipeline drives it (diffusers 0.42.1
//! `pipeline_z_image.py` + `scheduling_flow_match_euler_discrete.py`, static shift).
//!
//! `N` steps take `s = linspace(1, 1/N, N)`, shift them to `σ = shift·s / (1 + (shift − 1)·s)`
//! and append `σ_N = 0`; step `i` runs the transformer at model time
//! `t_i = (1000 − 1000·σ_i) / 1000` and moves `x ← x + (σ_{i+1} − σ_i)·(−v)`. Turbo uses shift 3
//! and 8 steps; the base model shift 6, ~50 steps and CFG `pred = pos + g·(pos − neg)`.
//!
//! Every value is computed in `f32` in the reference's order, so the schedule is bit-identical to
//! diffusers' (the fixture test checks it). Version note: diffusers 0.36 ran `N + 1` forwards over
//! `linspace(1, 0, N + 1)`, the last one wasted at σ = 0 (the HF README's "9 steps"); 0.42 and
//! this module take `N` effective steps.

use tessera_core::{Error, Result};

use super::config::SchedulerConfig;

/// The most steps accepted: past the scheduler's 1000 training timesteps the σ values stop being
/// distinct timesteps, and more would only burn time.
pub const MAX_STEPS: usize = 1000;

/// One generation's σ schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// `σ_0 … σ_N`, ending with 0.
    pub sigmas: Vec<f32>,
    /// `σ_i · 1000` (`scheduler.timesteps`).
    pub timesteps: Vec<f32>,
    /// The transformer's time input per step, `(1000 − timestep) / 1000`.
    pub t_model: Vec<f32>,
}

impl Schedule {
    pub fn steps(&self) -> usize {
        self.t_model.len()
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchEuler {
    pub config: SchedulerConfig,
}

/// `torch.linspace(1, 1/n, n)` in `f32` exactly as torch's CPU kernel computes it: the first half
/// from the start, the second from the end, each with one fused multiply-add.
fn linspace_to_reciprocal(n: usize) -> Vec<f32> {
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

impl FlowMatchEuler {
    pub fn new(config: SchedulerConfig) -> Self {
        FlowMatchEuler { config }
    }

    /// The schedule for `steps` effective steps (1 ..= [`MAX_STEPS`]).
    pub fn schedule(&self, steps: usize) -> Result<Schedule> {
        if steps == 0 || steps > MAX_STEPS {
            return Err(Error::input(format!(
                "--steps {steps}: choose between 1 and {MAX_STEPS} (Z-Image-Turbo uses 8, the base model 28–50)"
            )));
        }
        // numpy evaluates `shift * s / (1 + (shift - 1) * s)` on an f32 array with the Python
        // scalars cast to f32, one rounding per operation.
        let shift = self.config.shift as f32;
        let shift_m1 = (self.config.shift - 1.0) as f32;
        let train = self.config.num_train_timesteps as f32;
        let mut sigmas: Vec<f32> = linspace_to_reciprocal(steps)
            .into_iter()
            .map(|s| (shift * s) / (1.0 + shift_m1 * s))
            .collect();
        let timesteps: Vec<f32> = sigmas.iter().map(|&s| s * train).collect();
        let t_model = timesteps.iter().map(|&t| (1000.0 - t) / 1000.0).collect();
        sigmas.push(0.0);
        Ok(Schedule {
            sigmas,
            timesteps,
            t_model,
        })
    }
}

/// One Euler step on the latent: `x ← x + (σ_{i+1} − σ_i) · (−v)`.
pub fn euler_step(latent: &mut [f32], v: &[f32], schedule: &Schedule, step: usize) {
    let dt = schedule.sigmas[step + 1] - schedule.sigmas[step];
    for (x, &v) in latent.iter_mut().zip(v) {
        *x += dt * -v;
    }
}

/// Classifier-free guidance as Z-Image's pipeline combines the two predictions:
/// `pred = pos + g · (pos − neg)` (not `neg + g·(pos − neg)`), written into `pos`.
pub fn guide(pos: &mut [f32], neg: &[f32], guidance: f32) {
    for (p, &n) in pos.iter_mut().zip(neg) {
        *p += guidance * (*p - n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turbo_schedule_matches_the_published_values() {
        let s = FlowMatchEuler::new(SchedulerConfig {
            num_train_timesteps: 1000,
            shift: 3.0,
        })
        .schedule(8)
        .unwrap();
        let want = [
            1.0,
            0.954_545_45,
            0.9,
            0.833_333_3,
            0.75,
            0.642_857_13,
            0.5,
            0.3,
            0.0,
        ];
        for (g, w) in s.sigmas.iter().zip(want) {
            assert!((g - w).abs() < 1e-7, "{:?}", s.sigmas);
        }
        assert_eq!(s.t_model[0], 0.0);
    }

    #[test]
    fn absurd_step_counts_are_refused() {
        let f = FlowMatchEuler::new(SchedulerConfig {
            num_train_timesteps: 1000,
            shift: 3.0,
        });
        for n in [0, MAX_STEPS + 1] {
            let e = f.schedule(n).unwrap_err().to_string();
            assert!(
                e.contains("--steps") && e.contains("between 1 and 1000"),
                "{e}"
            );
        }
    }
}
