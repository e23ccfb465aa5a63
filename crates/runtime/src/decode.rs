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
        // With min_p and no top_p, tokens below min_p times the most likely can never be kept
        // and no total counts them: they are not weighed at all.
        let floor = (p.min_p > 0.0 && p.top_p >= 1.0).then_some(p.min_p as f64);
        let mut ranked = Ranked::new(weights(&z, p.temperature as f64, floor));
        // The candidates: the top_k most likely, then the smallest prefix reaching top_p of
        // their mass, then those at least min_p times the most likely. Totals over a filtered
        // set are summed most likely first, the whole vocabulary's in token order.
        let all = ranked.len();
        let top_k = p.top_k > 0 && p.top_k < all;
        let filtered = top_k || p.top_p < 1.0 || p.min_p > 0.0;
        if top_k {
            ranked.truncate(p.top_k);
        }
        let n = ranked.len();
        let mut keep = n;
        if p.top_p < 1.0 {
            let total = if n < all {
                ranked.prefix_total(n)
            } else {
                ranked.index_order_total
            };
            let mut acc = 0.0;
            keep = (0..n)
                .position(|i| {
                    acc += ranked.weight(i) / total;
                    acc >= p.top_p as f64
                })
                .map_or(n, |i| i + 1);
        }
        if p.min_p > 0.0 {
            let floor = ranked.weight(0) * p.min_p as f64;
            keep = (0..keep)
                .position(|i| ranked.weight(i) < floor)
                .unwrap_or(keep);
        }
        let total = if filtered {
            ranked.prefix_total(keep)
        } else {
            ranked.index_order_total
        };
        let mut u = self.uniform() * total;
        for i in 0..keep {
            let w = ranked.weight(i);
            if u < w {
                return Ok(ranked.token(i));
            }
            u -= w;
        }
        Ok(ranked.token(keep.saturating_sub(1)))
    }
}

/// The tokens `(token, weight)` that may be drawn, each weighing `e^((z − max) / t)` (the
/// softmax at temperature `t` before its division by the sum). Tokens of weight 0 (`exp`
/// underflows below −745) are left out: they add nothing to any total, and the draw's fallback
/// (where rounding leaves `u` past the last weight) must not land on one (a −∞ logit: a token the
/// model rules out). With `floor`, only those whose weight may reach `floor` (the most likely
/// weighs 1): a bound on `z` decides, with a margin so that rounding in `exp` never drops one the
/// exact test would keep. Where the largest logit is +∞ the tokens holding it share all the mass;
/// where every logit is −∞ every token weighs the same (either would otherwise give NaN weights).
fn weights(z: &[f64], t: f64, floor: Option<f64>) -> Vec<(u32, f64)> {
    let max = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let tokens = (0u32..).zip(z.iter().copied());
    if max == f64::INFINITY {
        return tokens
            .filter(|&(_, v)| v == max)
            .map(|(i, _)| (i, 1.0))
            .collect();
    }
    if max == f64::NEG_INFINITY {
        return tokens.map(|(i, _)| (i, 1.0)).collect();
    }
    let underflow = max - t * 746.0;
    let low = floor.map_or(underflow, |f| underflow.max(max + t * (f.ln() - 1e-6)));
    tokens
        .filter(|&(_, v)| v >= low)
        .map(|(i, v)| (i, ((v - max) / t).exp()))
        .filter(|&(_, w)| w > 0.0)
        .collect()
}

/// Candidates `(token, weight)` ranked lazily: the first `sorted` are the most likely in order
/// (weight descending, then token ascending) and every later one ranks below all of them. A
/// draw usually stops within the first few candidates, and sorting a whole 65,536-token
/// vocabulary took ~4.5 ms per token and sequence, several decode steps' worth on a GPU.
struct Ranked {
    c: Vec<(u32, f64)>,
    sorted: usize,
    /// The sum of every candidate's weight in token order (computed before any ranking).
    index_order_total: f64,
}

impl Ranked {
    fn new(c: Vec<(u32, f64)>) -> Ranked {
        let index_order_total = c.iter().map(|c| c.1).sum();
        Ranked {
            c,
            sorted: 0,
            index_order_total,
        }
    }

