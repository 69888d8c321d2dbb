/* json.h - a small, strict JSON reader (RFC 8259) for safetensors headers and
 * tokenizer vocabularies. Parses into a tree allocated from one arena so a single
 * kiln_json_free releases everything. Never reads past len; depth-limited. */
#ifndef KILN_JSON_H
#define KILN_JSON_H

#include "status.h"

typedef enum { KILN_JSON_NULL, KILN_JSON_BOOL, KILN_JSON_NUMBER, KILN_JSON_STRING,
               KILN_JSON_ARRAY, KILN_JSON_OBJECT } kiln_json_type;

typedef struct kiln_json kiln_json;
struct kiln_json {
    kiln_json_type type;
    int boolean;
    double number;
    int64_t integer;    /* exact value when the number is an integer within int64 */
    int is_integer;
    char *string;       /* NUL-terminated UTF-8 (escapes decoded); object member key for children */
    size_t string_len;
    char *key;          /* when this node is an object member: its key */
    size_t key_len;
    kiln_json *child;   /* first element/member */
    kiln_json *next;    /* next sibling */
    size_t count;       /* number of children */
};

/* Parses text[0..len). On error returns KILN_ERR_FORMAT with a message giving the
 * byte offset; *out is NULL then. */
kiln_status kiln_json_parse(const char *text, size_t len, kiln_json **out);
void kiln_json_free(kiln_json *root);
/* Member lookup in an object (linear); NULL when absent or not an object. */
const kiln_json *kiln_json_get(const kiln_json *obj, const char *key);

#endif
