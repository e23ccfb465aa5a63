// Row gathers, conversions, gated activations, per-segment means, and a VAE output's 8-bit pixels. CPU
// references: crates/backend/src/cpu/elementwise.rs, CpuBackend::cast and tessera_core::pixels.

// out[r] = table[ids[r]] · scale. One block per row.
template <typename TT, typename TO>
__device__ __forceinline__ void embed_impl(const TT* table, int dim, const u32* ids, float scale, TO* out,
                                           long os) {
    const long r = blockIdx.x;
    const TT* src = table + (long)ids[r] * dim;
    TO* dst = out + r * os;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = from_f<TO>(to_f(src[c]) * scale);
}

// y = x, converted. One block per row (`rows`, the grid's, unused).
template <typename TI, typename TO>
__device__ __forceinline__ void cast_impl(const TI* x, long xs, TO* y, long ys, long, int cols) {
    const long r = blockIdx.x;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) y[r * ys + c] = from_f<TO>(to_f(x[r * xs + c]));
}

// y = x, converted, four values a thread (16-byte f32 / 8-byte bf16 accesses), grid-stride over
// rows × cols / 4. The host uses it where cols, both row strides and both offsets are multiples
// of 4 and there are fewer than 2^32 vectors: the row kernel's one value a thread ran a VAE's
// stream-to-bf16 casts (1.5-3 GB each decode) at ~1.5 TB/s (run g20).
template <typename TI, typename TO>
__device__ __forceinline__ void cast_vec_impl(const TI* x, long xs, TO* y, long ys, long rows, int cols) {
    const int groups = cols / 4;
    const long n = rows * groups;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = (unsigned)i / (unsigned)groups;
        const int c = (int)(i - r * groups) * 4;
        float v[4];
        load4(x + r * xs + c, v);
        store4(y + r * ys + c, v);
    }
}

// o = act(g) ⊙ u over rows × cols, grid-stride.
template <typename TG, typename TU, typename TO, int ACT>
__device__ __forceinline__ void gated_impl(const TG* g, long gs, const TU* u, long us, TO* o, long os, long rows,
                                           int cols) {
    const long n = rows * cols;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / cols;
        const int c = (int)(i - r * cols);
        const float gv = to_f(g[r * gs + c]);
        const float a = ACT == 0 ? gelu_tanh(gv) : silu(gv);
        o[r * os + c] = from_f<TO>(a * to_f(u[r * us + c]));
    }
}

// out[s][c] = mean over the rows of segment s. Grid (segments, column blocks).
template <typename T>
__device__ __forceinline__ void segment_mean_impl(const T* x, long xs, const u32* offsets, float* out, long os,
                                                  int cols) {
    const int s = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    const u32 a = offsets[s], b = offsets[s + 1];
    float acc = 0.f;
    for (u32 r = a; r < b; r++) acc += to_f(x[(long)r * xs + c]);
    out[(long)s * os + c] = b > a ? acc / (float)(b - a) : 0.f;
}

#define EMBED(TT, TO, NAME)                                                                               \
    extern "C" __global__ void NAME(const TT* table, int dim, const u32* ids, float scale, TO* out, long os) { \
        pdl_enter();                                                                                           \
        embed_impl<TT, TO>(table, dim, ids, scale, out, os);                                              \
    }
EMBED(float, float, embed_f32_f32)
EMBED(bf16, float, embed_bf16_f32)

#define CAST(IMPL, TI, TO, NAME)                                                                          \
    extern "C" __global__ void NAME(const TI* x, long xs, TO* y, long ys, long rows, int cols) {          \
        pdl_enter();                                                                                      \
        IMPL<TI, TO>(x, xs, y, ys, rows, cols);                                                           \
    }
CAST(cast_impl, float, float, cast_f32_f32)
CAST(cast_impl, float, bf16, cast_f32_bf16)
CAST(cast_impl, bf16, float, cast_bf16_f32)
CAST(cast_impl, bf16, bf16, cast_bf16_bf16)
CAST(cast_vec_impl, float, float, cast_vec_f32_f32)
CAST(cast_vec_impl, float, bf16, cast_vec_f32_bf16)
CAST(cast_vec_impl, bf16, float, cast_vec_bf16_f32)
CAST(cast_vec_impl, bf16, bf16, cast_vec_bf16_bf16)

#define GATED(TG, TU, TO, ACT, NAME)                                                                      \
    extern "C" __global__ void NAME(const TG* g, long gs, const TU* u, long us, TO* o, long os, long rows,  \
                                    int cols) {                                                           \
        pdl_enter();                                                                                      \
        gated_impl<TG, TU, TO, ACT>(g, gs, u, us, o, os, rows, cols);                                     \
    }
GATED(float, float, float, 0, gated_gelu_f32)
GATED(bf16, bf16, bf16, 0, gated_gelu_bf16)
GATED(float, float, float, 1, gated_silu_f32)
GATED(bf16, bf16, bf16, 1, gated_silu_bf16)

