/* tokenizer.h - CLIP's byte-level BPE tokenizer (openai/CLIP simple_tokenizer).
 * Reads either a Hugging Face vocab.json + merges.txt pair or CLIP's original
 * bpe_simple_vocab_16e6.txt.gz (from a file, from memory, or the copy compiled into
 * the library). Text is cleaned (whitespace collapsed, lower-cased),
 * split by CLIP's regex, byte-encoded and merged by rank; "</w>" marks word ends. */
#ifndef KILN_TOKENIZER_H
#define KILN_TOKENIZER_H

#include "status.h"

#include <stddef.h>

typedef struct kiln_tokenizer kiln_tokenizer;

/* path: a folder holding vocab.json + merges.txt, a vocab.json path (merges.txt
 * beside it), or a .txt.gz / merges-only file (vocabulary derived as CLIP does). */
kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out);
/* CLIP's original format from memory: the bytes of a bpe_simple_vocab_16e6.txt.gz
 * (or of the text inside it). data is only read during the call; name labels errors
 * (NULL: "(memory)"). */
kiln_status kiln_tokenizer_open_memory(const void *data, size_t len, const char *name,
                                       kiln_tokenizer **out);
/* CLIP's own vocabulary, compiled into the library (openai/CLIP's
 * bpe_simple_vocab_16e6.txt.gz, MIT licence: runtime/data/LICENSE-CLIP): the
 * tokenizer of every SD 1.x / 2.x / XL text encoder, for checkpoints that carry none. */
kiln_status kiln_tokenizer_open_builtin(kiln_tokenizer **out);
/* How the built-in vocabulary names itself in messages. */
#define KILN_TOKENIZER_BUILTIN_NAME "built-in CLIP vocabulary"
void kiln_tokenizer_free(kiln_tokenizer *t);
int kiln_tokenizer_bos(const kiln_tokenizer *t);   /* <|startoftext|> (49406 for CLIP) */
int kiln_tokenizer_eos(const kiln_tokenizer *t);   /* <|endoftext|>   (49407) */
int kiln_tokenizer_vocab_size(const kiln_tokenizer *t);
/* Token ids of text without start/end tokens. *ids malloc'd (caller frees). */
kiln_status kiln_tokenizer_encode(kiln_tokenizer *t, const char *text, size_t len,
                                  int **ids, int *n);
/* Id of a token string ("cat</w>"), -1 when absent. */
int kiln_tokenizer_token_id(const kiln_tokenizer *t, const char *token);
/* Decodes ids back to text (for debugging/tests); caller frees. */
char *kiln_tokenizer_decode(const kiln_tokenizer *t, const int *ids, int n);

#endif
