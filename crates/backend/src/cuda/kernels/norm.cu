// RMSNorm kernels. CPU references: crates/backend/src/cpu/norm.rs (norm, residual) and
// crates/backend/src/cpu/rope.rs (qkv_norm_rope). Statistics in f32; `1/sqrtf` rather than
// `rsqrtf` for accuracy.

// out = x · (mean(x²) + eps)^-½ · w   (w may be null). One block per row.
template <typename TI, typename TO>
__device__ __forceinline__ void rms_norm_impl(const TI* x, long xs, const float* w, TO* out, long os,
                                              int cols, float eps) {
    __shared__ float sh[32];
    const long r = blockIdx.x;
    const TI* xr = x + r * xs;
    TO* orow = out + r * os;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_f(xr[c]);
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float inv = 1.f / sqrtf(ss / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = to_f(xr[c]) * inv;
        if (w) v *= w[c];
        orow[c] = from_f<TO>(v);
    }
}

// h = (h + N_post(y)) · scale; then mode 0: nothing, 1: out = N_next(h), 2: out = h.
// One block per row; the row of h is staged in dynamic shared memory (cols floats).
template <typename TY, typename TO>
__device__ __forceinline__ void residual_norm_impl(float* h, long hs, const TY* y, long ys, const float* post,
                                                   float scale, int mode, const float* next, TO* out, long os,
                                                   int cols, float eps) {
    extern __shared__ float row[];
    __shared__ float sh[32];
    const long r = blockIdx.x;
    float* hr = h + r * hs;
    const TY* yr = y + r * ys;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_f(yr[c]);
        row[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float inv = 1.f / sqrtf(ss / cols + eps);
    float ss2 = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float n = row[c] * inv;
        if (post) n *= post[c];
        const float hv = (hr[c] + n) * scale;
        hr[c] = hv;
        row[c] = hv;  // each thread re-reads only the entries it wrote
        ss2 += hv * hv;
    }
    if (mode == 0) return;
    TO* orow = out + r * os;
    if (mode == 2) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f<TO>(row[c]);
        return;
    }
    ss2 = block_sum(ss2, sh);
    const float inv2 = 1.f / sqrtf(ss2 / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f<TO>(row[c] * inv2 * next[c]);
}

// Warp-per-row variants with 16-byte (f32) / 8-byte (bf16) accesses for rows of 128·k columns,
// k ≤ 8: each lane keeps its 4·k values in registers, so a row is read once, every load of a
// row is in flight together and no block barrier is needed. The host picks them when cols fits
// and every row start is aligned; same arithmetic order as the block-per-row kernels above.
#define ROW_CHUNKS 8

// This lane's 4·k values of a row (columns 128t + 4·lane …, t < k) into `v`; returns the row's sum
// of squares, reduced over the warp.
template <typename T>
__device__ __forceinline__ float load_row(const T* row, int k, int c0, float (&v)[ROW_CHUNKS][4]) {
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < ROW_CHUNKS; t++) {
        if (t < k) {
            load4(row + 128 * t + c0, v[t]);
#pragma unroll
            for (int j = 0; j < 4; j++) ss += v[t][j] * v[t][j];
        }
    }
    return warp_sum(ss);
}

template <typename TI, typename TO>
__device__ __forceinline__ void rms_norm_warp_impl(const TI* x, long xs, const float* w, TO* out, long os,
                                                   long rows, int cols, float eps) {
    const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    const int c0 = 4 * (threadIdx.x & 31), k = cols >> 7;
    float v[ROW_CHUNKS][4];
    const float inv = 1.f / sqrtf(load_row(x + r * xs, k, c0, v) / cols + eps);
#pragma unroll
    for (int t = 0; t < ROW_CHUNKS; t++) {
        if (t < k) {
            float wv[4] = {1.f, 1.f, 1.f, 1.f};
            if (w) load4(w + 128 * t + c0, wv);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                v[t][j] *= inv;
                if (w) v[t][j] *= wv[j];
            }
            store4(out + r * os + 128 * t + c0, v[t]);
        }
    }
}

template <typename TY, typename TO>
__device__ __forceinline__ void residual_norm_warp_impl(float* h, long hs, const TY* y, long ys, const float* post,
                                                        float scale, int mode, const float* next, TO* out, long os,
                                                        long rows, int cols, float eps) {
    const long r = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    const int c0 = 4 * (threadIdx.x & 31), k = cols >> 7;
    float v[ROW_CHUNKS][4];
    const float inv = 1.f / sqrtf(load_row(y + r * ys, k, c0, v) / cols + eps);
    float ss2 = 0.f;
#pragma unroll
    for (int t = 0; t < ROW_CHUNKS; t++) {
        if (t < k) {
            float hv[4], pv[4] = {1.f, 1.f, 1.f, 1.f};
            float* hp = h + r * hs + 128 * t + c0;
            load4(hp, hv);
            if (post) load4(post + 128 * t + c0, pv);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float n = v[t][j] * inv;
                if (post) n *= pv[j];
                v[t][j] = (hv[j] + n) * scale;
                ss2 += v[t][j] * v[t][j];
            }
            store4(hp, v[t]);
        }
    }
    if (mode == 0) return;
    float inv2 = 1.f;
    if (mode == 1) inv2 = 1.f / sqrtf(warp_sum(ss2) / cols + eps);
