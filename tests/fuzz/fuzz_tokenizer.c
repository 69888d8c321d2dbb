/* fuzz_tokenizer.c - runtime/tokenizer.c's encoder (text cleaning, CLIP's split,
 * byte-level BPE, the word cache) with the built-in vocabulary on arbitrary bytes:
 * every id lies in the vocabulary and decodes. The vocabulary is loaded once. */
#include "fuzz.h"

#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static kiln_tokenizer *tok;
    if (!tok && kiln_tokenizer_open_builtin(&tok) != KILN_OK) {
        fprintf(stderr, "built-in vocabulary: %s\n", kiln_last_error());
        abort();
    }
    int *ids = NULL, n = 0;
    if (kiln_tokenizer_encode(tok, (const char *)data, size, &ids, &n) != KILN_OK) {
        FUZZ_REQUIRE(kiln_last_error()[0]);
        return 0;
    }
    FUZZ_REQUIRE(n >= 0 && (n == 0 || ids));
    for (int i = 0; i < n; i++) FUZZ_REQUIRE(ids[i] >= 0 && ids[i] < kiln_tokenizer_vocab_size(tok));
    char *text = kiln_tokenizer_decode(tok, ids, n);
    free(text);
    free(ids);
    return 0;
}
