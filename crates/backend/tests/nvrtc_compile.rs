//! Every CUDA kernel compiles with NVRTC for Hopper (sm_90a), and every kernel table agrees with
//! its source — no GPU needed.
//!
//! Needs libnvrtc (CUDA 13): `tools/test` installs the `nvidia-cuda-nvrtc` wheel and puts it on
//! `LD_LIBRARY_PATH`. Without it these tests fail, naming what is missing: a kernel that does not
//! compile, or a launch whose arguments do not match its kernel, must never pass CI unnoticed.
#![cfg(feature = "cuda")]

use std::collections::BTreeMap;

use tessera_backend::cuda::{self, Param, Signature, nvrtc};

fn require_nvrtc() {
    if let Err(e) = nvrtc::check_library() {
        panic!("{e}\n(run ./tools/test, which installs the nvidia-cuda-nvrtc wheel for this test)");
    }
    let (major, minor) = nvrtc::version().unwrap();
    eprintln!("NVRTC {major}.{minor}");
}

/// The kernel table of `source`, as the backend declares it.
fn table(source: &str) -> Vec<Signature> {
    cuda::kernel_tables()
        .into_iter()
        .find(|(s, _)| *s == source)
        .unwrap_or_else(|| panic!("{source} has no kernel table"))
        .1
}

#[test]
fn every_kernel_compiles_for_sm90a_without_spills() {
    require_nvrtc();
    for src in nvrtc::SOURCES {
        let out = nvrtc::compile(src, "sm_90a", true).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            out.cubin.starts_with(b"\x7fELF"),
            "{}: not an ELF cubin",
            src.name
        );
        for Signature { name, .. } in table(src.name) {
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

/// A kernel parameter as the launch ABI sees it: its size, and whether it is a float.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Abi {
    /// A pointer or `long`: 8 bytes.
    Int8,
    /// `int`: 4 bytes.
    Int4,
    F32,
    /// A tensor map by value: `.param .align 64 .b8 NAME[128]`.
    TensorMap,
}

fn abi(p: Param) -> Abi {
    match p {
        Param::Ptr | Param::I64 => Abi::Int8,
        Param::I32 => Abi::Int4,
        Param::F32 => Abi::F32,
        Param::TensorMap => Abi::TensorMap,
    }
}

/// Every `.entry NAME(.param .TYPE …, …)` of `ptx`, its parameters as their ABI class.
fn entries(ptx: &str) -> BTreeMap<String, Vec<Abi>> {
    let mut out = BTreeMap::new();
    for chunk in ptx.split(".entry ").skip(1) {
        let (name, rest) = chunk
            .split_once('(')
            .unwrap_or_else(|| panic!("no parameter list after .entry in {chunk:.80}"));
        let list = &rest[..rest.find(')').expect("unclosed parameter list")];
        let params = list
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                if p.contains(".align 64") && p.contains(".b8") && p.ends_with("[128]") {
                    return Abi::TensorMap;
                }
                let ty = p
                    .split_whitespace()
                    .find(|t| *t != ".param" && !t.starts_with(".ptr") && !t.starts_with(".align"))
                    .unwrap_or_else(|| panic!("{name}: parameter {p:?}"));
                match ty {
                    ".u64" | ".s64" | ".b64" => Abi::Int8,
                    ".u32" | ".s32" | ".b32" => Abi::Int4,
                    ".f32" => Abi::F32,
                    _ => panic!("{name}: parameter type {ty} in {p:?}"),
                }
            })
            .collect();
        out.insert(name.trim().to_string(), params);
    }
    out
}

/// C++ appended to a source for the check below: the compiler classifies each kernel's C
/// parameters (pointer 0, `long` 1, `int` 2, `float` 3, tensor map 4) and compares them with the table's.
const CLASSIFY: &str = r#"
template <typename T> struct TesseraAbi { static constexpr int v = -1; };
template <typename T> struct TesseraAbi<T*> { static constexpr int v = 0; };
template <> struct TesseraAbi<long> { static constexpr int v = 1; };
template <> struct TesseraAbi<int> { static constexpr int v = 2; };
template <> struct TesseraAbi<float> { static constexpr int v = 3; };
template <> struct TesseraAbi<TmaDesc> { static constexpr int v = 4; };
template <int... V> struct TesseraParams {};
template <typename F> struct TesseraSig;
template <typename... A> struct TesseraSig<void(A...)> { using type = TesseraParams<TesseraAbi<A>::v...>; };
template <typename A, typename B> struct TesseraSame { static constexpr bool v = false; };
template <typename A> struct TesseraSame<A, A> { static constexpr bool v = true; };
"#;

fn c_class(p: Param) -> u8 {
    match p {
        Param::Ptr => 0,
        Param::I64 => 1,
        Param::I32 => 2,
        Param::F32 => 3,
        Param::TensorMap => 4,
    }
}

