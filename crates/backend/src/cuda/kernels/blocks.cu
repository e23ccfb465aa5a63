// Products on weights in GGUF block formats (Q8_0, Q4_0, Q4_K, Q6_K), kept on the device as the
// file stores them: rows of blocks back to back, each row `row_bytes` long (blocks.rs).
//
// Decoding: every weight value is decoded exactly as tessera_core::gguf decodes it — the f16
// scales widened exactly (cvt.f32.f16), every product and difference of the decode rounded on its
// own (__fmul_rn / __fsub_rn, so no FMA contraction changes a weight), then used in f32.
//
// Alignment: a row of blocks starts where the previous one ends. Every block format's block is an
// even number of bytes (34, 18, 144, 210) and the launcher passes 16-byte-aligned row runs, so every
// block is 2-byte aligned: codes and scales are read with 2-byte (or byte) loads, except Q4_K, whose
// 144-byte super-blocks keep 16-byte alignment and whose nibble runs are read 8 bytes at a time.
// Narrow loads of neighbouring threads fall in the same sectors, which L1 keeps.
//
// A chunk is 32 consecutive values of a row (a Q8_0/Q4_0 block, a Q4_K sub-block, two Q6_K
// sub-blocks): `chunk` reads its scales, `decode8` decodes 8 of its values.
//
// qgemv_{fmt}_m{M}_{x}_{out}: out[m, n] (= or +=) α · x[m, k] · w[n, k]ᵀ for m ≤ M, as gemv.cu: a CTA
// of T threads (T from k alone, as gemv.cu's) owns R = 4 weight rows and all m input rows; thread t
// takes the 8-value units t, t + T, … of k (so a warp reads consecutive pieces of a row), decodes
// its unit of each weight row (reading the chunk's scales again per unit: the 4 threads of a chunk
// read the same bytes in one request) and adds its 8 products in order by FMA into R·M f32 sums,
// which the warp reduces (warp_reduce_scatter) and the CTA adds in warp order. A row's result depends on k and T
// alone, never on m: a batch of decode rows gives each row what it gives alone. The launcher
// guarantees: k a positive multiple of the block (32, or 256 for the k-quants), x and x's row stride
// 16-byte aligned, 1 ≤ m ≤ M. Weight rows past n (the last CTA's) are read as row n − 1 and not
// written.
//
// dequant_{fmt}_{out}: rows × k decoded values into a dense row-major matrix (k a multiple of the
// block, out 16-byte aligned), 8 values per thread and step, for the cuBLASLt products of more rows.

typedef unsigned char u8;

// GEMV_ROWS (weight rows per CTA) and GEMV_MAX_WARPS: gemv.cuh, shared with gemv.cu.

// A little-endian u16 at a 2-byte-aligned address.
__device__ __forceinline__ u32 ld_u16(const u8* p) { return *reinterpret_cast<const unsigned short*>(p); }

// Eight bytes at a 2-byte-aligned address (byte e in bits 8·(e % 4) of word e / 4).
__device__ __forceinline__ uint2 ld8_a2(const u8* p) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(p);
    uint2 v;
    v.x = (u32)s[0] | ((u32)s[1] << 16);
    v.y = (u32)s[2] | ((u32)s[3] << 16);
    return v;
}

// Eight bytes at an 8-byte-aligned address.
__device__ __forceinline__ uint2 ld8_a8(const u8* p) { return *reinterpret_cast<const uint2*>(p); }

__device__ __forceinline__ u32 byte_of(uint2 v, int e) { return ((e < 4 ? v.x : v.y) >> (8 * (e & 3))) & 0xffu; }

// An f16 bit pattern widened to f32, exactly (subnormals included), as half::f16::to_f32.
__device__ __forceinline__ float f16_to_f(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}

// Q8_0: blocks of 32, an f16 d then 32 signed bytes; value = q · d.
struct Q8_0 {
    static constexpr int BLOCK = 32, BYTES = 34;
    struct Chunk {
        float d;
        const u8* q;
    };
    static __device__ __forceinline__ Chunk chunk(const u8* row, int c) {
        const u8* b = row + (long)c * BYTES;
        return {f16_to_f(ld_u16(b)), b + 2};
    }
    static __device__ __forceinline__ void decode8(const Chunk& ch, int g, float* w) {
        const uint2 v = ld8_a2(ch.q + 8 * g);
#pragma unroll
        for (int e = 0; e < 8; e++) w[e] = __fmul_rn((float)(signed char)byte_of(v, e), ch.d);
    }
};

