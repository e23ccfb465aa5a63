//! FlowMatch Euler sampling as the Z-Image pipeline drives it (diffusers 0.42.1
//! `pipeline_z_image.py` + `scheduling_flow_match_euler_discrete.py`, static shift).
//!
//! `N` steps take `s = linspace(1, 1/N, N)`, shift them to `σ = shift·s / (1 + (shift − 1)·s)`
//! and append `σ_N = 0`; step `i` runs the transformer at model time
//! `t_i = (1000 − 1000·σ_i) / 1000` and moves `x ← x + (σ_{i+1} − σ_i)·(−v)`. Turbo uses shift 3
//! and 8 steps; the base model shift 6, ~50 steps and CFG `pred = pos + g·(pos − neg)`.
//!
//! Every value is computed in `f32` in the reference's order, so the schedule is bit-identical to
//! diffusers' (the fixture test checks it); the scheduler's arithmetic is shared with
//! Qwen-Image in [`crate::flow_match`]. Version note: diffusers 0.36 ran `N + 1` forwards over
//! `linspace(1, 0, N + 1)`, the last one wasted at σ = 0 (the HF README's "9 steps"); 0.42 and
//! this module take `N` effective steps.

use tessera_core::{Error, Result};

use super::config::SchedulerConfig;
pub use crate::flow_match::{MAX_STEPS, Schedule};
use crate::flow_match::{Shift, schedule_from, torch_linspace_to_reciprocal};

#[derive(Clone, Debug, PartialEq)]
pub struct FlowMatchEuler {
    pub config: SchedulerConfig,
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
        schedule_from(
            &torch_linspace_to_reciprocal(steps),
            Shift::Static(self.config.shift),
            None,
            self.config.num_train_timesteps,
            |t| (1000.0 - t) / 1000.0,
        )
    }
}

/// One Euler step on the latent: `x ← x + (σ_{i+1} − σ_i) · (−v)` (the pipeline negates the
/// transformer's output before the scheduler's step, [`crate::flow_match::euler_step`]).
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
