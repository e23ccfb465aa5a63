//! Choosing tokens: the samplers every chat model shares (greedy, temperature, top-k, top-p,
//! min-p, repetition penalty), why a reply ended, and what a caller says after each token. The
//! step loop that uses them is the chat scheduler ([`crate::scheduler`]).

use tessera_core::{Error, Result};
use tessera_models::chat_family::nan_logit;

/// How the next token is chosen from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the most likely token); otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already in the sequence by
    /// this (1: off), as transformers' `RepetitionPenaltyLogitsProcessor` does.
    pub repetition_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Refuse values that have no meaning, naming the parameter.
    pub fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f32, range: &str| {
            Err(Error::input(format!("{what} {v} is outside {range}")))
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "[0, ∞)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "(0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "[0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad("repetition_penalty", self.repetition_penalty, "(0, ∞)");
        }
        Ok(())
    }
}

/// Picks tokens from logits with [`SamplingParams`], from its own seeded generator (the same
/// seed gives the same tokens on every machine).
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.check()?;
        Ok(Sampler {
            params,
            state: params.seed,
        })
    }

    /// A uniform draw in [0, 1) (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Whether the next token is the first of the largest logits, whatever the history
    /// (greedy without a repetition penalty): what [`chat_family::greedy`] and a device's
    /// `argmax_rows` pick, and no draw is made.
    ///
    /// [`chat_family::greedy`]: tessera_models::chat_family::greedy
    pub fn argmax_only(&self) -> bool {
        self.params.temperature == 0.0 && self.params.repetition_penalty == 1.0
    }

    /// The next token of a sequence whose tokens so far are `history`.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::backend("sampling", "no logits"));
        }
        if logits.iter().any(|v| v.is_nan()) {
            return Err(nan_logit(logits));
        }
        let p = self.params;
        let mut z: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
        if p.repetition_penalty != 1.0 {
            let r = p.repetition_penalty as f64;
            for &t in history {
                if let Some(v) = z.get_mut(t as usize) {
                    *v = if *v > 0.0 { *v / r } else { *v * r };
                }
            }
        }
        if p.temperature == 0.0 {
            // Greedy: the first of the largest.
            let best =
                z.iter().enumerate().fold(
                    (0, f64::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                );
            return Ok(best.0 as u32);
        }
        // Softmax at the temperature over the candidates, most likely first.
        let t = p.temperature as f64;
        let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut cand: Vec<(usize, f64)> = z
            .iter()
            .enumerate()
            .map(|(i, &v)| (i, ((v - max) / t).exp()))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            cand.truncate(p.top_k);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = cand
                .iter()
                .position(|c| {
                    acc += c.1 / total;
                    acc >= p.top_p as f64
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 * p.min_p as f64;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut u = self.uniform() * total;
        for &(i, w) in &cand {
            if u < w {
                return Ok(i as u32);
            }
            u -= w;
        }
        Ok(cand.last().map_or(0, |c| c.0) as u32)
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token was sampled (it is not part of the output).
    Eos,
    /// `max_tokens` were generated, or the context is full.
    Length,
    /// The caller stopped it (a stop string, a disconnect).
    Stopped,
}

/// What the caller says after each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    Stop,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> Sampler {
        Sampler::new(SamplingParams::default()).unwrap()
    }

    #[test]
    fn filters_keep_only_what_they_allow() {
        // Probabilities ∝ e^logit: token 0 most likely, then 1, 2, 3.
        let logits = [3.0f32, 2.0, 1.0, -5.0];
        let draw = |p: SamplingParams| {
            let mut s = Sampler::new(p).unwrap();
            let mut seen = [0usize; 4];
            for _ in 0..2000 {
                seen[s.sample(&logits, &[]).unwrap() as usize] += 1;
            }
            seen
        };
        let hot = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let all = draw(hot);
        assert!(all.iter().take(3).all(|&n| n > 0), "{all:?}");
        assert!(all[0] > all[1] && all[1] > all[2], "{all:?}");
        let k2 = draw(SamplingParams { top_k: 2, ..hot });
        assert!(k2[2] == 0 && k2[3] == 0 && k2[1] > 0, "{k2:?}");
        // p(0) ≈ 0.66: top_p 0.5 keeps only token 0.
        let p = draw(SamplingParams { top_p: 0.5, ..hot });
        assert_eq!(p[0], 2000, "{p:?}");
        // min_p 0.3 drops token 2 (p₂/p₀ = e⁻² ≈ 0.14) but keeps 1 (e⁻¹ ≈ 0.37).
        let m = draw(SamplingParams { min_p: 0.3, ..hot });
        assert!(m[2] == 0 && m[1] > 0, "{m:?}");
        // A strong repetition penalty on token 0 makes token 1 the greedy choice.
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 10.0,
            ..SamplingParams::default()
        })
        .unwrap();
        assert_eq!(s.sample(&logits, &[0]).unwrap(), 1);
        // The same seed gives the same draws.
        assert_eq!(draw(hot), all);
    }

    #[test]
    fn meaningless_parameters_and_nan_logits_are_refused() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                min_p: 2.0,
                ..SamplingParams::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..SamplingParams::default()
            },
        ] {
            assert!(Sampler::new(p).is_err(), "{p:?}");
        }
        let e = greedy()
            .sample(&[0.0, f32::NAN], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("token 1 is NaN"), "{e}");
    }

    /// The CPU backend's `argmax_rows` and the families' host rule (`chat_family::greedy`) pick
    /// what the greedy sampler picks, and a NaN row fails with its message: rows of few distinct
    /// values (ties everywhere), with ±∞, all −∞, −0 beside 0, and NaN at the start, middle and end.
    #[test]
    fn argmax_rows_and_the_host_rule_agree_with_the_greedy_sampler() {
        use tessera_backend::cpu::CpuBackend;
        use tessera_backend::{Backend, NAN_ROW, Role, View};
        use tessera_models::chat_family::greedy as host_greedy;

        let cols = 37;
        let (inf, nan) = (f32::INFINITY, f32::NAN);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let palette = [-inf, -2.0, -0.0, 0.0, 1.5, 3.0, inf];
        let mut rows: Vec<Vec<f32>> = (0..200)
            .map(|r| {
                (0..cols)
                    .map(|_| {
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        // Fewer distinct values in later rows: more ties, down to −∞ and −2 alone.
                        let n = palette.len() - (r % 6);
                        palette[(state % n as u64) as usize]
                    })
                    .collect()
            })
            .collect();
        rows.push(vec![-inf; cols]);
        for at in [0, cols / 2, cols - 1] {
            let mut r = rows[0].clone();
            r[at] = nan;
            rows.push(r);
        }
        let be = CpuBackend::new();
        let host: Vec<f32> = rows.concat();
        let mut x = be.alloc(host.len(), Role::Stream).unwrap();
        be.write_f32(&mut x, &host).unwrap();
        let mut out = be.alloc(rows.len(), Role::Index).unwrap();
        be.argmax_rows(View::new(&x, rows.len(), cols), &mut out)
            .unwrap();
        let got = be.read_u32(&out, rows.len()).unwrap();
        for (row, got) in rows.iter().zip(got) {
            match greedy().sample(row, &[]) {
                Ok(want) => {
                    assert_eq!(got, want, "{row:?}");
                    assert_eq!(host_greedy(row).unwrap(), want, "{row:?}");
                }
                Err(e) => {
                    assert_eq!(got, NAN_ROW, "{row:?}");
                    let host = host_greedy(row).unwrap_err().to_string();
                    assert_eq!(host, e.to_string());
                    assert!(host.contains("is NaN"), "{host}");
                }
            }
        }
    }
}
