/* tokenizer.h - CLIP's byte-level BPE tokenizer (openai/CLIP simple_tokenizer).
 * Reads either a Hugging Face vocab.json + merges.txt pair or CLIP's original
 * bpe_simple_vocab_16e6.txt.gz. Text is cleaned (whitespace collapsed, lower-cased),
 * split by CLIP's regex, byte-encoded and merged by rank; "</w>" marks word ends. */
#ifndef KILN_TOKENIZER_H
#define KILN_TOKENIZER_H

#include "status.h"

typedef struct kiln_tokenizer kiln_tokenizer;

/* path: a folder holding vocab.json + merges.txt, a vocab.json path (merges.txt
 * beside it), or a .txt.gz / merges-only file (vocabulary derived as CLIP does). */
KILN_API kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out);
KILN_API void kiln_tokenizer_free(kiln_tokenizer *t);
KILN_API int kiln_tokenizer_bos(const kiln_tokenizer *t);   /* <|startoftext|> (49406 for CLIP) */
KILN_API int kiln_tokenizer_eos(const kiln_tokenizer *t);   /* <|endoftext|>   (49407) */
KILN_API int kiln_tokenizer_vocab_size(const kiln_tokenizer *t);
/* Token ids of text without start/end tokens. *ids malloc'd (caller frees). */
KILN_API kiln_status kiln_tokenizer_encode(kiln_tokenizer *t, const char *text, size_t len,
                                           int **ids, int *n);
/* Id of a token string ("cat</w>"), -1 when absent. */
KILN_API int kiln_tokenizer_token_id(const kiln_tokenizer *t, const char *token);
/* Decodes ids back to text (for debugging/tests); caller frees. */
KILN_API char *kiln_tokenizer_decode(const kiln_tokenizer *t, const int *ids, int n);

#endif
