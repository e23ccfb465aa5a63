// The VAE decoders' image ops over channels-last images `[pixels, channels]`: the column blocks
// of a convolution (the product itself is cuBLASLt's) and the tensor-core implicit GEMM that
// needs none (conv_implicit, at the end), GroupNorm, and the
// DupUp channel-to-space shortcut and its encoder mirror AvgDown. CPU references:
// crates/backend/src/cpu/conv.rs, crates/backend/src/cpu/group_norm.rs, crates/backend/src/cpu/dup_up.rs
// and crates/backend/src/cpu/avg_down.rs.

// Column rows of output pixels p0 … p0 + n − 1 of a "same" k × k convolution: row i, column
// (ky·k + kx)·c + ch holds the input at (oy + ky − k/2, ox + kx − k/2) of the image upsampled
// `up`× by nearest neighbour (up 1: as it is), passed through activation `act`, 0 outside (the
// padding is not activated). With `down` 2 (the VAE encoder's stride-2 3×3 convolution, never
// with up 2) it holds the input at (2·oy + ky, 2·ox + kx), zero-padded only after the last row
// and column. V channels per thread (4: aligned 4-wide accesses). Fewer than 2^32
// values per launch (the host's blocks of rows).
// Column entry i of a block (its row pi, tap and first channel ch, V channels an entry) and the
// input pixel it reads, or −1 where the tap falls on the zero padding.
struct ColumnAt {
    u32 pi;
    int tap, ch;
    long src;
};
__device__ __forceinline__ ColumnAt column_at(u32 i, u32 taps, u32 cv, int v, int h, int w, int k, int up,
                                              int down, long p0) {
    // The (upsampled) input is vh × vw; the output vw / down wide. Stride 2 pads only after.
    const int vh = h * up, vw = w * up, ow = vw / down, pad = down == 2 ? 0 : k / 2;
    ColumnAt at;
    at.pi = i / taps;
    const u32 rem = i - at.pi * taps;
    at.tap = (int)(rem / cv);
    at.ch = (int)(rem - (u32)at.tap * cv) * v;
    const int ky = at.tap / k, kx = at.tap - ky * k;
    const long p = p0 + at.pi;
    const int oy = (int)(p / ow), ox = (int)(p - (long)oy * ow);
    const int uy = oy * down + ky - pad, ux = ox * down + kx - pad;
    at.src = uy < 0 || uy >= vh || ux < 0 || ux >= vw ? -1 : (long)(uy / up) * w + ux / up;
    return at;
}

template <typename TI, typename TO, int V>
__device__ __forceinline__ void im2col_impl(const TI* x, long xs, int h, int w, int c, int k, int up, int down, int act,
                                            long p0, long n, TO* cols) {
    const u32 cv = (u32)(c / V);
    const u32 taps = (u32)(k * k) * cv;
    const u32 total = (u32)n * taps;
    const long row = (long)k * k * c;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const ColumnAt at = column_at(i, taps, cv, V, h, w, k, up, down, p0);
        TO* dst = cols + (long)at.pi * row + (long)at.tap * c + at.ch;
        float v[V];
        if (at.src < 0) {
#pragma unroll
            for (int j = 0; j < V; j++) v[j] = 0.f;
        } else {
            const TI* src = x + at.src * xs + at.ch;
            if (V == 4) {
                load4(src, v);
            } else {
#pragma unroll
                for (int j = 0; j < V; j++) v[j] = to_f(src[j]);
            }
            if (act >= 0) {
#pragma unroll
                for (int j = 0; j < V; j++) v[j] = image_act(act, v[j]);
            }
        }
        if (V == 4) {
            store4(dst, v);
        } else {
#pragma unroll
            for (int j = 0; j < V; j++) dst[j] = from_f<TO>(v[j]);
        }
    }
}

