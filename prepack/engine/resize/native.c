/* Pillow 13.0.0's bicubic resample of RGB pictures, value for value, in portable vector C.
 *
 * Built at first use by prepack/engine/resize/native.py with the machine's C compiler
 * (-O2 -march=native -ffp-contract=off) and proven against the installed Pillow before use.
 * Vector paths: AVX-512 and AVX2 (each with VNNI's fused 16-bit multiply-adds where the CPU has
 * them), NEON (aarch64), and portable loops for anything else.
 *
 * Exactness (the arithmetic of Pillow 13.0.0's libImaging/Resample.c, re-derived, not copied):
 *   - per axis, double-precision filter weights: window [int(center - support + 0.5),
 *     int(center + support + 0.5)) clamped to the picture, each weight the bicubic (a = -0.5) of
 *     (x + lo - center + 0.5) / filterscale through a precomputed reciprocal, a sequential sum and
 *     one division per weight; then 22-bit fixed point rounded half away from zero.  Only this
 *     table uses floating point, and -ffp-contract=off keeps the compiler from fusing it;
 *   - each output value is clip(((1 << 21) + sum(pixel * weight)) >> 22) in int32.  Every partial
 *     sum fits in int32, so lanes, tap grouping and the order of additions cannot change it;
 *   - the picture between the two passes is 8-bit, so the pass order is Pillow's (the caller says).
 *
 * Layout: pixels are 4 bytes (R, G, B, X: Pillow's own storage of an RGB image).  The vertical
 * pass runs 64 lanes (16 pixels) of one output row in registers over its taps; the horizontal pass
 * holds 16 rows transposed (one input column is 64 contiguous bytes) and runs the same loop per
 * output column, then transposes the result back.  The last pass writes each finished row as RGB,
 * plain or row-delta coded as the record's pixel table stores it (the _coded entry points), while
 * the row is still in L1.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PRECISION_BITS 22
#define HALF (1 << (PRECISION_BITS - 1))

/* The instruction set this build vectorizes with.  The arithmetic is generic vector C at the
 * machine's register width (GCC lowers wider generic vectors through the stack); the widening,
 * the narrowing, the transposes and the RGBX -> RGB store are asked for by name where the target
 * has the instructions (a generic conversion of bytes to int32 is lowered to scalar code, and the
 * others have no generic spelling). */
#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI512 1 /* the tap loop in 16-bit multiply-adds fused with the accumulate (vpdpwssd) */
#define ISA_NAME "avx512-vnni"
#else
#define ISA_NAME "avx512"
#endif
#define VL 16
#elif defined(__AVX2__)
#include <immintrin.h>
#if defined(__AVXVNNI__)
#define MADD256 1 /* the tap loop in 16-bit multiply-adds, fused with the accumulate (vpdpwssd) */
#define ISA_NAME "avx2-vnni"
#elif defined(PREPACK_RESIZE_MADD)
#define MADD256 1
#define ISA_NAME "avx2-madd"
#else
#define ISA_NAME "avx2"
#endif
#define VL 8
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#define ISA_NAME "neon"
#define VL 4
#else
#define ISA_NAME "portable"
#define VL 4
#endif
#define NV (64 / VL) /* vectors per 64 lanes (16 RGBX pixels) */
#define UNROLL _Pragma("GCC unroll 16")

typedef int32_t vsi __attribute__((vector_size(VL * 4)));

/* Which of the paths below this build took (the bench and the tests report it). */
const char *prepack_resize_isa(void) { return ISA_NAME; }

/* 64 bytes widened to 64 int32 lanes. */
static inline void widen64(const uint8_t *p, vsi x[NV]) {
#if defined(__AVX512F__)
    UNROLL for (int i = 0; i < NV; i++) x[i] = (vsi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
#elif defined(__AVX2__)
    UNROLL for (int i = 0; i < NV; i++) x[i] = (vsi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i)));
#elif defined(__ARM_NEON) && defined(__aarch64__)
    UNROLL for (int i = 0; i < 4; i++) {
        uint8x16_t b = vld1q_u8(p + 16 * i);
        uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
        x[4 * i] = (vsi)vmovl_u16(vget_low_u16(lo));
        x[4 * i + 1] = (vsi)vmovl_high_u16(lo);
        x[4 * i + 2] = (vsi)vmovl_u16(vget_low_u16(hi));
        x[4 * i + 3] = (vsi)vmovl_high_u16(hi);
    }
