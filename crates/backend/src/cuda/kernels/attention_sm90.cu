// Attention over packed segments on Hopper's warpgroup tensor-core instructions (wgmma, sm_90a).
// CPU reference: crates/backend/src/cpu/attention.rs. Same arguments, query tiles, masks,
// online softmax and split-key output as flash_bf16_d{D} in attention.cu (shared: flash.cuh),
// which serves every other GPU and head width.
//
// flash_wgmma_d{D}: one CTA is one 64-row query tile of one head and one warpgroup (4 warps, 128
// threads; two for 512-wide heads, see WgCfg); warp w of a warpgroup owns rows 16w..16w+15, as in
// the portable kernel. Per key block of BN = 64 keys:
//   S = Q·Kᵀ   D/16 wgmma m64n64k16, both operands read from shared memory by descriptor;
//   P·V        BN/16 wgmma m64n{D}k16, P from registers (the accumulators, rounded to bf16, are
//              already in the A-fragment layout), V read N-major ("transposed") from shared memory.
// A wgmma issues for the whole warpgroup and runs asynchronously; unlike mma.sync it needs no
// per-warp ldmatrix traffic, which bounded the portable kernel at 80–135 TFLOP/s on the H200.
// ptxas serialises every wgmma if a register one of them uses may be touched while it runs; the
// NVRTC test fails on that fallback.
//
// The wgmma helpers and the 128-byte-swizzled shared-memory layout they read are wgmma.cuh's.

// Rows [r0, r0 + R) ∩ [lo, hi) of a head's [rows][D] slice → the swizzled tile at `tile`, by NT
// threads; rows outside the range are zero-filled.
template <int D, int R, int NT>
__device__ __forceinline__ void load_sw128(u32 tile, const bf16* base, long stride, int r0, int lo, int hi) {
    constexpr int CH = D / 8;  // 16-byte chunks per row
    for (int i = threadIdx.x; i < R * CH; i += NT) {
        const int row = i / CH, ch = i % CH;
        const int gr = r0 + row;
        const bool ok = gr >= lo && gr < hi;
        const bf16* src = ok ? base + (long)gr * stride + ch * 8 : base;
        cp_async16(tile + (ch >> 3) * (R * 128) + row * 128 + (((ch & 7) ^ (row & 7)) << 4), src, ok);
    }
}


// Per head width, mirrored by `wgmma_config` in attention/flash.rs: WGS warpgroups per CTA, BN keys per
// block, MIN_CTAS resident per multiprocessor. 64-wide heads leave room for four CTAs per
// multiprocessor, 256-wide ones (128 accumulators per thread, 97 KB of shared memory) for two, so
// one CTA's softmax overlaps another's wgmma. A 512-wide head's 256 accumulators per thread do not
// fit one warpgroup, so two share the tile: each computes q·kᵀ over its half of the head, the
// halves are summed through shared memory, and each owns half of the output columns.
//
// Measured and dropped (run 16, H200): a pipelined loop (block j's P·V running during the softmax
// of block j + 1, two V buffers, so 48-key blocks for 256-wide heads and three CTAs per
// multiprocessor for 64-wide ones) was slower on every shape (W3 sliding 423 → 462 µs, one image
// 97 → 117 µs): the resident CTAs already overlap each other, and the buffer cost occupancy.
template <int D> struct WgCfg { static constexpr int WGS = 1, BN = 64, MIN_CTAS = 4; };
// 128-wide heads (Z-Image's DiT and text encoder) spill at four CTAs' 128 registers: three.
// Measured and dropped (run 8, H200, Z-Image 1024² and 2048²): 128-key blocks for 128-wide heads
// (m64n128 scores, two CTAs per multiprocessor) gave the same step time (108.1 → 109.1 ms,
// 744.2 → 746.5 ms): fewer iterations, but less overlap between resident CTAs.
template <> struct WgCfg<128> { static constexpr int WGS = 1, BN = 64, MIN_CTAS = 3; };
template <> struct WgCfg<256> { static constexpr int WGS = 1, BN = 64, MIN_CTAS = 2; };
template <> struct WgCfg<512> { static constexpr int WGS = 2, BN = 64, MIN_CTAS = 1; };