#pragma unroll
    for (int t = 0; t < ROW_CHUNKS; t++) {
        if (t < k) {
            if (mode == 1) {
                float nv[4];
                load4(next + 128 * t + c0, nv);
#pragma unroll
                for (int j = 0; j < 4; j++) v[t][j] = v[t][j] * inv2 * nv[j];
            }
            store4(out + r * os + 128 * t + c0, v[t]);
        }
    }
}

// In place on packed q|k|v rows: per-head RMSNorm (q, k with weights, or none when qk_norm is 0 and
// they rotate; v weightless when v_norm), then RoPE on q and k. One warp per (row, head); head_dim ≤ 512, even.
// rope: cos table [rope_len][tbl_half] followed by the sin table; null = no rotation.
// axial = 0: split-half, pair j ↔ j + hd/2 at position pos[r].
// axial = 1: 2-D, channels [0, hd/2) rotate by x = pos[2r], [hd/2, hd) by y = pos[2r+1]; within
// each half, pair j ↔ j + hd/4 (tbl_half = hd/4).
// STYLE 2: interleaved (complex pairs), pair j joins channels 2j and 2j + 1 at position pos[r].
// CACHE: each k and v head also goes to row at[r] of its cache (kc, row stride ks; vc, vs), the
// same values as written back (as scatter_rows copies them), so keys and values need no launch of
// their own; a v head that is not normed is copied as it is.
template <typename T, int STYLE, bool CACHE = false>
__device__ __forceinline__ void qkv_norm_rope_impl(T* qkv, long stride, int rows, int hq, int hkv, int hd,
                                                   const float* qw, const float* kw, int v_norm, int qk_norm, float eps,
                                                   const float* rope, int rope_len, int tbl_half,
                                                   const u32* pos, const u32* at = nullptr, T* kc = nullptr,
                                                   long ks = 0, T* vc = nullptr, long vs = 0) {
    constexpr bool axial = STYLE == 1, pairs2 = STYLE == 2;
    const int heads = hq + 2 * hkv;
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (long)rows * heads) return;
    // 32-bit division: rows · heads < 2^32 (checked by the host); 64-bit division is a long
    // emulated sequence in a kernel this short.
    const long r = (unsigned)gw / (unsigned)heads;
    const int hh = (int)((unsigned)gw % (unsigned)heads);
    const bool is_v = hh >= hq + hkv;
    T* x = qkv + r * stride + (long)hh * hd;
    T* cached = nullptr;  // this head's place in a cache (CACHE: k and v heads)
    if (CACHE && hh >= hq) {
        const long cr = at[r];
        cached = is_v ? vc + cr * vs + (long)(hh - hq - hkv) * hd : kc + cr * ks + (long)(hh - hq) * hd;
    }
    if (is_v && !v_norm) {
        if (CACHE)
            for (int c = lane; c < hd; c += 32) cached[c] = x[c];
        return;
    }
    // qk_norm 0: q and k heads are only rotated (normed as usual when nothing rotates, as on the CPU).
    const bool normed = is_v || qk_norm || rope == nullptr;
    const float* w = hh < hq ? qw : (hh < hq + hkv ? kw : nullptr);
    const int pairs = hd >> 1, quarter = hd >> 2;
    // Pair j (of hd/2) joins channels c1 and c1 + span.
    float a[8], b[8];
    float ss = 0.f;
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const int j = lane + 32 * t;
        a[t] = 0.f;
        b[t] = 0.f;
        if (j < pairs) {
            const int c1 = axial ? (j / quarter) * pairs + j % quarter : (pairs2 ? 2 * j : j);
            const int span = axial ? quarter : (pairs2 ? 1 : pairs);
            a[t] = to_f(x[c1]);
            b[t] = to_f(x[c1 + span]);
            ss += a[t] * a[t] + b[t] * b[t];
        }
    }
    ss = warp_sum(ss);
    const float inv = normed ? 1.f / sqrtf(ss / hd + eps) : 1.f;
    const bool rotate = !is_v && rope != nullptr;
#pragma unroll
    for (int t = 0; t < 8; t++) {
        const int j = lane + 32 * t;
        if (j < pairs) {
            const int axis = axial ? j / quarter : 0;
            const int fi = axial ? j % quarter : j;
            const int c1 = axial ? axis * pairs + fi : (pairs2 ? 2 * j : j);
            const int span = axial ? quarter : (pairs2 ? 1 : pairs);
            float x1 = a[t] * inv, x2 = b[t] * inv;
            if (w) {
                x1 *= w[c1];
                x2 *= w[c1 + span];
            }
            if (rotate) {
                const long p = axial ? pos[2 * r + axis] : pos[r];
                const float c = rope[p * tbl_half + fi];
                const float s = rope[((long)rope_len + p) * tbl_half + fi];
                const float y1 = x1 * c - x2 * s;
                const float y2 = x2 * c + x1 * s;
                x1 = y1;
                x2 = y2;
            }
            x[c1] = from_f<T>(x1);
            x[c1 + span] = from_f<T>(x2);
            if (CACHE && cached) {
                cached[c1] = from_f<T>(x1);
                cached[c1 + span] = from_f<T>(x2);
            }
        }
    }
}

