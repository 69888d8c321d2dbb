/* unicode.h - the few Unicode properties the CLIP tokenizer needs (internal to the
 * runtime, not exported): letter/number/space classes for CLIP's split regex, lower
 * casing as Python's str.lower(), canonical composition for NFC, and the character
 * maps of ftfy's fix_text steps (tables in unicode_tables.c, generated from Python's
 * unicodedata by tests/golden/gen_unicode_tables.py); and the runtime's one UTF-8
 * decoder, encoder and validator (tokenizer, JSON, safetensors, PNG text). */
#ifndef KILN_UNICODE_H
#define KILN_UNICODE_H

#include <stddef.h>
#include <stdint.h>
#include "unicode_entity.h"

#define KILN_UNICODE_REPLACEMENT 0xFFFDu

/* General category L* (\p{L}), N* (\p{N}); space is Python's str.isspace(). */
int kiln_unicode_is_letter(uint32_t c);
int kiln_unicode_is_number(uint32_t c);
int kiln_unicode_is_space(uint32_t c);
/* Derived properties Cased and Case_Ignorable (for the Greek final sigma rule). */
int kiln_unicode_is_cased(uint32_t c);
int kiln_unicode_is_case_ignorable(uint32_t c);
/* Simple lowercase mapping (U+0130 and final sigma are the caller's business). */
uint32_t kiln_unicode_lower(uint32_t c);
/* Canonical combining class (0 for starters). */
int kiln_unicode_combining_class(uint32_t c);
/* Primary composite of the pair (a, b) as NFC composes it, Hangul included; 0 when none. */
uint32_t kiln_unicode_compose(uint32_t a, uint32_t b);
/* ftfy's fix_character_width: U+3000 and the halfwidth/fullwidth forms U+FF01..U+FFEF
 * replaced by their NFKC forms. Writes up to 2 code points to out, returns how many
 * (0 when c is not mapped). */
int kiln_unicode_width_fold(uint32_t c, uint32_t out[2]);

/* Looks up a name (case-sensitive, without '&' and ';'); NULL when absent. */
const kiln_unicode_entity *kiln_unicode_entity_find(const char *name, size_t len);
/* Windows-1252 meaning of a C1 control U+0080..U+009F (itself where 1252 leaves it
 * undefined), as Python's html module and ftfy's sloppy-windows-1252 map it. */
uint32_t kiln_unicode_cp1252(uint32_t c);

/* Decodes one UTF-8 sequence from s[0..len) (len >= 1): invalid or truncated
 * sequences give U+FFFD for each maximal invalid subpart, as Python's
 * errors="replace" does. Returns the bytes consumed (>= 1). */
size_t kiln_unicode_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp);
/* Length (2..4) of the well-formed multi-byte UTF-8 sequence at s[0..n) (n >= 1,
 * s[0] >= 0x80), or 0 when it is not one: overlong forms, surrogates and code
 * points above U+10FFFF are rejected, as every reader of our files demands. */
size_t kiln_unicode_utf8_seq_len(const unsigned char *s, size_t n);
/* 1 when the NUL-terminated str is well-formed UTF-8, else 0. */
int kiln_unicode_utf8_valid(const char *str);
/* Encodes c (a scalar value; others become U+FFFD) into out; returns 1..4. */
size_t kiln_unicode_utf8_encode(uint32_t c, char out[4]);

#endif