#else
    for (int i = 0; i < NV; i++)
        for (int j = 0; j < VL; j++) x[i][j] = p[VL * i + j];
#endif
}

/* The 16-bit multiply-add builds (below) take taps in pairs: for even t, kp[t] holds the high
 * halves (w >> 11) of weights t and t + 1 and kp[t + 1] their low halves (w & 0x7ff), each pair
 * as one int32 of two int16 lanes, tap t in the low one. */
#if defined(VNNI512) || defined(MADD256)
#define PAIRED 1
#else
#define PAIRED 0
#endif

static void pack_pairs(const int32_t *k, int32_t *kp, int ksize) {
    for (int t = 0; t < ksize; t += 2) {
        kp[t] = (int32_t)(((uint32_t)(k[t + 1] >> 11) << 16) | (uint16_t)(k[t] >> 11));
        kp[t + 1] = (int32_t)(((uint32_t)(k[t + 1] & 0x7ff) << 16) | (uint32_t)(k[t] & 0x7ff));
    }
}

typedef struct {
    int ksize;       /* taps per output value, padded with zero weights to an even count */
    int32_t *first;  /* first input index of each output value */
    int32_t *count;  /* taps that carry weight */
    int32_t *weight; /* [out][ksize] fixed point, zero past count */
    int32_t *packed; /* the 16-bit multiply-add builds' [out][ksize]: taps 2j, 2j + 1 as pack_pairs
                      * makes them (once per axis, not per 64 lanes in the tap loop) */
} axis_t;

static double bicubic(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
    if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
    return 0.0;
}

static void free_axis(axis_t *ax) {
    free(ax->first);
    free(ax->count);
    free(ax->weight);
    free(ax->packed);
    memset(ax, 0, sizeof *ax);
}

static int make_axis(axis_t *ax, int in_size, int out_size) {
    double scale = (double)in_size / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 2.0 * filterscale;
    double inv = 1.0 / filterscale;
    int ksize = (int)ceil(support) * 2 + 2;
    double *w = malloc(sizeof(double) * ksize);
    ax->ksize = ksize;
    ax->first = malloc(sizeof(int32_t) * out_size);
    ax->count = malloc(sizeof(int32_t) * out_size);
    ax->weight = calloc((size_t)out_size * ksize, sizeof(int32_t));
    ax->packed = PAIRED ? malloc(sizeof(int32_t) * out_size * ksize) : NULL;
    if (!w || !ax->first || !ax->count || !ax->weight || (PAIRED && !ax->packed)) {
        free(w);
        free_axis(ax);
        return -1;
    }
    for (int xx = 0; xx < out_size; xx++) {
        double center = (xx + 0.5) * scale;
        double total = 0.0;
        int lo = (int)(center - support + 0.5);
        int hi = (int)(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in_size) hi = in_size;
        int n = hi - lo;
        for (int x = 0; x < n; x++) {
            double v = bicubic((x + lo - center + 0.5) * inv);
            w[x] = v;
            total += v;
        }
        int32_t *k = ax->weight + (size_t)xx * ksize;
        for (int x = 0; x < n; x++) {
            double v = total != 0.0 ? w[x] / total : w[x];
            k[x] = v < 0.0 ? (int32_t)(-0.5 + v * (1 << PRECISION_BITS))
                           : (int32_t)(0.5 + v * (1 << PRECISION_BITS));
        }
        ax->first[xx] = lo;
        ax->count[xx] = n;
        if (PAIRED) pack_pairs(k, ax->packed + (size_t)xx * ksize, ksize);
    }
    free(w);
    return 0;
}

/* What taps64 reads for output i: its weights, or in the paired builds their packed pairs. */
static inline const int32_t *taps_of(const axis_t *ax, int i) {
    return (PAIRED ? ax->packed : ax->weight) + (size_t)i * ax->ksize;
}