// Split-half q/k/v norm + RoPE for head dims 256·m (m ≤ 2, the text tower's 256 and 512): lane l
// owns pairs 128g + 4l … 4l+3, so every access to the row, the weights and the RoPE table is a
// 4-element vector (the scalar kernel above moves 2-byte values). The host picks it when the rows,
// weights and table are aligned; same arithmetic order as the scalar kernel.
template <typename T>
__device__ __forceinline__ void qkv_norm_rope_vec_impl(T* qkv, long stride, int rows, int hq, int hkv, int hd,
                                                       const float* qw, const float* kw, int v_norm, int qk_norm, float eps,
                                                       const float* rope, int rope_len, int tbl_half,
                                                       const u32* pos) {
    const int heads = hq + 2 * hkv;
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (gw >= (long)rows * heads) return;  // whole warps leave together
    // 32-bit division: rows · heads < 2^32 (checked by the host); 64-bit division is a long
    // emulated sequence in a kernel this short.
    const long r = (unsigned)gw / (unsigned)heads;
    const int hh = (int)((unsigned)gw % (unsigned)heads);
    const bool is_v = hh >= hq + hkv;
    if (is_v && !v_norm) return;
    // qk_norm 0: q and k heads are only rotated (normed as usual when nothing rotates, as on the CPU).
    const bool normed = is_v || qk_norm || rope == nullptr;
    const float* w = hh < hq ? qw : (hh < hq + hkv ? kw : nullptr);
    T* x = qkv + r * stride + (long)hh * hd;
    const int pairs = hd >> 1, groups = pairs >> 7, lane4 = 4 * (threadIdx.x & 31);
    float a[2][4], b[2][4];
    float ss = 0.f;
#pragma unroll
    for (int g = 0; g < 2; g++) {
        if (g < groups) {
            load4(x + 128 * g + lane4, a[g]);
            load4(x + 128 * g + lane4 + pairs, b[g]);
#pragma unroll
            for (int j = 0; j < 4; j++) ss += a[g][j] * a[g][j] + b[g][j] * b[g][j];
        }
    }
    const float inv = normed ? 1.f / sqrtf(warp_sum(ss) / hd + eps) : 1.f;
    const bool rotate = !is_v && rope != nullptr;
    const long p = rotate ? (long)pos[r] : 0;
#pragma unroll
    for (int g = 0; g < 2; g++) {
        if (g < groups) {
            const int j0 = 128 * g + lane4;
            float wa[4] = {1.f, 1.f, 1.f, 1.f}, wb[4] = {1.f, 1.f, 1.f, 1.f}, c[4], s[4];
            if (w) {
                load4(w + j0, wa);
                load4(w + j0 + pairs, wb);
            }
            if (rotate) {
                load4(rope + p * tbl_half + j0, c);
                load4(rope + ((long)rope_len + p) * tbl_half + j0, s);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float x1 = a[g][j] * inv, x2 = b[g][j] * inv;
                if (w) {
                    x1 *= wa[j];
                    x2 *= wb[j];
                }
                if (rotate) {
                    const float y1 = x1 * c[j] - x2 * s[j];
                    const float y2 = x2 * c[j] + x1 * s[j];
                    x1 = y1;
                    x2 = y2;
                }
                a[g][j] = x1;
                b[g][j] = x2;
            }
            store4(x + j0, a[g]);
            store4(x + j0 + pairs, b[g]);
        }
    }
}