// GroupNorm statistics, pass 1: block b sums its pixels p0 … p1 − 1 (the b-th of `blocks` equal
// ranges) per group, in f64: partial[(b·groups + g)·2 + {0, 1}] = (Σx, Σx²). Thread t reads
// channels cx = t mod bdx (+ bdx, …) of pixels p0 + t / bdx (+ per, …), so a warp reads
// consecutive channels of one pixel. `sums` in shared memory: 2·groups doubles.
template <typename T>
__device__ __forceinline__ void group_stats_impl(const T* x, long xs, long pixels, int c, int groups, int bdx,
                                                 double* partial) {
    extern __shared__ double sums[];
    const int cpg = c / groups;
    const int tx = threadIdx.x % bdx, ty = threadIdx.x / bdx, py = blockDim.x / bdx;
    const long per = (pixels + gridDim.x - 1) / gridDim.x;
    const long p0 = (long)blockIdx.x * per, p1 = min(pixels, p0 + per);
    for (int i = threadIdx.x; i < 2 * groups; i += blockDim.x) sums[i] = 0.0;
    __syncthreads();
    if (ty < py) {
        for (int ch = tx; ch < c; ch += bdx) {
            double s = 0.0, ss = 0.0;
            for (long p = p0 + ty; p < p1; p += py) {
                const double v = to_f(x[p * xs + ch]);
                s += v;
                ss += v * v;
            }
            const int g = ch / cpg;
            shared_add_f64(&sums[2 * g], s);
            shared_add_f64(&sums[2 * g + 1], ss);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * groups; i += blockDim.x) partial[(long)blockIdx.x * 2 * groups + i] = sums[i];
}

// Pass 2: stats[g] = (mean, 1/sqrt(var + eps)) from the `blocks` partial sums. One warp per group,
// its lanes striding over the blocks: a thread per group waited on ~500 dependent loads (30 µs a
// GroupNorm in Z-Image's decoder, run g13).
__device__ __forceinline__ void group_finish_impl(const double* partial, int blocks, int groups, long count,
                                                  float eps, float* stats) {
    const int g = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (g >= groups) return;  // whole warps
    double s = 0.0, ss = 0.0;
    for (int b = lane; b < blocks; b += 32) {
        s += partial[((long)b * groups + g) * 2];
        ss += partial[((long)b * groups + g) * 2 + 1];
    }
    s = warp_sum(s);
    ss = warp_sum(ss);
    if (lane != 0) return;
    const double mean = s / (double)count;
    const double var = fmax(ss / (double)count - mean * mean, 0.0);
    stats[2 * g] = (float)mean;
    stats[2 * g + 1] = (float)(1.0 / sqrt(var + (double)eps));
}

// Pass 3: out = act((x − mean_g) · inv_g · w + b), grid-stride; act −1 none, 0 GELU (tanh), 1 SiLU.
// V = 4: four channels of one group a thread (16- or 8-byte loads and stores, 32-bit indices: the
// host checks the alignment, cpg a multiple of 4 and fewer than 2^32 quads), else one.
template <typename TI, typename TO, int V>
__device__ __forceinline__ void group_apply_impl(const TI* x, long xs, long pixels, int c, int groups,
                                                 const float* stats, const float* w, const float* b, int act,
                                                 TO* out, long os) {
    const int cpg = c / groups;
    if (V == 4) {
        const u32 cv = (u32)(c / 4), n = (u32)pixels * cv;
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
            const u32 p = i / cv;
            const int ch = (int)(i - p * cv) * 4, g = ch / cpg;
            float v[4];
            load4(x + (long)p * xs + ch, v);
            const float mean = stats[2 * g], inv = stats[2 * g + 1];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = image_act(act, (v[j] - mean) * inv * w[ch + j] + b[ch + j]);
            store4(out + (long)p * os + ch, v);
        }
        return;
    }
    const long n = pixels * c;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long p = i / c;
        const int ch = (int)(i - p * c), g = ch / cpg;
        float v = (to_f(x[p * xs + ch]) - stats[2 * g]) * stats[2 * g + 1] * w[ch] + b[ch];
        if (act == 0) v = gelu_tanh(v);
        else if (act == 1) v = silu(v);
        out[p * os + ch] = from_f<TO>(v);
    }
}

// The same for bf16 → bf16 with eight channels a thread: one 16-byte load and store, converted
// only to apply an activation.
__device__ __forceinline__ void im2col8_impl(const bf16* x, long xs, int h, int w, int c, int k, int up, int down, int act,
                                             long p0, long n, bf16* cols) {
    const u32 cv = (u32)(c / 8);
    const u32 taps = (u32)(k * k) * cv;
    const u32 total = (u32)n * taps;
    const long row = (long)k * k * c;
    for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const ColumnAt at = column_at(i, taps, cv, 8, h, w, k, up, down, p0);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (at.src >= 0) {
            v = *reinterpret_cast<const uint4*>(x + at.src * xs + at.ch);
            if (act >= 0) image_act8(act, v);
        }
        *reinterpret_cast<uint4*>(cols + (long)at.pi * row + (long)at.tap * c + at.ch) = v;
    }
}