static inline uint8_t clip8(int32_t v) {
    v >>= PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

/* o[i] = clip(a[i] >> 22) for 64 lanes (a counts the rounding HALF already). */
static inline void narrow64(uint8_t *o, vsi a[NV]) {
    UNROLL for (int i = 0; i < NV; i++) a[i] >>= PRECISION_BITS;
#if defined(__AVX512F__)
    UNROLL for (int i = 0; i < NV; i++)
        _mm_storeu_si128((__m128i *)(o + 16 * i), _mm512_cvtusepi32_epi8(_mm512_max_epi32((__m512i)a[i], _mm512_setzero_si512())));
#elif defined(__AVX2__)
    /* saturating packs clip as clip8 does; they interleave the 128-bit lanes, which one dword
     * permute puts back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    UNROLL for (int i = 0; i < 2; i++) {
        __m256i w0 = _mm256_packs_epi32((__m256i)a[4 * i], (__m256i)a[4 * i + 1]);
        __m256i w1 = _mm256_packs_epi32((__m256i)a[4 * i + 2], (__m256i)a[4 * i + 3]);
        _mm256_storeu_si256((__m256i *)(o + 32 * i), _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w0, w1), order));
    }
#elif defined(__ARM_NEON) && defined(__aarch64__)
    UNROLL for (int i = 0; i < 4; i++) { /* saturating narrows: clip8's clip */
        int16x8_t lo = vcombine_s16(vqmovn_s32((int32x4_t)a[4 * i]), vqmovn_s32((int32x4_t)a[4 * i + 1]));
        int16x8_t hi = vcombine_s16(vqmovn_s32((int32x4_t)a[4 * i + 2]), vqmovn_s32((int32x4_t)a[4 * i + 3]));
        vst1q_u8(o + 16 * i, vcombine_u8(vqmovun_s16(lo), vqmovun_s16(hi)));
    }
#else
    for (int i = 0; i < NV; i++)
        for (int j = 0; j < VL; j++) o[VL * i + j] = (uint8_t)(a[i][j] < 0 ? 0 : (a[i][j] > 255 ? 255 : a[i][j]));
#endif
}

#if defined(VNNI512)
/* AVX-512 VNNI: vpdpwssd multiplies 16-bit pairs and adds both products to an int32 lane, so one
 * instruction does two taps of 16 lanes, exactly.  A weight is 22-bit fixed point (|w| < 2^23), so
 * w = hi * 2^11 + lo with hi = w >> 11 (|hi| < 2^12; int16 would hold it up to |w| < 2^26) and
 * lo = w & 0x7ff in [0, 2^11) both fit int16, and sum(p * w) = 2^11 * sum(p * hi) + sum(p * lo)
 * in int32: each instruction adds p * hi + p' * hi' (|.| < 2^21) or p * lo + p' * lo' (< 2^20) to
 * a lane without saturating, so everything wraps mod 2^32 as Pillow's own int32 sum does, and the
 * result (which fits int32) is the same bits.  The pixels of taps t and t + 1 (rows p and q) sit side
 * by side in 16-bit lanes (widened, then interleaved per 128-bit lane); an odd last tap is paired
 * with itself at weight 0 (no read past the window).  64 lanes per call: 8 accumulators (hi, lo
 * per 16 lanes).  kp: the pair's weights, packed once per axis (pack_pairs): packed here, per 64
 * lanes, and with pair_sums' two loops as one, the kernel took ~10% longer (~25% in the AVX2
 * builds). */
typedef __m512i vacc;
static inline void tap_pair(vacc h[4], vacc l[4], const uint8_t *p, const uint8_t *q, const int32_t *kp) {
    __m512i wh = _mm512_set1_epi32(kp[0]), wl = _mm512_set1_epi32(kp[1]);
    UNROLL for (int i = 0; i < 2; i++) {
        __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 * i)));
        __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * i)));
        __m512i lo = _mm512_unpacklo_epi16(a, b); /* lanes 0-3, 8-11, 16-19, 24-27 of these 32 */
        __m512i hi = _mm512_unpackhi_epi16(a, b); /* lanes 4-7, 12-15, 20-23, 28-31 */
        h[2 * i] = _mm512_dpwssd_epi32(h[2 * i], lo, wh);
        l[2 * i] = _mm512_dpwssd_epi32(l[2 * i], lo, wl);
        h[2 * i + 1] = _mm512_dpwssd_epi32(h[2 * i + 1], hi, wh);
        l[2 * i + 1] = _mm512_dpwssd_epi32(l[2 * i + 1], hi, wl);
    }
}
#elif defined(MADD256)
/* AVX2 with AVX-VNNI (vpdpwssd: the multiply-add and the accumulate in one instruction; ~35% faster
 * than the 32-bit multiplies on a Sapphire Rapids), or with -DPREPACK_RESIZE_MADD (vpmaddwd and
 * vpaddd; not the default: there it was 0-10% slower than the 32-bit multiplies while the weights
 * were packed in the tap loop, ~12% faster since pack_pairs): 16-bit multiply-adds, two taps per instruction, exactly.  A weight is 22-bit fixed point
 * (|w| < 2^23), so w = hi * 2^11 + lo with hi = w >> 11 (|hi| < 2^12) and lo = w & 0x7ff both fit
 * int16, and sum(p * w) = 2^11 * sum(p * hi) + sum(p * lo) in int32 (wrapping, like Pillow's
 * own sum).  Pixels of taps t and t + 1 sit side by side in 16-bit lanes; an odd last tap is
 * paired with itself at weight 0 (no read past the window).  32 lanes per loop: 8 accumulators. */