// Axial (2-D) RoPE heads of 64 (the vision tower): eight lanes per head, four heads per warp,
// each lane 8 adjacent channels in two 4-element vectors (the scalar kernel moves one 2-byte
// value per lane and leaves half a warp idle). Channels [0,16)+[16,32) are the x-axis pairs,
// [32,48)+[48,64) the y-axis pairs, so a lane's rotation partner is lane ^ 2. Same arithmetic
// per element as the scalar kernel; the host picks this one when rows and vectors are aligned.
template <typename T>
__device__ __forceinline__ void qkv_norm_rope_axial64_impl(T* qkv, long stride, int rows, int hq, int hkv,
                                                           const float* qw, const float* kw, int v_norm, int qk_norm,
                                                           float eps, const float* rope, int rope_len,
                                                           int tbl_half, const u32* pos) {
    constexpr int HD = 64;
    const int heads = hq + 2 * hkv;
    const int lane = threadIdx.x & 31, sub = lane & 7;
    const long slot = ((long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 4 + (lane >> 3);
    if (slot >= (long)rows * heads) return;  // whole 8-lane groups leave together
    const long r = (unsigned)slot / (unsigned)heads;  // 32-bit, as above
    const int hh = (int)((unsigned)slot % (unsigned)heads);
    const bool is_v = hh >= hq + hkv;
    if (is_v && !v_norm) return;
    // qk_norm 0: q and k heads are only rotated (normed as usual when nothing rotates, as on the CPU).
    const bool normed = is_v || qk_norm || rope == nullptr;
    const unsigned group = 0xffu << (lane & ~7);
    const float* w = hh < hq ? qw : (hh < hq + hkv ? kw : nullptr);
    T* x = qkv + r * stride + (long)hh * HD + 8 * sub;
    float v[8];
    load4(x, v);
    load4(x + 4, v + 4);
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) ss += v[j] * v[j];
    ss += __shfl_xor_sync(group, ss, 1);
    ss += __shfl_xor_sync(group, ss, 2);
    ss += __shfl_xor_sync(group, ss, 4);
    const float inv = normed ? 1.f / sqrtf(ss / HD + eps) : 1.f;
    float wv[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
    if (w) {
        load4(w + 8 * sub, wv);
        load4(w + 8 * sub + 4, wv + 4);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = v[j] * inv * wv[j];
    if (!is_v && rope != nullptr) {
        const int axis = sub >> 2, fi0 = 8 * (sub & 1);
        const bool first = (sub & 2) == 0;  // x1 of its pairs (else x2)
        const long p = pos[2 * r + axis];
        float c[8], sn[8];
        load4(rope + p * tbl_half + fi0, c);
        load4(rope + p * tbl_half + fi0 + 4, c + 4);
        load4(rope + ((long)rope_len + p) * tbl_half + fi0, sn);
        load4(rope + ((long)rope_len + p) * tbl_half + fi0 + 4, sn + 4);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float u = __shfl_xor_sync(group, v[j], 2);
            v[j] = first ? v[j] * c[j] - u * sn[j] : v[j] * c[j] + u * sn[j];
        }
    }
    store4(x, v);
    store4(x + 4, v + 4);
}

#define RMS_NORM(TI, TO, NAME)                                                                           \
    extern "C" __global__ void NAME(const TI* x, long xs, const float* w, TO* out, long os, int cols,      \
                                    float eps) {                                                          \
        pdl_enter();                                                                                      \
        rms_norm_impl<TI, TO>(x, xs, w, out, os, cols, eps);                                               \
    }
RMS_NORM(float, float, rms_norm_f32_f32)
RMS_NORM(float, bf16, rms_norm_f32_bf16)
RMS_NORM(bf16, float, rms_norm_bf16_f32)
RMS_NORM(bf16, bf16, rms_norm_bf16_bf16)

#define RESIDUAL_NORM(TY, TO, NAME)                                                                      \
    extern "C" __global__ void NAME(float* h, long hs, const TY* y, long ys, const float* post, float scale, \
                                    int mode, const float* next, TO* out, long os, int cols, float eps) {   \
        pdl_enter();                                                                                        \
        residual_norm_impl<TY, TO>(h, hs, y, ys, post, scale, mode, next, out, os, cols, eps);           \
    }
RESIDUAL_NORM(float, float, residual_norm_f32_f32)
RESIDUAL_NORM(float, bf16, residual_norm_f32_bf16)
RESIDUAL_NORM(bf16, float, residual_norm_bf16_f32)
RESIDUAL_NORM(bf16, bf16, residual_norm_bf16_bf16)

// Split-half, axial 2-D and interleaved are separate instantiations: the text path keeps its plain indexing.
#define QKV_NORM_ROPE(T, STYLE, NAME)                                                                    \
    extern "C" __global__ void NAME(T* qkv, long stride, int rows, int hq, int hkv, int hd, const float* qw, \
                                    const float* kw, int v_norm, int qk_norm, float eps, const float* rope, int rope_len, \
                                    int tbl_half, const u32* pos) {                                       \
        pdl_enter();                                                                                      \
        qkv_norm_rope_impl<T, STYLE>(qkv, stride, rows, hq, hkv, hd, qw, kw, v_norm, qk_norm, eps, rope, rope_len,   \
                                     tbl_half, pos);                                                      \
    }
QKV_NORM_ROPE(float, 0, qkv_norm_rope_f32)
QKV_NORM_ROPE(bf16, 0, qkv_norm_rope_bf16)
QKV_NORM_ROPE(float, 1, qkv_norm_rope_axial_f32)
QKV_NORM_ROPE(bf16, 1, qkv_norm_rope_axial_bf16)
QKV_NORM_ROPE(float, 2, qkv_norm_rope_pairs_f32)
QKV_NORM_ROPE(bf16, 2, qkv_norm_rope_pairs_bf16)

// Split-half q/k/v norm + RoPE with the keys and values written to a cache as well (CACHE above).
#define QKV_NORM_ROPE_CACHED(T, NAME)                                                                    \
    extern "C" __global__ void NAME(T* qkv, long stride, int rows, int hq, int hkv, int hd, const float* qw, \
                                    const float* kw, int v_norm, int qk_norm, float eps, const float* rope, int rope_len, \
                                    int tbl_half, const u32* pos, const u32* at, T* kc, long ks, T* vc, long vs) { \
        pdl_enter();                                                                                      \
        qkv_norm_rope_impl<T, 0, true>(qkv, stride, rows, hq, hkv, hd, qw, kw, v_norm, qk_norm, eps, rope,       \
                                       rope_len, tbl_half, pos, at, kc, ks, vc, vs);                       \
    }
QKV_NORM_ROPE_CACHED(float, qkv_norm_rope_cached_f32)
QKV_NORM_ROPE_CACHED(bf16, qkv_norm_rope_cached_bf16)

#define RMS_NORM_WARP(TI, TO, NAME)                                                                      \
    extern "C" __global__ void NAME(const TI* x, long xs, const float* w, TO* out, long os, long rows,     \
                                    int cols, float eps) {                                                \
        pdl_enter();                                                                                      \
        rms_norm_warp_impl<TI, TO>(x, xs, w, out, os, rows, cols, eps);                                    \
    }
RMS_NORM_WARP(float, float, rms_norm_warp_f32_f32)
RMS_NORM_WARP(float, bf16, rms_norm_warp_f32_bf16)
RMS_NORM_WARP(bf16, float, rms_norm_warp_bf16_f32)
RMS_NORM_WARP(bf16, bf16, rms_norm_warp_bf16_bf16)

#define RESIDUAL_NORM_WARP(TY, TO, NAME)                                                                 \
    extern "C" __global__ void NAME(float* h, long hs, const TY* y, long ys, const float* post, float scale, \
                                    int mode, const float* next, TO* out, long os, long rows, int cols,     \
                                    float eps) {                                                          \
        pdl_enter();                                                                                      \
        residual_norm_warp_impl<TY, TO>(h, hs, y, ys, post, scale, mode, next, out, os, rows, cols, eps);  \
    }
RESIDUAL_NORM_WARP(float, float, residual_norm_warp_f32_f32)
RESIDUAL_NORM_WARP(float, bf16, residual_norm_warp_f32_bf16)
RESIDUAL_NORM_WARP(bf16, float, residual_norm_warp_bf16_f32)
RESIDUAL_NORM_WARP(bf16, bf16, residual_norm_warp_bf16_bf16)

// The 4-wide kernels (split-half for 256·m, interleaved for 128·m below), by implementation.
#define QKV_NORM_ROPE_VEC(IMPL, T, NAME)                                                                 \
    extern "C" __global__ void NAME(T* qkv, long stride, int rows, int hq, int hkv, int hd, const float* qw, \
                                    const float* kw, int v_norm, int qk_norm, float eps, const float* rope, int rope_len, \
                                    int tbl_half, const u32* pos) {                                       \
        pdl_enter();                                                                                      \
        IMPL<T>(qkv, stride, rows, hq, hkv, hd, qw, kw, v_norm, qk_norm, eps, rope, rope_len, tbl_half, pos);      \
    }
QKV_NORM_ROPE_VEC(qkv_norm_rope_vec_impl, float, qkv_norm_rope_vec_f32)
QKV_NORM_ROPE_VEC(qkv_norm_rope_vec_impl, bf16, qkv_norm_rope_vec_bf16)

#define QKV_NORM_ROPE_AXIAL64(T, NAME)                                                                   \
    extern "C" __global__ void NAME(T* qkv, long stride, int rows, int hq, int hkv, int hd, const float* qw, \
                                    const float* kw, int v_norm, int qk_norm, float eps, const float* rope, int rope_len, \
                                    int tbl_half, const u32* pos) {                                       \
        pdl_enter();                                                                                      \
        qkv_norm_rope_axial64_impl<T>(qkv, stride, rows, hq, hkv, qw, kw, v_norm, qk_norm, eps, rope, rope_len,     \
                                      tbl_half, pos);                                                     \
    }
QKV_NORM_ROPE_AXIAL64(float, qkv_norm_rope_axial64_f32)
QKV_NORM_ROPE_AXIAL64(bf16, qkv_norm_rope_axial64_bf16)

// ---- Any row norm: RMS or layer, affine or not, adaLN-modulated or not (the DiT norms), and the
// residual step with any post-norm, a tanh gate and any next norm. One block per row, the row
// staged in dynamic shared memory (cols floats); statistics in f32, two passes (mean, then the
// squares around it) as the CPU reference does in f64.

// (mean, 1/sqrt(var + eps)) of `row`, mean 0 for RMS (kind 0), around the mean for layer (kind 1).
// Each thread reads back only the entries it wrote.
__device__ __forceinline__ float2 row_stats(const float* row, int cols, int kind, float eps, float* sh) {
    float mean = 0.f;
    if (kind == 1) {
        float s = 0.f;
        for (int c = threadIdx.x; c < cols; c += blockDim.x) s += row[c];
        mean = block_sum(s, sh) / cols;
    }
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float d = row[c] - mean;
        ss += d * d;
    }
    ss = block_sum(ss, sh);
    return make_float2(mean, 1.f / sqrtf(ss / cols + eps));
}

// (N(v) · w + b) · (1 + s), each factor optional (null), in the reference's order.
__device__ __forceinline__ float norm_affine(float v, float2 st, int c, const float* w, const float* b,
                                             const float* s) {
    float y = (v - st.x) * st.y;
    if (w) y *= w[c];
    if (b) y += b[c];
    if (s) y *= 1.f + s[c];
    return y;
}

// `act` (image_act's codes, −1 none) is applied to the normalised value before it is stored: the
// VAE resnets' SiLU ∘ norm, whose only reader is a convolution.
template <typename TI, typename TO>
__device__ __forceinline__ void row_norm_impl(const TI* x, long xs, int kind, const float* w, const float* b,
                                              const float* s, float eps, TO* out, long os, int cols, int act) {
    extern __shared__ float row[];
    __shared__ float sh[32];
    const long r = blockIdx.x;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] = to_f(x[r * xs + c]);
    const float2 st = row_stats(row, cols, kind, eps, sh);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        out[r * os + c] = from_f<TO>(image_act(act, norm_affine(row[c], st, c, w, b, s)));
}