extern "C" __global__ void im2col8_bf16_bf16(const bf16* x, long xs, int h, int w, int c, int k, int up, int down, int act,
                                             long p0, long n, bf16* cols) {
    pdl_enter();
    im2col8_impl(x, xs, h, w, c, k, up, down, act, p0, n, cols);
}

#define IM2COL(TI, TO, V, NAME)                                                                           \
    extern "C" __global__ void NAME(const TI* x, long xs, int h, int w, int c, int k, int up, int down, int act, long p0, \
                                    long n, TO* cols) {                                                   \
        pdl_enter();                                                                                      \
        im2col_impl<TI, TO, V>(x, xs, h, w, c, k, up, down, act, p0, n, cols);                                  \
    }
IM2COL(float, float, 1, im2col_f32_f32)
IM2COL(float, bf16, 1, im2col_f32_bf16)
IM2COL(bf16, float, 1, im2col_bf16_f32)
IM2COL(bf16, bf16, 1, im2col_bf16_bf16)
IM2COL(float, float, 4, im2col4_f32_f32)
IM2COL(float, bf16, 4, im2col4_f32_bf16)
IM2COL(bf16, float, 4, im2col4_bf16_f32)
IM2COL(bf16, bf16, 4, im2col4_bf16_bf16)

#define GROUP_STATS(T, NAME)                                                                              \
    extern "C" __global__ void NAME(const T* x, long xs, long pixels, int c, int groups, int bdx,            \
                                    double* partial) {                                                    \
        pdl_enter();                                                                                      \
        group_stats_impl<T>(x, xs, pixels, c, groups, bdx, partial);                                      \
    }
GROUP_STATS(float, group_stats_f32)
GROUP_STATS(bf16, group_stats_bf16)

extern "C" __global__ void group_finish(const double* partial, int blocks, int groups, long count, float eps,
                                        float* stats) {
    pdl_enter();
    group_finish_impl(partial, blocks, groups, count, eps, stats);
}

#define GROUP_APPLY(TI, TO, V, NAME)                                                                      \
    extern "C" __global__ void NAME(const TI* x, long xs, long pixels, int c, int groups, const float* stats,  \
                                    const float* w, const float* b, int act, TO* out, long os) {          \
        pdl_enter();                                                                                      \
        group_apply_impl<TI, TO, V>(x, xs, pixels, c, groups, stats, w, b, act, out, os);                 \
    }
GROUP_APPLY(float, float, 1, group_apply_f32_f32)
GROUP_APPLY(float, bf16, 1, group_apply_f32_bf16)
GROUP_APPLY(bf16, float, 1, group_apply_bf16_f32)
GROUP_APPLY(bf16, bf16, 1, group_apply_bf16_bf16)
GROUP_APPLY(float, float, 4, group_apply4_f32_f32)
GROUP_APPLY(float, bf16, 4, group_apply4_f32_bf16)
GROUP_APPLY(bf16, float, 4, group_apply4_bf16_f32)
GROUP_APPLY(bf16, bf16, 4, group_apply4_bf16_bf16)

// DupUp (diffusers' DupUp3D on one frame), added: out[(2y + sy)·2w + 2x + sx, o] +=
// x[y·w + x, ((o·frames + frames − 1)·4 + 2·sy + sx) / repeats] for `n` = 4·h·w·cout output
// elements, one a thread, grid-stride (consecutive threads: consecutive output channels).
template <typename TI, typename TO>
__device__ __forceinline__ void dup_up_impl(const TI* x, long xs, int w, int cout, int frames, int repeats, long n,
                                            TO* out, long os) {
    const long ow = 2L * w;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long p = i / cout;
        const int o = (int)(i - p * cout);
        const long oy = p / ow, ox = p - oy * ow;
        const int s = (int)(oy & 1) * 2 + (int)(ox & 1);
        const int src = ((o * frames + frames - 1) * 4 + s) / repeats;
        TO* dst = out + p * os + o;
        *dst = from_f<TO>(to_f(*dst) + to_f(x[((oy >> 1) * w + (ox >> 1)) * xs + src]));
    }
}