// Issue S (+)= Q·Kᵀ over head columns [16·c0, 16·(c0 + STEPS)): 64-column block c / 4, 32 bytes
// into its rows per step. No commit.
// Each step's descriptors are the tiles' first ones plus the step's offset (sw128_desc_at), so the
// loop adds constants instead of re-encoding every address.
template <int STEPS, int NS>
__device__ __forceinline__ void issue_qk(float (&s)[NS][4], u32 sQ, u32 sK, int c0) {
    constexpr int BN = NS * 8;
    const u64 dq = sw128_desc(sQ, 16), dk = sw128_desc(sK, 16);
#pragma unroll
    for (int kk = 0; kk < STEPS; kk++) {
        const int c = c0 + kk;
        const u32 col = (c & 3) * 32;
        wgmma_ss(s, sw128_desc_at(dq, (c >> 2) * (64 * 128) + col), sw128_desc_at(dk, (c >> 2) * (BN * 128) + col),
                 kk > 0);
    }
}

// Issue O += P·V for one key block: 16 keys per step, i.e. two 8-row groups of each 64-column
// block of V (from block b0 on), 2 KB apart per step. No commit.
template <int BN, int NO>
__device__ __forceinline__ void issue_pv(float (&o)[NO][4], const u32 (&pa)[BN / 16][4], u32 sV, int b0) {
    const u64 dv = sw128_desc(sV, BN * 128);
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) wgmma_rs(o, pa[kk], sw128_desc_at(dv, b0 * (BN * 128) + kk * 2048));
}

template <int D>
__device__ __forceinline__ void flash_wg_impl(const bf16* __restrict__ q, long qs, const bf16* __restrict__ k,
                                              long ks, const bf16* __restrict__ v, long vs, bf16* __restrict__ o,
                                              long os, const u32* __restrict__ tiles, int group, float scale_log2,
                                              int window, int causal, const u32* __restrict__ limits,
                                              float* __restrict__ part, int rows, int kv_splits) {
    using C = WgCfg<D>;
    constexpr int WGS = C::WGS, NT = 128 * WGS, DW = D / WGS, BN = C::BN, NS = BN / 8, NO = DW / 8;
    constexpr u32 TILE = BN * D * 2;  // bytes of one K or V tile
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = (smem_addr(smem) + 1023) & ~1023u;  // the host adds 1 KB of slack
    const u32 sK = sQ + 64 * D * 2, sV = sK + TILE;
    // Two warpgroups: each one's partial scores, in accumulator order ([NS·4][128] floats).
    float* sS = reinterpret_cast<float*>(smem + (sV + TILE - smem_addr(smem)));

    const int wg = WGS > 1 ? threadIdx.x >> 7 : 0, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const u32* tl = tiles + 4 * blockIdx.x;
    const int chunk = blockIdx.z;
    const int q0 = tl[0], q1 = tl[1], s0 = tl[2], s1 = tl[3];
    const int h = blockIdx.y, g = h / group;
    int k_lo, k_hi;
    key_range<BN>(k_lo, k_hi, q0, q1, s0, s1, window, causal, limits, chunk, kv_splits);
    const bf16* qb = q + (long)h * D;
    const bf16* kb = k + (long)g * D;
    const bf16* vb = v + (long)g * D;
    const int row_lo = q0 + 16 * warp + (lane >> 2);
    const int end_lo = row_key_end(limits, row_lo, q1, s0, s1), end_hi = row_key_end(limits, row_lo + 8, q1, s0, s1);

    load_sw128<D, 64, NT>(sQ, qb, qs, q0, q0, q1);
    load_sw128<D, BN, NT>(sK, kb, ks, k_lo, k_lo, k_hi);
    cp_commit();
    load_sw128<D, BN, NT>(sV, vb, vs, k_lo, k_lo, k_hi);
    cp_commit();

    float oacc[NO][4];
    zero(oacc);
    RowStats st;
    float alpha_lo, alpha_hi;
    u32 pa[BN / 16][4];

    for (int kb0 = k_lo; kb0 < k_hi; kb0 += BN) {
        cp_wait<1>();  // all but the newest group (this block's V) have landed: Q and K are ready
        fence_async_smem();
        __syncthreads();
        float s[NS][4];
        zero(s);
        wg_fence();
        issue_qk<DW / 16>(s, sQ, sK, wg * (DW / 16));
        wg_commit();
        wg_wait<0>();
        wg_keep(s);
        if constexpr (WGS > 1) {
            const int t = threadIdx.x & 127;
#pragma unroll
            for (int i = 0; i < NS * 4; i++) sS[(wg * NS * 4 + i) * 128 + t] = s[i / 4][i % 4];
            __syncthreads();
#pragma unroll
            for (int i = 0; i < NS * 4; i++) s[i / 4][i % 4] += sS[((1 - wg) * NS * 4 + i) * 128 + t];
        }
        __syncthreads();  // every warpgroup is done reading sK (and sS)
        if (kb0 + BN < k_hi) load_sw128<D, BN, NT>(sK, kb, ks, kb0 + BN, k_lo, k_hi);
        cp_commit();

        softmax_block<NS>(s, st, alpha_lo, alpha_hi, kb0, k_hi, q0, q1, row_lo, window, causal, end_lo, end_hi,
                          scale_log2);
        pack_p(s, pa);
        rescale(oacc, alpha_lo, alpha_hi);

        cp_wait<1>();  // all but the newest group (the next K): V is ready
        fence_async_smem();
        __syncthreads();
        wg_fence();
        issue_pv<BN>(oacc, pa, sV, wg * (DW / 64));
        wg_commit();
        wg_wait<0>();
        wg_keep(oacc);
        __syncthreads();  // every warpgroup is done reading sV
        if (kb0 + BN < k_hi) load_sw128<D, BN, NT>(sV, vb, vs, kb0 + BN, k_lo, k_hi);
        cp_commit();
    }

    flash_store<D, NO, bf16>(oacc, st, wg * DW, wg == 0, row_lo, q1, h, o, os, part, rows, chunk, kv_splits);
}

