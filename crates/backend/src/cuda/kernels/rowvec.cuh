// Rows held in registers 4-wide, for the vector row norm and residual kernels (norm.cu) and the
// products that end in a residual step (gemv.cu): rows of 4·m columns whose rows and vectors are
// aligned for 4-wide accesses; thread t of the T that hold a row holds columns 4(t + i·T) … + 3 for
// i < RN_CHUNKS in registers, so every load of a row is in flight at once (norm.cu's loops wait on
// one load per iteration, which left them at ~400 GB/s on Z-Image's 3840-wide rows). The host
// gives a row ⌈cols / (4·RN_CHUNKS)⌉ threads rounded up to a warp. Same arithmetic as norm.cu's
// scalar kernels.
#define RN_CHUNKS 8

// The threads that hold one row: thread t of T, with 32 floats of shared memory `sh` for the row's
// sums and the named barrier `bar` of the group (0: they are the whole block, as in norm.cu's
// kernels of a row per block; a group of warps of a larger block otherwise).
struct RowThreads {
    int t, T;
    float* sh;
    int bar;
};

__device__ __forceinline__ RowThreads block_row_threads(float* sh) {
    return RowThreads{(int)threadIdx.x, (int)blockDim.x, sh, 0};
}

// Sum over the row's threads; every one gets the total. The whole block: block_sum. A group: the
// same steps (warp sums, then the warps' totals summed by a warp, lanes past them adding zeros)
// behind the group's own barrier, so a row's sum has the same bits either way.
__device__ __forceinline__ float row_sum(float v, const RowThreads& rt) {
    if (rt.bar == 0) return block_sum(v, rt.sh);
    v = warp_sum(v);
    if (rt.T == 32) return warp_sum((rt.t & 31) == 0 ? v : 0.f);  // one warp: no barrier needed
    const int w = rt.t >> 5, l = rt.t & 31;
    asm volatile("bar.sync %0, %1;" ::"r"(rt.bar), "r"(rt.T) : "memory");  // `sh` may still be read
    if (l == 0) rt.sh[w] = v;
    asm volatile("bar.sync %0, %1;" ::"r"(rt.bar), "r"(rt.T) : "memory");
    const int nw = (rt.T + 31) >> 5;
    v = l < nw ? rt.sh[l] : 0.f;
    return warp_sum(v);
}

// (mean, 1/sqrt(var + eps)) of the held values (columns at or past `cols` hold 0 and are skipped).
// Every helper below takes N chunks a thread (RN_CHUNKS, or fewer where N·4·T covers the row: the
// chunks past the row hold zeros and are skipped, so the sums have the same bits either way).
template <int N>
__device__ __forceinline__ float2 row_stats_vec(const float (&v)[N][4], int cols, int kind, float eps,
                                                const RowThreads& rt) {
    float mean = 0.f;
    if (kind == 1) {
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < N; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) s += v[i][j];
        mean = row_sum(s, rt) / cols;
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (4 * (rt.t + i * rt.T) < cols) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float d = v[i][j] - mean;
                ss += d * d;
            }
        }
    }
    ss = row_sum(ss, rt);
    return make_float2(mean, 1.f / sqrtf(ss / cols + eps));
}

// norm_affine on four columns from c.
__device__ __forceinline__ void norm_affine4(float (&v)[4], float2 st, int c, const float* w, const float* b,
                                             const float* s) {
    float wv[4], bv[4], sv[4];
    if (w) load4(w + c, wv);
    if (b) load4(b + c, bv);
    if (s) load4(s + c, sv);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float y = (v[j] - st.x) * st.y;
        if (w) y *= wv[j];
        if (b) y += bv[j];
        if (s) y *= 1.f + sv[j];
        v[j] = y;
    }
}

template <typename T, int N>
__device__ __forceinline__ void load_row_vec(const T* row, int cols, float (&v)[N][4], const RowThreads& rt) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int c = 4 * (rt.t + i * rt.T);
        if (c < cols) {
            load4(row + c, v[i]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; j++) v[i][j] = 0.f;
        }
    }
}

template <typename T, int N>
__device__ __forceinline__ void store_row_vec(T* row, int cols, const float (&v)[N][4], const RowThreads& rt) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int c = 4 * (rt.t + i * rt.T);
        if (c < cols) store4(row + c, v[i]);
    }
}

// norm_affine4 on every held chunk of the row; no store in between, so the weights' loads are
// all in flight together.
template <int N>
__device__ __forceinline__ void norm_affine_row_vec(float (&v)[N][4], float2 st, int cols, const float* w,
                                                    const float* b, const float* s, const RowThreads& rt) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const int c = 4 * (rt.t + i * rt.T);
        if (c < cols) norm_affine4(v[i], st, c, w, b, s);
    }
}
