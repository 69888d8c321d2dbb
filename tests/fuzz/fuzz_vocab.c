/* fuzz_vocab.c - runtime/tokenizer.c's vocabulary loading: the first byte picks
 * CLIP's bpe_simple_vocab text (gzip or plain) from memory (0) or a Hugging Face
 * vocab.json + merges.txt pair written to a folder (1: the two separated by the
 * first NUL byte). A vocabulary that loads must encode a short text. */
#include "fuzz.h"

#include "tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    kiln_tokenizer *t = NULL;
    kiln_status st;
    if ((data[0] & 1) == 0) {
        st = kiln_tokenizer_open_memory(data + 1, size - 1, "fuzz", &t);
    } else {
        const uint8_t *nul = memchr(data + 1, 0, size - 1);
        size_t vlen = nul ? (size_t)(nul - (data + 1)) : size - 1;
        fuzz_file("vocab.json", data + 1, vlen);
        fuzz_file("merges.txt", nul ? nul + 1 : data, nul ? size - 1 - vlen - 1 : 0);
        st = kiln_tokenizer_open(fuzz_dir(), &t);
    }
    if (st) {
        FUZZ_REQUIRE(t == NULL && kiln_last_error()[0]);
        return 0;
    }
    static const char text[] = "Hello, a CAT  and caf\xc3\xa9 hell";
    int *ids = NULL, n = 0;
    if (kiln_tokenizer_encode(t, text, sizeof text - 1, &ids, &n) == KILN_OK) {
        for (int i = 0; i < n; i++) FUZZ_REQUIRE(ids[i] >= 0 && ids[i] < kiln_tokenizer_vocab_size(t));
        free(kiln_tokenizer_decode(t, ids, n));
        free(ids);
    }
    FUZZ_REQUIRE(kiln_tokenizer_bos(t) >= 0 && kiln_tokenizer_eos(t) >= 0);
    kiln_tokenizer_free(t);
    return 0;
}