// h = (h + tanh(g) ⊙ N_post(y)) · scale (post_kind −1: no post-norm; g null: no gate), then
// mode 0 nothing, 1 out = N_next(h), 2 out = h. Each norm: kind, weight, bias, modulation, eps.
template <typename TY, typename TO>
__device__ __forceinline__ void residual_any_impl(float* h, long hs, const TY* y, long ys, int post_kind,
                                                  const float* pw, const float* pb, const float* ps, float peps,
                                                  const float* g, float scale, int mode, int next_kind,
                                                  const float* nw, const float* nb, const float* ns, float neps,
                                                  TO* out, long os, int cols) {
    extern __shared__ float row[];
    __shared__ float sh[32];
    const long r = blockIdx.x;
    float* hr = h + r * hs;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) row[c] = to_f(y[r * ys + c]);
    float2 st = make_float2(0.f, 1.f);
    if (post_kind >= 0) st = row_stats(row, cols, post_kind, peps, sh);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = post_kind >= 0 ? norm_affine(row[c], st, c, pw, pb, ps) : row[c];
        if (g) v *= tanhf(g[c]);
        const float hv = (hr[c] + v) * scale;
        hr[c] = hv;
        row[c] = hv;
    }
    if (mode == 0) return;
    TO* orow = out + r * os;
    if (mode == 2) {
        for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f<TO>(row[c]);
        return;
    }
    const float2 st2 = row_stats(row, cols, next_kind, neps, sh);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = from_f<TO>(norm_affine(row[c], st2, c, nw, nb, ns));
}