#if defined(__AVXVNNI__)
#define MADD2(h, l, x) (h = _mm256_dpwssd_avx_epi32(h, x, wh), l = _mm256_dpwssd_avx_epi32(l, x, wl))
#else
#define MADD2(h, l, x) (h = _mm256_add_epi32(h, _mm256_madd_epi16(x, wh)), l = _mm256_add_epi32(l, _mm256_madd_epi16(x, wl)))
#endif
typedef __m256i vacc;
static inline void tap_pair(vacc h[4], vacc l[4], const uint8_t *p, const uint8_t *q, const int32_t *kp) {
    __m256i wh = _mm256_set1_epi32(kp[0]), wl = _mm256_set1_epi32(kp[1]);
    UNROLL for (int i = 0; i < 2; i++) {
        __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16 * i)));
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * i)));
        MADD2(h[2 * i], l[2 * i], _mm256_unpacklo_epi16(a, b));         /* lanes 0-3, 8-11 */
        MADD2(h[2 * i + 1], l[2 * i + 1], _mm256_unpackhi_epi16(a, b)); /* lanes 4-7, 12-15 */
    }
}
#undef MADD2
#endif

#if PAIRED
/* h, l: the sums over taps t < n (rows base + t * stride) of the pixels times the weights' high and
 * low halves, l from HALF (the rounding, added here for free: the int32 sum wraps, so where it goes
 * in cannot change a bit).  Full pairs in one loop, an odd last tap apart (paired with itself; its partner's
 * packed weight is 0): with the choice inside the loop, GCC copied the accumulators between
 * registers on every pair. */
static inline void pair_sums(vacc h[4], vacc l[4], const uint8_t *base, size_t stride, const int32_t *kp, int n) {
    UNROLL for (int i = 0; i < 4; i++) h[i] = (vacc){0}, l[i] = (vacc)((vsi){0} + HALF);
    int t = 0;
    for (; t + 1 < n; t += 2) tap_pair(h, l, base + (size_t)t * stride, base + (size_t)(t + 1) * stride, kp + t);
    if (t < n) tap_pair(h, l, base + (size_t)t * stride, base + (size_t)t * stride, kp + t);
}
#endif

#if defined(VNNI512)
static inline void taps64(const uint8_t *base, size_t stride, const int32_t *kp, int n, uint8_t *o) {
    vacc h[4], l[4];
    pair_sums(h, l, base, stride, kp, n);
    __m512i v[4];
    UNROLL for (int i = 0; i < 4; i++)
        v[i] = _mm512_srai_epi32(_mm512_add_epi32(_mm512_slli_epi32(h[i], 11), l[i]), PRECISION_BITS);
    /* the signed pack puts each 128-bit lane's 8 values back in order (lanes 0-31, 32-63); the
     * unsigned pack then interleaves the two halves by 8 bytes, which one qword permute undoes;
     * both saturate, which is clip8's clip */
    __m512i w = _mm512_packus_epi16(_mm512_packs_epi32(v[0], v[1]), _mm512_packs_epi32(v[2], v[3]));
    _mm512_storeu_si512(o, _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), w));
}
#elif defined(MADD256)
static inline void taps32(const uint8_t *base, size_t stride, const int32_t *kp, int n, uint8_t *o) {
    vacc h[4], l[4];
    pair_sums(h, l, base, stride, kp, n);
#define JOIN(i) _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h[i], 11), l[i]), PRECISION_BITS)
    /* the packs undo the unpacks' lane order within each 128-bit lane; one qword permute joins them */
    __m256i w = _mm256_packus_epi16(_mm256_packs_epi32(JOIN(0), JOIN(1)), _mm256_packs_epi32(JOIN(2), JOIN(3)));
#undef JOIN
    _mm256_storeu_si256((__m256i *)o, _mm256_permute4x64_epi64(w, 0xD8));
}
static inline void taps64(const uint8_t *base, size_t stride, const int32_t *kp, int n, uint8_t *o) {
    taps32(base, stride, kp, n, o);
    taps32(base + 32, stride, kp, n, o + 32);
}
#else
/* o[0 .. 64) = the narrowed sum over t < n of the 64 bytes at base + t * stride times k[t]: the
 * one inner loop of both passes, 64 lanes in registers over all taps.  int32 sums are exact, so
 * neither the lanes nor the order of the taps can change a value. */
