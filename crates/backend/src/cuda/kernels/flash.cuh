// What the two flash-attention kernels share: attention.cu (mma.sync, any sm_80+ GPU) and
// attention_sm90.cu (wgmma, Hopper). Both keep each warp's scores and outputs in the tensor-core
// accumulator layout: a warp owns 16 query rows, a thread rows g = lane / 4 and g + 8 ("lo" and
// "hi") and, in each 8-column n-tile, columns 2·(lane % 4) and the one after.

// Per-row key limits (`limits`, null when none; block-causal masks): packed query row i sees the
// first limits[i] keys of its segment [s0, s1), i.e. keys j < s0 + limits[i] (op/attention.rs,
// `Mask::Limits`). The end of the keys row i sees: s1 without limits, and for rows past q1 (the
// zero-filled queries of a short tile, whose output is never written), so they add no masking.
__device__ __forceinline__ int row_key_end(const u32* __restrict__ limits, int i, int q1, int s0, int s1) {
    if (!limits || i >= q1) return s1;
    return (int)min((long)s1, (long)s0 + (long)limits[i]);
}

// The end of the keys any of rows [q0, q1) sees under per-row limits: s0 plus their largest limit,
// at most s1. Each warp reads the rows' limits and reduces them alone (no shared memory, no
// barrier), so every thread of the CTA gets it; whole warps must call it. One redux.sync (sm_80)
// rather than five shuffles: with the shuffles ptxas spilled the 256- to 1152-wide kernels, which
// sit at 254 registers.
__device__ __forceinline__ int tile_key_end(const u32* __restrict__ limits, int q0, int q1, int s0, int s1) {
    int m = 0;
    for (int i = q0 + (int)(threadIdx.x & 31); i < q1; i += 32) m = max(m, (int)min(limits[i], (u32)(s1 - s0)));
    int top;
    asm volatile("redux.sync.max.s32 %0, %1, 0xffffffff;\n" : "=r"(top) : "r"(m));
    return s0 + top;
}

// The keys a CTA walks for query rows [q0, q1) of the segment [s0, s1): the segment cut to the
// window (inclusive radius), when causal to the last row, and under per-row limits to the largest
// limit of the rows (so no block past every row's limit is visited, and none any row needs is
// skipped); with key splits, chunk `chunk` of `kv_splits`, in whole blocks of BN (it may be empty,
// and a row may see no key of a non-empty one: its chunk's log2-sum-exp is then −inf, which the
// combine pass weighs 0). Whole warps must call it (`tile_key_end`).
template <int BN>
__device__ __forceinline__ void key_range(int& k_lo, int& k_hi, int q0, int q1, int s0, int s1, int window,
                                          int causal, const u32* __restrict__ limits, int chunk, int kv_splits) {
    k_lo = s0;
    k_hi = s1;
    if (window >= 0) {
        k_lo = max(s0, q0 - window);
        k_hi = min(s1, q1 + window);
    }
    if (causal) k_hi = min(k_hi, q1);
    if (limits) k_hi = max(k_lo, min(k_hi, tile_key_end(limits, q0, q1, s0, s1)));
    if (kv_splits > 1) {
        const int per = ((k_hi - k_lo + kv_splits - 1) / kv_splits + BN - 1) / BN * BN;
        k_lo = min(k_hi, k_lo + chunk * per);
        k_hi = min(k_hi, k_lo + per);
    }
}

// The running outputs times the softmax rescale of the thread's rows (lo, hi).
template <int NO>
__device__ __forceinline__ void rescale(float (&o)[NO][4], float alpha_lo, float alpha_hi) {
#pragma unroll
    for (int i = 0; i < NO; i++) {
        o[i][0] *= alpha_lo;
        o[i][1] *= alpha_lo;
        o[i][2] *= alpha_hi;
        o[i][3] *= alpha_hi;
    }
}

template <int N>
__device__ __forceinline__ void zero(float (&s)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
}

// The keys query row i sees, as the interval [lo, hi) less `col0`: those before k_hi and its
// per-row end, within the window (inclusive radius) and, when causal, up to i; none for rows
// past q1 (zero-filled queries whose output is never written).
__device__ __forceinline__ void key_span(int& lo, int& hi, int i, int end, int k_hi, int q1, int window, int causal,
                                         int col0) {
    // Keys and rows are far below 2^28, so nothing here overflows.
    lo = -(1 << 29);
    hi = min(k_hi, end);
    if (window >= 0) {
        const int w = min(window, 1 << 28);
        lo = i - w;
        hi = min(hi, i + w + 1);
    }
    if (causal) hi = min(hi, i + 1);
    if (i >= q1) hi = lo;
    lo -= col0;
    hi -= col0;
}