    fn len(&self) -> usize {
        self.c.len()
    }

    /// Likelier first; ties by token (a total order: tokens are distinct).
    fn rank(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
        b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
    }

    /// Rank at least the first `n` candidates, growing the ranked prefix geometrically so that
    /// a walk through all of them costs about one sort.
    fn ensure(&mut self, n: usize) {
        if n <= self.sorted {
            return;
        }
        let n = n.max(2 * self.sorted).max(64).min(self.c.len());
        let want = n - self.sorted;
        let rest = &mut self.c[self.sorted..];
        if want < rest.len() {
            rest.select_nth_unstable_by(want - 1, Self::rank);
        }
        rest[..want].sort_unstable_by(Self::rank);
        self.sorted = n;
    }

    /// Keep the `n` most likely.
    fn truncate(&mut self, n: usize) {
        self.ensure(n);
        self.c.truncate(n);
    }

    /// The weight of the `i`-th most likely candidate (`i` < `len`).
    fn weight(&mut self, i: usize) -> f64 {
        self.ensure(i + 1);
        self.c[i].1
    }

    fn token(&mut self, i: usize) -> u32 {
        self.ensure(i + 1);
        self.c[i].0
    }

    /// The sum of the `n` most likely weights, most likely first.
    fn prefix_total(&mut self, n: usize) -> f64 {
        self.ensure(n);
        self.c[..n].iter().map(|c| c.1).sum()
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

    /// The rule the lazy ranking and the min_p prefilter must keep, written plainly: weigh every
    /// token, rank them with one full sort, then filter and draw (totals summed as
    /// [`Sampler::sample`] defines them).
    fn sample_by_full_sort(p: SamplingParams, u: f64, logits: &[f32]) -> u32 {
        let z: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
        let mut cand = weights(&z, p.temperature as f64, None);
        let whole: f64 = cand.iter().map(|c| c.1).sum();
        cand.sort_by(Ranked::rank);
        let prefix = |c: &[(u32, f64)], n: usize| c[..n].iter().map(|c| c.1).sum::<f64>();
        let all = cand.len();
        let filtered = (p.top_k > 0 && p.top_k < all) || p.top_p < 1.0 || p.min_p > 0.0;
        if p.top_k > 0 && p.top_k < all {
            cand.truncate(p.top_k);
        }
        let n = cand.len();
        let mut keep = n;
        if p.top_p < 1.0 {
            let total = if n < all { prefix(&cand, n) } else { whole };
            let mut acc = 0.0;
            for (i, c) in cand.iter().enumerate() {
                acc += c.1 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = cand[0].1 * p.min_p as f64;
            keep = cand[..keep].iter().take_while(|c| c.1 >= floor).count();
        }
        let total = if filtered { prefix(&cand, keep) } else { whole };
        let mut u = u * total;
        for c in &cand[..keep] {
            if u < c.1 {
                return c.0;
            }
            u -= c.1;
        }
        cand[keep - 1].0
    }

    /// The lazily ranked draw picks what a full sort picks, for every filter and vocabularies
    /// that are flat (draws deep in the ranking), peaked, full of ties, or hold ±∞.
    #[test]
    fn lazy_ranking_draws_what_a_full_sort_draws() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let vocab = 5000;
        let rows: Vec<Vec<f32>> = (0..8)
            .map(|kind| {
                (0..vocab)
                    .map(|i| {
                        let r = (next() >> 40) as f32 / (1u64 << 24) as f32;
                        match kind {
                            0 => r * 0.01,          // nearly flat: draws walk deep
                            1 => r * 30.0 - 15.0,   // peaked
                            2 => (r * 4.0).floor(), // four values: ties everywhere
                            3 if i == 7 => f32::INFINITY,
                            4 => f32::NEG_INFINITY,
                            5 if i % 3 == 0 => f32::NEG_INFINITY,
                            _ => r * 8.0,
                        }
                    })
                    .collect()
            })
            .collect();
        let mut draws = 0;
        for (temperature, top_k, top_p, min_p) in [
            (1.0, 0, 1.0, 0.0),
            (0.7, 0, 0.9, 0.0),
            (0.1, 0, 1.0, 0.15),
            (1.0, 40, 1.0, 0.0),
            (1.5, 3000, 0.95, 0.05),
            (2.0, 1, 1.0, 0.0),
            (1.0, 0, 0.999, 0.0),
        ] {
            let p = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                seed: next(),
                ..SamplingParams::default()
            };
            for row in &rows {
                let mut s = Sampler::new(p).unwrap();
                let mut twin = Sampler::new(p).unwrap();
                for _ in 0..40 {
                    let want = sample_by_full_sort(p, twin.uniform(), row);
                    assert_eq!(s.sample(row, &[]).unwrap(), want, "{p:?}");
                    draws += 1;
                }
            }
        }
        assert_eq!(draws, 7 * 8 * 40);
    }