// The same, four output channels a thread (the sum read and written 16 bytes at a time for f32),
// where cout, the output's stride and offset are multiples of 4: `n4` = h·w·cout output vectors.
// The output is two thirds of the traffic; one value a thread ran Qwen-Image-2.1's shortcuts
// (6.6 GB a decode) at ~1.9 TB/s (run g20).
template <typename TI, typename TO>
__device__ __forceinline__ void dup_up_vec_impl(const TI* x, long xs, int w, int cout, int frames, int repeats,
                                                long n4, TO* out, long os) {
    const long ow = 2L * w;
    const int groups = cout / 4;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (long)gridDim.x * blockDim.x) {
        const long p = i / groups;
        const int o0 = (int)(i - p * groups) * 4;
        const long oy = p / ow, ox = p - oy * ow;
        const int s = (int)(oy & 1) * 2 + (int)(ox & 1);
        const TI* xp = x + ((oy >> 1) * w + (ox >> 1)) * xs;
        float v[4], a[4];
#pragma unroll
        for (int j = 0; j < 4; j++) a[j] = to_f(xp[(((o0 + j) * frames + frames - 1) * 4 + s) / repeats]);
        TO* dst = out + p * os + o0;
        load4(dst, v);
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] += a[j];
        store4(dst, v);
    }
}

#define DUP_UP(IMPL, TI, TO, NAME)                                                                        \
    extern "C" __global__ void NAME(const TI* x, long xs, int w, int cout, int frames, int repeats, long n,   \
                                    TO* out, long os) {                                                   \
        pdl_enter();                                                                                      \
        IMPL<TI, TO>(x, xs, w, cout, frames, repeats, n, out, os);                                        \
    }
DUP_UP(dup_up_impl, float, float, dup_up_f32_f32)
DUP_UP(dup_up_impl, float, bf16, dup_up_f32_bf16)
DUP_UP(dup_up_impl, bf16, float, dup_up_bf16_f32)
DUP_UP(dup_up_impl, bf16, bf16, dup_up_bf16_bf16)
DUP_UP(dup_up_vec_impl, float, float, dup_up_vec_f32_f32)
DUP_UP(dup_up_vec_impl, float, bf16, dup_up_vec_f32_bf16)
DUP_UP(dup_up_vec_impl, bf16, float, dup_up_vec_bf16_f32)
DUP_UP(dup_up_vec_impl, bf16, bf16, dup_up_vec_bf16_bf16)

