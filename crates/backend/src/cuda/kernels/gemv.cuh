// Shared by the GEMV kernels (gemv.cu, blocks.cu): the warp reduction of a CTA's R·M partial sums.

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
