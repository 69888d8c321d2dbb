/* fuzz_t5_tokenizer.c - runtime/t5_tokenizer.c and sp_normalizer.c on any bytes as
 * text under the built-in T5 vocabulary: every input tokenizes, every id is a piece
 * of the vocabulary (never <pad> or </s> before the end), no two <unk> in a row, and
 * </s> ends the list. */
#include "fuzz.h"

#include "t5_tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kiln_t5_tokenizer *t;
    if (!t && kiln_t5_tokenizer_open_builtin(&t)) FUZZ_REQUIRE(0);
    int *ids = NULL, n = 0;
    FUZZ_REQUIRE(kiln_t5_tokenizer_encode(t, (const char *)data, size, &ids, &n) == KILN_OK);
    FUZZ_REQUIRE(n >= 1 && ids[n - 1] == KILN_T5_EOS);
    for (int i = 0; i + 1 < n; i++) {
        FUZZ_REQUIRE(ids[i] >= 2 && ids[i] < kiln_t5_tokenizer_vocab_size(t));
        FUZZ_REQUIRE(!(ids[i] == KILN_T5_UNK && i && ids[i - 1] == KILN_T5_UNK));
    }
    free(ids);
    return 0;
}