/// `src` with a `static_assert` per kernel of its table that the kernel's C parameter types are
/// the table's, each naming its kernel when it fails.
fn with_signature_asserts(src: &nvrtc::Source, kernels: &[Signature]) -> nvrtc::Source {
    let mut text = format!("{}\n{CLASSIFY}", src.text);
    for k in kernels {
        let classes: Vec<String> = k.params.iter().map(|&p| c_class(p).to_string()).collect();
        text.push_str(&format!(
            "static_assert(TesseraSame<TesseraSig<decltype({0})>::type, TesseraParams<{1}>>::v, \
             \"{0}: its C parameters differ from its Rust argument struct {2:?}\");\n",
            k.name,
            classes.join(", "),
            k.params
        ));
    }
    nvrtc::Source {
        name: src.name,
        text: Box::leak(text.into_boxed_str()),
        headers: src.headers,
        sm90a_only: src.sm90a_only,
    }
}

/// The ABI check that typed launches rest on, for every kernel of every table: the compiler
/// finds the kernel's C parameter types equal to its Rust argument struct's (pointer, `long`,
/// `int`, `float`, in order), and the PTX NVRTC makes of the source declares exactly those
/// parameters (count; 8-byte integer, 4-byte integer or float each); and every kernel of a source
/// is in its table.
#[test]
fn every_kernel_takes_its_args_struct() {
    require_nvrtc();
    let mut checked = 0;
    for (source, kernels) in cuda::kernel_tables() {
        let src = nvrtc::SOURCES
            .iter()
            .find(|s| s.name == source)
            .unwrap_or_else(|| panic!("no source {source}"));
        let ptx = nvrtc::compile_ptx(&with_signature_asserts(src, &kernels), "compute_90a")
            .unwrap_or_else(|e| panic!("{e}"));
        let found = entries(&ptx);
        for k in &kernels {
            let params = found
                .get(&k.name)
                .unwrap_or_else(|| panic!("{source}: kernel {} is not in the PTX", k.name));
            let declared: Vec<Abi> = k.params.iter().map(|&p| abi(p)).collect();
            assert_eq!(
                &declared, params,
                "{source}: {}: the Rust argument struct {:?} does not match the kernel's PTX parameters",
                k.name, k.params
            );
        }
        for name in found.keys() {
            assert!(
                kernels.iter().any(|k| &k.name == name),
                "{source}: kernel {name} is in no kernel table"
            );
        }
        eprintln!(
            "{source}: {} kernels; C parameter types and PTX parameters match their argument structs",
            kernels.len()
        );
        checked += kernels.len();
    }
    eprintln!("{checked} kernels checked");
}

/// The first instruction of `body` that reads or writes global (or generic) memory, if any:
/// loads, stores, atomics, reductions and asynchronous copies outside the parameter, shared,
/// local and constant spaces. Prefetches are hints and do not count.
fn first_global_access(body: &str) -> Option<(usize, &str)> {
    const OPS: [&str; 6] = ["ld.", "st.", "atom.", "red.", "cp.", "tex."];
    const LOCAL: [&str; 4] = [".param", ".shared", ".local", ".const"];
    body.lines().enumerate().find_map(|(i, line)| {
        let op = line.split_whitespace().find(|t| !t.starts_with('@'))?;
        let memory = OPS.iter().any(|p| op.starts_with(p)) && !LOCAL.iter().any(|s| op.contains(s));
        memory.then_some((i, line.trim()))
    })
}

/// Kernels are launched with programmatic dependent launch on Hopper (`launch_overlapped`), so
/// each may start while the kernel before it still runs: every kernel must wait for it
/// (`griddepcontrol.wait`, from `pdl_enter`) before its first access to global memory, or it
/// would race with it. Checked on each kernel's PTX for `sm_90a`.
#[test]
fn every_kernel_waits_for_its_predecessor_before_touching_memory() {
    require_nvrtc();
    let mut checked = 0;
    for src in nvrtc::SOURCES {
        let ptx = nvrtc::compile_ptx(src, "compute_90a").unwrap_or_else(|e| panic!("{e}"));
        for chunk in ptx.split(".entry ").skip(1) {
            let name = chunk.split('(').next().unwrap_or_default().trim();
            let body = chunk.split_once('{').map_or("", |(_, b)| b);
            let wait = body
                .lines()
                .position(|l| l.trim_start().starts_with("griddepcontrol.wait"))
                .unwrap_or_else(|| {
                    panic!(
                        "{}: {name} never waits for its predecessor (pdl_enter)",
                        src.name
                    )
                });
            if let Some((line, text)) = first_global_access(body) {
                assert!(
                    wait < line,
                    "{}: {name} touches memory before waiting for its predecessor: {text}",
                    src.name
                );
            }
            checked += 1;
        }
    }
    eprintln!("{checked} kernels wait for their predecessor before touching memory");
    assert!(checked > 0, "no kernel found in the PTX");
}