#define FLASH_WG(D) FLASH_ENTRY(flash_wgmma_d##D, flash_wg_impl<D>, 128 * WgCfg<D>::WGS, WgCfg<D>::MIN_CTAS)
FLASH_WG(64)
FLASH_WG(128)
FLASH_WG(256)
FLASH_WG(512)

// ---- flash_ws_d{D}: warp-specialized, two consumer warpgroups sharing each key block ------------
//
// One CTA is one 128-row query tile (the host's wide tiles: 128 rows that never cross a segment)
// of one head, in three warpgroups:
//   warpgroup 0, the producer: loads Q once with cp.async, then K and V blocks of BN keys (WsCfg)
//     into a ring of STAGES through the tensor-memory accelerator, one thread issuing; it never
//     waits for a load, only for a free stage;
//   warpgroups 1 and 2, the consumers: 64 query rows each, S = Q·Kᵀ (m64n{BN}k16, both from shared
//     memory), the online softmax, O += P·V (P from registers), as in flash_wgmma_d{D}; each frees
//     a stage's K as soon as its scores are in registers and its V after the product.
// So a block's K/V is loaded once for 128 rows (flash_wgmma_d{D}: once per 64), loads run a block
// ahead of the products without any __syncthreads, and the consumers take turns on the tensor
// cores (ping-pong) while each overlaps its own softmax with its previous block's P·V (see the
// consumer below). setmaxnreg gives the consumers the producer's registers (the scores, the
// outputs and P take ~170 of them at D = 128).
// v2 (run a2), with neither overlap, was level with flash_wgmma_d{D}: the time went to the
// consumers' softmax with the tensor cores idle, not to loads.
// Mirrored by `ws_config` and `ws_bn` in attention/flash.rs. Three stages of 64 KB at D = 128 fill
// the 227 KB a CTA may take; four of 48 KB at D = 64, whose blocks are 192 keys: a 64-wide head's
// block is half the products of a 128-wide one for the same turn barriers, stage waits and row
// statistics, so a longer block spreads them over more work (the consumer's scores, P operand
// and outputs take 96 + 48 + 32 registers).
template <int D> struct WsCfg { static constexpr int BN = 192, STAGES = 4; };
template <> struct WsCfg<128> { static constexpr int BN = 128, STAGES = 3; };

// The consumers' ping-pong turns: named barriers PP_BAR (consumer 0's turn) and PP_BAR + 1
// (consumer 1's), each met by one warpgroup's sync and the other's arrive (256 threads).
constexpr int PP_BAR = 8;
__device__ __forceinline__ void pp_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void pp_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

