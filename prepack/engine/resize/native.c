/* Pillow 13.0.0's bicubic resample of RGB pictures, value for value, in portable vector C.
 *
 * Built at first use by prepack/engine/resize/native.py with the machine's C compiler
 * (-O3 -march=native -ffp-contract=off) and proven against the installed Pillow before use.
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
 * multiplies four taps x four channels per 16-lane vector with the weights pre-expanded per
 * channel, so neither pass transposes anything.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PRECISION_BITS 22
#define HALF (1 << (PRECISION_BITS - 1))

typedef int32_t v16si __attribute__((vector_size(64)));

/* 16 bytes widened to 16 int32 lanes.  Compilers lower a generic vector conversion of bytes to
 * scalar code, so the x86 widening instructions are asked for by name where the target has them. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16si widen16(const uint8_t *p) {
    return (v16si)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline v16si widen16(const uint8_t *p) {
    __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)));
    v16si r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
}
#else
static inline v16si widen16(const uint8_t *p) {
    v16si r;
    for (int i = 0; i < 16; i++) r[i] = p[i];
    return r;
}
#endif

typedef struct {
    int ksize;       /* taps per output value, padded with zero weights */
    int32_t *first;  /* first input index of each output value */
    int32_t *count;  /* taps that carry weight */
    int32_t *weight; /* [out][ksize] fixed point, zero past count */
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
    memset(ax, 0, sizeof *ax);
}

static int make_axis(axis_t *ax, int in_size, int out_size) {
    double scale = (double)in_size / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 2.0 * filterscale;
    double inv = 1.0 / filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *w = malloc(sizeof(double) * ksize);
    ax->ksize = ksize;
    ax->first = malloc(sizeof(int32_t) * out_size);
    ax->count = malloc(sizeof(int32_t) * out_size);
    ax->weight = calloc((size_t)out_size * ksize, sizeof(int32_t));
    if (!w || !ax->first || !ax->count || !ax->weight) {
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
    }
    free(w);
    return 0;
}

static inline uint8_t clip8(int32_t v) {
    v >>= PRECISION_BITS;
    return (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
}

/* o[i] = clip((HALF + v[i]) >> 22) for 16 lanes. */
static inline void narrow16(uint8_t *o, v16si v) {
#if defined(__AVX512F__)
    __m512i x = _mm512_srai_epi32(_mm512_add_epi32((__m512i)v, _mm512_set1_epi32(HALF)), PRECISION_BITS);
    _mm_storeu_si128((__m128i *)o, _mm512_cvtusepi32_epi8(_mm512_max_epi32(x, _mm512_setzero_si512())));
#else
    int32_t a[16];
    memcpy(a, &v, sizeof a);
    for (int i = 0; i < 16; i++) o[i] = clip8(HALF + a[i]);
#endif
}

/* n RGBX pixels -> n RGB pixels (dst may not overlap src). */
static void rgbx_to_rgb(const uint8_t *src, uint8_t *dst, size_t n) {
    size_t i = 0;
#if defined(__AVX512VBMI__)
    static const uint8_t order[64] = {0,  1,  2,  4,  5,  6,  8,  9,  10, 12, 13, 14, 16, 17, 18, 20,
                                      21, 22, 24, 25, 26, 28, 29, 30, 32, 33, 34, 36, 37, 38, 40, 41,
                                      42, 44, 45, 46, 48, 49, 50, 52, 53, 54, 56, 57, 58, 60, 61, 62};
    __m512i perm = _mm512_loadu_si512(order);
    for (; i + 16 <= n; i += 16) {
        __m512i px = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(src + 4 * i));
        _mm512_mask_storeu_epi8(dst + 3 * i, 0xffffffffffffULL, px);
    }
#endif
    for (; i < n; i++) {
        dst[3 * i] = src[4 * i];
        dst[3 * i + 1] = src[4 * i + 1];
        dst[3 * i + 2] = src[4 * i + 2];
    }
}