// Online-softmax state of a thread's two rows, in base 2.
struct RowStats {
    float m_lo = NEG_INF, m_hi = NEG_INF, l_lo = 0.f, l_hi = 0.f;
};

// One key block [kb0, kb0 + 8·NS) of scores `s` → unnormalised probabilities, in place, and the
// statistics updated; returns in alpha_* the factor the running outputs must be scaled by. Masks
// only when some row does not see the whole block: `end_lo` and `end_hi` are the key ends of the
// thread's rows under per-row limits (`row_key_end`; the segment's end without limits), checked per
// thread, as only the warps whose rows' limits fall inside the block need the mask. Rows past q1
// are zero-filled queries whose output is never written.
template <int NS>
__device__ __forceinline__ void softmax_block(float (&s)[NS][4], RowStats& st, float& alpha_lo, float& alpha_hi,
                                              int kb0, int k_hi, int q0, int q1, int row_lo, int window, int causal,
                                              int end_lo, int end_hi, float scale_log2) {
    const int row_hi = row_lo + 8;
    const int kb1 = kb0 + 8 * NS - 1;
    const bool masked = kb1 >= k_hi || kb1 >= min(end_lo, end_hi) ||
                        (window >= 0 && (kb1 - q0 > window || q1 - 1 - kb0 > window)) || (causal && kb1 > q0);
    // The maximum is taken over the unscaled scores (the scale is positive); each exponent is
    // then one FMA, s·scale − base.
    float mx_lo = NEG_INF, mx_hi = NEG_INF;
    if (masked) {
        // Each row sees one interval of keys, [lo, hi), here relative to the thread's first column
        // kb0 + 2·(lane % 4), so that each score's test is two comparisons with a constant.
        const int col0 = kb0 + 2 * (int)(threadIdx.x & 3);
        int lo_lo, hi_lo, lo_hi, hi_hi;
        key_span(lo_lo, hi_lo, row_lo, end_lo, k_hi, q1, window, causal, col0);
        key_span(lo_hi, hi_hi, row_hi, end_hi, k_hi, q1, window, causal, col0);
#pragma unroll
        for (int nt = 0; nt < NS; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = nt * 8 + (e & 1);
                const bool ok = e < 2 ? (j >= lo_lo && j < hi_lo) : (j >= lo_hi && j < hi_hi);
                if (!ok) s[nt][e] = NEG_INF;
            }
        }
    }
#pragma unroll
    for (int nt = 0; nt < NS; nt++) {
        mx_lo = fmaxf(mx_lo, fmaxf(s[nt][0], s[nt][1]));
        mx_hi = fmaxf(mx_hi, fmaxf(s[nt][2], s[nt][3]));
    }
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 1));
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, 2));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 1));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, 2));
    const float new_lo = fmaxf(st.m_lo, mx_lo * scale_log2), new_hi = fmaxf(st.m_hi, mx_hi * scale_log2);
    // A row with nothing visible yet keeps base 0 so that exp2(-inf - base) = 0, never NaN.
    const float base_lo = new_lo == NEG_INF ? 0.f : new_lo;
    const float base_hi = new_hi == NEG_INF ? 0.f : new_hi;
    alpha_lo = ex2(st.m_lo - base_lo);
    alpha_hi = ex2(st.m_hi - base_hi);
    st.m_lo = new_lo;
    st.m_hi = new_hi;
    float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
    for (int nt = 0; nt < NS; nt++) {
        s[nt][0] = ex2(fmaf(s[nt][0], scale_log2, -base_lo));
        s[nt][1] = ex2(fmaf(s[nt][1], scale_log2, -base_lo));
        s[nt][2] = ex2(fmaf(s[nt][2], scale_log2, -base_hi));
        s[nt][3] = ex2(fmaf(s[nt][3], scale_log2, -base_hi));
        sum_lo += s[nt][0] + s[nt][1];
        sum_hi += s[nt][2] + s[nt][3];
    }
    st.l_lo = st.l_lo * alpha_lo + sum_lo;  // per-thread partial; the quad is summed at the end
    st.l_hi = st.l_hi * alpha_hi + sum_hi;
}

