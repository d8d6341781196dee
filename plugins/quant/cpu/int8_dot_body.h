// The kernels' bodies, included once per instruction set by int8_dot.cpp inside a
// `#pragma GCC target` region and a namespace of that set's name. The includer defines
// DOT_U8S8(u, s): the 32 unsigned bytes u times the 32 signed bytes s, summed four
// products at a time into 8 int32 lanes (AVX2: vpmaddubsw then vpmaddwd; VNNI: vpdpbusd).
//
// Every function here is exact in its integer part: a block of 32 int8 x int4 (or int8)
// products sums in int32 without overflow (at most 32 * 127 * 127). The float part is a
// scale per (block, weight group) multiplied into a float32 accumulator.

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

// One row of activations, x [K] float32 (K a multiple of 32), quantized in blocks of 32:
// d[b] = max|x| / 127 over block b, q = round-half-even(x * (127 / max|x|)) in int8 (an
// all-zero block has d 0 and q 0), sums[b] = the float32 sum of the block's x (summed in
// four 8-lane partials, then across lanes) and rest[b] = sums[b] - d[b] * (the sum of the
// block's q): what the int8 block loses of the block's sum. With `deinterleave` the bytes
// come in the order int4's nibbles do (int4_tile): blocks in pairs, each pair's 64 bytes
// [evens of b, evens of b + 1, odds of b, odds of b + 1] (16 each), a last unpaired block
// [evens, odds].
static void quantize_row(const float* x, int64_t k, bool deinterleave, int8_t* q, float* d, float* sums,
                         float* rest) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    // gathers even bytes then odd bytes within each 128-bit lane
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int64_t b = 0; b < k / 32; ++b) {
        const float* xb = x + b * 32;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float block_max = _mm_cvtss_f32(m4);
        const float inv = block_max > 0.0f ? 127.0f / block_max : 0.0f;
        d[b] = block_max / 127.0f;
        sums[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        const __m256 scale = _mm256_set1_ps(inv);
        // _mm256_cvtps_epi32 rounds to nearest, ties to even (the default MXCSR mode)
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, scale)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, scale));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, scale)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, scale));
        __m256i isum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        rest[b] = sums[b] - d[b] * static_cast<float>(hsum8i(isum));
        // packs interleave the 128-bit lanes: [0-3 4-7 8-11 12-15 | ...] comes out as
        // [i0lo i1lo i2lo i3lo | i0hi i1hi i2hi i3hi] per 32-bit group; permute puts it back
        __m256i w01 = _mm256_packs_epi32(i0, i1), w23 = _mm256_packs_epi32(i2, i3);
        __m256i bytes = _mm256_packs_epi16(w01, w23);
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (!deinterleave) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), bytes);
            continue;
        }
        bytes = _mm256_shuffle_epi8(bytes, evens_odds);  // per lane: 8 evens, 8 odds
        bytes = _mm256_permute4x64_epi64(bytes, 0xD8);     // evens of both lanes, then odds
        if (b == k / 32 - 1 && b % 2 == 0) {  // unpaired last block
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), bytes);
            continue;
        }
        int8_t* pair = q + (b - b % 2) * 32 + (b % 2) * 16;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(bytes));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(bytes, 1));
    }
}

// R output channels from `row` on (see int4_rows), for every activation row: R independent
// accumulators share each pair of activation blocks loaded. A pair of weight blocks is 32
// bytes: their low nibbles are the two blocks' even elements (one 128-bit lane each), their
// high nibbles the odd ones, which is how quantize_row lays the activations out; the two
// products sum in int16 (at most 2 x 2 x 15 x 127) before widening, and the 8 int32 lanes
// (4 a block) take their block's scale. `group_of` maps a block to its weight group.
template <int R>
static inline void int4_tile(const int8_t* qx, const float* dx, const float* group_sums, const float* group_rests,
                             int64_t m, int64_t k, const uint8_t* packed, const float* scale, const float* offset,
                             int64_t groups, const int32_t* group_of, int64_t row, int64_t n, float* y) {
    const int64_t blocks = k / 32, pairs = blocks / 2;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < m; ++i) {
        const int8_t* a = qx + i * k;
        const float* ad = dx + i * blocks;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t b = 2 * p;
            const __m256i evens = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
            const __m256i odds = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32 + 32));
            const int32_t g0 = group_of[b], g1 = group_of[b + 1];
            for (int r = 0; r < R; ++r) {
                const float* ws = scale + (row + r) * groups;
                __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + (row + r) * (k / 2) + b * 16));
                __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                __m256 sums = _mm256_cvtepi32_ps(DOT2_U8S8(lo, evens, hi, odds));
                __m256 scales = _mm256_set_m128(_mm_set1_ps(ws[g1] * ad[b + 1]), _mm_set1_ps(ws[g0] * ad[b]));
                acc[r] = _mm256_fmadd_ps(scales, sums, acc[r]);
            }
        }
        if (blocks % 2) {  // the unpaired last block: [evens, odds] of its 16 bytes
            const int64_t b = blocks - 1;
            const __m256i acts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
            for (int r = 0; r < R; ++r) {
                __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + (row + r) * (k / 2) + b * 16));
                __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
                __m256 sums = _mm256_cvtepi32_ps(DOT_U8S8(nibbles, acts));
                const float s = scale[(row + r) * groups + group_of[b]] * ad[b];
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), sums, acc[r]);
            }
        }
        const float* gs = group_sums + i * groups;
        const float* gr = group_rests + i * groups;
        for (int r = 0; r < R; ++r) {
            const float* ws = scale + (row + r) * groups;
            const float* wo = offset + (row + r) * groups;
            float out = hsum8(acc[r]);
            for (int64_t g = 0; g < groups; ++g) out += wo[g] * gs[g] + ws[g] * gr[g];
            y[i * n + row + r] = out;
        }
    }
}

