// Attention over packed segments. CPU reference: crates/backend/src/cpu/attention.rs.
//
// flash_bf16_d{D}: bf16 q/k/v, f32 accumulation and softmax statistics, tensor cores
// (mma.m16n8k16). One CTA = a 64-row query tile (or a part of it) of one head. Tiles never cross a segment; the
// host lists them as (q0, q1, s0, s1): query rows [q0, q1) of the segment [s0, s1). The CTA walks
// the keys its rows can see (the segment cut to the window, to the last row when causal, or to the
// largest of its rows' per-row key limits) in blocks of BN with an online softmax; a block some
// row sees only in part is masked element by element (flash.cuh, `softmax_block`).
//
// Head widths that are not a multiple of 16 (72): q·kᵀ runs over D rounded up to 16 columns (80),
// whose extra columns are zero in the Q and K tiles; P·V and the output cover D exactly (9
// n-tiles of 8, the last one loaded alone). The scale is the caller's (1/√72), not the padded
// width's.
//
// Warps: WM along the query rows (16 rows each) × WD along the head dimension. With WD > 1 each
// warp computes q·kᵀ over its slice of the head dimension, the partial scores are summed through
// shared memory, and each warp then owns D/WD output columns — which keeps the accumulators of
// 256- and 512-wide heads in registers.
//
// Pipelining: K and V tiles are separate cp.async groups; the next K loads while softmax and P·V
// run, the next V while the next q·kᵀ runs. Key blocks that lie wholly inside every row's visible
// range skip the mask.
//
// Split keys (flash-decoding): when the tiles alone would leave multiprocessors idle (one long
// sequence), the host splits each tile's key range into `kv_splits` chunks (grid z). Each CTA then
// writes its chunk's normalised output (f32) and log2-sum-exp to a workspace, and flash_combine
// weighs the chunks into the bf16 output.
//
// attn_rows_f32: the exact (f32) mode; one warp per (query row, head), scalar FMAs.
//
// attn_cached_{T}_d{D}, attn_cached_combine_{T}: attention over cached key ranges, both
// precisions, every mask; also over a segment's own rows where neither kernel above applies (f32
// beyond attn_rows_f32's 512; bf16 under per-row key limits with TESSERA_FLASH_LIMITS=0), at the
// end of this file.

