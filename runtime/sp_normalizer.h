/* sp_normalizer.h - SentencePiece's text normaliser: its precompiled character map (a
 * Darts double-array trie from UTF-8 prefixes to replacement strings, NFKC-based, as
 * shipped in a model's normalizer_spec) and its whitespace rules, so that the tokenizers
 * built on SentencePiece models (T5's) see exactly the text SentencePiece's would. */
#ifndef KILN_SP_NORMALIZER_H
#define KILN_SP_NORMALIZER_H

#include "status.h"

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint32_t *units;   /* the double array, host order */
    size_t n_units;
    char *strings;     /* NUL-separated replacements, with a NUL after the last */
    size_t strings_len;
} kiln_sp_normalizer;

/* The normalizer_spec flags SentencePiece's trainer writes (T5: all three). */
enum {
    KILN_SP_ADD_DUMMY_PREFIX = 1,        /* "▁" before the text */
    KILN_SP_REMOVE_EXTRA_WHITESPACES = 2, /* leading, trailing and repeated spaces dropped */
    KILN_SP_ESCAPE_WHITESPACES = 4,       /* ' ' written as U+2581 "▁" */
};

/* blob: a precompiled_charsmap (u32 trie bytes, little-endian, the trie, the strings);
 * copied, so it need only live during the call. A blob that does not hold together (a
 * trie size past its end, units pointing outside) is an error naming `name`. */
kiln_status kiln_sp_normalizer_init(kiln_sp_normalizer *n, const void *blob, size_t len, const char *name);
void kiln_sp_normalizer_free(kiln_sp_normalizer *n);

/* Normalizes len bytes of text as SentencePiece's Normalizer::Normalize: longest
 * charsmap match per position, else one UTF-8 character, else (malformed UTF-8) one
 * byte read as U+FFFD; then the whitespace rules of flags. *out malloc'd, NUL-ended,
 * *out_len bytes (caller frees). */
kiln_status kiln_sp_normalizer_run(const kiln_sp_normalizer *n, const char *text, size_t len, int flags,
                                   char **out, size_t *out_len);

#endif