    /// What a draw over a 65,536-token vocabulary costs, the lazy ranking beside one full sort,
    /// in one run (random logits over ±10: flat, so draws walk deep; real logits are peakier).
    /// `cargo test --release -p tessera-runtime --lib sampling_cost -- --ignored --nocapture`
    #[test]
    #[ignore = "a timing, not a check"]
    fn sampling_cost_over_a_large_vocabulary() {
        let mut state = 12345u64;
        let logits: Vec<f32> = (0..65536)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
            })
            .collect();
        let time = |f: &mut dyn FnMut()| {
            let mut v: Vec<f64> = (0..30)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            v.sort_by(f64::total_cmp);
            (v[15], v[3], v[26])
        };
        for (what, p) in [
            ("temperature 1", 1.0, 0, 1.0, 0.0, 1.0),
            ("LFM2-VL's defaults", 0.1, 0, 1.0, 0.15, 1.05),
            ("top_p 0.9", 0.7, 0, 0.9, 0.0, 1.0),
            ("top_k 50", 0.7, 50, 1.0, 0.0, 1.0),
        ]
        .map(
            |(w, temperature, top_k, top_p, min_p, repetition_penalty)| {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repetition_penalty,
                    seed: 1,
                };
                (w, p)
            },
        ) {
            let mut s = Sampler::new(p).unwrap();
            let lazy = time(&mut || {
                s.sample(&logits, &[1, 2, 3]).unwrap();
            });
            let full = time(&mut || {
                sample_by_full_sort(p, 0.5, &logits);
            });
            eprintln!(
                "{what:<20} lazy {:.3} ms ({:.3}–{:.3}), full sort {:.3} ms ({:.3}–{:.3})",
                lazy.0, lazy.1, lazy.2, full.0, full.1, full.2
            );
        }
    }

    /// Tokens the model rules out (−∞) or that underflow to weight 0 are never candidates, so no
    /// filter or fallback can draw one; the most likely token always is one.
    #[test]
    fn zero_weight_tokens_are_never_candidates() {
        let mut logits = vec![f32::NEG_INFINITY; 1000];
        logits[10] = 0.0;
        logits[500] = -1.0;
        logits[900] = -2000.0; // e^(−2000) underflows at temperature 1
        let z: Vec<f64> = logits.iter().map(|&v| v as f64).collect();
        let w = weights(&z, 1.0, None);
        assert_eq!(w.iter().map(|c| c.0).collect::<Vec<_>>(), [10, 500]);
        assert!(w.iter().all(|c| c.1 > 0.0));
        // At a high enough temperature the far token counts again.
        assert_eq!(weights(&z, 10.0, None).len(), 3);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 9,
            ..SamplingParams::default()
        })
        .unwrap();
        for _ in 0..500 {
            let t = s.sample(&logits, &[]).unwrap();
            assert!(t == 10 || t == 500, "{t}");
        }
    }

    #[test]
    fn an_infinite_logit_takes_all_the_mass_and_all_minus_infinity_is_uniform() {
        let hot = SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(hot).unwrap();
        let inf = [0.0, f32::INFINITY, 5.0, f32::INFINITY];
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[s.sample(&inf, &[]).unwrap() as usize] += 1;
        }
        assert!(
            seen[0] == 0 && seen[2] == 0 && seen[1] > 100 && seen[3] > 100,
            "{seen:?}"
        );
        let none = [f32::NEG_INFINITY; 4];
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[s.sample(&none, &[]).unwrap() as usize] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
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