// Both general kernels, and their vector variants below, by implementation (IMPL).
#define ROW_NORM(IMPL, TI, TO, NAME)                                                                     \
    extern "C" __global__ void NAME(const TI* x, long xs, int kind, const float* w, const float* b,         \
                                    const float* s, float eps, TO* out, long os, int cols, int act) {     \
        pdl_enter();                                                                                      \
        IMPL<TI, TO>(x, xs, kind, w, b, s, eps, out, os, cols, act);                                      \
    }
ROW_NORM(row_norm_impl, float, float, row_norm_f32_f32)
ROW_NORM(row_norm_impl, float, bf16, row_norm_f32_bf16)
ROW_NORM(row_norm_impl, bf16, float, row_norm_bf16_f32)
ROW_NORM(row_norm_impl, bf16, bf16, row_norm_bf16_bf16)

#define RESIDUAL_ANY(IMPL, TY, TO, NAME)                                                                 \
    extern "C" __global__ void NAME(float* h, long hs, const TY* y, long ys, int post_kind, const float* pw, \
                                    const float* pb, const float* ps, float peps, const float* g, float scale, \
                                    int mode, int next_kind, const float* nw, const float* nb,              \
                                    const float* ns, float neps, TO* out, long os, int cols) {            \
        pdl_enter();                                                                                      \
        IMPL<TY, TO>(h, hs, y, ys, post_kind, pw, pb, ps, peps, g, scale, mode, next_kind, nw, nb, ns, neps,  \
                     out, os, cols);                                                                      \
    }
RESIDUAL_ANY(residual_any_impl, float, float, residual_any_f32_f32)
RESIDUAL_ANY(residual_any_impl, float, bf16, residual_any_f32_bf16)
RESIDUAL_ANY(residual_any_impl, bf16, float, residual_any_bf16_f32)
RESIDUAL_ANY(residual_any_impl, bf16, bf16, residual_any_bf16_bf16)

// ---- Vector variants of the general row norm and residual: rows held in registers 4-wide, the
// helpers in rowvec.cuh (shared with gemv.cu's products that end in a residual step).

// The held row normed, affine-mapped and activated in registers.
template <int N>
__device__ __forceinline__ void norm_act_row_vec(float (&v)[N][4], int kind, const float* w, const float* b,
                                                 const float* s, float eps, int cols, int act, const RowThreads& rt) {
    const float2 st = row_stats_vec(v, cols, kind, eps, rt);
    // The weights' loads all before the first store (see residual_any_vec_impl).
    norm_affine_row_vec(v, st, cols, w, b, s, rt);
    if (act >= 0) {
#pragma unroll
        for (int i = 0; i < N; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) v[i][j] = image_act(act, v[i][j]);
    }
}

// Row r by the threads `rt`.
template <typename TI, typename TO>
__device__ __forceinline__ void row_norm_vec_row(const TI* x, long xs, int kind, const float* w, const float* b,
                                                 const float* s, float eps, TO* out, long os, int cols, int act,
                                                 long r, const RowThreads& rt) {
    float v[RN_CHUNKS][4];
    load_row_vec(x + r * xs, cols, v, rt);
    norm_act_row_vec(v, kind, w, b, s, eps, cols, act, rt);
    store_row_vec(out + r * os, cols, v, rt);
}

// One row per block, its threads the whole block.
template <typename TI, typename TO>
__device__ __forceinline__ void row_norm_vec_impl(const TI* x, long xs, int kind, const float* w, const float* b,
                                                  const float* s, float eps, TO* out, long os, int cols, int act) {
    __shared__ float sh[32];
    row_norm_vec_row(x, xs, kind, w, b, s, eps, out, os, cols, act, (long)blockIdx.x, block_row_threads(sh));
}

// Rows of at most 4·32·C columns, R of them a warp (C·R = 8: the 32 registers of values
// row_norm_vec holds for one row), as many warps as the block has. A block of one such row
// (row_norm_vec) holds 32 threads, so a multiprocessor, at most 32 blocks, ran half full on the VAE
// decoders' narrow rows (Qwen-Image-2.1's 144 channels at 1024²: a million rows); with one row a
// warp, a 144-wide bf16 row kept 288 bytes a warp in flight and the decoder's narrow norms ran at
// 0.9-1.6 TB/s (run g20). So every load of the warp's R rows is issued before the first sum.
// Same sums, bit for bit: a one-warp row_sum is the block sum of one warp, and chunks past the row
// hold zeros (rowvec.cuh).
template <typename TI, typename TO, int C, int R>
__device__ __forceinline__ void row_norm_warps_impl(const TI* x, long xs, int kind, const float* w, const float* b,
                                                    const float* s, float eps, TO* out, long os, int cols, int act,
                                                    long rows) {
    const long r0 = ((long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * R;
    if (r0 >= rows) return;  // whole warps: nothing below waits on another warp
    // One warp: row_sum needs no shared memory and no barrier (bar 1 is never reached).
    const RowThreads rt{(int)(threadIdx.x & 31), 32, nullptr, 1};
    if constexpr (R == 1) {
        row_norm_vec_row(x, xs, kind, w, b, s, eps, out, os, cols, act, r0, rt);
        return;
    }
    const int n = (int)min((long)R, rows - r0);
    float v[R][C][4];
#pragma unroll
    for (int k = 0; k < R; k++)
        if (k < n) load_row_vec(x + (r0 + k) * xs, cols, v[k], rt);
#pragma unroll
    for (int k = 0; k < R; k++)
        if (k < n) norm_act_row_vec(v[k], kind, w, b, s, eps, cols, act, rt);
#pragma unroll
    for (int k = 0; k < R; k++)
        if (k < n) store_row_vec(out + (r0 + k) * os, cols, v[k], rt);
}

// Asks L2 for the lines of a per-column vector this thread will read after a reduction, so that
// read costs an L2 hit rather than a DRAM round trip (decoding's one-row launches are latency-bound).
__device__ __forceinline__ void prefetch_vec_l2(const float* p, int cols) {
    if (!p) return;
#pragma unroll
    for (int i = 0; i < RN_CHUNKS; i++) {
        const int c = 4 * (threadIdx.x + i * blockDim.x);
        if (c < cols) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + c));
    }
}

