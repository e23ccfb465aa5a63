//! Which fused decode ops the backend takes (`TESSERA_FUSE`): each gives the bits of the ops it
//! replaces in fewer launches, so the switch changes speed alone — for A/B measurement of one
//! fusion against the same binary without it.

/// `TESSERA_FUSE` unset or `1`: the default ([`Fusions::DEFAULT`]); `0`: none; else a comma list
/// of the ones to take (`gated`, `kv`, `conv`, `residual`; unknown names are ignored).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Fusions {
    /// A gated MLP's gate|up product gates its columns as it stores them (`gemv_tc_{act}_glu_m*`).
    pub gated: bool,
    /// The q/k/v norm + RoPE writes the new keys and values to the cache.
    pub kv: bool,
    /// A short convolution over one-row segments is one launch (`short_conv_step_*`).
    pub conv: bool,
    /// A product's residual step (and the next norm) runs in the product's last CTA. Off by
    /// default: LFM2-VL-450M decoded 2% slower with it at one and eight streams (run g9c) — the
    /// last CTA's serial tail costs more than the launch it saves once launches overlap.
    pub residual: bool,
}

impl Fusions {
    /// What the backend takes unless told otherwise: each of these measured faster (run g9).
    pub const DEFAULT: Fusions = Fusions {
        gated: true,
        kv: true,
        conv: true,
        residual: false,
    };

    pub fn from_env() -> Self {
        Self::parse(std::env::var("TESSERA_FUSE").ok().as_deref())
    }

    /// What `tessera info` says of them.
    pub fn describe(&self) -> String {
        let names = [
            (self.gated, "gate|up with its gating"),
            (self.kv, "q/k/v norm with the cache write"),
            (self.conv, "one-launch convolution"),
            (self.residual, "products ending in their residual step"),
        ];
        let on: Vec<&str> = names
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect();
        if on.is_empty() {
            "no fused decode ops (TESSERA_FUSE)".to_string()
        } else {
            format!("fused: {} (TESSERA_FUSE)", on.join(", "))
        }
    }

    fn parse(v: Option<&str>) -> Self {
        match v.map(str::trim) {
            None | Some("") | Some("1") => Self::DEFAULT,
            Some(list) => {
                let on = |name: &str| list.split(',').any(|s| s.trim() == name);
                Fusions {
                    gated: on("gated"),
                    kv: on("kv"),
                    conv: on("conv"),
                    residual: on("residual"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reads_all_none_or_a_list() {
        assert_eq!(Fusions::parse(None), Fusions::DEFAULT);
        assert_eq!(Fusions::parse(Some("1")), Fusions::DEFAULT);
        let all = Fusions::parse(Some("gated,kv,conv,residual"));
        assert!(all.gated && all.kv && all.conv && all.residual);
        let none = Fusions::parse(Some("0"));
        assert!(!(none.gated || none.kv || none.conv || none.residual));
        let some = Fusions::parse(Some("kv, conv"));
        assert!(some.kv && some.conv && !some.gated && !some.residual);
        assert_eq!(
            some.describe(),
            "fused: q/k/v norm with the cache write, one-launch convolution (TESSERA_FUSE)"
        );
        assert_eq!(none.describe(), "no fused decode ops (TESSERA_FUSE)");
    }
}