/// The SASS of one function of a cubin (`nvdisasm` from the `nvidia-cuda-nvdisasm` wheel that
/// `tools/test` installs): (address, instruction) pairs, branch targets as addresses.
fn sass(cubin: &[u8], function: &str) -> Vec<(u64, String)> {
    let dir = std::env::temp_dir().join(format!("tessera-sass-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("unit.cubin");
    std::fs::write(&path, cubin).unwrap();
    let out = std::process::Command::new("nvdisasm")
        .arg(&path)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "nvdisasm: {e}\n(run ./tools/test, which installs the nvidia-cuda-nvdisasm wheel)"
            )
        });
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        out.status.success(),
        "nvdisasm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let section = format!(".text.{function}:");
    let body = text
        .split_once(&section)
        .unwrap_or_else(|| panic!("{function} is not in the cubin"))
        .1;
    let body = body.split("\n\t.section").next().unwrap_or(body);
    // Labels (`.L_x_12:`) name the address of the instruction after them.
    let mut labels = BTreeMap::new();
    let mut pending = Vec::new();
    let mut code = Vec::new();
    for line in body.lines() {
        let line = line.trim();
        if let Some(label) = line.strip_suffix(':').filter(|l| l.starts_with(".L")) {
            pending.push(label.to_string());
        } else if let Some(rest) = line.strip_prefix("/*") {
            let Some((addr, ins)) = rest.split_once("*/") else {
                continue;
            };
            let Ok(addr) = u64::from_str_radix(addr, 16) else {
                continue;
            };
            for l in pending.drain(..) {
                labels.insert(l, addr);
            }
            code.push((addr, ins.trim().trim_end_matches(';').trim().to_string()));
        }
    }
    code.into_iter()
        .map(|(a, ins)| match ins.split_once("`(") {
            // A label past the last instruction (the function's end) stays a name.
            Some((head, label)) => match labels.get(label.trim_end_matches(')').trim()) {
                Some(target) => (a, format!("{head}{target:#x}")),
                None => (a, ins),
            },
            None => (a, ins),
        })
        .collect()
}

/// `flash_ws_d{64,128}`'s consumer loop runs its softmax while the previous block's P·V is in
/// flight (BENCHMARKS.md, run g13: 426 → 578 TFLOP/s at head 128). ptxas hoists a wgmma wait to
/// the start of its basic block, so a code change can silently put the wait for the P·V
/// (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) back in front of the exponentials: in the innermost loop
/// that holds the softmax, every `MUFU.EX2` must follow the wait for the scores alone
/// (`DEPBAR.LE gsb0, 0x1`), with no full wait between it and the loop's back edge.
#[test]
fn flash_ws_softmax_overlaps_the_previous_pv() {
    require_nvrtc();
    let src = nvrtc::SOURCES
        .iter()
        .find(|s| s.name == "attention_sm90.cu")
        .expect("attention_sm90.cu");
    let out = nvrtc::compile(src, "sm_90a", false).unwrap_or_else(|e| panic!("{e}"));
    for function in ["flash_ws_d128", "flash_ws_d64"] {
        let code = sass(&out.cubin, function);
        // The innermost loop (a backward branch) with at least one block's exponentials.
        let body = code
            .iter()
            .filter_map(|(addr, ins)| {
                let target = ins.contains("BRA ").then(|| ins.rsplit(' ').next())??;
                let target = u64::from_str_radix(target.trim_start_matches("0x"), 16).ok()?;
                (target < *addr).then_some((target, *addr))
            })
            .map(|(from, to)| {
                code.iter()
                    .filter(|(a, _)| (from..=to).contains(a))
                    .map(|(_, i)| i.as_str())
                    .collect::<Vec<_>>()
            })
            .filter(|b| b.iter().filter(|i| i.starts_with("MUFU.EX2")).count() >= 32)
            .min_by_key(|b| b.len())
            .unwrap_or_else(|| panic!("{function}: no loop holds the softmax's exponentials"));
        let waits: Vec<(usize, &str)> = body
            .iter()
            .enumerate()
            .filter(|(_, i)| i.contains("DEPBAR.LE gsb0"))
            .map(|(n, i)| (n, *i))
            .collect();
        let scores = waits
            .iter()
            .find(|(_, i)| i.ends_with("0x1"))
            .unwrap_or_else(|| {
                panic!("{function}: the loop never waits for the scores alone: {waits:?}")
            })
            .0;
        let first_exp = body
            .iter()
            .position(|i| i.starts_with("MUFU.EX2"))
            .unwrap_or(0);
        assert!(
            first_exp > scores,
            "{function}: an exponential comes before the wait for the scores"
        );
        let full_after = waits
            .iter()
            .find(|(n, i)| *n > scores && i.ends_with("0x0"));
        assert!(
            full_after.is_none(),
            "{function}: the wait for the P·V ({full_after:?}) is back between the scores and \
             the exponentials' loop end: the softmax no longer overlaps the P·V"
        );
        let exps = body.iter().filter(|i| i.starts_with("MUFU.EX2")).count();
        eprintln!(
            "{function}: {exps} exponentials after DEPBAR.LE gsb0, 0x1 in a {}-instruction loop",
            body.len()
        );
    }
}
