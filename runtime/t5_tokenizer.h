/* t5_tokenizer.h - T5 v1.1's tokenizer: SentencePiece's Unigram model (32,000 pieces
 * with scores, its precompiled NFKC-based charsmap) applied exactly as SentencePiece
 * does, with the vocabulary compiled into the library (runtime/data/t5_spiece.bin.gz,
 * Apache-2.0, Google: runtime/data/LICENSE-T5). */
#ifndef KILN_T5_TOKENIZER_H
#define KILN_T5_TOKENIZER_H

#include "status.h"

#include <stddef.h>

typedef struct kiln_t5_tokenizer kiln_t5_tokenizer;

#define KILN_T5_PAD 0
#define KILN_T5_EOS 1 /* </s> */
#define KILN_T5_UNK 2
/* The longest text encode takes; longer text is an argument error (prompts are far
 * shorter; the bound keeps every offset an int). */
#define KILN_T5_MAX_TEXT_BYTES ((size_t)1 << 24)

/* The model in kiln's compact form (runtime/data/gen_t5_vocab.py), gzip'd or not; data
 * is only read during the call; name labels errors (NULL: "(memory)"). */
kiln_status kiln_t5_tokenizer_open_memory(const void *data, size_t len, const char *name,
                                          kiln_t5_tokenizer **out);
/* T5 v1.1's own vocabulary, compiled into the library. */
kiln_status kiln_t5_tokenizer_open_builtin(kiln_t5_tokenizer **out);
void kiln_t5_tokenizer_free(kiln_t5_tokenizer *t);
int kiln_t5_tokenizer_vocab_size(const kiln_t5_tokenizer *t);

/* Token ids of len bytes of text (any bytes: malformed UTF-8 reads as U+FFFD, as in
 * SentencePiece), ending in </s> (1), no padding: SentencePiece's EncodeAsIds plus
 * eos. *ids malloc'd, *n of them (caller frees). Safe to call from several threads on
 * one tokenizer. */
kiln_status kiln_t5_tokenizer_encode(const kiln_t5_tokenizer *t, const char *text, size_t len, int **ids, int *n);

#endif