#define SEGMENT_MEAN(T, NAME)                                                                             \
    extern "C" __global__ void NAME(const T* x, long xs, const u32* offsets, float* out, long os, int cols) { \
        pdl_enter();                                                                                          \
        segment_mean_impl<T>(x, xs, offsets, out, os, cols);                                              \
    }
SEGMENT_MEAN(float, segment_mean_f32)
SEGMENT_MEAN(bf16, segment_mean_bf16)

// Vectorised gate: 16-byte loads and stores (8 bf16 or 4 f32 per thread). The host uses it when
// cols and every row stride are multiples of the vector and the rows are 16-byte aligned.
template <typename T, int ACT>
__device__ __forceinline__ void gated_vec_impl(const T* g, long gs, const T* u, long us, T* o, long os, long rows,
                                               int cols) {
    constexpr int V = 16 / sizeof(T);
    const int groups = cols / V;
    const long n = rows * groups;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = (unsigned)i / (unsigned)groups;  // fewer than 2^32 vectors (host)
        const int c = (int)(i - r * groups) * V;
        const uint4 gv = *reinterpret_cast<const uint4*>(g + r * gs + c);
        const uint4 uv = *reinterpret_cast<const uint4*>(u + r * us + c);
        const T* ga = reinterpret_cast<const T*>(&gv);
        const T* ua = reinterpret_cast<const T*>(&uv);
        uint4 ov;
        T* oa = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int k = 0; k < V; k++) {
            const float x = to_f(ga[k]);
            oa[k] = from_f<T>((ACT == 0 ? gelu_tanh(x) : silu(x)) * to_f(ua[k]));
        }
        *reinterpret_cast<uint4*>(o + r * os + c) = ov;
    }
}

#define GATED_VEC(T, ACT, NAME)                                                                           \
    extern "C" __global__ void NAME(const T* g, long gs, const T* u, long us, T* o, long os, long rows, int cols) { \
        pdl_enter();                                                                                                \
        gated_vec_impl<T, ACT>(g, gs, u, us, o, os, rows, cols);                                          \
    }
GATED_VEC(float, 0, gated_vec_gelu_f32)
GATED_VEC(bf16, 0, gated_vec_gelu_bf16)
GATED_VEC(float, 1, gated_vec_silu_f32)
GATED_VEC(bf16, 1, gated_vec_silu_bf16)

// An epilogue's activation by code: −1 none, 0 GELU (tanh), 1 SiLU, 2 GELU (erf).
__device__ __forceinline__ float epilogue_act(int act, float v) {
    if (act == 0) return gelu_tanh(v);
    if (act == 1) return silu(v);
    if (act == 2) return 0.5f * v * (1.f + erff(v * 0.7071067811865476f));
    return v;
}

// After a product: o = [o +] g ⊙ act(y · cs + bias) over rows × cols, grid-stride. cs null: no
// column scale (else an FP8 weight's per-row scales, one per output column); act −1 none, 0 GELU
// (tanh), 1 SiLU, 2 GELU (erf); g null: no gate, gs 0: one broadcast gate row, tanh: multiply by tanh(g). `y` may
// alias `o` (in place): each element is read before it is written, by the same thread.
template <typename TY, typename TO>
__device__ __forceinline__ void epilogue_impl(const TY* y, long ys, TO* o, long os, long rows, int cols,
                                              const float* cs, const float* bias, int act, const float* g,
                                              long gs, int tanh_g, int accumulate) {
    const long n = rows * cols;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / cols;
        const int c = (int)(i - r * cols);
        float v = to_f(y[r * ys + c]);
        if (cs) v *= cs[c];
        if (bias) v += bias[c];
        v = epilogue_act(act, v);
        if (g) {
            const float gv = g[r * gs + c];
            v *= tanh_g ? tanhf(gv) : gv;
        }
        if (accumulate) v += to_f(o[r * os + c]);
        o[r * os + c] = from_f<TO>(v);
    }
}

// The epilogue four columns a thread (16-byte f32 / 8-byte bf16 accesses, one 32-bit division a
// vector), the same operations on each value. The host uses it where cols, every row stride and
// every row start are multiples of 4 (bias and gate rows too) and there are fewer than 2^32
// vectors: the scalar kernel's 64-bit division a value ran Qwen-Image-2.1's decoder epilogues at
// ~1 TB/s (1.8 ms of a decode, run g22).
template <typename TY, typename TO>
__device__ __forceinline__ void epilogue_vec_impl(const TY* y, long ys, TO* o, long os, long rows, int cols,
                                                  const float* cs, const float* bias, int act, const float* g,
                                                  long gs, int tanh_g, int accumulate) {
    const int groups = cols / 4;
    const long n = rows * groups;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = (unsigned)i / (unsigned)groups;
        const int c = (int)(i - r * groups) * 4;
        float v[4], sv[4], bv[4], gv[4], ov[4];
        load4(y + r * ys + c, v);
        if (cs) load4(cs + c, sv);
        if (bias) load4(bias + c, bv);
        if (g) load4(g + r * gs + c, gv);
        if (accumulate) load4(o + r * os + c, ov);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float x = v[j];
            if (cs) x *= sv[j];
            if (bias) x += bv[j];
            x = epilogue_act(act, x);
            if (g) x *= tanh_g ? tanhf(gv[j]) : gv[j];
            if (accumulate) x += ov[j];
            v[j] = x;
        }
        store4(o + r * os + c, v);
    }
}