static inline void taps64(const uint8_t *base, size_t stride, const int32_t *k, int n, uint8_t *o) {
    vsi acc[NV];
    UNROLL for (int i = 0; i < NV; i++) acc[i] = (vsi){0} + HALF; /* the rounding, as in pair_sums */
    for (int t = 0; t < n; t++) {
        vsi x[NV], kk = (vsi){0} + k[t];
        widen64(base + (size_t)t * stride, x);
        UNROLL for (int i = 0; i < NV; i++) acc[i] += x[i] * kk;
    }
    narrow64(o, acc);
}
#endif

/* n RGBX pixels -> n RGB pixels (dst may not overlap src); row-delta coded when `coded`: each byte
 * minus the same channel of the pixel before it, mod 256, the first pixel as is (PNG's "Sub"
 * filter: schemas/pixel_table.py's encode_rows, which the record's pixel table stores).  Coding
 * here, on the row the pass just made (in L1), spares the table a pass over the picture. */
static void store_rgb(const uint8_t *src, uint8_t *dst, size_t n, int coded) {
    size_t i = 0;
    if (coded && n) { /* the first pixel as is; every later one less its left neighbour */
        dst[0] = src[0];
        dst[1] = src[1];
        dst[2] = src[2];
        i = 1;
    }
#if defined(__AVX512VBMI__)
    static const uint8_t order[64] = {0,  1,  2,  4,  5,  6,  8,  9,  10, 12, 13, 14, 16, 17, 18, 20,
                                      21, 22, 24, 25, 26, 28, 29, 30, 32, 33, 34, 36, 37, 38, 40, 41,
                                      42, 44, 45, 46, 48, 49, 50, 52, 53, 54, 56, 57, 58, 60, 61, 62};
    __m512i perm = _mm512_loadu_si512(order);
    for (; i + 16 <= n; i += 16) {
        __m512i px = _mm512_loadu_si512(src + 4 * i);
        if (coded) px = _mm512_sub_epi8(px, _mm512_loadu_si512(src + 4 * i - 4));
        _mm512_mask_storeu_epi8(dst + 3 * i, 0xffffffffffffULL, _mm512_permutexvar_epi8(perm, px));
    }
#elif defined(__AVX2__)
    /* per 128-bit lane the 12 RGB bytes of its 4 pixels first, then the two lanes' 24 bytes joined */
    const __m256i pick = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i join = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);
    for (; i + 8 <= n; i += 8) {
        __m256i px = _mm256_loadu_si256((const __m256i *)(src + 4 * i));
        if (coded) px = _mm256_sub_epi8(px, _mm256_loadu_si256((const __m256i *)(src + 4 * i - 4)));
        px = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(px, pick), join);
        _mm_storeu_si128((__m128i *)(dst + 3 * i), _mm256_castsi256_si128(px));
        _mm_storel_epi64((__m128i *)(dst + 3 * i + 16), _mm256_extracti128_si256(px, 1));
    }
#elif defined(__ARM_NEON) && defined(__aarch64__)
    for (; i + 16 <= n; i += 16) {
        uint8x16x4_t px = vld4q_u8(src + 4 * i);
        uint8x16x3_t rgb = {{px.val[0], px.val[1], px.val[2]}};
        if (coded) {
            uint8x16x4_t left = vld4q_u8(src + 4 * i - 4);
            for (int c = 0; c < 3; c++) rgb.val[c] = vsubq_u8(rgb.val[c], left.val[c]);
        }
        vst3q_u8(dst + 3 * i, rgb);
    }
