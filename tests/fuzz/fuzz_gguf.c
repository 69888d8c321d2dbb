/* fuzz_gguf.c - runtime/gguf.c's reader on arbitrary files: an open either fails
 * with a message naming the file or gives entries that lie inside the data section,
 * hold whole blocks and are found by name; every tensor of a small file is then
 * decoded to f32 (quant.c's decoders on whatever bytes it holds), and the file is
 * opened as a model and loaded in f32 (model.c's copies out of the mapping). */
#include "fuzz.h"

#include "device.h"
#include "gguf.h"
#include "fuzz_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file("f.gguf", data, size);
    kiln_st_file *f = NULL;
    kiln_status st = kiln_gguf_open(path, &f);
    if (st) {
        FUZZ_REQUIRE(f == NULL);
        FUZZ_REQUIRE(strstr(kiln_last_error(), path) != NULL); /* errors name the file */
        return 0;
    }
    for (int i = 0; i < f->n; i++) {
        const kiln_st_entry *e = &f->entries[i];
        FUZZ_REQUIRE(e->begin <= e->end && e->end <= f->data_size);
        FUZZ_REQUIRE(e->ndim >= 0 && e->ndim <= 4);
        uint64_t numel = 1;
        for (int d = 0; d < e->ndim; d++) numel *= (uint64_t)e->shape[d];
        int blk = kiln_dtype_block(e->dtype);
        FUZZ_REQUIRE(blk == 1 || (e->ndim > 0 && e->shape[e->ndim - 1] % blk == 0));
        FUZZ_REQUIRE(kiln_dtype_nbytes(e->dtype, (int64_t)numel) == e->end - e->begin);
        if (numel > 0 && numel <= 4096) {
            float *y = malloc(numel * sizeof *y);
            FUZZ_REQUIRE(y != NULL);
            kiln_convert(y, KILN_F32, kiln_st_data(f, i), e->dtype, (size_t)numel);
            fuzz_sink += (size_t)(y[0] == y[0]) + (size_t)(y[numel - 1] == y[numel - 1]);
            free(y);
        }
        FUZZ_REQUIRE(kiln_st_find(f, e->name) >= 0);
    }
    for (int i = 0; i < f->n_meta; i++) fuzz_sink += strlen(f->meta_keys[i]) + strlen(f->meta_values[i]);
    kiln_st_release(f);

    if (size <= 4096) fuzz_open_as_model(path);
    return 0;
}