// Every read of a pass is issued before its first store: a store between two loads keeps the
// compiler from moving the second above it (they might alias), and with one load per chunk behind
// each store a one-row launch — decoding's residual + norm — waited on one DRAM round trip per chunk.
template <typename TY, typename TO>
__device__ __forceinline__ void residual_any_vec_impl(float* h, long hs, const TY* y, long ys, int post_kind,
                                                      const float* pw, const float* pb, const float* ps, float peps,
                                                      const float* g, float scale, int mode, int next_kind,
                                                      const float* nw, const float* nb, const float* ns, float neps,
                                                      TO* out, long os, int cols) {
    __shared__ float sh[32];
    const RowThreads rt = block_row_threads(sh);
    const long r = blockIdx.x;
    float* hr = h + r * hs;
    if (mode == 1) {
        prefetch_vec_l2(nw, cols);
        prefetch_vec_l2(nb, cols);
        prefetch_vec_l2(ns, cols);
    }
    float v[RN_CHUNKS][4], hv[RN_CHUNKS][4];
    load_row_vec(y + r * ys, cols, v, rt);
    load_row_vec(hr, cols, hv, rt);
    if (post_kind >= 0) norm_affine_row_vec(v, row_stats_vec(v, cols, post_kind, peps, rt), cols, pw, pb, ps, rt);
#pragma unroll
    for (int i = 0; i < RN_CHUNKS; i++) {
        const int c = 4 * (threadIdx.x + i * blockDim.x);
        if (c < cols) {
            float gv[4];
            if (g) load4(g + c, gv);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float bv = g ? v[i][j] * tanhf(gv[j]) : v[i][j];
                v[i][j] = (hv[i][j] + bv) * scale;
            }
        }
    }
    store_row_vec(hr, cols, v, rt);
    if (mode == 0) return;
    if (mode == 1) norm_affine_row_vec(v, row_stats_vec(v, cols, next_kind, neps, rt), cols, nw, nb, ns, rt);
    store_row_vec(out + r * os, cols, v, rt);
}

ROW_NORM(row_norm_vec_impl, float, float, row_norm_vec_f32_f32)
ROW_NORM(row_norm_vec_impl, float, bf16, row_norm_vec_f32_bf16)
ROW_NORM(row_norm_vec_impl, bf16, float, row_norm_vec_bf16_f32)
ROW_NORM(row_norm_vec_impl, bf16, bf16, row_norm_vec_bf16_bf16)

#define ROW_NORM_WARPS(TI, TO, C, R, NAME)                                                                \
    extern "C" __global__ void NAME(const TI* x, long xs, int kind, const float* w, const float* b,         \
                                    const float* s, float eps, TO* out, long os, int cols, int act,       \
                                    long rows) {                                                          \
        pdl_enter();                                                                                      \
        row_norm_warps_impl<TI, TO, C, R>(x, xs, kind, w, b, s, eps, out, os, cols, act, rows);           \
    }