template <int D>
__device__ __forceinline__ void flash_ws_impl(const bf16* __restrict__ q, long qs, const bf16* __restrict__ k,
                                              long ks, const bf16* __restrict__ v, long vs, bf16* __restrict__ o,
                                              long os, const u32* __restrict__ tiles, int group, float scale_log2,
                                              int window, int causal, const u32* __restrict__ limits,
                                              float* __restrict__ part, int rows, int kv_splits, const TmaDesc* tk,
                                              const TmaDesc* tv) {
    using C = WsCfg<D>;
    constexpr int BN = C::BN, S = C::STAGES, NS = BN / 8, NO = D / 8;
    constexpr u32 QH = 64 * D * 2, TILE = BN * D * 2;  // bytes of a 64-row Q half, of a K or V tile
    extern __shared__ __align__(1024) unsigned char smem[];
    const u32 sQ = (smem_addr(smem) + 1023) & ~1023u;  // the host adds 1 KB of slack
    const u32 sK = sQ + 2 * QH, sV = sK + S * TILE;
    // mbarriers: Q landed; per stage K landed, V landed, K free, V free.
    const u32 bar = sV + S * TILE, q_full = bar, k_full = bar + 8, v_full = k_full + 8 * S, k_free = v_full + 8 * S,
              v_free = k_free + 8 * S;

    const u32* tl = tiles + 4 * blockIdx.x;
    const int chunk = blockIdx.z;
    const int q0 = tl[0], q1 = tl[1], s0 = tl[2], s1 = tl[3];
    const int h = blockIdx.y, g = h / group;
    int k_lo, k_hi;
    key_range<BN>(k_lo, k_hi, q0, q1, s0, s1, window, causal, limits, chunk, kv_splits);
    const int nb = k_hi > k_lo ? (k_hi - k_lo + BN - 1) / BN : 0;

    if (threadIdx.x == 0) {
        mbar_init(q_full, 128);
        for (int i = 0; i < S; i++) {
            mbar_init(k_full + 8 * i, 1);  // the producer thread's expect_tx; the TMA bytes complete it
            mbar_init(v_full + 8 * i, 1);
            mbar_init(k_free + 8 * i, 256);
            mbar_init(v_free + 8 * i, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        // The producer: the query tile once with cp.async (all 128 threads, zero-filled past q1),
        // then one thread hands each K and V block to the tensor-memory accelerator, which does
        // the addressing and the swizzle; it only ever waits for a stage to be free. A block may
        // take rows past k_hi from the next segment: the scores mask those keys (p = 0), so
        // their values add nothing.
        set_max_regs_dec<24>();
        const bf16* qb = q + (long)h * D;
        load_sw128<D, 64, 128>(sQ, qb, qs, q0, q0, q1);
        load_sw128<D, 64, 128>(sQ + QH, qb, qs, q0 + 64, q0, q1);
        cp_arrive_on(q_full);
        if (threadIdx.x == 0) {
            for (int j = 0; j < nb; j++) {
                const int st = j % S, row = k_lo + j * BN;
                const u32 par = ((j / S) & 1) ^ 1;
                mbar_wait(k_free + 8 * st, par);
                mbar_expect_tx(k_full + 8 * st, TILE);
#pragma unroll
                for (int b = 0; b < D / 64; b++) tma_load_3d(sK + st * TILE + b * (BN * 128), tk, 64 * b, row, g, k_full + 8 * st);
                mbar_wait(v_free + 8 * st, par);
                mbar_expect_tx(v_full + 8 * st, TILE);
#pragma unroll
                for (int b = 0; b < D / 64; b++) tma_load_3d(sV + st * TILE + b * (BN * 128), tv, 64 * b, row, g, v_full + 8 * st);
            }
        }
        cp_wait<0>();
        return;
    }

    // A consumer: 64 query rows of the tile. Two overlaps keep the tensor cores busy while a
    // consumer computes its softmax:
    //  - inside a warpgroup, block j's scores are issued together with block j - 1's P·V, and the
    //    softmax of block j runs while that P·V is still in flight. The wait for that P·V, the
    //    outputs' rescale and the packing of block j's probabilities into its operand come at the
    //    top of the next turn, after the spin on the stage barriers: ptxas hoists a wgmma wait to
    //    the start of its basic block, so placed right after the softmax it ran before the
    //    exponentials and only the row maximum overlapped the P·V;
    //  - between the two warpgroups, "ping-pong": each issues its products only in its turn (named
    //    barrier PP + c, handed over with bar.arrive right after the issue), so one warpgroup's
    //    softmax falls on the other's products instead of both computing softmax at once.
    // The issues of one consumer come in nb + 1 turns: block 0's scores; block j's scores with
    // block j - 1's P·V; the last P·V. Consumer 1 hands consumer 0 its first turn and takes no
    // turn back after its last, so every arrive meets a sync. K and V land through the
    // tensor-memory accelerator (the async proxy wgmma reads through): only Q, copied with
    // cp.async, needs the proxy fence, once.
    set_max_regs_inc<240>();
    const int c = (threadIdx.x >> 7) - 1, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int qa = min(q1, q0 + 64 * c), qz = min(q1, qa + 64);
    const int row_lo = qa + 16 * warp + (lane >> 2);
    const int end_lo = row_key_end(limits, row_lo, qz, s0, s1), end_hi = row_key_end(limits, row_lo + 8, qz, s0, s1);
    const u32 sQc = sQ + c * QH;

    float oacc[NO][4];
    zero(oacc);
    RowStats stats;
    float alpha_lo, alpha_hi;
    u32 pa[BN / 16][4];
    float s[NS][4];
    // Block j - 1's probabilities (in `s`) into the P·V operand and the outputs rescaled for them,
    // once block j - 2's P·V (which reads the operand) has finished; then its V stage is free.
    auto settle = [&](int j) {
        wg_wait<0>();
        wg_keep(oacc);
        if (j >= 2) mbar_arrive(v_free + 8 * ((j - 2) % S));
        pack_p(s, pa);
        rescale(oacc, alpha_lo, alpha_hi);
    };
    if (nb > 0) {
        zero(s);
        mbar_wait(q_full, 0);
        if (c == 1) pp_arrive(PP_BAR);
        mbar_wait(k_full, 0);
        fence_async_smem();  // Q landed through the generic proxy; wgmma reads through the async one
        pp_sync(PP_BAR + c);
        wg_fence();
        issue_qk<D / 16>(s, sQc, sK, 0);
        wg_commit();
        pp_arrive(PP_BAR + 1 - c);
        wg_wait<0>();
        wg_keep(s);
        mbar_arrive(k_free);
        softmax_block<NS>(s, stats, alpha_lo, alpha_hi, k_lo, k_hi, qa, qz, row_lo, window, causal, end_lo, end_hi,
                          scale_log2);
        for (int j = 1; j < nb; j++) {
            const int st = j % S, pst = (j - 1) % S;
            mbar_wait(k_full + 8 * st, (j / S) & 1);
            mbar_wait(v_full + 8 * pst, ((j - 1) / S) & 1);
            settle(j);
            pp_sync(PP_BAR + c);
            wg_fence();
            issue_qk<D / 16>(s, sQc, sK + st * TILE, 0);
            wg_commit();
            issue_pv<BN>(oacc, pa, sV + pst * TILE, 0);
            wg_commit();
            pp_arrive(PP_BAR + 1 - c);
            wg_wait<1>();  // the scores; block j - 1's P·V may still run
            wg_keep(s);
            mbar_arrive(k_free + 8 * st);
            softmax_block<NS>(s, stats, alpha_lo, alpha_hi, k_lo + j * BN, k_hi, qa, qz, row_lo, window, causal,
                              end_lo, end_hi, scale_log2);
        }
        const int lst = (nb - 1) % S;
        mbar_wait(v_full + 8 * lst, ((nb - 1) / S) & 1);
        settle(nb);
        pp_sync(PP_BAR + c);
        wg_fence();
        issue_pv<BN>(oacc, pa, sV + lst * TILE, 0);
        wg_commit();
        if (c == 0) pp_arrive(PP_BAR + 1);
        wg_wait<0>();
        wg_keep(oacc);
        mbar_arrive(v_free + 8 * lst);
    }
    flash_store<D, NO, bf16>(oacc, stats, 0, true, row_lo, qz, h, o, os, part, rows, chunk, kv_splits);
}

// flash_ws_d{D} takes the flash kernels' parameters and then the tensor maps of K and V (3-D:
// head columns, rows, kv heads; boxes of 64 columns × BN rows; `FlashWsArgs` in cuda/attention.rs).
#define FLASH_WS(D)                                                                                        \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                  \
        flash_ws_d##D(const bf16* q, long qs, const bf16* k, long ks, const bf16* v, long vs, bf16* o, long os, \
                      const u32* tiles, int group, float scale_log2, int window, int causal, const u32* limits, \
                      float* part, int rows, int kv_splits, const __grid_constant__ TmaDesc tk,              \
                      const __grid_constant__ TmaDesc tv) {                                                 \
        pdl_enter();                                                                                        \
        flash_ws_impl<D>(q, qs, k, ks, v, vs, o, os, tiles, group, scale_log2, window, causal, limits, part,   \
                         rows, kv_splits, &tk, &tv);                                                         \
    }
FLASH_WS(64)
FLASH_WS(128)