// Probabilities (accumulator layout) → bf16 A fragments of the P·V product, 16 keys each.
template <int NS>
__device__ __forceinline__ void pack_p(const float (&p)[NS][4], u32 (&pa)[NS / 2][4]) {
#pragma unroll
    for (int kk = 0; kk < NS / 2; kk++) {
        pa[kk][0] = pack_bf16x2(p[2 * kk][0], p[2 * kk][1]);
        pa[kk][1] = pack_bf16x2(p[2 * kk][2], p[2 * kk][3]);
        pa[kk][2] = pack_bf16x2(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16x2(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
}

// The normalised outputs of a thread's rows: NO n-tiles of `oacc` starting at head column `col0`.
// Unsplit, into the output row (bf16 or f32); split, into chunk `chunk` of the f32 workspace
// `part` ([kv_splits][rows][heads][D] outputs, then [kv_splits][rows][heads] log2-sum-exps),
// whose combine pass weighs the chunks.
template <int D, int NO, typename TO>
__device__ __forceinline__ void flash_store(float (&oacc)[NO][4], RowStats st, int col0, bool write_lse, int row_lo,
                                            int q1, int h, TO* __restrict__ o, long os, float* __restrict__ part,
                                            int rows, int chunk, int kv_splits) {
    // An empty key chunk never waited for its (zero-filling) prologue copies.
    asm volatile("cp.async.wait_all;\n" ::);
    const int row_hi = row_lo + 8, col_in = 2 * (threadIdx.x & 3);
    float l_lo = st.l_lo, l_hi = st.l_hi;
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 1);
    l_lo += __shfl_xor_sync(0xffffffffu, l_lo, 2);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 1);
    l_hi += __shfl_xor_sync(0xffffffffu, l_hi, 2);
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f;
    const float inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
    if (kv_splits > 1) {
        const long heads = gridDim.y;
        float* po = part + (long)chunk * rows * heads * D;
        float* pl = part + (long)kv_splits * rows * heads * D + (long)chunk * rows * heads;
#pragma unroll
        for (int ot = 0; ot < NO; ot++) {
            const int col = col0 + ot * 8 + col_in;
            if (row_lo < q1) *reinterpret_cast<float2*>(po + ((long)row_lo * heads + h) * D + col) =
                make_float2(oacc[ot][0] * inv_lo, oacc[ot][1] * inv_lo);
            if (row_hi < q1) *reinterpret_cast<float2*>(po + ((long)row_hi * heads + h) * D + col) =
                make_float2(oacc[ot][2] * inv_hi, oacc[ot][3] * inv_hi);
        }
        if (write_lse && (threadIdx.x & 3) == 0) {
            if (row_lo < q1) pl[(long)row_lo * heads + h] = l_lo > 0.f ? st.m_lo + log2f(l_lo) : NEG_INF;
            if (row_hi < q1) pl[(long)row_hi * heads + h] = l_hi > 0.f ? st.m_hi + log2f(l_hi) : NEG_INF;
        }
        return;
    }
#pragma unroll
    for (int ot = 0; ot < NO; ot++) {
        const long col = (long)h * D + col0 + ot * 8 + col_in;
        if (row_lo < q1) {
            o[(long)row_lo * os + col] = from_f<TO>(oacc[ot][0] * inv_lo);
            o[(long)row_lo * os + col + 1] = from_f<TO>(oacc[ot][1] * inv_lo);
        }
        if (row_hi < q1) {
            o[(long)row_hi * os + col] = from_f<TO>(oacc[ot][2] * inv_hi);
            o[(long)row_hi * os + col + 1] = from_f<TO>(oacc[ot][3] * inv_hi);
        }
    }
}

// One flash kernel's entry point: the parameters every flash kernel takes (`FlashArgs` in
// cuda/attention.rs), handed to IMPL, under the launch bounds THREADS, MIN_CTAS. IMPL is passed
// in parentheses when its template arguments hold a comma.
#define FLASH_ENTRY(NAME, IMPL, THREADS, MIN_CTAS)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)                                     \
        NAME(const bf16* q, long qs, const bf16* k, long ks, const bf16* v, long vs, bf16* o, long os,    \
             const u32* tiles, int group, float scale_log2, int window, int causal, const u32* limits,       \
             float* part, int rows, int kv_splits) {                                                       \
        pdl_enter();                                                                                       \
        IMPL(q, qs, k, ks, v, vs, o, os, tiles, group, scale_log2, window, causal, limits, part, rows,        \
             kv_splits);                                                                                 \
    }
