// Shared by the GEMV kernels (gemv.cu, blocks.cu): their CTA geometry, the reduction of a CTA's
// R·M partial sums and their store.

// Weight rows per CTA (gemv.rs's CTA_ROWS) and the most warps a CTA has (256 threads).
#define GEMV_ROWS 4
#define GEMV_MAX_WARPS 8

// Warp reduction of the HELD values each lane holds (a power of two), from offset O down: at
// offset o = 16, 8, 4, 2, 1, while a lane holds more than one value, it keeps half of them (the
// upper half if bit o of its lane is set) plus its partner's copy of that half and sends the
// other half; once one is left, plain butterfly adds. Every value's sum is the butterfly tree
// over offsets 16..1, as `warp_sum` gives (62 shuffles for 64 values instead of 320). Adds to
// `first` the index (among the HELD) of what v[0] holds at the end; a lane then holds
// v[0..max(HELD/32, 1)), and the lanes that differ from it only in the bits below 32/HELD hold the
// same values.
template <int HELD, int O> __device__ __forceinline__ void warp_reduce_scatter(float* v, int lane, int& first) {
    if constexpr (O > 0) {
        if constexpr (HELD > 1) {
            constexpr int half = HELD / 2;
            const bool upper = (lane & O) != 0;
#pragma unroll
            for (int i = 0; i < half; i++) {
                const float send = upper ? v[i] : v[i + half];
                const float keep = upper ? v[i + half] : v[i];
                v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
            }
            if (upper) first += half;
            warp_reduce_scatter<half, O / 2>(v, lane, first);
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
            warp_reduce_scatter<1, O / 2>(v, lane, first);
        }
    }
}

// The CTA's N = R·M sums from its T / 32 warps' totals in `red` (N floats a warp, sum j for weight
// row j / M and x row j % M), added in warp order by N threads and stored as
// out[i, r0 + r] = α · sum (+ what it holds where `accumulate`), skipping rows past `n` weight
// rows and `m` x rows. The caller has synchronised the CTA after writing `red`.
template <int N, int M, typename TO>
__device__ __forceinline__ void gemv_add_warps(const float* red, int tid, int T, int r0, int n, int m, TO* out,
                                               long os, float alpha, int accumulate) {
    const int warps = T >> 5;
    for (int j = tid; j < N; j += T) {
        const int r = j / M, i = j % M;
        if (r0 + r >= n || i >= m) continue;
        float s = red[j];
        for (int q = 1; q < warps; q++) s += red[q * N + j];
        TO* o = out + i * os + r0 + r;
        float v = alpha * s;
        if (accumulate) v += to_f(*o);
        *o = from_f<TO>(v);
    }
}

// The end of a GEMV kernel whose CTA computes N = R·M sums (R weight rows from r0, M x rows):
// each thread's `acc` reduced over its warp, then over the CTA's T / 32 warps through `red`
// (N floats a warp, in shared memory) in warp order, and stored as out[i, r0 + r] = α · sum
// (+ what it holds where `accumulate`), skipping rows past `n` weight rows and `m` x rows.
template <int N, int M, typename TO>
__device__ __forceinline__ void gemv_store(float* acc, float* red, int lane, int warp, int tid, int T, int r0, int n,
                                           int m, TO* out, long os, float alpha, int accumulate) {
    int first = 0;
    warp_reduce_scatter<N, 16>(acc, lane, first);
    if constexpr (N >= 32) {
#pragma unroll
        for (int s = 0; s < N / 32; s++) red[warp * N + first + s] = acc[s];
    } else {
        if ((lane & (32 / N - 1)) == 0) red[warp * N + first] = acc[0];
    }
    __syncthreads();
    gemv_add_warps<N, M>(red, tid, T, r0, n, m, out, os, alpha, accumulate);
}
