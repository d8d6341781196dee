// The kernels' bodies, included once per instruction set by int8_dot.cpp inside a
// `#pragma GCC target` region and a namespace of that set's name. The includer defines
// DOT_U8S8(u, s): the 32 unsigned bytes u times the 32 signed bytes s, summed four
// products at a time into 8 int32 lanes (AVX2: vpmaddubsw then vpmaddwd; VNNI: vpdpbusd),
// and DOT2_U8S8(u1, s1, u2, s2): the two such sums added (lane by lane).
//
// Every function here is exact in its integer part: a block of 32 int8 x int4 (or int8)
// products sums in int32 without overflow (at most 32 * 127 * 127, 128 times that with a
// second digit). The float part is a
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

// Where block b's 32 bytes go in an activation row q: in natural order, or (`deinterleave`)
// in the order int4's nibbles come in (int4_tile): blocks in pairs, each pair's 64 bytes
// [evens of b, evens of b + 1, odds of b, odds of b + 1] (16 each), a last unpaired block
// [evens, odds].
static inline void store_block(__m256i bytes, int64_t b, int64_t blocks, bool deinterleave, int8_t* q) {
    if (!deinterleave) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), bytes);
        return;
    }
    // gathers even bytes then odd bytes within each 128-bit lane
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    bytes = _mm256_shuffle_epi8(bytes, evens_odds);  // per lane: 8 evens, 8 odds
    bytes = _mm256_permute4x64_epi64(bytes, 0xD8);     // evens of both lanes, then odds
    if (b == blocks - 1 && b % 2 == 0) {               // unpaired last block
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * 32), bytes);
        return;
    }
    int8_t* pair = q + (b - b % 2) * 32 + (b % 2) * 16;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pair + 32), _mm256_extracti128_si256(bytes, 1));
}

// Four vectors of 8 int32 (elements 0-7, 8-15, 16-23, 24-31) as 32 int8 in order, saturating.
static inline __m256i pack_bytes(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    // packs interleave the 128-bit lanes: [i0lo i1lo i2lo i3lo | i0hi i1hi i2hi i3hi] per
    // 32-bit group comes out; the permute puts it back in order
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One row of activations, x [K] float32 (K a multiple of 32), quantized in blocks of 32:
// d[b] = max|x| / 127 over block b and q1 = round-half-even(x * (127 / max|x|)) in int8 (an
// all-zero block has d 0 and q 0). With `digits` 2 also the residual's digit:
// q2 = round-half-even((x - q1 * d) * (128 * 127 / max|x|)), within +-64, so x ~ (d / 128) *
// (128 q1 + q2). Every step is one IEEE float32 operation (no fused multiply-add), as in the
// torch reference. sums[b] = the float32 sum of the block's x (four 8-lane partials, then
// across lanes) and rest[b] = sums[b] - the quantized block's sum: what the int8 digits lose
// of it. The bytes go where store_block puts them.
static void quantize_row(const float* x, int64_t k, bool deinterleave, int digits, int8_t* q1, int8_t* q2,
                         float* d, float* sums, float* rest) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const int64_t blocks = k / 32;
    for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x + b * 32;
        __m256 v[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)};
        __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float block_max = _mm_cvtss_f32(m4);
        const float inv = block_max > 0.0f ? 127.0f / block_max : 0.0f;
        d[b] = block_max / 127.0f;
        sums[b] = hsum8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
        const __m256 scale = _mm256_set1_ps(inv), step = _mm256_set1_ps(d[b]);
        __m256i i[4], isum = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {  // _mm256_cvtps_epi32 rounds to nearest, ties to even (MXCSR's default)
            i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], scale));
            isum = _mm256_add_epi32(isum, i[j]);
        }
        store_block(pack_bytes(i[0], i[1], i[2], i[3]), b, blocks, deinterleave, q1);
        if (digits == 1) {
            rest[b] = sums[b] - d[b] * static_cast<float>(hsum8i(isum));
            continue;
        }
        const __m256 scale2 = _mm256_set1_ps(inv * 128.0f);
        __m256i r[4], rsum = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            __m256 residual = _mm256_sub_ps(v[j], _mm256_mul_ps(_mm256_cvtepi32_ps(i[j]), step));
            r[j] = _mm256_cvtps_epi32(_mm256_mul_ps(residual, scale2));
            rsum = _mm256_add_epi32(rsum, r[j]);
        }
        store_block(pack_bytes(r[0], r[1], r[2], r[3]), b, blocks, deinterleave, q2);
        const int32_t total = 128 * hsum8i(isum) + hsum8i(rsum);
        rest[b] = sums[b] - d[b] * (1.0f / 128.0f) * static_cast<float>(total);
    }
}

// One block's (or pair's) integer products with D digits of activations: 128 x the first
// digit's sum plus the second's (D 2), exact in int32 (at most 32 x 127 x (128 x 127 + 64)).
#define DIGITS_SUM(dot1, dot2) (D == 1 ? (dot1) : _mm256_add_epi32(_mm256_slli_epi32((dot1), 7), (dot2)))