#define EPILOGUE(IMPL, TY, TO, NAME)                                                                      \
    extern "C" __global__ void NAME(const TY* y, long ys, TO* o, long os, long rows, int cols, const float* bias, \
                                    int act, const float* g, long gs, int tanh_g, int accumulate) {        \
        pdl_enter();                                                                                       \
        IMPL<TY, TO>(y, ys, o, os, rows, cols, nullptr, bias, act, g, gs, tanh_g, accumulate);             \
    }
EPILOGUE(epilogue_impl, float, float, epilogue_f32_f32)
EPILOGUE(epilogue_impl, float, bf16, epilogue_f32_bf16)
EPILOGUE(epilogue_impl, bf16, float, epilogue_bf16_f32)
EPILOGUE(epilogue_impl, bf16, bf16, epilogue_bf16_bf16)
EPILOGUE(epilogue_vec_impl, float, float, epilogue_vec_f32_f32)
EPILOGUE(epilogue_vec_impl, float, bf16, epilogue_vec_f32_bf16)
EPILOGUE(epilogue_vec_impl, bf16, float, epilogue_vec_bf16_f32)
EPILOGUE(epilogue_vec_impl, bf16, bf16, epilogue_vec_bf16_bf16)

// The epilogue with a column scale first (FP8 products on weights with a scale per row).
#define EPILOGUE_SCALED(TY, TO, NAME)                                                                     \
    extern "C" __global__ void NAME(const TY* y, long ys, TO* o, long os, long rows, int cols, const float* cs, \
                                    const float* bias, int act, const float* g, long gs, int tanh_g,       \
                                    int accumulate) {                                                      \
        pdl_enter();                                                                                       \
        epilogue_impl<TY, TO>(y, ys, o, os, rows, cols, cs, bias, act, g, gs, tanh_g, accumulate);         \
    }
EPILOGUE_SCALED(float, float, epilogue_scaled_f32_f32)
EPILOGUE_SCALED(float, bf16, epilogue_scaled_f32_bf16)
EPILOGUE_SCALED(bf16, float, epilogue_scaled_bf16_f32)
EPILOGUE_SCALED(bf16, bf16, epilogue_scaled_bf16_bf16)

// A VAE's output as 8-bit values, rows packed: tessera_core::pixels::to_rgb8 byte for byte,
// clamp(x·½ + ½, 0, 1)·255 rounded to even by adding 2²³ and keeping the low byte of the sum's
// bits, each operation rounded on its own (a fused multiply-add rounds once and could land on the
// other side of a tie). Grid-stride over the packed index i < 2³²: values that are not finite
// count in bad[0], and bad[1] (set to 2³² − 1 first) keeps the least such i.
template <typename T>
__device__ __forceinline__ void rgb8_impl(const T* x, long xs, long rows, int cols, unsigned char* out, u32* bad) {
    const long n = rows * cols;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long r = i / cols;
        const float v = to_f(x[r * xs + (i - r * cols)]);
        if (!isfinite(v)) {
            atomicAdd(&bad[0], 1u);
            atomicMin(&bad[1], (u32)i);
        }
        const float y = fminf(fmaxf(__fadd_rn(__fmul_rn(v, 0.5f), 0.5f), 0.f), 1.f);
        out[i] = (unsigned char)(__float_as_uint(__fadd_rn(__fmul_rn(y, 255.f), 8388608.f)) & 0xffu);
    }
}

#define RGB8(T, NAME)                                                                                     \
    extern "C" __global__ void NAME(const T* x, long xs, long rows, int cols, unsigned char* out, u32* bad) { \
        pdl_enter();                                                                                      \
        rgb8_impl<T>(x, xs, rows, cols, out, bad);                                                        \
    }
RGB8(float, rgb8_f32)
RGB8(bf16, rgb8_bf16)

// Bytes through a 256-entry table into T: an image's pixels go up as bytes (a quarter of their
// f32 size, half of bf16) and take their values here, each rounded to T once as the host's table
// lookup did. Grid-stride over i < n.
template <typename T>
__device__ __forceinline__ void map_bytes_impl(const unsigned char* src, const float* table, T* dst, long n) {
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        dst[i] = from_f<T>(table[src[i]]);
}

#define MAP_BYTES(T, NAME)                                                                                \
    extern "C" __global__ void NAME(const unsigned char* src, const float* table, T* dst, long n) {       \
        pdl_enter();                                                                                      \
        map_bytes_impl<T>(src, table, dst, n);                                                            \
    }
MAP_BYTES(float, map_bytes_f32)
MAP_BYTES(bf16, map_bytes_bf16)
