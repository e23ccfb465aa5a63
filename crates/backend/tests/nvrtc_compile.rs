//! Every CUDA kernel compiles with NVRTC for Hopper (sm_90a) — no GPU needed.
//!
//! Needs libnvrtc (CUDA 13): `tools/test` installs the `nvidia-cuda-nvrtc` wheel and puts it on
//! `LD_LIBRARY_PATH`. Without it this test fails, naming what is missing: a kernel that does not
//! compile must never pass CI unnoticed.
#![cfg(feature = "cuda")]

use tessera_backend::cuda::{kernels, nvrtc};

#[test]
fn every_kernel_compiles_for_sm90a_without_spills() {
    if let Err(e) = nvrtc::check_library() {
        panic!("{e}\n(run ./tools/test, which installs the nvidia-cuda-nvrtc wheel for this test)");
    }
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
    for src in nvrtc::SOURCES {
        let out = nvrtc::compile(src, "sm_90a", true).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            out.cubin.starts_with(b"\x7fELF"),
            "{}: not an ELF cubin",
            src.name
        );
        for name in kernels::names(src.name) {
            let needle = name.as_bytes();
            assert!(
                out.cubin.windows(needle.len()).any(|w| w == needle),
                "{}: kernel {name} is not in the cubin",
                src.name
            );
        }
        // ptxas -v reports per function: "Function properties for NAME ... N bytes spill stores".
        let mut current = String::new();
        for line in out.log.lines() {
            if let Some(rest) = line.split("Function properties for ").nth(1) {
                current = rest.trim().to_string();
            }
            if line.contains("spill stores") && !line.contains(" 0 bytes spill stores") {
                panic!("{}: {current} spills registers: {line}", src.name);
            }
            // ptxas falls back to serialising wgmma (waiting after every instruction) when it
            // cannot keep the accumulators in place; that must never ship silently.
            if line.contains("wgmma") && line.contains("serialized") {
                panic!("{}: {current}: {line}", src.name);
            }
            if line.contains("registers") {
                eprintln!("{}: {current}: {}", src.name, line.trim());
            }
        }
    }
}
