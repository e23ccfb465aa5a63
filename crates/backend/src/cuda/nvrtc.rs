//! Kernel sources embedded in the binary, compiled by NVRTC for the device's architecture on
//! first use and cached on disk.
//!
//! The cache key is (source hash, target arch, NVRTC version, options), so a new driver toolkit or
//! an edited kernel never loads a stale binary. Compile errors name the source and carry NVRTC's
//! log. The sources need no CUDA headers (see `kernels/common.cuh`).

use std::ffi::{CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys;
use tessera_core::{Error, Result};

/// One kernel source file.
pub struct Source {
    pub name: &'static str,
    pub text: &'static str,
    /// Headers it includes after `common.cuh`, as (name, text).
    pub headers: &'static [(&'static str, &'static str)],
    /// Uses Hopper-only instructions (wgmma): compiled and loaded for `sm_90a` alone.
    pub sm90a_only: bool,
}

impl Source {
    /// Whether this source is built for `arch`.
    pub fn builds_for(&self, arch: &str) -> bool {
        !self.sm90a_only || arch == "sm_90a"
    }
}

const COMMON: &str = include_str!("kernels/common.cuh");
const FLASH: (&str, &str) = ("flash.cuh", include_str!("kernels/flash.cuh"));
const GEMV: (&str, &str) = ("gemv.cuh", include_str!("kernels/gemv.cuh"));
const ROWVEC: (&str, &str) = ("rowvec.cuh", include_str!("kernels/rowvec.cuh"));
const WGMMA: (&str, &str) = ("wgmma.cuh", include_str!("kernels/wgmma.cuh"));

/// Every kernel source Tessera ships, in the order they are loaded.
pub const SOURCES: &[Source] = &[
    Source {
        name: "norm.cu",
        text: include_str!("kernels/norm.cu"),
        headers: &[ROWVEC],
        sm90a_only: false,
    },
    Source {
        name: "elementwise.cu",
        text: include_str!("kernels/elementwise.cu"),
        headers: &[],
        sm90a_only: false,
    },
    Source {
        name: "rows.cu",
        text: include_str!("kernels/rows.cu"),
        headers: &[],
        sm90a_only: false,
    },
    Source {
        name: "image.cu",
        text: include_str!("kernels/image.cu"),
        headers: &[],
        sm90a_only: false,
    },
    Source {
        name: "conv_sm90.cu",
        text: include_str!("kernels/conv_sm90.cu"),
        headers: &[WGMMA],
        sm90a_only: true,
    },
    Source {
        name: "short_conv.cu",
        text: include_str!("kernels/short_conv.cu"),
        headers: &[],
        sm90a_only: false,
    },
    Source {
        name: "gemv.cu",
        text: include_str!("kernels/gemv.cu"),
        headers: &[GEMV, ROWVEC],
        sm90a_only: false,
    },
    Source {
        name: "attention.cu",
        text: include_str!("kernels/attention.cu"),
        headers: &[FLASH],
        sm90a_only: false,
    },
    Source {
        name: "attention_sm90.cu",
        text: include_str!("kernels/attention_sm90.cu"),
        headers: &[FLASH, WGMMA],
        sm90a_only: true,
    },
    Source {
        name: "fp8.cu",
        text: include_str!("kernels/fp8.cu"),
        headers: &[],
        sm90a_only: true,
    },
    Source {
        name: "blocks.cu",
        text: include_str!("kernels/blocks.cu"),
        headers: &[GEMV],
        sm90a_only: false,
    },
];

/// The full translation unit NVRTC sees for `src`.
pub fn unit(src: &Source) -> String {
    let mut u = String::from(COMMON);
    for (name, text) in src.headers.iter().chain([&(src.name, src.text)]) {
        u.push_str(&format!("\n#line 1 \"{name}\"\n{text}"));
    }
    u
}

/// The NVRTC `major.minor` version, or an error if the library cannot be used.
pub fn version() -> Result<(i32, i32)> {
    check_library()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters; the library is present (checked above).
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::Device(format!("nvrtcVersion failed: {r:?}")));
    }
    Ok((major, minor))
}

/// cudarc panics when a library is missing; ask first.
pub fn check_library() -> Result<()> {
    // SAFETY: only probes whether the shared library can be loaded.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::Device(
            "libnvrtc (CUDA 13 runtime compiler) not found: install the CUDA 13 toolkit or the \
             nvidia-cuda-nvrtc wheel and put its lib folder on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

/// Compiler output: the cubin and the log (ptxas resource usage when `verbose`).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

fn options(arch: &str, verbose: bool) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
    ];
    if verbose {
        o.push("--ptxas-options=-v".to_string());
    }
    o
}

/// Compile one source to a cubin for `arch` (e.g. `sm_90a`).
pub fn compile(src: &Source, arch: &str, verbose: bool) -> Result<Compiled> {
    let (cubin, log) = build(src, arch, verbose, Output::Cubin)?;
    Ok(Compiled { cubin, log })
}