// AvgDown (diffusers' AvgDown3D on one frame), added: out[y·ow + x, o] += (1/g) · Σ over the
// expanded channels e = o·g … o·g + g − 1 of x[(s·y + sy)·w + s·x + sx, c], where e = c·f + r
// (f = frames·s², the factor) reads spatial slot r mod s² = sy·s + sx of frame r / s², and only
// the last frame (frames − 1) holds the image (the others are the zero padding frame). `n` =
// oh·ow·cout output elements, one a thread, grid-stride (consecutive threads: consecutive output
// channels).
template <typename TI, typename TO>
__device__ __forceinline__ void avg_down_impl(const TI* x, long xs, int w, int space, int frames, int cout, int g,
                                              long n, TO* out, long os) {
    const int s2 = space * space, f = frames * s2;
    const long ow = w / space;
    for (long i = (long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        const long p = i / cout;
        const int o = (int)(i - p * cout);
        const long oy = p / ow, ox = p - oy * ow;
        const TI* base = x + (space * oy * w + space * ox) * xs;
        float sum = 0.f;
        for (int e = o * g; e < (o + 1) * g; e++) {
            const int c = e / f, r = e - c * f;
            if (r / s2 != frames - 1) continue;
            const int sp = r - (frames - 1) * s2, sy = sp / space, sx = sp - sy * space;
            sum += to_f(base[((long)sy * w + sx) * xs + c]);
        }
        TO* dst = out + p * os + o;
        *dst = from_f<TO>(to_f(*dst) + sum / (float)g);
    }
}

#define AVG_DOWN(TI, TO, NAME)                                                                            \
    extern "C" __global__ void NAME(const TI* x, long xs, int w, int space, int frames, int cout, int g,    \
                                    long n, TO* out, long os) {                                           \
        pdl_enter();                                                                                      \
        avg_down_impl<TI, TO>(x, xs, w, space, frames, cout, g, n, out, os);                              \
    }
AVG_DOWN(float, float, avg_down_f32_f32)
AVG_DOWN(float, bf16, avg_down_f32_bf16)
AVG_DOWN(bf16, float, avg_down_bf16_f32)
AVG_DOWN(bf16, bf16, avg_down_bf16_bf16)

// ---- Convolution as an implicit GEMM on the tensor cores (bf16 in, f32 accumulation).
//
// out[p, n] = bias[n] + Σ_{ky, kx, c} act(x)[src(p, ky, kx), c] · wt[n, (ky·k + kx)·cin + c]
// (or out[p, n] += that, with `add`), the
// im2col product above without its column matrix: each CTA gathers its output pixels' input
// taps straight from the image into shared memory. A CTA computes BM = 128 output pixels × BN
// (128 or 64) output channels with 8 warps (4 along the pixels × 2 along the channels, each
// 32 × BN/2); the reduction walks taps (ky, kx) and, within each, chunks of 32 input channels, two
// m16n8k16 steps a chunk. Both operands are staged by cp.async into two shared buffers (the next
// chunk loads while this one multiplies), rows padded to 40 bf16 so that ldmatrix's eight rows
// fall on distinct banks. Taps on the padding, pixels past the image, channels past cin and
// output channels past cout are zero-filled by the copy (0 source bytes). The pixel → source map
// is column_at's: nearest 2× upsampling reads (uy / 2, ux / 2); stride 2 reads (2·oy + ky,
// 2·ox + kx) padded only after.
//
// The input activation (act ≥ 0) is applied in shared memory: after its copies land, each thread
// rewrites the 16-byte chunks it copied as bf16(act(x)) (im2col8's rounding; act(0) = 0, so the
// zero padding stays zero), before the block barrier that publishes the stage.
//
// The epilogue adds the bias in f32 (and, with `add`, the output's value: out += conv + bias,
// a resnet's residual add fused) and writes the output type once (one rounding; the im2col path
// rounds the product to the output type before its bias epilogue). Needs cin a multiple of
// 8, x, its row stride and the weight's rows 16-byte aligned (the host checks).
#define CONV_BM 128
#define CONV_BK 32
#define CONV_PITCH 40
#define CONV_THREADS 256

__device__ __forceinline__ void conv_ldsm_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void conv_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    mma_bf16(c, a[0], a[1], a[2], a[3], b0, b1);
}

template <typename TO, int BN>
__device__ __forceinline__ void conv_implicit_impl(const bf16* __restrict__ x, long xs, int h, int w, int cin, int k,
                                                   int up, int down, int act, const bf16* __restrict__ wt, int cout,
                                                   const float* __restrict__ bias, long pixels, TO* __restrict__ out,
                                                   long os, int add) {
    constexpr int NI = BN / 16;  // 8-wide n-tiles per warp (a warp spans BN / 2 channels)
    constexpr int BROWS = BN / 64;  // weight rows each thread copies per chunk
    __shared__ __align__(128) bf16 sa[2][CONV_BM * CONV_PITCH];
    __shared__ __align__(128) bf16 sb[2][BN * CONV_PITCH];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 3, wn = warp >> 2;
    const long p0 = (long)blockIdx.x * CONV_BM;
    const int n0 = blockIdx.y * BN;
    const int vh = h * up, vw = w * up, ow = vw / down, pad = down == 2 ? 0 : k / 2;
    const long kk = (long)k * k * cin;
    const int cc = (cin + CONV_BK - 1) / CONV_BK, steps = k * k * cc;

    // Each thread copies 16-byte chunk lc of rows lr and lr + 64 (pixels; weight rows).
    const int lr = tid >> 2, lc = (tid & 3) * 8;
    int oy[2], ox[2];  // the pixel's top-left tap in the (upsampled) image; far negative past the end
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const long p = p0 + lr + 64 * i;
        if (p < pixels) {
            const int py = (int)(p / ow), px = (int)(p - (long)py * ow);
            oy[i] = py * down - pad;
            ox[i] = px * down - pad;
        } else {
            oy[i] = -(1 << 29);
            ox[i] = 0;
        }
    }

    auto load = [&](int s, int step) {
        const int tap = step / cc, c0 = (step - tap * cc) * CONV_BK + lc;
        const int ky = tap / k, kx = tap - ky * k;
        const bool cv = c0 < cin;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const int uy = oy[i] + ky, ux = ox[i] + kx;
            const bool ok = cv && uy >= 0 && uy < vh && ux >= 0 && ux < vw;
            const bf16* src = ok ? x + ((long)(uy / up) * w + ux / up) * xs + c0 : x;
            cp_async16(smem_addr(&sa[s][(lr + 64 * i) * CONV_PITCH + lc]), src, ok);
        }
