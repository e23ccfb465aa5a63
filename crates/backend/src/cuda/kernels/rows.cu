// Row gathers, scatters and pooling: position rows added by index, k×k average pooling of packed
// grids, rows scattered to listed places; each row's first largest value. CPU references:
// crates/backend/src/cpu/rows.rs, first_argmax in crates/backend/src/lib.rs.

// x[r] += table[pos[2r]] + table[axis_rows + pos[2r+1]] (the two table rows summed first).
// One block per row.
template <typename TT, typename TX>
__device__ __forceinline__ void add_positions_2d_impl(const TT* table, int dim, int axis_rows, const u32* pos, TX* x,
                                                      long xs) {
    const long r = blockIdx.x;
    const TT* tx = table + (long)pos[2 * r] * dim;
    const TT* ty = table + ((long)axis_rows + pos[2 * r + 1]) * dim;
    TX* row = x + r * xs;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) row[c] = from_f<TX>(to_f(row[c]) + (to_f(tx[c]) + to_f(ty[c])));
}

// k×k average pooling of packed patch grids. grids: (first patch row, width, height, first
// pooled row) per image. Grid (pooled rows, column blocks); the image of a pooled row is found by
// binary search over the first-pooled-row column.
template <typename TI, typename TO>
__device__ __forceinline__ void avg_pool2d_impl(const TI* x, long xs, const u32* grids, int images, int k,
                                                float scale, TO* out, long os, int cols) {
    const int o = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    int lo = 0, hi = images;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((int)grids[4 * mid + 3] <= o) lo = mid; else hi = mid;
    }
    const int first = grids[4 * lo], w = grids[4 * lo + 1], fp = grids[4 * lo + 3];
    const int cell = o - fp, per_row = w / k;
    const int cy = cell / per_row, cx = cell - cy * per_row;
    const long top_left = first + (long)cy * k * w + (long)cx * k;
    float acc = 0.f;
    for (int dy = 0; dy < k; dy++)
        for (int dx = 0; dx < k; dx++) acc += to_f(x[(top_left + (long)dy * w + dx) * xs + c]);
    out[(long)o * os + c] = from_f<TO>(acc / (float)(k * k) * scale);
}

// dst[at[i]] = src[i]. One block per source row.
template <typename TI, typename TO>
__device__ __forceinline__ void scatter_rows_impl(const TI* src, long ss, const u32* at, TO* dst, long ds, int cols) {
    const long i = blockIdx.x;
    const TI* s = src + i * ss;
    TO* d = dst + (long)at[i] * ds;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = from_f<TO>(to_f(s[c]));
}

// (value, index) of the larger, the lower index on equal values: the first of the largest.
__device__ __forceinline__ void argmax_pick(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// out[r] = the index of the first largest value of row r: 0 when no value is above -inf, and
// 0xffffffff when the row holds a NaN. One block per row (up to 1024 threads): each thread keeps
// the first largest of its strided columns (a strict > in column order), then the block reduces
// (value, index) pairs with the lower index winning ties.
template <typename T>
__device__ __forceinline__ void argmax_rows_impl(const T* x, long xs, int cols, u32* out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const T* row = x + (long)blockIdx.x * xs;
    float best = NEG_INF;
    int at = 0x7fffffff;  // none above -inf
    int nan = 0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = to_f(row[c]);
        nan |= v != v;
        if (v > best) {
            best = v;
            at = c;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_pick(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    nan = __syncthreads_or(nan);
    const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) {
        sv[w] = best;
        si[w] = at;
    }
    __syncthreads();
    if (w != 0) return;
    const int nw = (blockDim.x + 31) >> 5;
    best = l < nw ? sv[l] : NEG_INF;
    at = l < nw ? si[l] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        argmax_pick(best, at, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, at, o));
    if (l == 0) out[blockIdx.x] = nan ? 0xffffffffu : (at == 0x7fffffff ? 0u : (u32)at);
}

#define ADD_POS(TT, TX, NAME)                                                                             \
    extern "C" __global__ void NAME(const TT* table, int dim, int axis_rows, const u32* pos, TX* x, long xs) { \
        pdl_enter();                                                                                           \
        add_positions_2d_impl<TT, TX>(table, dim, axis_rows, pos, x, xs);                                 \
    }
ADD_POS(float, float, add_positions_2d_f32_f32)
ADD_POS(float, bf16, add_positions_2d_f32_bf16)
ADD_POS(bf16, float, add_positions_2d_bf16_f32)
ADD_POS(bf16, bf16, add_positions_2d_bf16_bf16)

#define AVG_POOL(TI, TO, NAME)                                                                            \
    extern "C" __global__ void NAME(const TI* x, long xs, const u32* grids, int images, int k, float scale, TO* out, \
                                    long os, int cols) {                                                  \
        pdl_enter();                                                                                      \
        avg_pool2d_impl<TI, TO>(x, xs, grids, images, k, scale, out, os, cols);                           \
    }
AVG_POOL(float, float, avg_pool2d_f32_f32)
AVG_POOL(float, bf16, avg_pool2d_f32_bf16)
AVG_POOL(bf16, float, avg_pool2d_bf16_f32)
AVG_POOL(bf16, bf16, avg_pool2d_bf16_bf16)

#define SCATTER(TI, TO, NAME)                                                                             \
    extern "C" __global__ void NAME(const TI* src, long ss, const u32* at, TO* dst, long ds, int cols) {   \
        pdl_enter();                                                                                       \
        scatter_rows_impl<TI, TO>(src, ss, at, dst, ds, cols);                                            \
    }
SCATTER(float, float, scatter_rows_f32_f32)
SCATTER(float, bf16, scatter_rows_f32_bf16)
SCATTER(bf16, float, scatter_rows_bf16_f32)
SCATTER(bf16, bf16, scatter_rows_bf16_bf16)

#define ARGMAX(T, NAME)                                                             \
    extern "C" __global__ void NAME(const T* x, long xs, int cols, u32* out) {      \
        pdl_enter();                                                                \
        argmax_rows_impl<T>(x, xs, cols, out);                                      \
    }
ARGMAX(float, argmax_rows_f32)
ARGMAX(bf16, argmax_rows_bf16)