// y[m, n] = sum_b scale[n, g(b)] * dx[m, b] * sum_j qx[m, 32b + j] * (qw[n, 32b + j] - 8)
//         + sum_g (offset[n, g] + 8 scale[n, g]) * (sum of x[m, k] over group g)
// for int4 weights `packed` [N, K / 2] (byte j of a block: element 2j low nibble, 2j + 1
// high), scale and offset [N, G] float32 with groups of `group` input channels (a multiple of
// 32): the nibbles centred on 8, so what the int8 activations lose multiplies weights of
// mean near zero. Computed as sum_b scale * dx * (the block's sum of qx * qw, unsigned
// nibbles) + sum_g offset * group_sums[g] + scale * group_rests[g], with group_rests = 8 x
// the group's sum of `rest` (quantize_row): the same value up to float rounding.
static void int4_rows(const int8_t* qx, const float* dx, const float* group_sums, const float* group_rests,
                      int64_t m, int64_t k, const uint8_t* packed, const float* scale, const float* offset,
                      int64_t groups, const int32_t* group_of, int64_t n_begin, int64_t n_end, int64_t n, float* y) {
    int64_t row = n_begin;
    for (; row + 4 <= n_end; row += 4)
        int4_tile<4>(qx, dx, group_sums, group_rests, m, k, packed, scale, offset, groups, group_of, row, n, y);
    for (; row < n_end; ++row)
        int4_tile<1>(qx, dx, group_sums, group_rests, m, k, packed, scale, offset, groups, group_of, row, n, y);
}

// y[m, n] = sum_b scale[n, g(b)] * dx[m, b] * sum_j qx[m, 32b + j] * qw[n, 32b + j] for int8
// weights `qw` [N, K] and scale [N, G] (G = 1: one scale per output channel).
template <int R>
static inline void int8_tile(const int8_t* qx, const float* dx, int64_t m, int64_t k, const int8_t* qw,
                             const float* scale, int64_t groups, int64_t row, int64_t n, float* y) {
    const int64_t blocks = k / 32, per_group = blocks / groups;
    for (int64_t i = 0; i < m; ++i) {
        const int8_t* a = qx + i * k;
        const float* ad = dx + i * blocks;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {  // blocks of one weight group share its scales
            float ws[R];
            for (int r = 0; r < R; ++r) ws[r] = scale[(row + r) * groups + g];
            for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
                const __m256i acts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
                for (int r = 0; r < R; ++r) {
                    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + (row + r) * k + b * 32));
                    // |w| as unsigned bytes, and the activations carrying w's sign (w = 0 zeroes them)
                    __m256i sums = DOT_U8S8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(acts, w));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ws[r] * ad[b]), _mm256_cvtepi32_ps(sums), acc[r]);
                }
            }
        }
        for (int r = 0; r < R; ++r) y[i * n + row + r] = hsum8(acc[r]);
    }
}

static void int8_rows(const int8_t* qx, const float* dx, int64_t m, int64_t k, const int8_t* qw,
                      const float* scale, int64_t groups, int64_t n_begin, int64_t n_end, int64_t n, float* y) {
    int64_t row = n_begin;
    for (; row + 4 <= n_end; row += 4) int8_tile<4>(qx, dx, m, k, qw, scale, groups, row, n, y);
    for (; row < n_end; ++row) int8_tile<1>(qx, dx, m, k, qw, scale, groups, row, n, y);
}