/* dst[c * dst_stride + r] = src[r * src_stride + c] for a 16 x 16 block of pixels. */
static inline void transpose16(const uint32_t *src, size_t src_stride, uint32_t *dst, size_t dst_stride) {
#if defined(__AVX512F__)
    __m512i r[16], a[16], b[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(src + i * src_stride);
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: rows 2i, 2i+1 interleaved by 32 bits */
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* b[4i + c], lane L: column 4L + c of rows 4i .. 4i + 3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* a 4 x 4 transpose of 128-bit lanes */
        __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
        __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
        __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
        __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
        _mm512_storeu_si512(dst + c * dst_stride, _mm512_shuffle_i32x4(s0, s2, 0x88));
        _mm512_storeu_si512(dst + (4 + c) * dst_stride, _mm512_shuffle_i32x4(s0, s2, 0xDD));
        _mm512_storeu_si512(dst + (8 + c) * dst_stride, _mm512_shuffle_i32x4(s1, s3, 0x88));
        _mm512_storeu_si512(dst + (12 + c) * dst_stride, _mm512_shuffle_i32x4(s1, s3, 0xDD));
    }
#else
    for (int r = 0; r < 16; r++)
        for (int c = 0; c < 16; c++) dst[c * dst_stride + r] = src[r * src_stride + c];
#endif
}

/* dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols: 16 x 16 blocks where
 * they fit, single pixels at the edges. */
static void transpose(const uint32_t *src, size_t src_stride, size_t rows, size_t cols, uint32_t *dst,
                      size_t dst_stride) {
    size_t r = 0;
    for (; r + 16 <= rows; r += 16) {
        size_t c = 0;
        for (; c + 16 <= cols; c += 16)
            transpose16(src + r * src_stride + c, src_stride, dst + c * dst_stride + r, dst_stride);
        for (; c < cols; c++)
            for (size_t i = r; i < r + 16; i++) dst[c * dst_stride + i] = src[i * src_stride + c];
    }
    for (; r < rows; r++)
        for (size_t c = 0; c < cols; c++) dst[c * dst_stride + r] = src[r * src_stride + c];
}

/* (rows, in_w) RGBX -> (rows, out_w) with `channels` bytes per output pixel (4: RGBX, 3: RGB).
 * Sixteen rows at a time are held transposed (a column of 16 pixels is 64 contiguous bytes), so
 * each output column is the same register-blocked sum over taps as the vertical pass. */
static int horizontal(const uint8_t *src, int in_w, int rows, const axis_t *ax, int out_w,
                      uint8_t *dst, int channels) {
    uint32_t *tile = malloc((size_t)in_w * 16 * 4); /* [x][r] */
    uint32_t *res = malloc((size_t)out_w * 16 * 4); /* [xx][r] */
    uint32_t *back = malloc((size_t)out_w * 16 * 4); /* [r][xx] */
    int rc = -1;
    if (!tile || !res || !back) goto done;
    for (int y0 = 0; y0 < rows; y0 += 16) {
        int n_rows = rows - y0 < 16 ? rows - y0 : 16;
        const uint32_t *block = (const uint32_t *)(src + (size_t)y0 * in_w * 4);
        if (n_rows < 16) memset(tile, 0, (size_t)in_w * 16 * 4);
        transpose(block, in_w, n_rows, in_w, tile, 16);
        for (int xx = 0; xx < out_w; xx++) {
            const int32_t *k = ax->weight + (size_t)xx * ax->ksize;
            const uint8_t *base = (const uint8_t *)(tile + (size_t)ax->first[xx] * 16);
            int n = ax->count[xx];
            v16si a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int t = 0; t < n; t++) {
                const uint8_t *p = base + (size_t)t * 64;
                v16si kk = (v16si){0} + k[t];
                a0 += widen16(p) * kk;
                a1 += widen16(p + 16) * kk;
                a2 += widen16(p + 32) * kk;
                a3 += widen16(p + 48) * kk;
            }
            uint8_t *o = (uint8_t *)(res + (size_t)xx * 16);
            narrow16(o, a0);
            narrow16(o + 16, a1);
            narrow16(o + 32, a2);
            narrow16(o + 48, a3);
        }
        transpose(res, 16, out_w, n_rows, back, out_w);
        for (int r = 0; r < n_rows; r++) {
            uint8_t *out = dst + (size_t)(y0 + r) * out_w * channels;
            if (channels == 4)
                memcpy(out, back + (size_t)r * out_w, (size_t)out_w * 4);
            else
                rgbx_to_rgb((const uint8_t *)(back + (size_t)r * out_w), out, out_w);
        }
    }
    rc = 0;