// R output channels from `row` on (see int4_rows), for every activation row: R independent
// accumulators share each pair of activation blocks loaded. A pair of weight blocks is 32
// bytes: their low nibbles are the two blocks' even elements (one 128-bit lane each), their
// high nibbles the odd ones, which is how quantize_row lays the activations out; the two
// products sum in int16 (at most 2 x 2 x 15 x 127) before widening, and the 8 int32 lanes
// (4 a block) take their block's scale. `group_of` maps a block to its weight group.
template <int R, int D>
static inline void int4_tile(const int8_t* q1, const int8_t* q2, const float* dx, const float* group_sums,
                             const float* group_rests, int64_t m, int64_t k, const uint8_t* packed, const float* scale,
                             const float* offset, int64_t groups, const int32_t* group_of, int64_t row, int64_t n,
                             float* y) {
    const int64_t blocks = k / 32, pairs = blocks / 2;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const float unit = D == 1 ? 1.0f : 1.0f / 128.0f;  // the activation digits' step, in units of d
    for (int64_t i = 0; i < m; ++i) {
        const int8_t* a = q1 + i * k;
        const int8_t* a2 = D == 1 ? a : q2 + i * k;
        const float* ad = dx + i * blocks;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t b = 2 * p;
            const __m256i evens = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
            const __m256i odds = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32 + 32));
            const __m256i evens2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + b * 32));
            const __m256i odds2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + b * 32 + 32));
            const float s0 = ad[b] * unit, s1 = ad[b + 1] * unit;
            const int32_t g0 = group_of[b], g1 = group_of[b + 1];
            for (int r = 0; r < R; ++r) {
                const float* ws = scale + (row + r) * groups;
                __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + (row + r) * (k / 2) + b * 16));
                __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                __m256i ints = DIGITS_SUM(DOT2_U8S8(lo, evens, hi, odds), DOT2_U8S8(lo, evens2, hi, odds2));
                __m256 scales = _mm256_set_m128(_mm_set1_ps(ws[g1] * s1), _mm_set1_ps(ws[g0] * s0));
                acc[r] = _mm256_fmadd_ps(scales, _mm256_cvtepi32_ps(ints), acc[r]);
            }
        }
        if (blocks % 2) {  // the unpaired last block: [evens, odds] of its 16 bytes
            const int64_t b = blocks - 1;
            const __m256i acts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
            const __m256i acts2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + b * 32));
            for (int r = 0; r < R; ++r) {
                __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + (row + r) * (k / 2) + b * 16));
                __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
                __m256i ints = DIGITS_SUM(DOT_U8S8(nibbles, acts), DOT_U8S8(nibbles, acts2));
                const float s = scale[(row + r) * groups + group_of[b]] * (ad[b] * unit);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(ints), acc[r]);
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
template <int D>
static void int4_rows(const int8_t* q1, const int8_t* q2, const float* dx, const float* group_sums,
                      const float* group_rests, int64_t m, int64_t k, const uint8_t* packed, const float* scale,
                      const float* offset, int64_t groups, const int32_t* group_of, int64_t n_begin, int64_t n_end,
                      int64_t n, float* y) {
    int64_t row = n_begin;
    for (; row + 4 <= n_end; row += 4)
        int4_tile<4, D>(q1, q2, dx, group_sums, group_rests, m, k, packed, scale, offset, groups, group_of, row, n, y);
    for (; row < n_end; ++row)
        int4_tile<1, D>(q1, q2, dx, group_sums, group_rests, m, k, packed, scale, offset, groups, group_of, row, n, y);
}

// y[m, n] = sum_b scale[n, g(b)] * dx[m, b] * sum_j qx[m, 32b + j] * qw[n, 32b + j] for int8
// weights `qw` [N, K] and scale [N, G] (G = 1: one scale per output channel); with D 2,
// qx = 128 q1 + q2 and the scale is dx / 128.
template <int R, int D>
static inline void int8_tile(const int8_t* q1, const int8_t* q2, const float* dx, int64_t m, int64_t k,
                             const int8_t* qw, const float* scale, int64_t groups, int64_t row, int64_t n, float* y) {
    const int64_t blocks = k / 32, per_group = blocks / groups;
    const float unit = D == 1 ? 1.0f : 1.0f / 128.0f;
    for (int64_t i = 0; i < m; ++i) {
        const int8_t* a = q1 + i * k;
        const int8_t* a2 = D == 1 ? a : q2 + i * k;
        const float* ad = dx + i * blocks;
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < groups; ++g) {  // blocks of one weight group share its scales
            float ws[R];
            for (int r = 0; r < R; ++r) ws[r] = scale[(row + r) * groups + g];
            for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
                const __m256i acts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + b * 32));
                const __m256i acts2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a2 + b * 32));
                const float s = ad[b] * unit;
                for (int r = 0; r < R; ++r) {
                    __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qw + (row + r) * k + b * 32));
                    // |w| as unsigned bytes, and the activations carrying w's sign (w = 0 zeroes them)
                    __m256i u = _mm256_sign_epi8(w, w);
                    __m256i ints = DIGITS_SUM(DOT_U8S8(u, _mm256_sign_epi8(acts, w)),
                                              DOT_U8S8(u, _mm256_sign_epi8(acts2, w)));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ws[r] * s), _mm256_cvtepi32_ps(ints), acc[r]);
                }
            }
        }
        for (int r = 0; r < R; ++r) y[i * n + row + r] = hsum8(acc[r]);
    }
}

template <int D>
static void int8_rows(const int8_t* q1, const int8_t* q2, const float* dx, int64_t m, int64_t k, const int8_t* qw,
                      const float* scale, int64_t groups, int64_t n_begin, int64_t n_end, int64_t n, float* y) {
    int64_t row = n_begin;
    for (; row + 4 <= n_end; row += 4) int8_tile<4, D>(q1, q2, dx, m, k, qw, scale, groups, row, n, y);
    for (; row < n_end; ++row) int8_tile<1, D>(q1, q2, dx, m, k, qw, scale, groups, row, n, y);
}

#undef DIGITS_SUM
