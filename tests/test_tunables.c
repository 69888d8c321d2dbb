/* test_tunables.c - the kernels' KILN_* environment variables, read through
 * runtime/tunables.c: values and defaults, and a context opened with ignore_env
 * turning the environment off for them. */
#define _POSIX_C_SOURCE 200809L
#include "../bindings/kiln.h"
#include "../runtime/tunables.h"
#include "test.h"

#include <stdlib.h>

static void t_values(void)
{
    setenv("KILN_CONV_PATH", "gemm", 1);
    CHECK(kiln_tunable_str("KILN_CONV_PATH") && strcmp(kiln_tunable_str("KILN_CONV_PATH"), "gemm") == 0, "str");
    setenv("KILN_CONV_PATH", "", 1);
    CHECK(kiln_tunable_str("KILN_CONV_PATH") == NULL, "empty is unset");
    unsetenv("KILN_CONV_PATH");
    CHECK(kiln_tunable_str("KILN_CONV_PATH") == NULL, "unset");
    setenv("KILN_SPIN", "123", 1);
    CHECK(kiln_tunable_int("KILN_SPIN", 7) == 123, "int %d", kiln_tunable_int("KILN_SPIN", 7));
    setenv("KILN_SPIN", "12x", 1);
    CHECK(kiln_tunable_int("KILN_SPIN", 7) == 7, "not a number: the default");
    unsetenv("KILN_SPIN");
    CHECK(kiln_tunable_int("KILN_SPIN", 7) == 7, "unset: the default");
    setenv("KILN_CUDA_SYNC", "0", 1);
    CHECK(!kiln_tunable_flag("KILN_CUDA_SYNC"), "flag 0");
    setenv("KILN_CUDA_SYNC", "1", 1);
    CHECK(kiln_tunable_flag("KILN_CUDA_SYNC"), "flag 1");
}

static void t_ignore_env(void)
{
    setenv("KILN_WINOGRAD_TILE", "6", 1);
    CHECK(kiln_tunable_str("KILN_WINOGRAD_TILE") != NULL, "read before");
    kiln_config cfg = KILN_CONFIG_INIT;
    cfg.log_level = KILN_LOG_OFF;
    cfg.ignore_env = 1;
    kiln_ctx *ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    kiln_close(ctx);
    CHECK(kiln_tunable_str("KILN_WINOGRAD_TILE") == NULL, "a context with ignore_env turns the environment off");
    CHECK(kiln_tunable_int("KILN_WINOGRAD_TILE", 4) == 4 && !kiln_tunable_flag("KILN_CUDA_SYNC"), "defaults");
    kiln_tunables_use_env(1);
    CHECK(kiln_tunable_int("KILN_WINOGRAD_TILE", 4) == 6, "back on");
    unsetenv("KILN_WINOGRAD_TILE");
    unsetenv("KILN_CUDA_SYNC");
}

int main(void)
{
    RUN(t_values);
    RUN(t_ignore_env);
    return test_summary();
}
