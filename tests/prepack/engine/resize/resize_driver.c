/* Runs the C kernel on cases written by test_cross.py and compares with Pillow's bytes: for a
 * build that this machine cannot load (another architecture, run under an emulator).
 *
 * Input file: int32 count, then per case int32 in_w, in_h, out_w, out_h, vertical_first, the
 * RGBX input (in_w * in_h * 4 bytes) and Pillow's RGB output (out_w * out_h * 3 bytes).
 * Each case runs twice: from the contiguous picture, and from a table of rows that do not lie end
 * to end (prepack_resize_rows' gathering path); and twice more through the _coded entry points,
 * against Pillow's bytes row-delta coded here (schemas/pixel_table.py's encode_rows).  Prints the
 * build's path ("isa NAME"), one line per differing run, and "checked N". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int prepack_resize_rgbx(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                        int vertical_first);
int prepack_resize_rows(const uint8_t *const *rows, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                        int vertical_first);
int prepack_resize_rgbx_coded(const uint8_t *src, int in_w, int in_h, uint8_t *dst, int out_w, int out_h,
                              int vertical_first);
int prepack_resize_rows_coded(const uint8_t *const *rows, int in_w, int in_h, uint8_t *dst, int out_w,
                              int out_h, int vertical_first);

static void compare(int i, const char *how, const int32_t *h, int rc, const uint8_t *got, const uint8_t *want,
                    size_t n_out) {
    if (rc)
        printf("case %d %dx%d->%dx%d %s: failed\n", i, h[0], h[1], h[2], h[3], how);
    else if (memcmp(got, want, n_out)) {
        size_t bad = 0, first = 0;
        for (size_t j = n_out; j-- > 0;)
            if (got[j] != want[j]) bad++, first = j;
        printf("case %d %dx%d->%dx%d %s: %zu values differ, first at byte %zu\n", i, h[0], h[1], h[2], h[3], how,
               bad, first);
    }
}
const char *prepack_resize_isa(void);

int main(int argc, char **argv) {
    FILE *f = argc == 2 ? fopen(argv[1], "rb") : NULL;
    int32_t count, h[5];
    if (!f || fread(&count, 4, 1, f) != 1) return 2;
    printf("isa %s\n", prepack_resize_isa());
    for (int i = 0; i < count; i++) {
        if (fread(h, 4, 5, f) != 5) return 2;
        size_t n_in = (size_t)h[0] * h[1] * 4, n_out = (size_t)h[2] * h[3] * 3;
        uint8_t *src = malloc(n_in), *want = malloc(n_out), *got = malloc(n_out);
        if (!src || !want || !got || fread(src, 1, n_in, f) != n_in || fread(want, 1, n_out, f) != n_out) return 2;
        compare(i, "contiguous", h, prepack_resize_rgbx(src, h[0], h[1], got, h[2], h[3], h[4]), got, want, n_out);
        size_t line = (size_t)h[0] * 4;
        uint8_t *spread = malloc((line + 64) * h[1]);
        const uint8_t **rows = malloc(sizeof *rows * h[1]);
        if (!spread || !rows) return 2;
        for (int y = 0; y < h[1]; y++) { /* bottom row first, 64 bytes apart */
            rows[y] = spread + (size_t)(h[1] - 1 - y) * (line + 64);
            memcpy((uint8_t *)rows[y], src + y * line, line);
        }
        memset(got, 0, n_out);
        compare(i, "rows", h, prepack_resize_rows(rows, h[0], h[1], got, h[2], h[3], h[4]), got, want, n_out);
        for (size_t j = n_out; j-- > 0;) /* in place, from the end: each byte less its left neighbour's */
            if (j % ((size_t)h[2] * 3) >= 3) want[j] = (uint8_t)(want[j] - want[j - 3]);
        memset(got, 0, n_out);
        compare(i, "coded", h, prepack_resize_rgbx_coded(src, h[0], h[1], got, h[2], h[3], h[4]), got, want, n_out);
        memset(got, 0, n_out);
        compare(i, "rows coded", h, prepack_resize_rows_coded(rows, h[0], h[1], got, h[2], h[3], h[4]), got, want,
                n_out);
        free(spread);
        free(rows);
        free(src);
        free(want);
        free(got);
    }
    printf("checked %d\n", count);
    return 0;
}
