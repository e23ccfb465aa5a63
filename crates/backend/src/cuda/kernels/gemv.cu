// Products of a few rows, streaming the weight: out[m, n] (= or +=) α · x[m, k] · w[n, k]ᵀ for m ≤ M,
// bf16 x and w, f32 accumulation, f32 or bf16 out. cuBLASLt's small-m products read the weight at a
// fraction of HBM bandwidth; here the weight is read once, in 16-byte loads, by as many threads as
// the GPU holds.
//
// gemv_m{M}_{out}: a CTA of T threads (a multiple of 32, at most 256: blockDim.x) owns R = 4
// consecutive weight rows and every one of the m ≤ M input rows. The k axis is cut into chunks of 8
// (one uint4 of bf16); thread t takes chunks t, t + T, t + 2T, … of all R weight rows (so the R
// loads of an iteration, and the next iteration's R, are in flight together), reads the same chunk
// of each input row (from L1/L2: x is small and every CTA reads it), and keeps R·M f32 sums,
// each chunk's 8 products added in order by FMA. Then the warp reduces its R·M sums by halving
// exchanges (every value's tree is the xor butterfly 16, 8, 4, 2, 1, as `warp_sum`'s, in 62
// shuffles for 64 sums instead of 320), warp totals go to shared memory, and R·M threads add the
// warps' totals in warp order and write α·sum (+ out).
//
// Sum order: a row's result depends on k and T alone (T is chosen from k), never on m or on the
// other rows: a batch of decode rows gives each row what it gives alone. It differs from
// cuBLASLt's, so bf16 results move within rounding against the cuBLASLt path.
//
// Speed: memory-bound at a few rows. Each weight element costs M FMAs, so at 16 rows streaming at
// an H200's 4.8 TB/s would take 3.8e13 f32 FMA/s against the CUDA cores' ~3.3e13: 16 rows cannot
// reach bandwidth here and 8 may not; tensor cores (mma with the weight as the 16-row A operand) are
// the way past that.
//
// The launcher guarantees: k a multiple of 8, x, x's row stride and w 16-byte aligned, 1 ≤ m ≤ M.
// Weight rows past n (the last CTA's) are read as row n − 1 and not written.

// GEMV_ROWS, GEMV_MAX_WARPS, the reduction and the store: gemv.cuh.

// A weight chunk: read once, so it bypasses L1 (which keeps x), and asks L2 for the next sectors.
// Volatile, as the input's load: neither may be hoisted above the bounds check that guards it.
__device__ __forceinline__ uint4 load_stream(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// An input chunk: read by every CTA, so cached.
__device__ __forceinline__ uint4 load_cached(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Eight bf16 (a uint4, element 0 in the low half of .x) as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

template <int M, typename TO>
__device__ __forceinline__ void gemv_impl(const bf16* __restrict__ x, long xs, const bf16* __restrict__ w, int k,
                                          int n, int m, TO* out, long os, float alpha, int accumulate) {
    constexpr int R = GEMV_ROWS, N = R * M;
    __shared__ float red[GEMV_MAX_WARPS * N];
    const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5;
    const int r0 = blockIdx.x * R;
    const int chunks = k >> 3;

    const bf16* wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) wr[r] = w + (long)min(r0 + r, n - 1) * k;

    float acc[N];  // acc[r * M + i]: weight row r0 + r, input row i
#pragma unroll
    for (int j = 0; j < N; j++) acc[j] = 0.f;

    uint4 cur[R];
    int c = tid;
    if (c < chunks) {
#pragma unroll
        for (int r = 0; r < R; r++) cur[r] = load_stream(wr[r] + 8 * (long)c);
    }
    while (c < chunks) {
        // The next iteration's weight chunks are read while this one's are used.
        const int cn = c + T;
        uint4 nxt[R] = {};
        if (cn < chunks) {
#pragma unroll
            for (int r = 0; r < R; r++) nxt[r] = load_stream(wr[r] + 8 * (long)cn);
        }
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; r++) unpack8(cur[r], wf[r]);
#pragma unroll
        for (int i = 0; i < M; i++) {
            if (i < m) {
                float xf[8];
                unpack8(load_cached(x + i * xs + 8 * (long)c), xf);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    float a = acc[r * M + i];
#pragma unroll
                    for (int e = 0; e < 8; e++) a = fmaf(wf[r][e], xf[e], a);
                    acc[r * M + i] = a;
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) cur[r] = nxt[r];
        c = cn;
    }

    gemv_store<N, M>(acc, red, lane, warp, tid, T, r0, n, m, out, os, alpha, accumulate);
}

#define GEMV(M, TO, NAME)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16* x, long xs, const bf16* w, int k, int n,   \
                                                           int m, TO* out, long os, float alpha, int accumulate) { \
        pdl_enter();                                                                                               \
        gemv_impl<M, TO>(x, xs, w, k, n, m, out, os, alpha, accumulate);                                        \
    }