// Q4_0: blocks of 32, an f16 d then 16 bytes; byte j's low nibble is value j, its high nibble value
// j + 16; value = (q − 8) · d.
struct Q4_0 {
    static constexpr int BLOCK = 32, BYTES = 18;
    struct Chunk {
        float d;
        const u8* q;
    };
    static __device__ __forceinline__ Chunk chunk(const u8* row, int c) {
        const u8* b = row + (long)c * BYTES;
        return {f16_to_f(ld_u16(b)), b + 2};
    }
    static __device__ __forceinline__ void decode8(const Chunk& ch, int g, float* w) {
        const uint2 v = ld8_a2(ch.q + 8 * (g & 1));
        const int shift = 4 * (g >> 1);
#pragma unroll
        for (int e = 0; e < 8; e++) w[e] = __fmul_rn((float)((int)((byte_of(v, e) >> shift) & 0xfu) - 8), ch.d);
    }
};

// Q4_K: super-blocks of 256 (144 bytes): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins,
// 128 bytes of nibbles. Sub-block j (a chunk) reads the nibble run 32·(j / 2) of the 128 bytes, low
// nibbles for even j, high for odd; value = (d · scale_j) · q − (dmin · min_j).
struct Q4_K {
    static constexpr int BLOCK = 256, BYTES = 144;
    struct Chunk {
        float ds, ms;
        const u8* q;
        int shift;
    };
    static __device__ __forceinline__ Chunk chunk(const u8* row, int c) {
        const u8* b = row + (long)(c >> 3) * BYTES;
        const int j = c & 7;
        const u8* s = b + 4;
        u32 sc, mn;
        if (j < 4) {
            sc = s[j] & 63u;
            mn = s[j + 4] & 63u;
        } else {
            sc = (s[j + 4] & 0xfu) | ((u32)(s[j - 4] >> 6) << 4);
            mn = (u32)(s[j + 4] >> 4) | ((u32)(s[j] >> 6) << 4);
        }
        const float d = f16_to_f(ld_u16(b)), dmin = f16_to_f(ld_u16(b + 2));
        return {__fmul_rn(d, (float)sc), __fmul_rn(dmin, (float)mn), b + 16 + 32 * (j >> 1), 4 * (j & 1)};
    }
    static __device__ __forceinline__ void decode8(const Chunk& ch, int g, float* w) {
        const uint2 v = ld8_a8(ch.q + 8 * g);
#pragma unroll
        for (int e = 0; e < 8; e++)
            w[e] = __fsub_rn(__fmul_rn(ch.ds, (float)((byte_of(v, e) >> ch.shift) & 0xfu)), ch.ms);
    }
};

// Q6_K: super-blocks of 256 (210 bytes): 128 bytes of low nibbles (ql), 64 of 2-bit pairs (qh), 16
// signed 8-bit scales (one per 16 values), f16 d. Chunk c of a super-block (values 32c..32c+32) is
// quarter q = c % 4 of half h = c / 4: value l of it takes its low 4 bits from ql byte
// 64h + 32·(q % 2) + l (low nibble for q < 2, high otherwise) and its top 2 from bits 2q of qh byte
// 32h + l; value = (d · scale) · (q6 − 32).
struct Q6_K {
    static constexpr int BLOCK = 256, BYTES = 210;
    struct Chunk {
        float ds0, ds1;
        const u8* ql;
        const u8* qh;
        int shift, hshift;
    };
    static __device__ __forceinline__ Chunk chunk(const u8* row, int c) {
        const u8* b = row + (long)(c >> 3) * BYTES;
        const int cc = c & 7, h = cc >> 2, q = cc & 3;
        const float d = f16_to_f(ld_u16(b + 208));
        const u32 s = ld_u16(b + 192 + 2 * cc);  // scales 2cc (low byte) and 2cc + 1
        return {__fmul_rn(d, (float)(signed char)(s & 0xffu)), __fmul_rn(d, (float)(signed char)(s >> 8)),
                b + 64 * h + 32 * (q & 1), b + 128 + 32 * h, 4 * (q >> 1), 2 * q};
    }
    static __device__ __forceinline__ void decode8(const Chunk& ch, int g, float* w) {
        const uint2 lo = ld8_a2(ch.ql + 8 * g), hi = ld8_a2(ch.qh + 8 * g);
        const float ds = g < 2 ? ch.ds0 : ch.ds1;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int q6 = (int)(((byte_of(lo, e) >> ch.shift) & 0xfu) | (((byte_of(hi, e) >> ch.hshift) & 3u) << 4));
            w[e] = __fmul_rn(ds, (float)(q6 - 32));
        }
    }
};

// Eight input values (16-byte-aligned) as floats.
__device__ __forceinline__ void load_x8(const bf16* p, float* f) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void load_x8(const float* p, float* f) {
    load4(p, f);
    load4(p + 4, f + 4);
}

