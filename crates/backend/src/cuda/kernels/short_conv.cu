// LFM2's short convolution over packed segments. CPU reference: crates/backend/src/cpu/short_conv.rs.
//
// Rows are [b | c | x], each `channels` wide; u = b ⊙ x. Segment s (rows offsets[s] ..
// offsets[s + 1]) continues the sequence in state slot seqs[2s], which holds the `kernel − 1`
// inputs before its first row (oldest first, `channels` floats each), or zeros when the sequence
// held no tokens (seqs[2s + 1] == 0). Input t of a segment is written u(t): t ≥ 0 is its row t,
// t < 0 the state's row kernel − 1 + t.
//
// Two launches, so that no thread overwrites a state another still reads:
// - short_conv_{in}_{out}: one thread per (row, channel) reads its kernel inputs (rows of the
//   segment, or the old state) and writes out = c ⊙ (bias + Σ_j w_j · u(t − kernel + 1 + j)), the
//   taps summed in f64 in the CPU's order.
// - short_conv_state_{in}, after it: one thread per (segment, channel) refreshes the slot with the
//   last kernel − 1 inputs of [old state ‖ the segment's u], in place: new row j is input
//   n − (kernel − 1) + j (n the segment's rows), which reads old row n + j ≥ j, not yet written
//   when rows are written in ascending order.
// Where every segment is one row (decoding), short_conv_step_{in}_{out} does both in one launch.

// The segment holding packed row r: the last s with offsets[s] <= r (empty segments skipped).
__device__ __forceinline__ int segment_of(const u32* offsets, int nseg, long r) {
    int lo = 0, hi = nseg;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((long)offsets[mid] <= r) lo = mid; else hi = mid;
    }
    return lo;
}

// Input t of a segment starting at packed row a (see above); `st` is its slot, or null for zeros.
template <typename TI>
__device__ __forceinline__ float conv_input(const TI* bcx, long xs, long a, int t, const float* st, int channels,
                                            int kernel, int ch) {
    if (t >= 0) {
        const TI* row = bcx + (a + t) * xs;
        return to_f(row[ch]) * to_f(row[2 * channels + ch]);
    }
    return st ? st[(long)(kernel - 1 + t) * channels + ch] : 0.f;
}

// The slot of segment s if the sequence held tokens and the slot exists, else null (zeros).
__device__ __forceinline__ float* conv_slot(float* state, int slots, const u32* seqs, int s, int channels,
                                            int kernel) {
    const u32 slot = seqs[2 * s], held = seqs[2 * s + 1];
    if (held == 0 || slot >= (u32)slots) return nullptr;
    return state + (long)slot * (kernel - 1) * channels;
}

// Output row a + t of a segment starting at packed row a (slot `st`): c ⊙ (bias + Σ_j w_j ·
// u(t − kernel + 1 + j)), the taps summed in f64 in the CPU's order.
template <typename TI, typename TO>
__device__ __forceinline__ void conv_output(const TI* bcx, long xs, long a, int t, const float* st,
                                            const float* weight, const float* bias, int channels, int kernel, int ch,
                                            TO* out, long os) {
    const float* w = weight + (long)ch * kernel;
    double acc = bias ? (double)bias[ch] : 0.0;
    for (int j = 0; j < kernel; j++) {
        const float u = conv_input(bcx, xs, a, t - kernel + 1 + j, st, channels, kernel, ch);
        acc += (double)w[j] * (double)u;
    }
    const long r = a + t;
    const float c = to_f(bcx[r * xs + channels + ch]);
    out[r * os + ch] = from_f<TO>(c * (float)acc);
}

// Slot `dst` refreshed in place with the last kernel − 1 inputs of [old state `st` ‖ the n rows of
// the segment at a]: new row j is input n − (kernel − 1) + j, which reads old row n + j ≥ j, not
// yet written when rows are written in ascending order.
template <typename TI>
__device__ __forceinline__ void conv_refresh(const TI* bcx, long xs, long a, int n, const float* st, float* dst,
                                             int channels, int kernel, int ch) {
    for (int j = 0; j < kernel - 1; j++) {
        const float u = conv_input(bcx, xs, a, n - (kernel - 1) + j, st, channels, kernel, ch);
        dst[(long)j * channels + ch] = u;
    }
}