GEMV(1, float, gemv_m1_f32)
GEMV(2, float, gemv_m2_f32)
GEMV(4, float, gemv_m4_f32)
GEMV(8, float, gemv_m8_f32)
GEMV(16, float, gemv_m16_f32)
GEMV(1, bf16, gemv_m1_bf16)
GEMV(2, bf16, gemv_m2_bf16)
GEMV(4, bf16, gemv_m4_bf16)
GEMV(8, bf16, gemv_m8_bf16)
GEMV(16, bf16, gemv_m16_bf16)

// gemv_tc_m{M}_{out} (M = 8 or 16; TESSERA_GEMV=tc): the same product on the tensor cores, for k a
// multiple of 32. At 8 or 16 rows the kernels above spend M FMAs of the CUDA cores on each weight
// element and read x once per four weight rows; here an mma.sync multiplies 16 weight rows by 8
// input rows at once and x is read once per 16 weight rows.
//
// A CTA of W warps (blockDim.x / 32, chosen from k) owns 16 weight rows; warp q takes the 32-wide k
// steps q, q + W, q + 2W, …, four at a time with their loads in flight together. In a step, lane
// (g = lane / 4, t = lane % 4) reads 16 bytes of weight row r0 + g and of row r0 + g + 8 at k offset
// 8t (the group's four lanes cover the step's 32 values) and 16 bytes of input row g (and g + 8 when
// M = 16), and issues two m16n8k16 products per 8 input rows: the first on each lane's values 0..3,
// the second on 4..7. That hands k positions to the MMA's k index in a permuted order — the same
// for the weight (A) and the input (B) fragment, whose lane layouts hold the same k indices — so
// the sums are the product's and every lane reads whole 16-byte chunks. Input rows past m are
// zeros. Each warp's 16 × M sums go to shared memory and gemv_add_warps adds the warps' in warp order.
//
// Sum order: a row's result depends on k alone (W and each warp's steps come from k; one column of
// an MMA does not depend on the others), never on m: a batch of decode rows gives each row what it
// gives alone. It differs from gemv_m{M}'s, so the two are not mixed: TESSERA_GEMV picks one.
//
// The launcher guarantees: k a multiple of 32, x, x's row stride and w 16-byte aligned, 1 ≤ m ≤ M.
// Which weight rows a CTA reads, and where its sums go, is the Out type's (below): 16 consecutive
// rows for a plain product, rows past n read as row n − 1 and not written.

// Where a tensor-core GEMV's sums go. row(j): the weight row the CTA reads as its row j (j < 16);
// store<M>(red, tid, T, m, α) once `red` holds every warp's 16 × M sums and the CTA is synchronised.
// PlainOut: rows 16b … 16b + 15 of CTA b, out[i, row] = α · sum (+ out).
template <typename TO>
struct PlainOut {
    TO* out;
    long os;
    int accumulate;
    int n;
    __device__ __forceinline__ int row(int j) const { return min((int)blockIdx.x * 16 + j, n - 1); }
    template <int M>
    __device__ __forceinline__ void store(const float* red, int tid, int T, int m, float alpha) const {
        gemv_add_warps<16 * M, M>(red, tid, T, (int)blockIdx.x * 16, n, m, out, os, alpha, accumulate);
    }
};

// GluOut: a gated MLP's gate|up product (w stacked [gate; up], n = 2·half rows) with the gating in
// its store, out[i, c] = act(gate_c) ⊙ up_c for c < half. CTA b reads gate rows 8b … 8b + 7 as its
// rows 0 … 7 and the matching up rows half + 8b … as 8 … 15, so both sums of an output are its own;
// each is summed over the warps in gemv_add_warps' order and rounded to bf16 as the product's bf16
// output would be, and the gating is the gated kernels' (elementwise.cu) — the bits of the product
// into [gate | up] followed by the gated kernel, in one launch. Rows past half read as half − 1.
template <int ACT>
struct GluOut {
    bf16* out;
    long os;
    int half;
    __device__ __forceinline__ int row(int j) const {
        const int c = min((int)blockIdx.x * 8 + (j & 7), half - 1);
        return j < 8 ? c : half + c;
    }
    template <int M>
    __device__ __forceinline__ void store(const float* red, int tid, int T, int m, float alpha) const {
        constexpr int N = 16 * M;
        const int warps = T >> 5, c0 = (int)blockIdx.x * 8;
        for (int j = tid; j < 8 * M; j += T) {
            const int c = j / M, i = j % M;
            if (c0 + c >= half || i >= m) continue;
            const int jg = c * M + i, ju = (c + 8) * M + i;
            float sg = red[jg], su = red[ju];
            for (int q = 1; q < warps; q++) {
                sg += red[q * N + jg];
                su += red[q * N + ju];
            }
            const float gate = to_f(from_f<bf16>(alpha * sg)), up = to_f(from_f<bf16>(alpha * su));
            out[i * os + c0 + c] = from_f<bf16>((ACT == 0 ? gelu_tanh(gate) : silu(gate)) * up);
        }
    }
};

