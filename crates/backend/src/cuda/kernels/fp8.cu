// FP8 e4m3 activations for cuBLASLt's FP8 products (Hopper): the largest magnitude of a block of
// rows, then each value divided by amax / 448 and rounded to e4m3 — to nearest, ties to even,
// saturating at ±448 (NaN stays NaN) — as torch's `(x / s).to(float8_e4m3fn)` and Tessera's
// `fp8::from_f32` round. `cvt.rn.satfinite.e4m3x2.f32` needs sm_89; this source is built for
// sm_90a alone.

// Indices are 32-bit: a block of rows holds at most ACT_BYTES (64 MiB) of codes (fp8.rs), so
// rows × cols < 2³¹, and a 64-bit division per element would cost more than the element's load.
// `v8`: every row start is 16-byte aligned (x and xs), so eight values are one load (cols, a
// multiple of 16, splits into whole octets); else one value at a time.

// Eight bf16 from a 16-byte-aligned address, as floats.
__device__ __forceinline__ void load8(const bf16* p, float* v) {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    const unsigned u[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(u[j] << 16);
        v[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
    }
}

// Largest |x| over each block's share of rows × cols (row stride xs) into part[blockIdx.x]. NaN
// is skipped (fmaxf), as the CPU's amax of finite rows would never see one.
extern "C" __global__ void fp8_amax_bf16(const bf16* x, long xs, long rows, int cols, int v8, float* part) {
    pdl_enter();
    float m = 0.f;
    const unsigned w = v8 ? (unsigned)cols >> 3 : (unsigned)cols;
    const unsigned n = (unsigned)rows * w;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const unsigned r = i / w, c = i - r * w;
        if (v8) {
            float v[8];
            load8(x + (long)r * xs + 8 * c, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(v[j]));
        } else {
            m = fmaxf(m, fabsf(to_f(x[(long)r * xs + c])));
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ float warps[32];
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? warps[threadIdx.x] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) part[blockIdx.x] = m;
    }
}

// Two values as the e4m3 pair cuBLASLt reads: the first source goes to the upper byte.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi) {
    unsigned short v;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(v) : "f"(hi), "f"(lo));
    return v;
}

// s = amax / 448 over the `parts` block maxima (1 when every value is 0, as fp8::row_scale), then
// q[r, c] = e4m3(x[r, c] / s) packed rows × cols, two codes a store (eight with v8); s goes to
// scale[0..nscale]: one activation scale (cuBLASLt's scalar B scale) or one per row (its outer-vector
// B scale, every entry s). The division is IEEE (NVRTC's default -prec-div=true), so the codes are
// those the host computes from the same s.
extern "C" __global__ void fp8_quantize_bf16(const bf16* x, long xs, long rows, int cols, int v8, const float* part,
                                             int parts, unsigned* q, float* scale, int nscale) {
    pdl_enter();
    __shared__ float s_shared;
    if (threadIdx.x < 32) {
        float m = 0.f;
        for (int i = threadIdx.x; i < parts; i += 32) m = fmaxf(m, part[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) s_shared = m > 0.f ? m / 448.f : 1.f;
    }
    __syncthreads();
    const float s = s_shared;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < (unsigned)nscale; i += gridDim.x * blockDim.x)
        scale[i] = s;
    if (v8) {
        const unsigned w = (unsigned)cols >> 3, n = (unsigned)rows * w;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const unsigned r = i / w, c = i - r * w;
            float v[8];
            load8(x + (long)r * xs + 8 * c, v);
            uint2 out;
            out.x = e4m3x2(v[0] / s, v[1] / s) | (unsigned)e4m3x2(v[2] / s, v[3] / s) << 16;
            out.y = e4m3x2(v[4] / s, v[5] / s) | (unsigned)e4m3x2(v[6] / s, v[7] / s) << 16;
            reinterpret_cast<uint2*>(q)[i] = out;
        }
    } else {
        unsigned short* q2 = reinterpret_cast<unsigned short*>(q);
        const unsigned w = (unsigned)cols >> 1, n = (unsigned)rows * w;
        for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const unsigned r = i / w, c = (i - r * w) * 2;
            const bf16* p = x + (long)r * xs + c;
            q2[i] = e4m3x2(to_f(p[0]) / s, to_f(p[1]) / s);
        }
    }
}