template <typename F, int M, typename TX, typename TO>
__device__ __forceinline__ void qgemv_impl(const TX* __restrict__ x, long xs, const u8* __restrict__ w, long rb, int k,
                                           int n, int m, TO* out, long os, float alpha, int accumulate) {
    constexpr int R = GEMV_ROWS, N = R * M;
    __shared__ float red[GEMV_MAX_WARPS * N];
    const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const int r0 = blockIdx.x * R;
    const int units = k >> 3;

    const u8* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (long)min(r0 + r, n - 1) * rb;

    float acc[N];  // acc[r * M + i]: weight row r0 + r, input row i
#pragma unroll
    for (int j = 0; j < N; j++) acc[j] = 0.f;

    // Unit u: values 8u..8u+8 of each row, group g = u % 4 of chunk u / 4.
    for (int u = tid; u < units; u += T) {
        const int c = u >> 2, g = u & 3;
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) F::decode8(F::chunk(wr[r], c), g, wf[r]);
#pragma unroll
        for (int i = 0; i < M; i++) {
            if (i < m) {
                float xf[8];
                load_x8(x + i * xs + 8 * (long)u, xf);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float a = acc[r * M + i];
#pragma unroll
                    for (int e = 0; e < 8; e++) a = fmaf(wf[r][e], xf[e], a);
                    acc[r * M + i] = a;
                }
            }
        }
    }

    gemv_store<N, M>(acc, red, lane, warp, tid, T, r0, n, m, out, os, alpha, accumulate);
}

// Eight decoded values stored at p (16-byte aligned for bf16, 32 for f32).
__device__ __forceinline__ void store8(bf16* p, const float* v) {
    uint4 t;
    t.x = pack_bf16x2(v[0], v[1]);
    t.y = pack_bf16x2(v[2], v[3]);
    t.z = pack_bf16x2(v[4], v[5]);
    t.w = pack_bf16x2(v[6], v[7]);
    *reinterpret_cast<uint4*>(p) = t;
}
__device__ __forceinline__ void store8(float* p, const float* v) {
    store4(p, v);
    store4(p + 4, v + 4);
}

template <typename F, typename TO>
__device__ __forceinline__ void dequant_impl(const u8* __restrict__ w, long rb, int k, int rows, TO* out) {
    const long per_row = k >> 3;
    const long total = (long)rows * per_row;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (long)gridDim.x * blockDim.x) {
        const long r = i / per_row;
        const int e8 = (int)(i - r * per_row);
        const typename F::Chunk ch = F::chunk(w + r * rb, e8 >> 2);
        float v[8];
        F::decode8(ch, e8 & 3, v);
        store8(out + r * k + 8 * (long)e8, v);
    }
}

// (256, 1): without the minimum of one CTA, ptxas capped qgemv_q8_0_m4_bf16_bf16 at 64 registers
// and spilled (NVRTC 13.0).
#define QGEMV(F, M, TX, TO, NAME)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                     \
        NAME(const TX* x, long xs, const u8* w, long rb, int k, int n, int m, TO* out, long os, float alpha, \
             int accumulate) {                                                                               \
        pdl_enter();                                                                                         \
        qgemv_impl<F, M, TX, TO>(x, xs, w, rb, k, n, m, out, os, alpha, accumulate);                         \
    }
#define QGEMV_PAIRS(F, M, fmt)                                     \
    QGEMV(F, M, float, float, qgemv_##fmt##_m##M##_f32_f32)        \
    QGEMV(F, M, float, bf16, qgemv_##fmt##_m##M##_f32_bf16)        \
    QGEMV(F, M, bf16, float, qgemv_##fmt##_m##M##_bf16_f32)        \
    QGEMV(F, M, bf16, bf16, qgemv_##fmt##_m##M##_bf16_bf16)
#define QGEMV_FORMAT(F, fmt)  \
    QGEMV_PAIRS(F, 1, fmt)    \
    QGEMV_PAIRS(F, 2, fmt)    \
    QGEMV_PAIRS(F, 4, fmt)    \
    QGEMV_PAIRS(F, 8, fmt)    \
    QGEMV_PAIRS(F, 16, fmt)   \
    extern "C" __global__ void dequant_##fmt##_f32(const u8* w, long rb, int k, int rows, float* out) { \
        pdl_enter();                                                                                    \
        dequant_impl<F, float>(w, rb, k, rows, out);                                                    \
    }                                                                                                   \
    extern "C" __global__ void dequant_##fmt##_bf16(const u8* w, long rb, int k, int rows, bf16* out) { \
        pdl_enter();                                                                                    \
        dequant_impl<F, bf16>(w, rb, k, rows, out);                                                     \
    }
QGEMV_FORMAT(Q8_0, q8_0)
QGEMV_FORMAT(Q4_0, q4_0)
QGEMV_FORMAT(Q4_K, q4_k)
QGEMV_FORMAT(Q6_K, q6_k)