#endif
    for (; i < n; i++)
        for (int c = 0; c < 3; c++)
            dst[3 * i + c] = (uint8_t)(src[4 * i + c] - (coded && i ? src[4 * i - 4 + c] : 0));
}

/* dst[c * dst_stride + r] = src[r * src_stride + c] for a TB x TB block of 32-bit pixels.  The loops
 * are unrolled so the rows stay in registers (rolled, GCC kept r, a and b on the stack). */
#if defined(__AVX512F__)
#define TB 16
static inline void transpose_block(const uint32_t *src, size_t src_stride, uint32_t *dst, size_t dst_stride) {
    __m512i r[16], a[16], b[16];
    UNROLL for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * src_stride);
    UNROLL for (int i = 0; i < 8; i++) { /* per 128-bit lane: rows 2i, 2i+1 interleaved by 32 bits */
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    UNROLL for (int i = 0; i < 4; i++) { /* b[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    UNROLL for (int c = 0; c < 4; c++) { /* a 4 x 4 transpose of 128-bit lanes */
        __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
        __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(s0, s2, 0x88));
        _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(s0, s2, 0xDD));
        _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(s1, s3, 0x88));
        _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(s1, s3, 0xDD));
    }
}
#elif defined(__AVX2__)
#define TB 8
static inline void transpose_block(const uint32_t *src, size_t src_stride, uint32_t *dst, size_t dst_stride) {
    __m256i r[8], a[8], b[8];
    UNROLL for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(src + i * src_stride));
    UNROLL for (int i = 0; i < 4; i++) { /* per 128-bit lane: rows 2i, 2i+1 interleaved by 32 bits */
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    UNROLL for (int i = 0; i < 2; i++) { /* b[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3 */
        b[4 * i] = _mm256_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm256_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm256_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm256_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    UNROLL for (int c = 0; c < 4; c++) { /* rows 0-3 and 4-7 of columns c and 4 + c */
        _mm256_storeu_si256((__m256i *)(dst + c * dst_stride), _mm256_permute2x128_si256(b[c], b[4 + c], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (4 + c) * dst_stride), _mm256_permute2x128_si256(b[c], b[4 + c], 0x31));
    }
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define TB 4
static inline void transpose_block(const uint32_t *src, size_t src_stride, uint32_t *dst, size_t dst_stride) {
    uint32x4_t r0 = vld1q_u32(src), r1 = vld1q_u32(src + src_stride), r2 = vld1q_u32(src + 2 * src_stride),
               r3 = vld1q_u32(src + 3 * src_stride);
    uint64x2_t t0 = vreinterpretq_u64_u32(vtrn1q_u32(r0, r1)), t1 = vreinterpretq_u64_u32(vtrn2q_u32(r0, r1));
    uint64x2_t t2 = vreinterpretq_u64_u32(vtrn1q_u32(r2, r3)), t3 = vreinterpretq_u64_u32(vtrn2q_u32(r2, r3));
    vst1q_u32(dst, vreinterpretq_u32_u64(vtrn1q_u64(t0, t2)));
    vst1q_u32(dst + dst_stride, vreinterpretq_u32_u64(vtrn1q_u64(t1, t3)));
    vst1q_u32(dst + 2 * dst_stride, vreinterpretq_u32_u64(vtrn2q_u64(t0, t2)));
    vst1q_u32(dst + 3 * dst_stride, vreinterpretq_u32_u64(vtrn2q_u64(t1, t3)));
}
#else
#define TB 16
static inline void transpose_block(const uint32_t *src, size_t src_stride, uint32_t *dst, size_t dst_stride) {
    for (int r = 0; r < TB; r++)
        for (int c = 0; c < TB; c++) dst[c * dst_stride + r] = src[r * src_stride + c];
}
#endif

/* dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: TB x TB blocks where
 * they fit, single pixels at the edges. */
static void transpose(const uint32_t *src, size_t src_stride, size_t rows, size_t cols, uint32_t *dst,
                      size_t dst_stride) {
    size_t r = 0;
    for (; r + TB <= rows; r += TB) {
        size_t c = 0;
        for (; c + TB <= cols; c += TB)
            transpose_block(src + r * src_stride + c, src_stride, dst + c * dst_stride + r, dst_stride);
        for (; c < cols; c++)
            for (size_t i = r; i < r + TB; i++) dst[c * dst_stride + i] = src[i * src_stride + c];
    }
    for (; r < rows; r++)
        for (size_t c = 0; c < cols; c++) dst[c * dst_stride + r] = src[r * src_stride + c];
}

/* What a pass writes: the RGBX picture between the passes, or the result as RGB bytes, plain or
 * row-delta coded (store_rgb). */
typedef enum { OUT_RGBX, OUT_RGB, OUT_CODED } out_kind;

/* (rows, in_w) RGBX -> (rows, out_w), written as `kind` asks.  Sixteen rows at a time are held
 * transposed (a column of 16 pixels is 64 contiguous bytes), so each output column is the same
 * register-blocked sum over taps as the vertical pass.  Sixteen output columns at a time go to a
 * 1 KB buffer that stays in L1 and are transposed from there straight into the RGBX rows (the
 * picture between the passes), or into `back`, whose rows are then stored as RGB. */
static int horizontal(const uint8_t *src, int in_w, int rows, const axis_t *ax, int out_w,
                      uint8_t *dst, out_kind kind) {
    uint32_t *tile = malloc((size_t)in_w * 16 * 4); /* [x][r] */
    uint32_t res[16 * 16];                          /* [xx - xx0][r] */
    uint32_t *back = kind == OUT_RGBX ? NULL : malloc((size_t)out_w * 16 * 4); /* [r][xx] */
    int rc = -1;
    if (!tile || (kind != OUT_RGBX && !back)) goto done;
    for (int y0 = 0; y0 < rows; y0 += 16) {
        int n_rows = rows - y0 < 16 ? rows - y0 : 16;
        const uint32_t *block = (const uint32_t *)(src + (size_t)y0 * in_w * 4);
        uint32_t *out = back ? back : (uint32_t *)dst + (size_t)y0 * out_w;
        if (n_rows < 16) memset(tile, 0, (size_t)in_w * 16 * 4);
        int ready = 0; /* input columns transposed so far */
        for (int xx0 = 0; xx0 < out_w; xx0 += 16) {
            int n_cols = out_w - xx0 < 16 ? out_w - xx0 : 16, need = 0;
            for (int j = 0; j < n_cols; j++)
                if (ax->first[xx0 + j] + ax->count[xx0 + j] > need) need = ax->first[xx0 + j] + ax->count[xx0 + j];
            /* the columns these outputs read, transposed just before (still in L1 when read) */
            for (; ready < need; ready += 16) {
                int n = in_w - ready < 16 ? in_w - ready : 16;
                transpose(block + ready, in_w, n_rows, n, tile + (size_t)ready * 16, 16);
            }
            for (int j = 0; j < n_cols; j++) {
                int xx = xx0 + j;
                taps64((const uint8_t *)(tile + (size_t)ax->first[xx] * 16), 64,
                       taps_of(ax, xx), ax->count[xx], (uint8_t *)(res + 16 * j));
            }
            transpose(res, 16, n_cols, n_rows, out + xx0, out_w);
        }
        if (back)
            for (int r = 0; r < n_rows; r++)
                store_rgb((const uint8_t *)(back + (size_t)r * out_w), dst + (size_t)(y0 + r) * out_w * 3, out_w,
                          kind == OUT_CODED);
    }
    rc = 0;
done:
    free(tile);
    free(back);
    return rc;
}

/* (in_h, width) RGBX -> (out_h, width), written as `kind` asks. */
static int vertical(const uint8_t *src, int width, const axis_t *ax, int out_h, uint8_t *dst,
                    out_kind kind) {
    size_t lanes = (size_t)width * 4;
    uint8_t *line = malloc(lanes);
    if (!line) return -1;
    for (int yy = 0; yy < out_h; yy++) {
        const int32_t *k = ax->weight + (size_t)yy * ax->ksize;
        const uint8_t *base = src + (size_t)ax->first[yy] * lanes;
        int n = ax->count[yy];
        uint8_t *out = kind == OUT_RGBX ? dst + (size_t)yy * lanes : line;
        size_t j = 0;
        for (; j + 64 <= lanes; j += 64) taps64(base + j, lanes, taps_of(ax, yy), n, out + j);
        for (; j < lanes; j++) {
            int32_t a = 0;
            for (int t = 0; t < n; t++) a += base[(size_t)t * lanes + j] * k[t];
            out[j] = clip8(HALF + a);
        }
        if (kind != OUT_RGBX) store_rgb(line, dst + (size_t)yy * width * 3, width, kind == OUT_CODED);
    }
    free(line);
    return 0;
}

/* Pillow 13.0.0's Image.resize((out_w, out_h), BICUBIC) of an RGB picture given as RGBX bytes,
 * written as out_h * out_w * 3 RGB bytes (kind: plain or coded).  0 on success, -1 when memory
 * ran out. */
static int resize_rgbx(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                       int vertical_first, out_kind kind) {
    axis_t ah = {0}, av = {0};
    uint8_t *mid = NULL;
    int rc = -1;
    int need_h = out_w != in_w, need_v = out_h != in_h;
    if (in_w <= 0 || in_h <= 0 || out_w <= 0 || out_h <= 0) return -1;
    if (!need_h && !need_v) {
        for (int y = 0; y < in_h; y++)
            store_rgb(src + (size_t)y * in_w * 4, dst + (size_t)y * in_w * 3, in_w, kind == OUT_CODED);
        return 0;
    }
    if (need_h && make_axis(&ah, in_w, out_w)) goto done;
    if (need_v && make_axis(&av, in_h, out_h)) goto done;
    if (need_h && need_v) {
        if (vertical_first) {
            mid = malloc((size_t)in_w * out_h * 4);
            if (!mid || vertical(src, in_w, &av, out_h, mid, OUT_RGBX)) goto done;
            rc = horizontal(mid, in_w, out_h, &ah, out_w, dst, kind);
        } else {
            mid = malloc((size_t)out_w * in_h * 4);
            if (!mid || horizontal(src, in_w, in_h, &ah, out_w, mid, OUT_RGBX)) goto done;
            rc = vertical(mid, out_w, &av, out_h, dst, kind);
        }
    } else if (need_h) {
        rc = horizontal(src, in_w, in_h, &ah, out_w, dst, kind);
    } else {
        rc = vertical(src, in_w, &av, out_h, dst, kind);
    }
done:
    free(mid);
    free_axis(&ah);
    free_axis(&av);
    return rc;
}

/* The same, reading the picture in place from its row pointers (Pillow's image32 rows, 4 bytes a
 * pixel): where the rows lie end to end (one Pillow memory block, the usual case) they are the
 * RGBX picture itself, else they are gathered into one first. */
static int resize_rows(const uint8_t *const *rows, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                       int vertical_first, out_kind kind) {
    size_t line = (size_t)in_w * 4;
    int contiguous = in_w > 0 && in_h > 0;
    for (int y = 1; y < in_h && contiguous; y++) contiguous = rows[y] == rows[0] + (size_t)y * line;
    if (contiguous || in_w <= 0 || in_h <= 0)
        return resize_rgbx(in_h > 0 ? rows[0] : NULL, in_w, in_h, dst, out_w, out_h, vertical_first, kind);
    uint8_t *src = malloc(line * in_h);
    if (!src) return -1;
    for (int y = 0; y < in_h; y++) memcpy(src + y * line, rows[y], line);
    int rc = resize_rgbx(src, in_w, in_h, dst, out_w, out_h, vertical_first, kind);
    free(src);
    return rc;
}

/* The entry points: from the RGBX picture or from its row pointers, writing the RGB result plain
 * or row-delta coded (the record's pixel table, straight into its slot). */
int prepack_resize_rgbx(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                        int vertical_first) {
    return resize_rgbx(src, in_w, in_h, dst, out_w, out_h, vertical_first, OUT_RGB);
}

int prepack_resize_rgbx_coded(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                              int vertical_first) {
    return resize_rgbx(src, in_w, in_h, dst, out_w, out_h, vertical_first, OUT_CODED);
}

int prepack_resize_rows(const uint8_t *const *rows, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                        int vertical_first) {
    return resize_rows(rows, in_w, in_h, dst, out_w, out_h, vertical_first, OUT_RGB);
}

int prepack_resize_rows_coded(const uint8_t *const *rows, int in_w, int in_h, uint8_t *dst, int out_w,
                              int out_h, int vertical_first) {
    return resize_rows(rows, in_w, in_h, dst, out_w, out_h, vertical_first, OUT_CODED);
}