// Grid (rows, channel blocks of blockDim.x).
template <typename TI, typename TO>
__device__ __forceinline__ void short_conv_impl(const TI* bcx, long xs, const u32* offsets, int nseg, const u32* seqs,
                                                const float* state, int slots, const float* weight,
                                                const float* bias, int channels, int kernel, TO* out, long os) {
    const long r = blockIdx.x;
    const int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= channels) return;
    const int s = segment_of(offsets, nseg, r);
    const long a = offsets[s];
    const float* st = conv_slot(const_cast<float*>(state), slots, seqs, s, channels, kernel);
    conv_output<TI, TO>(bcx, xs, a, (int)(r - a), st, weight, bias, channels, kernel, ch, out, os);
}

// Grid (segments, channel blocks of blockDim.x).
template <typename TI>
__device__ __forceinline__ void short_conv_state_impl(const TI* bcx, long xs, const u32* offsets, const u32* seqs,
                                                      float* state, int slots, int channels, int kernel) {
    const int s = blockIdx.x;
    const int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= channels) return;
    const u32 slot = seqs[2 * s];
    if (slot >= (u32)slots) return;
    float* dst = state + (long)slot * (kernel - 1) * channels;
    const float* st = conv_slot(state, slots, seqs, s, channels, kernel);
    const long a = offsets[s];
    conv_refresh<TI>(bcx, xs, a, (int)(offsets[s + 1] - a), st, dst, channels, kernel, ch);
}

// Segments of one row each (a decode step): a thread per (segment, channel) does both of the
// above — its output from the old state, then its channel of the slot — in one launch, since no
// other thread reads what it overwrites. Grid (segments, channel blocks of blockDim.x); nseg unused.
template <typename TI, typename TO>
__device__ __forceinline__ void short_conv_step_impl(const TI* bcx, long xs, const u32* offsets, const u32* seqs,
                                                     float* state, int slots, const float* weight, const float* bias,
                                                     int channels, int kernel, TO* out, long os) {
    const int s = blockIdx.x;
    const int ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= channels) return;
    const long a = offsets[s];
    const float* st = conv_slot(state, slots, seqs, s, channels, kernel);
    conv_output<TI, TO>(bcx, xs, a, 0, st, weight, bias, channels, kernel, ch, out, os);
    const u32 slot = seqs[2 * s];
    if (slot >= (u32)slots) return;
    conv_refresh<TI>(bcx, xs, a, 1, st, state + (long)slot * (kernel - 1) * channels, channels, kernel, ch);
}

#define SHORT_CONV(TI, TO, NAME)                                                                          \
    extern "C" __global__ void NAME(const TI* bcx, long xs, const u32* offsets, int nseg, const u32* seqs,    \
                                    const float* state, int slots, const float* weight, const float* bias,  \
                                    int channels, int kernel, TO* out, long os) {                          \
        pdl_enter();                                                                                       \
        short_conv_impl<TI, TO>(bcx, xs, offsets, nseg, seqs, state, slots, weight, bias, channels, kernel, out, \
                                os);                                                                      \
    }
SHORT_CONV(float, float, short_conv_f32_f32)
SHORT_CONV(float, bf16, short_conv_f32_bf16)
SHORT_CONV(bf16, float, short_conv_bf16_f32)
SHORT_CONV(bf16, bf16, short_conv_bf16_bf16)

#define SHORT_CONV_STATE(TI, NAME)                                                                        \
    extern "C" __global__ void NAME(const TI* bcx, long xs, const u32* offsets, const u32* seqs, float* state, \
                                    int slots, int channels, int kernel) {                                \
        pdl_enter();                                                                                      \
        short_conv_state_impl<TI>(bcx, xs, offsets, seqs, state, slots, channels, kernel);                \
    }
SHORT_CONV_STATE(float, short_conv_state_f32)
SHORT_CONV_STATE(bf16, short_conv_state_bf16)

#define SHORT_CONV_STEP(TI, TO, NAME)                                                                     \
    extern "C" __global__ void NAME(const TI* bcx, long xs, const u32* offsets, int nseg, const u32* seqs,    \
                                    float* state, int slots, const float* weight, const float* bias,        \
                                    int channels, int kernel, TO* out, long os) {                          \
        pdl_enter();                                                                                       \
        short_conv_step_impl<TI, TO>(bcx, xs, offsets, seqs, state, slots, weight, bias, channels, kernel, out, os); \
    }
SHORT_CONV_STEP(float, float, short_conv_step_f32_f32)
SHORT_CONV_STEP(float, bf16, short_conv_step_f32_bf16)
SHORT_CONV_STEP(bf16, float, short_conv_step_bf16_f32)
SHORT_CONV_STEP(bf16, bf16, short_conv_step_bf16_bf16)