// WM warps along query rows (BM = 16·WM rows per CTA; a 64-row tile takes 64/BM CTAs along z),
// WD warps along the head dimension, BN keys per block, MIN_CTAS resident per multiprocessor.
// Mirrored by `flash_config` in attention/flash.rs.
// Heads up to 64 wide: ≤ 128 registers, so four CTAs share a multiprocessor (three at the 135
// registers the compiler picks unbounded, which left one 2,394-patch image's 456 CTAs a second
// wave of 60).
template <int D> struct FlashCfg { static constexpr int WM = 4, WD = 1, BN = 64, MIN_CTAS = 4; };
// 72-wide heads (SigLIP2's and Qwen3-VL's vision towers), q·kᵀ over 80 columns: the four more
// accumulators than at 64 spill at four CTAs' 128 registers, so three.
template <> struct FlashCfg<72> { static constexpr int WM = 4, WD = 1, BN = 64, MIN_CTAS = 3; };
template <> struct FlashCfg<128> { static constexpr int WM = 4, WD = 1, BN = 64, MIN_CTAS = 2; };
// 256-wide heads: one warp holds a whole 16×256 output block (128 accumulators), so no partial
// scores cross warps; 512-wide heads split the head in two. 128 threads and 32-key blocks keep
// two CTAs on a multiprocessor (≤ 255 registers, ≤ 113 KB of shared memory each), so one CTA's
// loads and barriers overlap the other's tensor-core work. Measured on the H200 against shapes
// with 2–4 warps across the head and 16-key blocks: 25–35% faster on the EmbeddingGemma 2 shapes
// (BENCHMARKS.md, attention rows).
template <> struct FlashCfg<256> { static constexpr int WM = 4, WD = 1, BN = 32, MIN_CTAS = 2; };
template <> struct FlashCfg<512> { static constexpr int WM = 2, WD = 2, BN = 32, MIN_CTAS = 2; };
// 1152-wide heads (Qwen-Image-2.1's VAE mid-block: one head, up to 16,384 rows): 32-row CTAs of
// 2 × 4 warps, each warp owning 288 output columns (144 accumulators), and 16-key blocks:
// (32 + 2·16) rows × 2,320 B + 8 KB of partial scores = 153 KB of shared memory, one CTA per
// multiprocessor (it fits an A100's 163 KB too). Each K/V row read from L2 serves 32 query rows;
// a CTA per query row on CUDA cores (the key-range kernel) would read K and V once per row.
// Expected on an H200 (not yet measured): at 4,096 rows and keys (a 1024² image) 128 CTAs in one
// wave stream 2.4 GB of K|V from L2 (19 MB in bf16, resident) in ~0.5–1 ms, latency-bound on
// the 37 KB tile loads; at 16,384 (2048²) 512 CTAs, ~39 GB, ~7–10 ms. The key-range kernel would
// take ~15 ms and ~250 ms.
template <> struct FlashCfg<1152> { static constexpr int WM = 2, WD = 4, BN = 16, MIN_CTAS = 1; };
// 768 (the VAE encoder's mid-block): the same shape, 192 columns a warp, 105 KB of shared memory.
template <> struct FlashCfg<768> { static constexpr int WM = 2, WD = 4, BN = 16, MIN_CTAS = 1; };

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
// The first two matrices of ldsm_x4_t: lanes 0–15 give the addresses (the others are ignored).
__device__ __forceinline__ void ldsm_x2_t(u32& r0, u32& r1, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Rows [r0, r0 + R) ∩ [lo, hi) of a head's [rows][D] slice → shared tile [R][PITCH]; rows outside
// the range are zero-filled.
template <int D, int R, int PITCH, int NT>
__device__ __forceinline__ void load_rows(bf16* tile, const bf16* base, long stride, int r0, int lo, int hi) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < R * CHUNKS; i += NT) {
        const int row = i / CHUNKS, ch = i - row * CHUNKS;
        const int gr = r0 + row;
        const bool ok = gr >= lo && gr < hi;
        const bf16* src = ok ? base + (long)gr * stride + ch * 8 : base;
        cp_async16(smem_addr(tile + row * PITCH + ch * 8), src, ok);
    }
}

