/* fuzz_png.c - runtime/png.c's reader on arbitrary files: kiln_png_read and
 * kiln_png_read_text either fail with a message or give an image of the size the
 * header declared with every sample in [0, 1], and text entries that are strings. */
#include "fuzz.h"

#include "png_io.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file("f.png", data, size);
    float *pix = NULL;
    int c = 0, h = 0, w = 0;
    if (kiln_png_read(path, &pix, &c, &h, &w) == KILN_OK) {
        FUZZ_REQUIRE(pix && c >= 1 && c <= 4 && h >= 1 && w >= 1);
        size_t n = (size_t)c * (size_t)h * (size_t)w;
        for (size_t i = 0; i < n; i++) FUZZ_REQUIRE(pix[i] >= 0.0f && pix[i] <= 1.0f);
        free(pix);
    } else {
        FUZZ_REQUIRE(pix == NULL && kiln_last_error()[0]);
    }
    int nt = 0;
    char **keys = NULL, **values = NULL;
    if (kiln_png_read_text(path, &nt, &keys, &values) == KILN_OK) {
        for (int i = 0; i < nt; i++) fuzz_sink += strlen(keys[i]) + strlen(values[i]);
        kiln_png_free_text(nt, keys, values);
    }
    return 0;
}