/// Compile one source to PTX for the virtual `arch` (e.g. `compute_90a`): the text whose
/// `.entry` parameter lists CI checks the kernel tables' argument structs against.
pub fn compile_ptx(src: &Source, arch: &str) -> Result<String> {
    let (ptx, _) = build(src, arch, false, Output::Ptx)?;
    let text = CStr::from_bytes_until_nul(&ptx)
        .map_err(|e| Error::backend(format!("nvrtc {}", src.name), e))?;
    Ok(text.to_string_lossy().into_owned())
}

/// What [`build`] fetches from a compiled program.
#[derive(Clone, Copy)]
enum Output {
    Cubin,
    Ptx,
}

type SizeFn = unsafe fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult;
type GetFn = unsafe fn(sys::nvrtcProgram, *mut std::ffi::c_char) -> sys::nvrtcResult;

/// Compile `src` for `arch` and return `output` (PTX with its terminating NUL) and the log.
fn build(src: &Source, arch: &str, verbose: bool, output: Output) -> Result<(Vec<u8>, String)> {
    check_library()?;
    let code = CString::new(unit(src)).map_err(|e| Error::backend("nvrtc", e))?;
    let name = CString::new(src.name).map_err(|e| Error::backend("nvrtc", e))?;
    let opts: Vec<CString> = options(arch, verbose)
        .into_iter()
        .map(|o| CString::new(o).map_err(|e| Error::backend("nvrtc", e)))
        .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let fail = |what: &str, r: sys::nvrtcResult| {
        Error::backend(
            format!("nvrtc {}", src.name),
            format!("{what} failed: {r:?}"),
        )
    };
    let (size_name, size_fn, get_name, get_fn): (&str, SizeFn, &str, GetFn) = match output {
        Output::Cubin => (
            "nvrtcGetCUBINSize",
            sys::nvrtcGetCUBINSize,
            "nvrtcGetCUBIN",
            sys::nvrtcGetCUBIN,
        ),
        Output::Ptx => (
            "nvrtcGetPTXSize",
            sys::nvrtcGetPTXSize,
            "nvrtcGetPTX",
            sys::nvrtcGetPTX,
        ),
    };
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: `code` and `name` are NUL-terminated and outlive the call; no headers are passed.
    let r = unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            code.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", r));
    }
    // SAFETY: `prog` was created above; `opt_ptrs` points at live NUL-terminated strings.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let log = program_log(prog);
    let result = if compiled != sys::nvrtcResult::NVRTC_SUCCESS {
        Err(Error::backend(
            format!("compiling kernel source {} for {arch}", src.name),
            format!("NVRTC: {compiled:?}\n{log}"),
        ))
    } else {
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; out-parameter only.
        let r = unsafe { size_fn(prog, &mut size) };
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            Err(fail(size_name, r))
        } else {
            let mut bytes = vec![0u8; size];
            // SAFETY: `bytes` has exactly the size NVRTC reported for this output.
            let r = unsafe { get_fn(prog, bytes.as_mut_ptr().cast()) };
            if r != sys::nvrtcResult::NVRTC_SUCCESS {
                Err(fail(get_name, r))
            } else {
                Ok((bytes, log))
            }
        }
    };
    // SAFETY: `prog` is valid and destroyed exactly once.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result
}

fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut size = 0usize;
    // SAFETY: `prog` is a live program; out-parameter only.
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut size) } != sys::nvrtcResult::NVRTC_SUCCESS
        || size == 0
    {
        return String::new();
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the size NVRTC reported, including the terminating NUL.
    if unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr().cast()) }
        != sys::nvrtcResult::NVRTC_SUCCESS
    {
        return String::new();
    }
    CStr::from_bytes_until_nul(&buf)
        .map(|c| c.to_string_lossy().trim().to_string())
        .unwrap_or_default()
}

/// `$TESSERA_CACHE_DIR/kernels`, else `$XDG_CACHE_HOME/tessera/kernels`, else
/// `~/.cache/tessera/kernels`.
fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("TESSERA_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|p| p.join("tessera")))
        .or_else(|| var("HOME").map(|p| p.join(".cache").join("tessera")))
        .map(|p| p.join("kernels"))
}

/// FNV-1a over the inputs that determine the binary.
fn cache_key(src: &Source, arch: &str, nvrtc: (i32, i32)) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x100_0000_01b3);
        }
    };
    feed(unit(src).as_bytes());
    feed(arch.as_bytes());
    feed(format!("{nvrtc:?}").as_bytes());
    feed(options(arch, false).join(" ").as_bytes());
    format!("{}-{arch}-{h:016x}.cubin", src.name.trim_end_matches(".cu"))
}

/// The cubin for `src` on `arch`: from the disk cache, else compiled (and cached when the cache
/// folder is writable; a read-only cache only costs the compile time).
pub fn cubin(src: &Source, arch: &str) -> Result<Vec<u8>> {
    let nvrtc = version()?;
    let path = cache_dir().map(|d| d.join(cache_key(src, arch, nvrtc)));
    if let Some(p) = &path
        && let Ok(bytes) = std::fs::read(p)
        && bytes.starts_with(b"\x7fELF")
    {
        return Ok(bytes);
    }
    let compiled = compile(src, arch, false)?;
    if let Some(p) = &path
        && let Some(dir) = p.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &compiled.cubin).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok(compiled.cubin)
}