template <int D, typename TO>
__device__ __forceinline__ void flash_impl(const bf16* __restrict__ q, long qs, const bf16* __restrict__ k, long ks,
                                           const bf16* __restrict__ v, long vs, TO* __restrict__ o, long os,
                                           const u32* __restrict__ tiles, int group, float scale_log2, int window,
                                           int causal, const u32* __restrict__ limits, float* __restrict__ part,
                                           int rows, int kv_splits) {
    constexpr int WM = FlashCfg<D>::WM, WD = FlashCfg<D>::WD, BN = FlashCfg<D>::BN;
    // q·kᵀ reduces over DK columns: D rounded up to whole 16-column k-steps of the mma (72 → 80),
    // the columns past D zero in sQ and sK. P·V and the output keep D (9 n-tiles of 8 at 72).
    constexpr int DK = (D + 15) / 16 * 16;
    constexpr int BM = 16 * WM, NT = 32 * WM * WD, PITCH = DK + 8, DW = D / WD, DKW = DK / WD;
    constexpr int NS = BN / 8;  // score n-tiles per warp
    constexpr int NO = DW / 8;  // output n-tiles per warp
    static_assert(D % 8 == 0 && (D % 16 == 0 || WD == 1), "rows load in 16-byte chunks; a split head in k-steps");
    extern __shared__ __align__(16) unsigned char smem[];
    // The key end of each of the CTA's rows (`row_key_end`), read at each block's softmax rather
    // than held in registers across the loop (two more live registers spilled at 1152).
    __shared__ int sEnd[BM];
    bf16* sQ = reinterpret_cast<bf16*>(smem);
    bf16* sK = sQ + BM * PITCH;
    bf16* sV = sK + BN * PITCH;
    float* sS = reinterpret_cast<float*>(sV + BN * PITCH);

    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, wd = warp / WM;
    const u32* tl = tiles + 4 * blockIdx.x;
    constexpr int SUBS = 64 / BM;  // CTAs per 64-row tile
    const int sub = blockIdx.z % SUBS, chunk = blockIdx.z / SUBS;
    const int q0 = tl[0] + BM * sub, q1 = min((int)tl[1], q0 + BM), s0 = tl[2], s1 = tl[3];
    if (q0 >= q1) return;  // the tile's last rows, when it is shorter than 64
    const int h = blockIdx.y, g = h / group;
    int k_lo, k_hi;
    key_range<BN>(k_lo, k_hi, q0, q1, s0, s1, window, causal, limits, chunk, kv_splits);
    const bf16* qb = q + (long)h * D;
    const bf16* kb = k + (long)g * D;
    const bf16* vb = v + (long)g * D;

    if constexpr (DK > D) {
        // The pad columns [D, DK) of every sQ and sK row (sK follows sQ), zeroed once: the loads
        // never write them, and the first read is after the loop's first barrier.
        for (int r = threadIdx.x; r < BM + BN; r += NT)
#pragma unroll
            for (int c = D; c < DK; c += 8) *reinterpret_cast<uint4*>(sQ + r * PITCH + c) = make_uint4(0u, 0u, 0u, 0u);
    }
    load_rows<D, BM, PITCH, NT>(sQ, qb, qs, q0, q0, q1);
    load_rows<D, BN, PITCH, NT>(sK, kb, ks, k_lo, k_lo, k_hi);
    cp_commit();
    load_rows<D, BN, PITCH, NT>(sV, vb, vs, k_lo, k_lo, k_hi);
    cp_commit();

    float oacc[NO][4];
    zero(oacc);
    RowStats st;
    const int row_lo = q0 + 16 * wm + (lane >> 2);
    const int col_in = 2 * (lane & 3);
    // Visible from the loop's first barrier on.
    for (int r = threadIdx.x; r < BM; r += NT) sEnd[r] = row_key_end(limits, q0 + r, q1, s0, s1);

    for (int kb0 = k_lo; kb0 < k_hi; kb0 += BN) {
        cp_wait<1>();  // all but the newest group (this block's V) have landed: Q and K are ready
        __syncthreads();
        float s[NS][4];
        zero(s);
#pragma unroll
        for (int kk = 0; kk < DKW / 16; kk++) {
            const int dcol = wd * DKW + kk * 16;
            u32 a0, a1, a2, a3;
            ldsm_x4(a0, a1, a2, a3, smem_addr(sQ + (16 * wm + (lane & 15)) * PITCH + dcol + 8 * (lane >> 4)));
#pragma unroll
            for (int nt = 0; nt < NS; nt += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3,
                        smem_addr(sK + (nt * 8 + (lane & 7) + 8 * (lane >> 4)) * PITCH + dcol + 8 * ((lane >> 3) & 1)));
                mma_bf16(s[nt], a0, a1, a2, a3, b0, b1);
                mma_bf16(s[nt + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        if constexpr (WD > 1) {
            float* mine = sS + (wd * BM + 16 * wm) * BN;
#pragma unroll
            for (int nt = 0; nt < NS; nt++) {
                const int c = nt * 8 + col_in;
                mine[(lane >> 2) * BN + c] = s[nt][0];
                mine[(lane >> 2) * BN + c + 1] = s[nt][1];
                mine[((lane >> 2) + 8) * BN + c] = s[nt][2];
                mine[((lane >> 2) + 8) * BN + c + 1] = s[nt][3];
            }
            __syncthreads();
            zero(s);
#pragma unroll
            for (int w = 0; w < WD; w++) {
                const float* part = sS + (w * BM + 16 * wm) * BN;
#pragma unroll
                for (int nt = 0; nt < NS; nt++) {
                    const int c = nt * 8 + col_in;
                    s[nt][0] += part[(lane >> 2) * BN + c];
                    s[nt][1] += part[(lane >> 2) * BN + c + 1];
                    s[nt][2] += part[((lane >> 2) + 8) * BN + c];
                    s[nt][3] += part[((lane >> 2) + 8) * BN + c + 1];
                }
            }
        }
        __syncthreads();  // every warp is done with sK (and with sS for this block)
        if (kb0 + BN < k_hi) load_rows<D, BN, PITCH, NT>(sK, kb, ks, kb0 + BN, k_lo, k_hi);
        cp_commit();

        float alpha_lo, alpha_hi;
        const int* ends = sEnd + 16 * wm + (lane >> 2);
        softmax_block<NS>(s, st, alpha_lo, alpha_hi, kb0, k_hi, q0, q1, row_lo, window, causal, ends[0], ends[8],
                          scale_log2);
        u32 pa[BN / 16][4];  // the score floats are dead before P·V starts
        pack_p(s, pa);
        rescale(oacc, alpha_lo, alpha_hi);

        cp_wait<1>();  // all but the newest group (the next K): V is ready
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
            for (int ot = 0; ot < NO; ot += 2) {
                const int n0 = wd * DW + ot * 8;
                const u32 at =
                    smem_addr(sV + (kk * 16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * PITCH + n0 + 8 * (lane >> 4));
                u32 b0, b1, b2, b3;
                if (ot + 1 < NO) {
                    ldsm_x4_t(b0, b1, b2, b3, at);
                    mma_bf16(oacc[ot], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
                    mma_bf16(oacc[ot + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b2, b3);
                } else {
                    // An odd last n-tile (72-wide heads): its 8 columns alone.
                    ldsm_x2_t(b0, b1, at);
                    mma_bf16(oacc[ot], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b0, b1);
                }
            }
        }
        __syncthreads();  // every warp is done with sV
        if (kb0 + BN < k_hi) load_rows<D, BN, PITCH, NT>(sV, vb, vs, kb0 + BN, k_lo, k_hi);
        cp_commit();
    }

    flash_store<D, NO, TO>(oacc, st, wd * DW, wd == 0, row_lo, q1, h, o, os, part, rows, chunk, kv_splits);
}

#define FLASH(D) \
    FLASH_ENTRY(flash_bf16_d##D, (flash_impl<D, bf16>), 32 * FlashCfg<D>::WM * FlashCfg<D>::WD, FlashCfg<D>::MIN_CTAS)
FLASH(16)
FLASH(32)
FLASH(64)
FLASH(72)
FLASH(128)
FLASH(256)
FLASH(512)
FLASH(768)
FLASH(1152)

// The split-key chunks of flash_bf16_d{D} → the bf16 output: one warp per (row, head), each chunk
// weighted by 2^(its log2-sum-exp − the largest); a row no chunk saw stays 0, as in one pass.
extern "C" __global__ void flash_combine(const float* __restrict__ part, bf16* __restrict__ o, long os, int rows,
                                         int heads, int D, int kv_splits) {
    pdl_enter();
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (long)rows * heads) return;
    const long n = (long)rows * heads;
    const float* lse = part + (long)kv_splits * n * D;
    float top = NEG_INF;
    for (int c = 0; c < kv_splits; c++) top = fmaxf(top, lse[c * n + gw]);
    // The chunks' weights, normalised, once per row (kv_splits ≤ 8).
    float w[8];
    float wsum = 0.f;
#pragma unroll
    for (int c = 0; c < 8; c++) {
        w[c] = c < kv_splits && top != NEG_INF ? ex2(lse[c * n + gw] - top) : 0.f;
        wsum += w[c];
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    bf16* orow = o + (gw / heads) * os + (gw % heads) * D;
    for (int col = 4 * lane; col < D; col += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int c = 0; c < 8; c++) {
            if (c < kv_splits && w[c] > 0.f) {
                const float4 x = *reinterpret_cast<const float4*>(part + (c * n + gw) * D + col);
                acc.x += w[c] * x.x;
                acc.y += w[c] * x.y;
                acc.z += w[c] * x.z;
                acc.w += w[c] * x.w;
            }
        }
        orow[col] = from_f<bf16>(acc.x * inv);
        orow[col + 1] = from_f<bf16>(acc.y * inv);
        orow[col + 2] = from_f<bf16>(acc.z * inv);
        orow[col + 3] = from_f<bf16>(acc.w * inv);
    }
}

// One warp per (query row, head); lane holds head channels lane, lane+32, … (D ≤ 512), f32 sums
// and softmax. attn_rows_f32 is the exact mode; attn_rows_bf16 the bf16 mode's kernel for any head
// width the tensor-core kernels are not built for (slow — scalar FMAs — but never a refusal).
// `limits` (null: none) cuts row i to the first limits[i] keys of its segment (block-causal
// masks); a row that sees no key writes zeros, as the flash kernels do.
template <typename T>
__device__ __forceinline__ void attn_rows_impl(const T* q, long qs, const T* k, long ks, const T* v, long vs, T* o,
                                               long os, const u32* offsets, int nseg, int rows, int hq, int group,
                                               int D, float scale, int window, int causal, const u32* limits) {
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= (long)rows * hq) return;
    const int i = (int)(gw / hq), h = (int)(gw % hq), g = h / group;
    int lo = 0, hi = nseg;  // the segment holding row i: offsets[lo] <= i < offsets[lo + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((int)offsets[mid] <= i) lo = mid; else hi = mid;
    }
    int k_lo = offsets[lo], k_hi = offsets[lo + 1];
    if (window >= 0) {
        k_lo = max(k_lo, i - window);
        k_hi = min(k_hi, i + window + 1);
    }
    if (causal) k_hi = min(k_hi, i + 1);
    if (limits) k_hi = (int)min((long)k_hi, (long)offsets[lo] + limits[i]);
    float qv[16], acc[16];
    const T* qr = q + (long)i * qs + (long)h * D;
#pragma unroll
    for (int t = 0; t < 16; t++) {
        const int c = lane + 32 * t;
        qv[t] = c < D ? to_f(qr[c]) : 0.f;
        acc[t] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int j = k_lo; j < k_hi; j++) {
        const T* kr = k + (long)j * ks + (long)g * D;
        float d = 0.f;
#pragma unroll
        for (int t = 0; t < 16; t++) {
            const int c = lane + 32 * t;
            if (c < D) d += qv[t] * to_f(kr[c]);
        }
        const float sc = warp_sum(d) * scale;
        const float mn = fmaxf(m, sc);
        const float a = expf(m - mn), p = expf(sc - mn);
        l = l * a + p;
        const T* vr = v + (long)j * vs + (long)g * D;
#pragma unroll
        for (int t = 0; t < 16; t++) {
            const int c = lane + 32 * t;
            if (c < D) acc[t] = acc[t] * a + p * to_f(vr[c]);
        }
        m = mn;
    }
    T* orow = o + (long)i * os + (long)h * D;
#pragma unroll
    for (int t = 0; t < 16; t++) {
        const int c = lane + 32 * t;
        if (c < D) orow[c] = from_f<T>(l > 0.f ? acc[t] / l : 0.f);
    }
}

#define ATTN_ROWS(T, NAME)                                                                                  \
    extern "C" __global__ void NAME(const T* q, long qs, const T* k, long ks, const T* v, long vs, T* o, long os, \
                                    const u32* offsets, int nseg, int rows, int hq, int group, int D, float scale, \
                                    int window, int causal, const u32* limits) {                            \
        pdl_enter();                                                                                        \
        attn_rows_impl<T>(q, qs, k, ks, v, vs, o, os, offsets, nseg, rows, hq, group, D, scale, window, causal, \
                          limits);                                                                          \
    }
ATTN_ROWS(float, attn_rows_f32)
ATTN_ROWS(bf16, attn_rows_bf16)

// ---- Attention over cached key ranges: decoding, and prompts appended to a cache.
//
// Segment s's queries are its packed rows; its keys are rows ranges[2s] .. ranges[2s] +
// ranges[2s + 1] of k and v, of which the queries are the last q_len positions (op/attention.rs).
// Without ranges (null) its keys are its own rows, offsets[s] .. offsets[s + 1]: self-attention
// at head widths no tensor-core kernel takes, and in f32 at widths beyond attn_rows_f32's 512.
// Every mask leaves a query row one interval [k_lo, k_hi) of those keys: all of them, cut to the
// window around the row's position, to the position itself (causal), or to limits[row].
//
// attn_cached_{T}_d{D}: one CTA of CACHED_WARPS warps per (query row, block of up to
// CachedCfg<D>::HEADS q heads sharing one kv head, key chunk). The row's interval is cut into
// gridDim.z chunks of whole 32-key blocks (trailing chunks may be empty), so any chunk count covers
// every key. Each warp walks its chunk's 32-key blocks round-robin: lane i scores key i of the
// block against every head of the CTA (the q rows in shared memory, pre-scaled to log2 units), the
// warp takes the block's maximum and rescales its running state, then accumulates P·V with each
// lane owning head columns lane, lane + 32, … and the block's probabilities broadcast by shuffles.
// The warps' states are merged through shared memory. Unsplit (part null) the CTA writes its output
// rows; split, its chunk's normalised f32 outputs and log2-sum-exps into `part`
// ([chunks][rows][hq][D], then [chunks][rows][hq]), which attn_cached_combine_{T} weighs into the
// output. Keys outside the interval, and cache rows outside the ranges, are never read.
constexpr int CACHED_WARPS = 4;

// q heads per CTA, mirrored by `heads_per_cta` in attention/cached.rs. Four share each key load
// (decoding with grouped kv heads); heads wider than 256 take one, so that the merge buffer
// so[4][HEADS][D] and the accumulators acc[HEADS][D / 32] stay small: at 1152 (Qwen-Image-2.1's
// VAE, a single head) 23 KB of static shared memory and 36 accumulators a lane. There it runs
// f32 self-attention (bf16 takes flash_bf16_d1152), a CTA per query row reading every key and
// value row once: at 4,096 rows and keys 155 GB from L2 (K|V, 38 MB in f32, stays resident),
// expected ~30–40 ms on an H200 (not yet measured), and ~0.5 s at 16,384.
template <int D> struct CachedCfg { static constexpr int HEADS = D > 256 ? 1 : 4; };

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <int D, typename T>
__device__ __forceinline__ void attn_cached_impl(const T* __restrict__ q, long qs, const T* __restrict__ k, long ks,
                                                 const T* __restrict__ v, long vs, T* __restrict__ o, long os,
                                                 const u32* __restrict__ offsets, int nseg,
                                                 const u32* __restrict__ ranges, const u32* __restrict__ limits,
                                                 int hq, int group, float scale_log2, int window, int causal,
                                                 float* __restrict__ part) {
    constexpr int GB = CachedCfg<D>::HEADS, NW = CACHED_WARPS, NT = 32 * NW, TD = (D + 31) / 32;
    static_assert(D % 4 == 0, "keys are read four values at a time");
    __shared__ __align__(16) float sq[GB][D];
    __shared__ float sm[NW][GB], sl[NW][GB];
    __shared__ float so[NW][GB][D];

    const long r = blockIdx.x;
    const int hblocks = (group + GB - 1) / GB;
    const int g = blockIdx.y / hblocks;
    const int h0 = g * group + (blockIdx.y - g * hblocks) * GB;
    const int nh = min(GB, (g + 1) * group - h0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // The row's segment: the last s with offsets[s] <= r (empty segments skipped).
    int lo = 0, hi = nseg;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((long)offsets[mid] <= r) lo = mid; else hi = mid;
    }
    const int q_len = (int)(offsets[lo + 1] - offsets[lo]);
    const long kstart = ranges ? (long)ranges[2 * lo] : (long)offsets[lo];
    const int n = ranges ? (int)ranges[2 * lo + 1] : q_len;
    const int pos = n - q_len + (int)(r - offsets[lo]);  // the row's position among the keys
    int k_lo = 0, k_hi = n;
    if (window >= 0) {
        k_lo = max(0, pos - window);
        k_hi = (int)min((long)n, (long)pos + window + 1);
    }
    if (causal) k_hi = min(k_hi, pos + 1);
    if (limits) {
        const u32 lim = limits[r];
        k_hi = min(k_hi, lim < (u32)n ? (int)lim : n);
    }
    const int span = max(k_hi - k_lo, 0);
    const int per = ((span + (int)gridDim.z - 1) / (int)gridDim.z + 31) / 32 * 32;
    const int c0 = k_lo + (int)min((long)span, (long)blockIdx.z * per);
    const int c1 = k_lo + (int)min((long)span, ((long)blockIdx.z + 1) * per);

    // The CTA's q rows, times scale · log2(e): scores come out in log2 units.
    const T* qr = q + r * qs + (long)h0 * D;
    for (int i = threadIdx.x; i < GB * D; i += NT) {
        const int h = i / D, c = i - h * D;
        sq[h][c] = h < nh ? to_f(qr[(long)h * D + c]) * scale_log2 : 0.f;
    }
    __syncthreads();

    // Keys four values at a time where every key row is aligned to them.
    const bool vec = reinterpret_cast<u64>(k) % (4 * sizeof(T)) == 0 && ks % 4 == 0;
    const T* kb = k + kstart * ks + (long)g * D;
    const T* vb = v + kstart * vs + (long)g * D;
    float m[GB], l[GB], acc[GB][TD];
#pragma unroll
    for (int h = 0; h < GB; h++) {
        m[h] = NEG_INF;
        l[h] = 0.f;  // this lane's share; summed over the warp at the end
#pragma unroll
        for (int t = 0; t < TD; t++) acc[h][t] = 0.f;
    }
    for (int j0 = c0 + 32 * warp; j0 < c1; j0 += 32 * NW) {
        const int j = j0 + lane;
        const bool valid = j < c1;
        float s[GB];
#pragma unroll
        for (int h = 0; h < GB; h++) s[h] = 0.f;
        if (valid) {
            const T* kr = kb + (long)j * ks;
            // Whole rows unrolled up to 256 wide; 64 columns at a time beyond (1152 unrolled
            // whole spills in f32).
#pragma unroll(D > 256 ? 16 : D / 4)
            for (int d = 0; d < D; d += 4) {
                float kk[4];
                if (vec) {
                    load4(kr + d, kk);
                } else {
#pragma unroll
                    for (int e = 0; e < 4; e++) kk[e] = to_f(kr[d + e]);
                }
#pragma unroll
                for (int h = 0; h < GB; h++) {
                    if (h < nh) {
                        const float4 qv = *reinterpret_cast<const float4*>(&sq[h][d]);
                        s[h] = fmaf(qv.w, kk[3], fmaf(qv.z, kk[2], fmaf(qv.y, kk[1], fmaf(qv.x, kk[0], s[h]))));
                    }
                }
            }
        }
        // The block's statistics (lane 0's key is always valid, so each maximum is finite).
        float p[GB];
#pragma unroll
        for (int h = 0; h < GB; h++) {
            p[h] = 0.f;
            if (h < nh) {
                const float sc = valid ? s[h] : NEG_INF;
                const float mn = fmaxf(m[h], warp_max(sc));
                const float alpha = ex2(m[h] - mn);  // 0 on the first block (m = -inf)
                p[h] = valid ? ex2(sc - mn) : 0.f;
                l[h] = l[h] * alpha + p[h];
#pragma unroll
                for (int t = 0; t < TD; t++) acc[h][t] *= alpha;
                m[h] = mn;
            }
        }
        // P·V over the block's valid keys.
        const int nk = min(32, c1 - j0);
        for (int jj = 0; jj < nk; jj++) {
            const T* vr = vb + (long)(j0 + jj) * vs;
            float vv[TD];
#pragma unroll
            for (int t = 0; t < TD; t++) {
                const int c = lane + 32 * t;
                vv[t] = c < D ? to_f(vr[c]) : 0.f;
            }
#pragma unroll
            for (int h = 0; h < GB; h++) {
                if (h < nh) {
                    const float pj = __shfl_sync(0xffffffffu, p[h], jj);
#pragma unroll
                    for (int t = 0; t < TD; t++) acc[h][t] = fmaf(pj, vv[t], acc[h][t]);
                }
            }
        }
    }

    // Merge the warps: each one's state weighted by 2^(its max − the largest); a warp that saw no
    // key (max −inf) adds nothing.
#pragma unroll
    for (int h = 0; h < GB; h++) {
        if (h < nh) l[h] = warp_sum(l[h]);
        if (lane == 0) {
            sm[warp][h] = m[h];
            sl[warp][h] = l[h];
        }
#pragma unroll
        for (int t = 0; t < TD; t++) {
            const int c = lane + 32 * t;
            if (c < D) so[warp][h][c] = acc[h][t];
        }
    }
    __syncthreads();
    const long nrh = (long)gridDim.x * hq;  // (row, head) pairs
    for (int i = threadIdx.x; i < nh * D; i += NT) {
        const int h = i / D, c = i - h * D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) mx = fmaxf(mx, sm[w][h]);
        float sum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < NW; w++) {
            if (sm[w][h] != NEG_INF) {
                const float wt = ex2(sm[w][h] - mx);
                sum = fmaf(sl[w][h], wt, sum);
                a = fmaf(so[w][h][c], wt, a);
            }
        }
        // A row that sees no key at all gets zeros, as on the CPU.
        const float out = sum > 0.f ? a / sum : 0.f;
        const long rh = r * hq + h0 + h;
        if (!part) {
            o[r * os + (long)(h0 + h) * D + c] = from_f<T>(out);
        } else {
            part[((long)blockIdx.z * nrh + rh) * D + c] = out;
            if (c == 0)
                part[(long)gridDim.z * nrh * D + (long)blockIdx.z * nrh + rh] = sum > 0.f ? mx + log2f(sum) : NEG_INF;
        }
    }
}

// The key chunks of attn_cached_{T}_d{D} → the output: one warp per (row, head), each chunk weighted
// by 2^(its log2-sum-exp − the largest); empty chunks (−inf) are skipped, and a row no chunk saw
// gets zeros.
template <typename T>
__device__ __forceinline__ void attn_cached_combine_impl(const float* __restrict__ part, T* __restrict__ o, long os,
                                                         int rows, int heads, int D, int splits) {
    const long gw = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const long n = (long)rows * heads;
    if (gw >= n) return;
    const float* lse = part + (long)splits * n * D;
    float top = NEG_INF;
    for (int c = 0; c < splits; c++) top = fmaxf(top, lse[c * n + gw]);
    float wsum = 0.f;
    for (int c = 0; c < splits; c++) {
        const float e = lse[c * n + gw];
        if (e != NEG_INF) wsum += ex2(e - top);
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    T* orow = o + (gw / heads) * os + (gw % heads) * D;
    for (int col = lane; col < D; col += 32) {
        float a = 0.f;
        for (int c = 0; c < splits; c++) {
            const float e = lse[c * n + gw];
            if (e != NEG_INF) a = fmaf(ex2(e - top), part[(c * n + gw) * D + col], a);
        }
        orow[col] = from_f<T>(a * inv);
    }
}

#define ATTN_CACHED(T, TAG, D)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * CACHED_WARPS) attn_cached_##TAG##_d##D(               \
        const T* q, long qs, const T* k, long ks, const T* v, long vs, T* o, long os, const u32* offsets,     \
        int nseg, const u32* ranges, const u32* limits, int hq, int group, float scale_log2, int window,     \
        int causal, float* part) {                                                                        \
        pdl_enter();                                                                                      \
        attn_cached_impl<D, T>(q, qs, k, ks, v, vs, o, os, offsets, nseg, ranges, limits, hq, group, scale_log2, \
                               window, causal, part);                                                     \
    }
#define ATTN_CACHED_DIMS(T, TAG)                                                                          \
    ATTN_CACHED(T, TAG, 16)                                                                               \
    ATTN_CACHED(T, TAG, 32)                                                                               \
    ATTN_CACHED(T, TAG, 64)                                                                               \
    ATTN_CACHED(T, TAG, 72)                                                                               \
    ATTN_CACHED(T, TAG, 80)                                                                               \
    ATTN_CACHED(T, TAG, 96)                                                                               \
    ATTN_CACHED(T, TAG, 128)                                                                              \
    ATTN_CACHED(T, TAG, 256)                                                                              \
    ATTN_CACHED(T, TAG, 768)                                                                              \
    ATTN_CACHED(T, TAG, 1152)
ATTN_CACHED_DIMS(float, f32)
ATTN_CACHED_DIMS(bf16, bf16)

#define ATTN_CACHED_COMBINE(T, NAME)                                                                      \
    extern "C" __global__ void NAME(const float* part, T* o, long os, int rows, int heads, int D, int splits) { \
        pdl_enter();                                                                                            \
        attn_cached_combine_impl<T>(part, o, os, rows, heads, D, splits);                                 \
    }
ATTN_CACHED_COMBINE(float, attn_cached_combine_f32)
ATTN_CACHED_COMBINE(bf16, attn_cached_combine_bf16)
