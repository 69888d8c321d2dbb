/* unicode_entity.h - the record of one HTML5 character reference, in a header of its own
 * so that the generated tables (unicode_tables.h) and the code reading them (unicode.c)
 * share it without the tables pointing back at unicode.h. */
#ifndef KILN_UNICODE_ENTITY_H
#define KILN_UNICODE_ENTITY_H

#include <stdint.h>

/* One HTML5 character reference name (all valid with a trailing ';'). */
typedef struct {
    const char *name;
    uint32_t cp[2];     /* its characters (cp[1] == 0 for one) */
    uint32_t upper[3];  /* ftfy also decodes "&NAME;" upper-cased to these; 0 when not */
    int bare;           /* also recognised without the ';' (the legacy names) */
} kiln_unicode_entity;

#endif