#define ROW_NORM_WARPS_ALL(TI, TO, SUFFIX)                                                                \
    ROW_NORM_WARPS(TI, TO, RN_CHUNKS, 1, row_norm_warps_##SUFFIX)                                        \
    ROW_NORM_WARPS(TI, TO, 4, 2, row_norm_warps2_##SUFFIX)                                                \
    ROW_NORM_WARPS(TI, TO, 2, 4, row_norm_warps4_##SUFFIX)                                                \
    ROW_NORM_WARPS(TI, TO, 1, 8, row_norm_warps8_##SUFFIX)
ROW_NORM_WARPS_ALL(float, float, f32_f32)
ROW_NORM_WARPS_ALL(float, bf16, f32_bf16)
ROW_NORM_WARPS_ALL(bf16, float, bf16_f32)
ROW_NORM_WARPS_ALL(bf16, bf16, bf16_bf16)
RESIDUAL_ANY(residual_any_vec_impl, float, float, residual_any_vec_f32_f32)
RESIDUAL_ANY(residual_any_vec_impl, float, bf16, residual_any_vec_f32_bf16)
RESIDUAL_ANY(residual_any_vec_impl, bf16, float, residual_any_vec_bf16_f32)
RESIDUAL_ANY(residual_any_vec_impl, bf16, bf16, residual_any_vec_bf16_bf16)

// Interleaved (complex-pair) q/k norm + RoPE for heads of 128·m (m ≤ 4, Z-Image's 128): lane l
// owns channels 128t + 4l … + 3, i.e. pairs 64t + 2l and + 1, so every access to the row, the
// weights and the RoPE table is a vector (the scalar kernel moves 2-byte values). Same arguments
// and arithmetic order as qkv_norm_rope_impl<T, 2>; the host picks it for aligned rows and tables.
// Heads of 128 (HPW = 4, K = 1) go four to a warp, whose loads are all issued before its first
// sum: one head a warp had a single 256-byte load in flight per warp between its sums, and ran the
// DiT steps' q/k at ~1.2 TB/s (runs g15, g17: ~103 µs a launch for 2 × 3,840 columns of 4,128
// rows). Wider heads (HPW = 1, K = 4) keep one a warp; both keep 16 values a lane.
template <typename T, int K, int HPW>
__device__ __forceinline__ void qkv_norm_rope_pairs_vec_impl(T* qkv, long stride, int rows, int hq, int hkv, int hd,
                                                             const float* qw, const float* kw, int v_norm, int qk_norm,
                                                             float eps, const float* rope, int rope_len,
                                                             int tbl_half, const u32* pos) {
    const int heads = hq + 2 * hkv;
    // Heads are counted in 32 bits (the host checks rows · heads < 2^31).
    const int total = rows * heads;
    const int g0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * HPW;
    const int lane = threadIdx.x & 31;
    const int k = hd >> 7;
    float v[HPW][K][4];
    // The warp's heads (row, head): one division for the first, the others counted on from it.
    // A 64-bit division and remainder per head in both loops below were ~30 calls of the
    // division routine, ~110 us a DiT layer's launch (runs g20, g22), 2.5x its traffic's time.
    int row[HPW], head[HPW];
    row[0] = (unsigned)g0 / (unsigned)heads;
    head[0] = g0 - row[0] * heads;
#pragma unroll
    for (int i = 1; i < HPW; i++) {
        row[i] = row[i - 1];
        head[i] = head[i - 1] + 1;
        if (head[i] == heads) {
            head[i] = 0;
            row[i]++;
        }
    }
    // Whether each head is this warp's to do (warp-uniform): in range, and not a value head
    // unless values are normed.
    bool mine[HPW];
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        mine[i] = g0 + i < total && (v_norm || head[i] < hq + hkv);
        if (!mine[i]) continue;
        const T* x = qkv + (long)row[i] * stride + (long)head[i] * hd;
#pragma unroll
        for (int t = 0; t < K; t++)
            if (t < k) load4(x + 128 * t + 4 * lane, v[i][t]);
    }
#pragma unroll
    for (int i = 0; i < HPW; i++) {
        if (!mine[i]) continue;
        const long r = row[i];
        const int hh = head[i];
        const bool is_v = hh >= hq + hkv;
        // qk_norm 0: q and k heads are only rotated (normed as usual when nothing rotates, as on the CPU).
        const bool normed = is_v || qk_norm || rope == nullptr;
        const float* w = hh < hq ? qw : (hh < hq + hkv ? kw : nullptr);
        T* x = qkv + r * stride + (long)hh * hd;
        float ss = 0.f;
#pragma unroll
        for (int t = 0; t < K; t++) {
            if (t < k) {
#pragma unroll
                for (int j = 0; j < 4; j++) ss += v[i][t][j] * v[i][t][j];
            }
        }
        ss = warp_sum(ss);
        const float inv = normed ? 1.f / sqrtf(ss / hd + eps) : 1.f;
        const bool rotate = !is_v && rope != nullptr;
        const long p = rotate ? (long)pos[r] : 0;
#pragma unroll
        for (int t = 0; t < K; t++) {
            if (t < k) {
                const int c = 128 * t + 4 * lane;
                float wv[4];
                if (w) load4(w + c, wv);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    v[i][t][j] *= inv;
                    if (w) v[i][t][j] *= wv[j];
                }
                if (rotate) {
                    const float2 cs = *reinterpret_cast<const float2*>(rope + p * tbl_half + c / 2);
                    const float2 sn = *reinterpret_cast<const float2*>(rope + ((long)rope_len + p) * tbl_half + c / 2);
                    const float a0 = v[i][t][0], b0 = v[i][t][1], a1 = v[i][t][2], b1 = v[i][t][3];
                    v[i][t][0] = a0 * cs.x - b0 * sn.x;
                    v[i][t][1] = a0 * sn.x + b0 * cs.x;
                    v[i][t][2] = a1 * cs.y - b1 * sn.y;
                    v[i][t][3] = a1 * sn.y + b1 * cs.y;
                }
                store4(x + c, v[i][t]);
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void qkv_norm_rope_pairs_any_impl(T* qkv, long stride, int rows, int hq, int hkv, int hd,
                                                             const float* qw, const float* kw, int v_norm, int qk_norm,
                                                             float eps, const float* rope, int rope_len,
                                                             int tbl_half, const u32* pos) {
    if (hd == 128)
        qkv_norm_rope_pairs_vec_impl<T, 1, 4>(qkv, stride, rows, hq, hkv, hd, qw, kw, v_norm, qk_norm, eps, rope,
                                              rope_len, tbl_half, pos);
    else
        qkv_norm_rope_pairs_vec_impl<T, 4, 1>(qkv, stride, rows, hq, hkv, hd, qw, kw, v_norm, qk_norm, eps, rope,
                                              rope_len, tbl_half, pos);
}
QKV_NORM_ROPE_VEC(qkv_norm_rope_pairs_any_impl, float, qkv_norm_rope_pairs_vec_f32)
QKV_NORM_ROPE_VEC(qkv_norm_rope_pairs_any_impl, bf16, qkv_norm_rope_pairs_vec_bf16)