// ResidualOut: the residual step after the product, in the product's kernel (one launch instead of
// two). Each CTA (rows as PlainOut's) rounds its columns of y = α · sum to bf16, as the product's
// bf16 output would be, and adds them into the residual stream, h = (h + y) · scale, for the columns
// it owns. The last CTA to finish — a grid-wide count (atom.inc, which wraps to 0 for the next
// launch) after a fence — then writes each row's next norm (mode 1) or copy (mode 2) of the finished
// h to `out`, with the row threads of residual_any_vec (rowvec.cuh: the same chunks, sums and order),
// so every value has the bits of the product into y followed by residual_any_vec. mode 0: h alone.
// Rows are taken by groups of `row_threads` threads (a multiple of 32 dividing the CTA, at most 8
// groups), each group with its own barrier.
struct ResidualOut {
    int n;
    float* h;
    long hs;
    float scale;
    int mode;
    int next_kind;
    const float* nw;
    const float* nb;
    const float* ns;
    float neps;
    bf16* out;
    long os;
    int cols;
    int row_threads;
    u32* counter;

    __device__ __forceinline__ int row(int j) const { return min((int)blockIdx.x * 16 + j, n - 1); }

    template <int M>
    __device__ __forceinline__ void store(const float* red, int tid, int T, int m, float alpha) const {
        constexpr int N = 16 * M;
        const int warps = T >> 5, r0 = (int)blockIdx.x * 16;
        for (int j = tid; j < N; j += T) {
            const int r = j / M, i = j % M;
            if (r0 + r >= n || i >= m) continue;
            float s = red[j];
            for (int q = 1; q < warps; q++) s += red[q * N + j];
            const float y = to_f(from_f<bf16>(alpha * s));
            float* hp = h + i * hs + r0 + r;
            *hp = (*hp + y) * scale;
        }
        if (mode == 0) return;
        __shared__ u32 ticket;
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // this CTA's h before its count
        __syncthreads();
        if (tid == 0) {
            asm volatile("atom.global.inc.u32 %0, [%1], %2;" : "=r"(ticket) : "l"(counter), "r"(gridDim.x - 1) : "memory");
        }
        __syncthreads();
        if (ticket != gridDim.x - 1) return;
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // every CTA's h before the reads below
        __shared__ float sh[GEMV_MAX_WARPS][32];
        const int groups = T / row_threads, gi = tid / row_threads;
        if (gi >= groups) return;
        const RowThreads rt{tid % row_threads, row_threads, sh[gi], 1 + gi};
        for (int i = gi; i < m; i += groups) {
            float v[RN_CHUNKS][4];
            // From L2: this CTA's L1 may hold lines of h from before the other CTAs wrote them.
#pragma unroll
            for (int c4 = 0; c4 < RN_CHUNKS; c4++) {
                const int c = 4 * (rt.t + c4 * rt.T);
                if (c < cols) {
                    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];"
                                 : "=f"(v[c4][0]), "=f"(v[c4][1]), "=f"(v[c4][2]), "=f"(v[c4][3])
                                 : "l"(h + i * hs + c));
                } else {
                    v[c4][0] = v[c4][1] = v[c4][2] = v[c4][3] = 0.f;
                }
            }
            if (mode == 1) norm_affine_row_vec(v, row_stats_vec(v, cols, next_kind, neps, rt), cols, nw, nb, ns, rt);
            store_row_vec(out + i * os, cols, v, rt);
        }
    }
};

