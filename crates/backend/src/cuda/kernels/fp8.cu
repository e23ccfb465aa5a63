// FP8 e4m3 activations for cuBLASLt's FP8 products (Hopper): the largest magnitude of a block of
// rows, then each value divided by amax / 448 and rounded to e4m3 — to nearest, ties to even,
// saturating at ±448 (NaN stays NaN) — as torch's `(x / s).to(float8_e4m3fn)` and Tessera's
// `fp8::from_f32` round. `cvt.rn.satfinite.e4m3x2.f32` needs sm_89; this source is built for
// sm_90a alone.

// Largest |x| over each block's share of rows × cols (row stride xs) into part[blockIdx.x]. NaN
// is skipped (fmaxf), as the CPU's amax of finite rows would never see one.
extern "C" __global__ void fp8_amax_bf16(const bf16* x, long xs, long rows, int cols, float* part) {
    pdl_enter();
    float m = 0.f;
    const long n = rows * cols;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / cols;
        const int c = (int)(i - r * cols);
        m = fmaxf(m, fabsf(to_f(x[r * xs + c])));
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

// s = amax / 448 over the `parts` block maxima (1 when every value is 0, as fp8::row_scale), then
// q[r, c] = e4m3(x[r, c] / s) packed rows × cols (cols even), two codes per store; block 0 writes
// s to *scale, the activation scale cuBLASLt reads as B's scale. The division is IEEE (NVRTC's
// default -prec-div=true), so the codes are those the host computes from the same s.
extern "C" __global__ void fp8_quantize_bf16(const bf16* x, long xs, long rows, int cols, const float* part,
                                             int parts, unsigned short* q, float* scale) {
    pdl_enter();
    __shared__ float s_shared;
    if (threadIdx.x < 32) {
        float m = 0.f;
        for (int i = threadIdx.x; i < parts; i += 32) m = fmaxf(m, part[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) {
            const float s = m > 0.f ? m / 448.f : 1.f;
            s_shared = s;
            if (blockIdx.x == 0) *scale = s;
        }
    }
    __syncthreads();
    const float s = s_shared;
    const int half = cols >> 1;
    const long n = rows * half;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / half;
        const int c = (int)(i - r * half) * 2;
        const float lo = to_f(x[r * xs + c]) / s;
        const float hi = to_f(x[r * xs + c + 1]) / s;
        unsigned short v;
        // The first source goes to the upper byte: element c + 1.
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(v) : "f"(hi), "f"(lo));
        q[i] = v;
    }
}
