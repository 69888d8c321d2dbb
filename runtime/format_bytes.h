/* Byte counts for people: the one formatter that messages, summaries and
 * scripts share, so a size reads the same in an OOM error, a model summary and
 * a memory report. */
#ifndef KILN_FORMAT_BYTES_H
#define KILN_FORMAT_BYTES_H

#include <stddef.h>

/* Writes bytes in binary units with three significant digits into buf (always
 * terminated when cap > 0): "512 B", "1.50 KiB", "12.0 MiB", "512 MiB",
 * "1.50 GiB", "2.00 TiB". Whole bytes print without decimals. */
void kiln_format_bytes(char *buf, size_t cap, double bytes);

#endif
