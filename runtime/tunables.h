/* tunables.h - the environment variables that tune the kernels (paths, tiles, spins,
 * thread counts), read in one place so that a host asking kiln to ignore the
 * environment (kiln_config.ignore_env, kiln -E) is obeyed everywhere. The table in
 * tunables.c lists every one with what it does. */
#ifndef KILN_TUNABLES_H
#define KILN_TUNABLES_H

/* The value of tunable name (a KILN_* variable of tunables.c's table), or NULL when it
 * is unset, empty or the environment is ignored. Read at each call: a test or a
 * benchmark may change it between ops (callers that must not change their mind cache
 * the answer themselves). */
const char *kiln_tunable_str(const char *name);
/* The tunable as a whole number; def when it is unset, ignored or not a number. */
int kiln_tunable_int(const char *name, int def);
/* The tunable as a flag: set, non-empty and not "0". */
int kiln_tunable_flag(const char *name);

/* Stops (use 0) or resumes (1) reading the environment for every tunable of the
 * process: the kernels and their pools are the process's, so one context opened with
 * ignore_env turns it off for all (values a kernel has already cached stay). */
void kiln_tunables_use_env(int use);

#endif
