/* Byte counts for people (see format_bytes.h): binary units and three
 * significant digits, the form model summaries and memory reports settled on. */
#include "format_bytes.h"

#include <math.h>
#include <stdio.h>

void kiln_format_bytes(char *buf, size_t cap, double bytes)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    if (!buf || cap == 0) return;
    double v = bytes;
    int i = 0;
    while (fabs(v) >= 1024.0 && i < 4) {
        v /= 1024.0;
        i++;
    }
    double m = fabs(v);
    int decimals = i == 0 ? 0 : m < 10 ? 2 : m < 100 ? 1 : 0;
    snprintf(buf, cap, "%.*f %s", decimals, v, unit[i]);
}