done:
    free(tile);
    free(res);
    free(back);
    return rc;
}

/* (in_h, width) RGBX -> (out_h, width) with `channels` bytes per output pixel. */
static int vertical(const uint8_t *src, int width, const axis_t *ax, int out_h, uint8_t *dst,
                    int channels) {
    size_t lanes = (size_t)width * 4;
    uint8_t *line = malloc(lanes);
    if (!line) return -1;
    for (int yy = 0; yy < out_h; yy++) {
        const int32_t *k = ax->weight + (size_t)yy * ax->ksize;
        const uint8_t *base = src + (size_t)ax->first[yy] * lanes;
        int n = ax->count[yy];
        uint8_t *out = channels == 4 ? dst + (size_t)yy * lanes : line;
        size_t j = 0;
        for (; j + 64 <= lanes; j += 64) {
            v16si a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int t = 0; t < n; t++) {
                const uint8_t *p = base + (size_t)t * lanes + j;
                v16si kk = (v16si){0} + k[t];
                a0 += widen16(p) * kk;
                a1 += widen16(p + 16) * kk;
                a2 += widen16(p + 32) * kk;
                a3 += widen16(p + 48) * kk;
            }
            narrow16(out + j, a0);
            narrow16(out + j + 16, a1);
            narrow16(out + j + 32, a2);
            narrow16(out + j + 48, a3);
        }
        for (; j < lanes; j++) {
            int32_t a = 0;
            for (int t = 0; t < n; t++) a += base[(size_t)t * lanes + j] * k[t];
            out[j] = clip8(HALF + a);
        }
        if (channels == 3) rgbx_to_rgb(line, dst + (size_t)yy * width * 3, width);
    }
    free(line);
    return 0;
}

/* Pillow 13.0.0's Image.resize((out_w, out_h), BICUBIC) of an RGB picture given as RGBX bytes,
 * written as out_h * out_w * 3 RGB bytes.  0 on success, -1 when memory ran out. */
int prepack_resize_rgbx(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w,
                        int out_h, int vertical_first) {
    axis_t ah = {0}, av = {0};
    uint8_t *mid = NULL;
    int rc = -1;
    int need_h = out_w != in_w, need_v = out_h != in_h;
    if (in_w <= 0 || in_h <= 0 || out_w <= 0 || out_h <= 0) return -1;
    if (!need_h && !need_v) {
        rgbx_to_rgb(src, dst, (size_t)in_w * in_h);
        return 0;
    }
    if (need_h && make_axis(&ah, in_w, out_w)) goto done;
    if (need_v && make_axis(&av, in_h, out_h)) goto done;
    if (need_h && need_v) {
        if (vertical_first) {
            mid = malloc((size_t)in_w * out_h * 4);
            if (!mid || vertical(src, in_w, &av, out_h, mid, 4)) goto done;
            rc = horizontal(mid, in_w, out_h, &ah, out_w, dst, 3);
        } else {
            mid = malloc((size_t)out_w * in_h * 4);
            if (!mid || horizontal(src, in_w, in_h, &ah, out_w, mid, 4)) goto done;
            rc = vertical(mid, out_w, &av, out_h, dst, 3);
        }
    } else if (need_h) {
        rc = horizontal(src, in_w, in_h, &ah, out_w, dst, 3);
    } else {
        rc = vertical(src, in_w, &av, out_h, dst, 3);
    }
done:
    free(mid);
    free_axis(&ah);
    free_axis(&av);
    return rc;
}
