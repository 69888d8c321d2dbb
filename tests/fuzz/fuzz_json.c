/* fuzz_json.c - runtime/json.c on arbitrary bytes: a parse either fails with a
 * message or gives a tree whose every node is well formed (counts match the
 * children, strings as long as they say, keys only on object members). */
#include "fuzz.h"

#include "json.h"

static size_t json_walk(const kiln_json *v, int in_object, int depth)
{
    FUZZ_REQUIRE(depth <= 64);
    FUZZ_REQUIRE(in_object ? v->key != NULL : v->key == NULL);
    if (v->key) FUZZ_REQUIRE(v->key[v->key_len] == '\0');
    size_t nodes = 1;
    switch (v->type) {
    case KILN_JSON_STRING:
        FUZZ_REQUIRE(v->string && v->string[v->string_len] == '\0');
        break;
    case KILN_JSON_NUMBER:
        if (v->is_integer) FUZZ_REQUIRE((double)v->integer == v->number);
        break;
    case KILN_JSON_ARRAY:
    case KILN_JSON_OBJECT: {
        size_t n = 0;
        for (const kiln_json *c = v->child; c; c = c->next, n++)
            nodes += json_walk(c, v->type == KILN_JSON_OBJECT, depth + 1);
        FUZZ_REQUIRE(n == v->count);
        break;
    }
    default: break;
    }
    return nodes;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kiln_json *root = NULL;
    kiln_status st = kiln_json_parse((const char *)data, size, &root);
    if (st) {
        FUZZ_REQUIRE(root == NULL);
        FUZZ_REQUIRE(kiln_last_error()[0] != '\0');
        return 0;
    }
    FUZZ_REQUIRE(root != NULL);
    json_walk(root, 0, 0);
    if (root->type == KILN_JSON_OBJECT && root->child) {
        /* a member is found under its own key (the first of that key) */
        const kiln_json *c = root->child;
        if (strlen(c->key) == c->key_len) FUZZ_REQUIRE(kiln_json_get(root, c->key) == c);
    }
    kiln_json_free(root);
    return 0;
}
