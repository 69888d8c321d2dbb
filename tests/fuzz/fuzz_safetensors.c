/* fuzz_safetensors.c - runtime/safetensors.c's header validation on arbitrary
 * files: an open either fails with a message or gives entries that lie inside the
 * data section, do not overlap, match their shapes and are found by name; small
 * files are then opened as a model and loaded onto the cpu in f32 (model.c's
 * copies out of the mapping). */
#include "fuzz.h"

#include "device.h"
#include "fuzz_model.h"
#include "safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *path = fuzz_file("f.safetensors", data, size);
    kiln_st_file *f = NULL;
    kiln_status st = kiln_st_open(path, &f);
    if (st) {
        FUZZ_REQUIRE(f == NULL);
        FUZZ_REQUIRE(strstr(kiln_last_error(), path) != NULL); /* errors name the file */
        return 0;
    }
    FUZZ_REQUIRE(kiln_st_check(f) == KILN_OK);
    uint64_t prev_end = 0;
    for (int i = 0; i < f->n; i++) {
        const kiln_st_entry *e = &f->entries[i];
        FUZZ_REQUIRE(e->begin <= e->end && e->end <= f->data_size);
        FUZZ_REQUIRE(e->ndim >= 0 && e->ndim <= KILN_ST_MAX_DIMS);
        uint64_t numel = 1;
        for (int d = 0; d < e->ndim; d++) numel *= (uint64_t)e->shape[d];
        FUZZ_REQUIRE(numel * kiln_dtype_size(e->dtype) == e->end - e->begin);
        if (e->end > e->begin) {
            FUZZ_REQUIRE(e->begin >= prev_end); /* sorted, no overlap */
            prev_end = e->end;
            const uint8_t *p = kiln_st_data(f, i);
            fuzz_sink += p[0] + p[e->end - e->begin - 1]; /* both ends lie in the mapping */
        }
        FUZZ_REQUIRE(kiln_st_find(f, e->name) == i);
    }
    for (int i = 0; i < f->n_meta; i++) fuzz_sink += strlen(f->meta_keys[i]) + strlen(f->meta_values[i]);
    kiln_st_release(f);

    if (size <= 4096) fuzz_open_as_model(path);
    return 0;
}