#pragma unroll
        for (int i = 0; i < BROWS; i++) {
            const int n = n0 + lr + 64 * i;
            const bool ok = cv && n < cout;
            const bf16* src = ok ? wt + (long)n * kk + (long)tap * cin + c0 : wt;
            cp_async16(smem_addr(&sb[s][(lr + 64 * i) * CONV_PITCH + lc]), src, ok);
        }
        cp_commit();
    };

    float acc[2][NI][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int j = 0; j < 4; j++) acc[mi][ni][j] = 0.f;

    load(0, 0);
    for (int step = 0; step < steps; step++) {
        const int s = step & 1;
        if (step + 1 < steps) load(s ^ 1, step + 1);
        else cp_commit();  // an empty group keeps the count
        cp_wait<1>();  // this step's copies have landed
        if (act >= 0) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                uint4* chunk = reinterpret_cast<uint4*>(&sa[s][(lr + 64 * i) * CONV_PITCH + lc]);
                uint4 v = *chunk;  // one 16-byte load and store
                image_act8(act, v);
                *chunk = v;
            }
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < CONV_BK; ks += 16) {
            u32 a[2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int row = wm * 32 + mi * 16 + (lane & 15), col = ks + (lane >> 4) * 8;
                conv_ldsm_x4(a[mi], smem_addr(&sa[s][row * CONV_PITCH + col]));
            }
#pragma unroll
            for (int nj = 0; nj < NI / 2; nj++) {
                // Matrices: channels +0–7 at k +0 and +8, channels +8–15 at k +0 and +8.
                const int row = wn * (BN / 2) + nj * 16 + (lane & 7) + ((lane >> 4) << 3);
                const int col = ks + ((lane >> 3) & 1) * 8;
                u32 b[4];
                conv_ldsm_x4(b, smem_addr(&sb[s][row * CONV_PITCH + col]));
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    conv_mma(acc[mi][2 * nj], a[mi], b[0], b[1]);
                    conv_mma(acc[mi][2 * nj + 1], a[mi], b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with stage s before step + 2 refills it
    }
    cp_wait_all();

    // Accumulator layout: rows lane / 4 and + 8 of each m-tile, columns 2·(lane % 4) and + 1.
#pragma unroll
    for (int mi = 0; mi < 2; mi++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const long p = p0 + wm * 32 + mi * 16 + (lane >> 2) + 8 * half;
            if (p >= pixels) continue;
            TO* row = out + p * os;
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int n = n0 + wn * (BN / 2) + ni * 8 + 2 * (lane & 3) + j;
                    // add: out += conv + bias (a resnet's residual add), summed in that order.
                    if (n < cout)
                        row[n] = from_f<TO>((add ? to_f(row[n]) : 0.f) +
                                            (acc[mi][ni][2 * half + j] + (bias ? bias[n] : 0.f)));
                }
            }
        }
    }
}

#define CONV_IMPLICIT(TO, BN, NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(CONV_THREADS)                                                  \
        NAME(const bf16* x, long xs, int h, int w, int cin, int k, int up, int down, int act, const bf16* wt, \
             int cout, const float* bias, long pixels, TO* out, long os, int add) {                             \
        pdl_enter();                                                                                            \
        conv_implicit_impl<TO, BN>(x, xs, h, w, cin, k, up, down, act, wt, cout, bias, pixels, out, os, add);  \
    }
CONV_IMPLICIT(float, 128, conv_implicit_f32)
CONV_IMPLICIT(bf16, 128, conv_implicit_bf16)
CONV_IMPLICIT(float, 64, conv_implicit64_f32)
CONV_IMPLICIT(bf16, 64, conv_implicit64_bf16)