template <int M, typename Out>
__device__ __forceinline__ void gemv_tc_impl(const bf16* __restrict__ x, long xs, const bf16* __restrict__ w, int k,
                                             int m, const Out o, float alpha) {
    constexpr int NT = M / 8, U = 4;
    __shared__ float red[GEMV_MAX_WARPS * 16 * M];  // red[warp][weight row][input row]
    const int tid = threadIdx.x, T = blockDim.x, lane = tid & 31, warp = tid >> 5, W = T >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int steps = k >> 5;
    const bf16* wa = w + (long)o.row(g) * k + 8 * t;
    const bf16* wb = w + (long)o.row(g + 8) * k + 8 * t;
    const bf16* xr[NT];
    bool xv[NT];
#pragma unroll
    for (int j = 0; j < NT; j++) {
        xv[j] = g + 8 * j < m;
        xr[j] = x + (long)(g + 8 * j) * xs + 8 * t;
    }

    float d[NT][4];
#pragma unroll
    for (int j = 0; j < NT; j++) d[j][0] = d[j][1] = d[j][2] = d[j][3] = 0.f;

    for (int s0 = warp; s0 < steps; s0 += W * U) {
        uint4 lo[U], hi[U], xin[U][NT];  // weight rows g and g + 8, inputs
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int s = s0 + u * W;
            const uint4 zero = {0u, 0u, 0u, 0u};
            lo[u] = hi[u] = zero;
#pragma unroll
            for (int j = 0; j < NT; j++) xin[u][j] = zero;
            if (s < steps) {
                const long off = (long)s * 32;
                lo[u] = load_stream(wa + off);
                hi[u] = load_stream(wb + off);
#pragma unroll
                for (int j = 0; j < NT; j++)
                    if (xv[j]) xin[u][j] = load_cached(xr[j] + off);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (s0 + u * W < steps) {  // the same for the whole warp, as mma.sync needs
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    mma_bf16(d[j], lo[u].x, hi[u].x, lo[u].y, hi[u].y, xin[u][j].x, xin[u][j].y);
                    mma_bf16(d[j], lo[u].z, hi[u].z, lo[u].w, hi[u].w, xin[u][j].z, xin[u][j].w);
                }
            }
        }
    }

    // d[j]: (weight row g, input rows 8j + 2t, +1), then (weight row g + 8, the same input rows).
    float* mine = red + warp * 16 * M;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int i = 8 * j + 2 * t;
        mine[g * M + i] = d[j][0];
        mine[g * M + i + 1] = d[j][1];
        mine[(g + 8) * M + i] = d[j][2];
        mine[(g + 8) * M + i + 1] = d[j][3];
    }
    __syncthreads();
    o.template store<M>(red, tid, T, m, alpha);
}

#define GEMV_TC(M, TO, NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16* x, long xs, const bf16* w, int k, int n,   \
                                                           int m, TO* out, long os, float alpha, int accumulate) { \
        pdl_enter();                                                                                               \
        gemv_tc_impl<M>(x, xs, w, k, m, PlainOut<TO>{out, os, accumulate, n}, alpha);                            \
    }
GEMV_TC(8, float, gemv_tc_m8_f32)
GEMV_TC(16, float, gemv_tc_m16_f32)
GEMV_TC(8, bf16, gemv_tc_m8_bf16)
GEMV_TC(16, bf16, gemv_tc_m16_bf16)

// gemv_tc_{act}_glu_m{M}: a gated MLP's gate|up product with the gating in its store (GluOut),
// out = act(x · W_gateᵀ) ⊙ (x · W_upᵀ) in bf16, for w = [gate; up] of n = 2·half rows; act: gelu
// (tanh) or silu.
#define GEMV_TC_GLU(M, ACT, NAME)                                                                                \
    extern "C" __global__ void __launch_bounds__(256) NAME(const bf16* x, long xs, const bf16* w, int k, int n,   \
                                                           int m, bf16* out, long os, float alpha) {              \
        pdl_enter();                                                                                               \
        gemv_tc_impl<M>(x, xs, w, k, m, GluOut<ACT>{out, os, n / 2}, alpha);                                     \
    }
GEMV_TC_GLU(8, 0, gemv_tc_gelu_glu_m8)
GEMV_TC_GLU(16, 0, gemv_tc_gelu_glu_m16)
GEMV_TC_GLU(8, 1, gemv_tc_silu_glu_m8)
GEMV_TC_GLU(16, 1, gemv_tc_silu_glu_m16)

// gemv_tc_res_m{M}: the product (bf16 y, never written) with the residual step that follows it in a
// pre-norm block, h = (h + y) · scale, then the next norm or copy of h into bf16 `out` (ResidualOut).
// (256, 1): the tail's row registers on top of the product's fit without spilling.
#define GEMV_TC_RES(M, NAME)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(const bf16* x, long xs, const bf16* w, int k,       \
                                                              int n, int m, float alpha, float* h, long hs,       \
                                                              float scale, int mode, int next_kind,               \
                                                              const float* nw, const float* nb, const float* ns,  \
                                                              float neps, bf16* out, long os, int cols,           \
                                                              int row_threads, u32* counter) {                    \
        pdl_enter();                                                                                               \
        gemv_tc_impl<M>(x, xs, w, k, m,                                                                            \
                        ResidualOut{n, h, hs, scale, mode, next_kind, nw, nb, ns, neps, out, os, cols, row_threads, \
                                    counter},                                                                      \
                        alpha);                                                                                    \
    }
GEMV_TC_RES(8, gemv_tc_res_m8)
GEMV_TC_RES(16, gemv_tc_res_m16)
